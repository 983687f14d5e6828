"""LTX-2 checkpoints load each component with the class model_index.json names, among those LTX2Pipeline accepts: the
vocoder of LTX-2 (LTX2Vocoder) or LTX-2.3's with bandwidth extension (LTX2VocoderWithBWE, 48 kHz sound), which trains
and renders its validation sample's sound track at its own output rate. Any other class is refused before loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
from safetensors.torch import load_file
from transformers import Gemma3ForConditionalGeneration, Gemma4UnifiedForConditionalGeneration

from tests.helpers.sound import assert_sound_track, read_sound, record_samples
from vidtune.cli import main as cli_main
from vidtune.config import ModelConfig
from vidtune.errors import ModelError
from vidtune.models.ltx_2 import TEXT_ENCODERS, VOCODERS, LTX2Spec
from vidtune.models.tiny.ltx_2 import build_tiny_gemma4, write_tiny_ltx_2
from vidtune.outputs import LORA_WEIGHTS
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")


def _spec(folder: Path, **model) -> LTX2Spec:
    return LTX2Spec(ModelConfig(name="ltx-2", pretrained=str(folder), **model), frame_rate=24.0)


@pytest.fixture(scope="module")
def bwe_folder(tmp_path_factory) -> Path:
    """The tiny LTX-2 with LTX-2.3's vocoder layout, written by LTX2Pipeline.save_pretrained."""
    return write_tiny_ltx_2(tmp_path_factory.mktemp("tiny-ltx-2-bwe"), bandwidth_extension=True)


def renamed_component(source: Path, folder: Path, component: str, class_name: str) -> Path:
    """`source`'s model folder (its subfolders linked, not copied) whose model_index.json names `class_name` for
    `component`."""
    folder.mkdir()
    for child in source.iterdir():
        if child.is_dir():
            (folder / child.name).symlink_to(child, target_is_directory=True)
    index = json.loads((source / "model_index.json").read_text())
    index[component] = [index[component][0], class_name]
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def test_the_bwe_vocoder_loads_with_its_own_class_and_weights(bwe_folder):
    assert json.loads((bwe_folder / "model_index.json").read_text())["vocoder"][-1] == "LTX2VocoderWithBWE"
    vocoder = _spec(bwe_folder).load_vae(CPU).vocoder
    assert type(vocoder) is LTX2VocoderWithBWE
    assert vocoder.config.input_sampling_rate == 16000 and vocoder.config.output_sampling_rate == 48000
    # Every tensor of the checkpoint, the STFT and mel bases included, is the one loaded (none left at random).
    saved = load_file(str(bwe_folder / "vocoder" / "diffusion_pytorch_model.safetensors"))
    loaded = vocoder.state_dict()
    assert set(saved) <= set(loaded) and any(name.startswith("bwe_generator.") for name in saved)
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


def test_ltx_2_with_a_bwe_vocoder_trains_lora_and_samples_its_48_khz_sound(make_config, bwe_folder, tmp_path):
    config = make_config("ltx-2", model={"pretrained": str(bwe_folder)}, training={"steps": 2},
                         validation={"enabled": True, "num_inference_steps": 1, "prompts": ["a tone"]})
    trainer = build_trainer(config)
    validated = record_samples(trainer.spec)
    trainer.run()
    assert (Path(config.output_dir) / LORA_WEIGHTS).is_file()
    videos = sorted((Path(config.output_dir) / "samples").glob("*.mp4"))
    assert len(videos) == len(validated) == 1
    assert validated[0].sample_rate == 48000  # the extension's rate, not its first stage's 16 kHz
    assert read_sound(videos[0])[1] == 48000
    # Compared below 4 kHz: AAC (at the encoder's default bit rate) keeps that band of a random model's noise-like
    # sound, not the higher ones.
    assert_sound_track(videos[0], validated[0], config.data.frames, config.frame_rate, highest_hz=4000)
    # `vidtune sample` loads the run's base model the same way: its mp4 has the 48 kHz track too.
    out = tmp_path / "sample.mp4"
    assert cli_main(["sample", config.output_dir, "--prompt", "a tone", "--steps", "1", "--output", str(out),
                     "--device", "cpu"]) == 0
    assert read_sound(out)[1] == 48000


