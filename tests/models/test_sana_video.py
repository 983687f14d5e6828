"""Sana Video conventions (text and image-to-video) that the contract and overfit tests would not pin down alone."""

from __future__ import annotations

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file

from tests.helpers.distributed import two_ranks_against_one_process
from tests.helpers.runs import run_stopped_at
from vidtune.algorithms.build import build_part, build_spec
from vidtune.config import ModelConfig
from vidtune.errors import ConfigError
from vidtune.export.comfyui import ComfyUIExportError, save_comfyui_lora
from vidtune.models import first_frame
from vidtune.models.sana_video import SanaVideoImageToVideoSpec, SanaVideoSpec, complex_human_instruction
from vidtune.models.tiny import TINY_SHAPES, reference_videos
from vidtune.objectives import FlowMatching, objective_from_scheduler
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")
CAPTIONS = ["a red circle moving left", "  A Blue Square, spinning slowly "]
HUB_ID = "Efficient-Large-Model/SANA-Video_2B_480p_diffusers"


def _spec(cls, folder, **model):
    return cls(ModelConfig(name=cls.name, pretrained=str(folder), **model))


def _videos(family: str, batch: int = 2) -> torch.Tensor:
    frames, size, _ = TINY_SHAPES[family]
    return reference_videos(frames, size)[:batch]


@pytest.fixture(scope="module")
def t2v_folder(tiny_model_dir):
    return tiny_model_dir("sana-video")


@pytest.fixture(scope="module")
def i2v_folder(tiny_model_dir):
    return tiny_model_dir("sana-video-i2v")


@pytest.fixture(scope="module")
def t2v(t2v_folder):
    spec = _spec(SanaVideoSpec, t2v_folder)
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    return spec, text, vae, denoiser, pipeline


# ----- text ----------------------------------------------------------------------------------------------
def test_conditions_equal_the_pipelines_prompt_and_the_empty_caption_its_negative_prompt(t2v):
    spec, text, _, _, pipeline = t2v
    assert spec.max_sequence_length == 300
    conditions = spec.prepare_conditions(text, [*CAPTIONS, ""])
    assert conditions["prompt_embeds"].shape == (3, 300, 32)
    with torch.no_grad():
        # What the pipeline's call encodes: its default instruction before each prompt, and "" as negative prompt.
        embeds, mask, negative, negative_mask = pipeline.encode_prompt(
            CAPTIONS[:1], do_classifier_free_guidance=True, negative_prompt="", device=CPU,
            complex_human_instruction=list(complex_human_instruction()))
        second, second_mask, _, _ = pipeline.encode_prompt(
            CAPTIONS[1:2], do_classifier_free_guidance=False, device=CPU,
            complex_human_instruction=list(complex_human_instruction()))
    torch.testing.assert_close(conditions["prompt_embeds"][:2], torch.cat([embeds, second]))
    assert torch.equal(conditions["prompt_attention_mask"][:2], torch.cat([mask, second_mask]))
    torch.testing.assert_close(conditions["prompt_embeds"][2:], negative)
    assert torch.equal(conditions["prompt_attention_mask"][2:], negative_mask)
    # The instruction is what the tokens begin with: without it the caption's embeddings differ.
    bare, _, _, _ = pipeline.encode_prompt(CAPTIONS[:1], do_classifier_free_guidance=False, device=CPU)
    assert not torch.allclose(bare, embeds)
    assert spec.condition_identity()["instruction"] == list(complex_human_instruction())
    assert len(complex_human_instruction()) > 3


# ----- latents and timesteps -----------------------------------------------------------------------------
def test_latents_are_normalised_as_the_pipeline_denormalises_them(t2v):
    spec, _, vae, _, _ = t2v
    videos = _videos("sana-video")
    latents = spec.prepare_latents(vae, videos)
    raw = vae.encode(videos.permute(0, 2, 1, 3, 4)).latent_dist
    # SanaVideoPipeline decodes latents / (1 / latents_std) + latents_mean.
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(latents["latents_mean"] / (1.0 / std) + mean, raw.mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(latents["latents_std"] * std, raw.std, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scheduler", [
    DPMSolverMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True, prediction_type="flow_prediction"),
    FlowMatchEulerDiscreteScheduler(shift=8.0)], ids=["dpm-solver", "flow-euler"])
def test_the_pipelines_schedulers_tell_the_transformer_sigma_times_1000(scheduler):
    objective = objective_from_scheduler(scheduler, sampling="uniform")
    assert isinstance(objective, FlowMatching) and not objective.invert_timesteps and not objective.negate_target
    scheduler.set_timesteps(10)
    sigmas = scheduler.sigmas[:-1].float()
    assert (sigmas[:-1] > sigmas[1:]).all()
    torch.testing.assert_close(scheduler.timesteps.float(), objective.timesteps(sigmas), atol=1.0, rtol=0)


