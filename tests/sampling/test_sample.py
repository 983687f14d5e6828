"""`vidtune sample` and `load_pipeline`: what a run trained, in the family's own pipeline, for every family."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from diffusers.modular_pipelines import ModularPipeline
from PIL import Image
from safetensors import safe_open

from vidtune.cli import main as cli_main
from vidtune.data.sources import read_sources
from vidtune.data.video import ClipWindow, read_clip
from vidtune.models.registry import available_models
from vidtune.models.tiny import TINY_SHAPES
from vidtune.sampling import SampleSettings, load_pipeline, render_sample, sample_run
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")
FAMILIES = available_models()


def _record_generate(spec) -> list[torch.Tensor]:
    """The frames of every sample `spec.sample` returns from now on (what validation and `vidtune sample`
    render)."""
    made: list[torch.Tensor] = []
    original = spec.sample

    def sample(*args, **kwargs):
        sampled = original(*args, **kwargs)
        made.append(sampled.frames)
        return sampled

    spec.sample = sample
    return made


@pytest.mark.parametrize("family", FAMILIES)
def test_a_lora_run_samples_what_its_validation_sampled(make_config, family, tmp_path):
    config = make_config(family, training={"steps": 2, "learning_rate": 5e-2}, lora={"rank": 4, "alpha": 4},
                         validation={"enabled": True, "num_inference_steps": 2, "prompts": ["a red circle"]})
    trainer = build_trainer(config)
    validated = _record_generate(trainer.spec)
    trainer.run()
    assert len(validated) == 1

    run = load_pipeline(config.output_dir, device="cpu")
    assert run.weights == Path(config.output_dir) / "pytorch_lora_weights.safetensors"
    sampled = _record_generate(run.spec)
    # No --image: an image-to-video family starts from the run's first clip, as validation did.
    sample_run(run, "a red circle", tmp_path / "sample.mp4")
    torch.testing.assert_close(sampled[0], validated[0], rtol=1e-4, atol=1e-5)

    run.pipeline.unload_lora_weights()  # the base model samples something else
    sample_run(run, "a red circle", tmp_path / "base.mp4")
    assert (sampled[1] - sampled[0]).abs().max() > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_a_full_run_loads_its_trained_transformer(make_config, family):
    config = make_config(family, training={"algorithm": "full", "steps": 1, "learning_rate": 1e-3})
    trainer = build_trainer(config)
    trainer.run()
    trained = dict(trainer.context.denoiser.named_parameters())
    base = dict(trainer.spec.load_denoiser(CPU).named_parameters())
    assert any(not torch.equal(base[name], trained[name]) for name in trained), "nothing trained"

    run = load_pipeline(config.output_dir, device="cpu")
    assert run.weights == Path(config.output_dir) / "transformer"
    loaded = dict(run.pipeline.transformer.named_parameters())
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[name], trained[name].to(loaded[name].dtype)) for name in trained)

    # What README.md tells users: the family's pipeline class with the family's transformer class (diffusers'
    # generic DiffusionPipeline.from_pretrained ignores `transformer=` for some families).
    spec = run.spec
    transformer = spec.denoiser_class.from_pretrained(run.weights)
    if issubclass(spec.pipeline_class, ModularPipeline):  # docs/models.md: its components loaded, then replaced
        pipeline = spec.pipeline_class.from_pretrained(config.model.pretrained)
        pipeline.load_components(names=["transformer"])
        assert any(not torch.equal(value, trained[name].to(value.dtype))
                   for name, value in pipeline.transformer.named_parameters()), "the base model was not loaded"
        pipeline.update_components(transformer=transformer)
    else:
        # Cosmos Predict 2.5's pipeline runs NVIDIA's guardrail: the tiny model's stand-in, as vidtune hands it.
        checker = {"safety_checker": spec.safety_checker()} if hasattr(spec, "safety_checker") else {}
        pipeline = spec.pipeline_class.from_pretrained(config.model.pretrained, transformer=transformer, **checker)
    held = dict(pipeline.transformer.named_parameters())
    assert all(torch.equal(held[name], trained[name].to(held[name].dtype)) for name in trained)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_saved_latents_are_the_pipelines_final_latents(make_config, family, tmp_path):
    """`--latents` keeps the last step's latents of the same call that renders the video: with guidance 1 they are
    what `spec.generate_latents` (output_type="latent") returns, in the training layout."""
    config = make_config(family)
    from vidtune.models.registry import get_spec_class

    spec = get_spec_class(family)(config.model, frame_rate=config.frame_rate)
    pipeline = spec.pipeline(spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU))
    pipeline.set_progress_bar_config(disable=True)
    frames, height, width = TINY_SHAPES[family]
    clip = read_sources(config.data).clips[0].video  # the dataset's first clip, wherever its layout keeps it
    reference = read_clip(clip, ClipWindow(1, height, width)) if spec.image_to_video else None
    settings = SampleSettings(("a red circle",), frames, height, width, 2, 1.0, 3, 24.0)
    render_sample(spec, pipeline, "a red circle", settings, 3, tmp_path / "s.mp4", reference=reference,
                  latents_path=tmp_path / "s.safetensors")
    with safe_open(tmp_path / "s.safetensors", "pt") as saved:
        latents = saved.get_tensor("latents")
        assert saved.metadata()["prompt"] == "a red circle" and saved.metadata()["seed"] == "3"
    expected = spec.sample(pipeline, "a red circle", frames=frames, height=height, width=width, num_inference_steps=2,
                           generator=torch.Generator().manual_seed(3), reference=reference, output="latents").latents
    assert latents.shape == expected.shape and latents.dtype == torch.float32
    torch.testing.assert_close(latents, expected.float(), rtol=1e-5, atol=1e-6)


def test_vidtune_sample_writes_the_video_contact_sheet_and_latents(make_config, tmp_path):
    config = make_config(training={"steps": 1})
    build_trainer(config).run()
    out, latents = tmp_path / "made" / "out.mp4", tmp_path / "out.safetensors"
    frames, height, width = 17, 32, 64  # another shape than training's: a valid one for the tiny model
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-m", "vidtune", "sample", config.output_dir, "--prompt", "a blue square", "--steps", "2",
         "--guidance", "1.5", "--seed", "4", "--frames", str(frames), "--height", str(height), "--width",
         str(width), "--output", str(out), "--latents", str(latents), "--device", "cpu"],
        capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Sample in" in result.stdout and str(out) in result.stdout and str(latents) in result.stdout
    assert "Loading the model ..." in result.stdout and "denoising: 100%" in result.stderr and "2/2" in result.stderr
    assert ("1 sample at 17x32x64 (frames x height x width, from --frames --height --width), 2 denoising steps "
            "each.") in result.stdout
    with av.open(str(out)) as container:
        decoded = list(container.decode(video=0))
    assert len(decoded) == frames and (decoded[0].height, decoded[0].width) == (height, width)
    with Image.open(out.with_suffix(".png")) as sheet:  # 8 of the frames, in 2 rows of 4, under the prompt
        assert sheet.width == 4 * 160 + 5 * 6 and sheet.height > 2 * 160 * height // width + 2 * 16
    assert out.with_suffix(".txt").read_text() == "a blue square\n"
    with safe_open(latents, "pt") as saved:
        assert list(saved.keys()) == ["latents"]
        tensor = saved.get_tensor("latents")
        assert saved.metadata()["guidance_scale"] == "1.5"
    # [1, C, F, H, W]: the tiny LTX-Video VAE compresses 4x in time and in space.
    assert tensor.shape[0] == 1 and tensor.shape[2:] == ((frames - 1) // 4 + 1, height // 4, width // 4)
    assert torch.isfinite(tensor).all() and np.isfinite(tensor.numpy()).all()

    # Without --output: the first free name under the run's samples folder.
    assert cli_main(["sample", config.output_dir, "--prompt", "x", "--steps", "1", "--device", "cpu"]) == 0
    assert (Path(config.output_dir) / "samples" / "sample-001.mp4").is_file()


def test_sample_refusals_say_what_to_do(make_config, tmp_path, capsys):
    config = make_config(training={"steps": 1}, checkpoint={"every": 1})
    build_trainer(config).run()
    run = config.output_dir
    cases = [
        ([str(tmp_path), "--prompt", "x"], "is not the folder of a vidtune run: it has no config.yaml"),
        ([run, "--prompt", "x", "--image", str(tmp_path / "a.png")], "--image: ltx-video generates from text alone"),
        ([run, "--prompt", "x", "--control", "c.mp4"], "was not trained with control clips (training.algorithm lora)"),
        ([run, "--prompt", "x", "--frames", "10"], "--frames=10 must be 4k+1"),
        ([run, "--prompt", "x", "--output", "a.gif"], "--output a.gif: the file name must end in .mp4"),
        ([run, "--prompt", "x", "--ema"], None),
    ]
    for arguments, message in cases:
        if message is None:
            with pytest.raises(SystemExit):  # argparse: unknown option
                cli_main(["sample", *arguments])
            continue
        assert cli_main(["sample", *arguments, "--device", "cpu"]) == 2, message
        err = capsys.readouterr().err
        assert message in err and "What to do:" in err, err
    # A run that did not finish samples its newest checkpoint; without one, nothing was trained yet.
    (Path(run) / "pytorch_lora_weights.safetensors").unlink()
    assert cli_main(["sample", run, "--prompt", "x", "--steps", "1"]) == 0
    assert "sampling the checkpoint" in capsys.readouterr().out
    shutil.rmtree(Path(run) / "checkpoints")
    assert cli_main(["sample", run, "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "holds no trained weights" in err and "What to do:" in err


def test_a_run_with_a_weights_average_samples_with_it_unless_told(make_config, tmp_path):
    from vidtune.errors import VidtuneError
    from vidtune.sampling import run_weights

    config = make_config(training={"steps": 2, "ema_decay": 0.5, "learning_rate": 5e-2})
    build_trainer(config).run()
    out = Path(config.output_dir)
    assert run_weights(out) == (out / "pytorch_lora_weights_ema.safetensors", True)
    assert run_weights(out, ema=False) == (out / "pytorch_lora_weights.safetensors", True)
    averaged, plain = load_pipeline(out, device="cpu"), load_pipeline(out, device="cpu", ema=False)
    videos = [_record_generate(run.spec) for run in (averaged, plain)]
    for run in (averaged, plain):
        sample_run(run, "a red circle", tmp_path / "s.mp4", num_inference_steps=2)
    assert (videos[0][0] - videos[1][0]).abs().max() > 1e-4
    (out / "pytorch_lora_weights_ema.safetensors").unlink()
    with pytest.raises(VidtuneError, match="has no moving average of its weights"):
        run_weights(out, ema=True)


def test_vidtune_sample_takes_a_checkpoint_an_unfinished_run_and_an_export(make_config, tmp_path, capsys):
    from tests.helpers.runs import run_stopped_at
    from vidtune.export.command import export_checkpoint

    finished = make_config(training={"steps": 2}, checkpoint={"every": 1, "keep": 5})
    build_trainer(finished).run()
    run = Path(finished.output_dir)
    assert cli_main(["sample", str(run / "checkpoints" / "step-00000001"), "--prompt", "x", "--steps", "1",
                     "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"sampling the checkpoint {run / 'checkpoints' / 'step-00000001'}" in out
    assert "with pytorch_lora_weights.safetensors of step-00000001" in out
    assert (run / "samples" / "sample-001.mp4").is_file()  # the run's samples folder

    stopped = make_config(training={"steps": 4}, checkpoint={"every": 1, "keep": 5},
                          output_dir=str(tmp_path / "stopped"))
    run_stopped_at(build_trainer(stopped), 2)
    unfinished = Path(stopped.output_dir)
    assert (unfinished / "loss.png").is_file()  # written with each checkpoint, also when the run stops
    assert cli_main(["sample", str(unfinished), "--prompt", "x", "--steps", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert (f"{unfinished} holds no final weights (the run did not finish): sampling the checkpoint "
            f"{unfinished / 'checkpoints' / 'step-00000002'}") in out

    # What the interrupt message advises: export, then sample the export.
    exported = tmp_path / "exported"
    export_checkpoint(unfinished / "checkpoints" / "step-00000002", exported)
    assert (exported / "config.yaml").is_file()
    assert cli_main(["sample", str(exported), "--prompt", "x", "--steps", "1", "--device", "cpu"]) == 0
    assert (exported / "samples" / "sample-001.mp4").is_file()
    assert "Sample in" in capsys.readouterr().out