def test_a_vocoder_class_ltx_2_pipeline_does_not_accept_is_refused_before_loading(tiny_model_dir, tmp_path):
    folder = renamed_component(tiny_model_dir("ltx-2"), tmp_path / "model", "vocoder", "LTX3Vocoder")
    with pytest.raises(ModelError) as raised:
        _spec(folder).check_source()
    message = str(raised.value)
    assert f"model.pretrained: {(folder / 'model_index.json').resolve()} names LTX3Vocoder for the vocoder" in message
    assert "LTX2Vocoder or LTX2VocoderWithBWE" in message and "\nWhat to do: " in message


def test_vidtune_train_with_an_unknown_vocoder_class_exits_2_before_loading(make_config, tiny_model_dir, tmp_path,
                                                                           capsys):
    folder = renamed_component(tiny_model_dir("ltx-2"), tmp_path / "model", "vocoder", "LTX3Vocoder")
    config = make_config("ltx-2", model={"pretrained": str(folder)})
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    assert cli_main(["train", str(path)]) == 2
    error = capsys.readouterr().err
    assert f"error: model.pretrained: {(folder / 'model_index.json').resolve()} names LTX3Vocoder" in error
    assert "What to do:" in error and "Traceback" not in error
    assert not (Path(config.output_dir) / LORA_WEIGHTS).exists()


def test_the_class_comes_from_model_index_or_a_given_subfolders_own_config(tiny_model_dir, bwe_folder, tmp_path):
    tiny = tiny_model_dir("ltx-2")
    assert _spec(tiny).component_class("vocoder", VOCODERS) is LTX2Vocoder
    assert _spec(tiny).component_class("text_encoder", TEXT_ENCODERS) is Gemma3ForConditionalGeneration
    # A vocoder given by model.subfolders is what its config.json names, whatever model_index.json says.
    given = _spec(tiny, subfolders={"vocoder": str(bwe_folder / "vocoder")})
    assert given.component_class("vocoder", VOCODERS) is LTX2VocoderWithBWE
    # LTX2Pipeline also takes Gemma 4 as the text encoder.
    gemma4 = renamed_component(tiny, tmp_path / "gemma4", "text_encoder", "Gemma4UnifiedForConditionalGeneration")
    assert _spec(gemma4).component_class("text_encoder", TEXT_ENCODERS) is Gemma4UnifiedForConditionalGeneration
    # A folder without model_index.json: each component's own config.json says.
    bare = tmp_path / "bare"
    shutil.copytree(bwe_folder, bare, ignore=shutil.ignore_patterns("model_index.json", "*.safetensors"))
    assert _spec(bare).component_class("vocoder", VOCODERS) is LTX2VocoderWithBWE
    assert _spec(bare).component_class("text_encoder", TEXT_ENCODERS) is Gemma3ForConditionalGeneration


def test_a_gemma_4_text_encoder_loads_and_encodes_as_the_pipeline_does(tiny_model_dir, tmp_path):
    tiny = tiny_model_dir("ltx-2")
    folder = renamed_component(tiny, tmp_path / "gemma4", "text_encoder", "Gemma4UnifiedForConditionalGeneration")
    (folder / "text_encoder").unlink()
    build_tiny_gemma4().save_pretrained(folder / "text_encoder")
    spec = _spec(folder)
    spec.check_source()
    text = spec.load_text_components(CPU)
    assert type(text["text_encoder"]) is Gemma4UnifiedForConditionalGeneration
    conditions = spec.prepare_conditions(text, ["a red circle"])

    pipeline = spec.pipeline(text, spec.load_vae(CPU), spec.load_denoiser(CPU))
    embeds, mask, _, _ = pipeline.encode_prompt("a red circle", do_classifier_free_guidance=False,
                                                max_sequence_length=spec.max_sequence_length, device=CPU)
    video, audio, connector_mask = pipeline.connectors(embeds, mask, padding_side="left")
    torch.testing.assert_close(conditions["prompt_embeds"], video)
    torch.testing.assert_close(conditions["audio_prompt_embeds"], audio)
    assert torch.equal(conditions["prompt_attention_mask"], connector_mask)