def test_shape_rules_name_the_pipelines_multiple_of_32(t2v):
    spec = t2v[0]
    spec.check_video_shape(9, 32, 64)
    with pytest.raises(ConfigError) as caught:
        spec.check_video_shape(10, 48, 32)
    message = str(caught.value)
    assert "data.frames=10" in message and "9 or 13" in message
    assert "data.height=48 must be a multiple of 32" in message and "frames 4k+1, sides multiples of 32" in message


# ----- image-to-video --------------------------------------------------------------------------------------
def _transformer_calls(denoiser) -> tuple[list[dict], object]:
    calls: list[dict] = []

    def record(module, args, kwargs):
        hidden_states = args[0] if args else kwargs["hidden_states"]  # the pipelines pass it by position
        calls.append({"hidden_states": hidden_states.detach().clone(),
                      "timestep": kwargs["timestep"].detach().clone()})

    return calls, denoiser.register_forward_pre_hook(record, with_kwargs=True)


def test_image_to_video_forward_gives_the_transformer_what_the_pipeline_gives_it(i2v_folder):
    """One step of SanaImageToVideoPipeline and the training forward on the same noisy latents: the same first
    frame (the image's latent), the same per-token timesteps (0 on the first frame), the same prediction."""
    spec = _spec(SanaVideoImageToVideoSpec, i2v_folder)
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    frames, size, _ = TINY_SHAPES["sana-video-i2v"]
    clip = _videos("sana-video-i2v", 1)
    calls, hook = _transformer_calls(denoiser)
    spec.sample(pipeline, CAPTIONS[0], frames=frames, height=size, width=size, num_inference_steps=1,
                generator=torch.Generator().manual_seed(0), reference=clip[0], output="latents")
    hook.remove()
    given = calls[0]
    conditions = {**spec.prepare_conditions(text, CAPTIONS[:1]), **spec.prepare_latents(vae, clip)}
    # The image's latent is what the pipeline put in the first frame.
    torch.testing.assert_close(conditions[first_frame.LATENTS], given["hidden_states"][:, :, :1],
                               atol=2e-2, rtol=0)
    noisy = given["hidden_states"].clone()
    noisy[:, :, :1] = torch.randn_like(noisy[:, :, :1])  # training's noise there is replaced by the image
    timestep = given["timestep"].flatten().max().view(1)
    calls, hook = _transformer_calls(denoiser)
    with torch.no_grad():
        spec.forward(denoiser, conditions, noisy, timestep)
    hook.remove()
    ours = calls[0]
    assert ours["timestep"].shape == given["timestep"].shape == (1, 1, 3, 2, 2)  # latent frames x patches
    assert torch.equal(ours["timestep"], given["timestep"].to(ours["timestep"]))
    assert float(ours["timestep"][:, :, 0].abs().max()) == 0.0 and bool((ours["timestep"][:, :, 1:] > 0).all())
    torch.testing.assert_close(ours["hidden_states"][:, :, :1], conditions[first_frame.LATENTS])
    torch.testing.assert_close(ours["hidden_states"][:, :, 1:], given["hidden_states"][:, :, 1:])
    # The first frame is the image, not a prediction: it stays out of the loss.
    error = torch.zeros(1, 4, 3, 2, 2)
    error[:, :, 0] = 7.0
    assert float(spec.per_clip_error(error, conditions)) == 0.0


def test_text_to_video_takes_first_frame_conditioning_and_image_to_video_refuses_a_share(t2v_folder, i2v_folder):
    spec = _spec(SanaVideoSpec, t2v_folder, first_frame_conditioning=1.0)
    assert spec.visit_conditions(torch.zeros(2, 4, 3, 2, 2), torch.tensor([0, 1]), seed=0)[first_frame.GIVEN] \
        .tolist() == [1.0, 1.0]
    assert _spec(SanaVideoSpec, t2v_folder).visit_conditions(torch.zeros(2, 4, 3, 2, 2), torch.tensor([0, 1]), 0) \
        == {}
    denoiser = spec.load_denoiser(CPU)
    given = torch.tensor([1.0, 0.0])
    timesteps = spec.token_timesteps(denoiser, torch.tensor([600.0, 300.0]), torch.zeros(2, 4, 3, 4, 4), given)
    assert timesteps[0, 0, 0].abs().max() == 0 and bool((timesteps[0, 0, 1:] == 600).all())
    assert bool((timesteps[1] == 300).all())
    i2v = _spec(SanaVideoImageToVideoSpec, i2v_folder, first_frame_conditioning=0.5)
    from vidtune.config import build_config

    config = build_config({"model": {"name": i2v.name, "pretrained": str(i2v_folder),
                                     "first_frame_conditioning": 0.5}, "data": {"root": "."}})
    with pytest.raises(ConfigError, match=r"first_frame_conditioning=0\.5: sana-video-i2v takes no"):
        i2v.check_frame_settings(config, [])


# ----- a trained LoRA in the pipeline, ComfyUI ---------------------------------------------------------------
@pytest.mark.parametrize("family", ["sana-video", "sana-video-i2v"])
def test_a_trained_lora_changes_what_the_pipeline_samples(make_config, family):
    config = make_config(family, training={"steps": 2, "learning_rate": 5e-2},
                         lora={"rank": 4, "alpha": 4, "target_modules": "attention+ffn"})
    trainer = build_trainer(config)
    result = trainer.run()
    spec = trainer.spec
    pipeline = spec.pipeline(spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU))
    pipeline.set_progress_bar_config(disable=True)
    frames, height, width = TINY_SHAPES[family]
    reference = _videos(family, 1)[0] if spec.image_to_video else None

    def sample() -> torch.Tensor:
        return spec.sample(pipeline, "a red circle", frames=frames, height=height, width=width,
                           num_inference_steps=2, generator=torch.Generator().manual_seed(0), reference=reference,
                           guidance_scale=spec.validation_guidance_scale).frames

    plain = sample()
    spec.load_lora(pipeline, result.weights_path.parent, result.weights_path.name)
    adapted = sample()
    assert plain.shape == adapted.shape == (frames, 3, height, width)
    assert (plain - adapted).abs().max() > 1e-4
    # The feed-forward's 1x1 convolutions were adapted too, and reached the pipeline's transformer.
    assert any("ff.conv_point.lora_A" in name for name, _ in pipeline.transformer.named_parameters())


def test_no_comfyui_file_is_written_and_the_message_says_why(make_config, tmp_path, capsys):
    config = make_config("sana-video", lora={"rank": 2})
    spec = build_spec(config)
    part = build_part(config, spec)
    denoiser = spec.load_denoiser(CPU)
    part.configure(denoiser)
    state = get_peft_model_state_dict(denoiser)
    assert spec.comfyui_model() is None
    assert part.save_comfyui(tmp_path, state, "run") is None  # at the end of a run: said, not fatal
    assert list(tmp_path.iterdir()) == []
    assert "ComfyUI's core has no Sana Video model" in capsys.readouterr().out
    with pytest.raises(ComfyUIExportError, match=r"no Sana Video model.*load_lora_weights"):
        save_comfyui_lora(spec, tmp_path, state, 2.0, "run")


@pytest.mark.parametrize("family", ["sana-video", "sana-video-i2v"])
def test_a_run_stopped_and_resumed_ends_bit_for_bit_as_one_left_alone(make_config, tmp_path, family):
    """With the first-frame share drawn per visit (text-to-video) and the image in every sample (image-to-video)."""
    ours = {"first_frame_conditioning": 0.5} if family == "sana-video" else {}

    def config(output, **checkpointing):
        return make_config(family, model=ours, training={"steps": 4, "learning_rate": 1e-2},
                           lora={"rank": 4, "alpha": 4, "dropout": 0.1}, checkpoint={"every": 2, **checkpointing},
                           output_dir=str(output))

    reference = build_trainer(config(tmp_path / "reference")).run()
    out = tmp_path / "stopped"
    run_stopped_at(build_trainer(config(out)), 3)
    resumed = build_trainer(config(out, resume="latest")).run()
    expected, found = load_file(reference.weights_path), load_file(resumed.weights_path)
    assert expected.keys() == found.keys() and expected
    assert all(torch.equal(expected[key], found[key]) for key in expected)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_train_what_one_process_trains_with_twice_the_batch(make_config, tmp_path, strategy):
    """Image-to-video (per-token timesteps, the image's latent in each sample) with the feed-forward's 1x1
    convolutions adapted, on two ranks of one clip each, against one process with both."""
    settings = {"family": "sana-video-i2v", "training": {"steps": 2, "learning_rate": 1e-2},
                "lora": {"rank": 4, "alpha": 4, "target_modules": "attention+ffn"},
                "parallel": {"strategy": strategy}}
    # The forward is the same batched or not (to 4e-7); Adam's first steps magnify the order of the gradients' float
    # sums where a gradient is near zero: measured 1.4e-4 on 3 of the 96 values of one adapter matrix.
    two_ranks_against_one_process(make_config, tmp_path, settings, atol=3e-4)


# ----- the planner --------------------------------------------------------------------------------------------
def test_the_shipped_text_encoder_is_gemma_2_2b():
    from transformers import Gemma2Config, Gemma2Model

    from vidtune.memory.architectures import architecture_folder, families

    assert families(HUB_ID) == ["sana-video", "sana-video-i2v"]
    folder, _ = architecture_folder(HUB_ID, "sana-video-i2v")
    with torch.device("meta"):
        encoder = Gemma2Model(Gemma2Config.from_pretrained(folder / "text_encoder"))
    count = sum(p.numel() for p in encoder.parameters())
    assert abs(count / 2.6e9 - 1) < 0.03, count  # Gemma 2 2B: 2.6B parameters (its model card)
