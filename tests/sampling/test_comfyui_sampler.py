"""`validation.sampler: comfyui`: a sample steps with Euler through the sigmas ComfyUI computes for the run's
workflow, and is what the family's pipeline gives when handed those sigmas."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from safetensors import safe_open

from vidtune.config import load_config
from vidtune.errors import ConfigError
from vidtune.export.comfyui_sigmas import ComfyUISchedule
from vidtune.models.hunyuan_video import PROMPT_TEMPLATE
from vidtune.models.registry import get_spec_class
from vidtune.models.tiny import TINY_SHAPES
from vidtune.sampling import SampleSettings, comfyui_sigmas, render_sample

CPU = torch.device("cpu")
PROMPT = "a red circle"


def _spec_and_pipeline(config):
    spec = get_spec_class(config.model.name)(config.model, frame_rate=config.frame_rate)
    pipeline = spec.pipeline(spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU))
    pipeline.set_progress_bar_config(disable=True)
    return spec, pipeline


def _settings(config, spec, steps: int = 3) -> SampleSettings:
    frames, height, width = TINY_SHAPES[config.model.name]
    settings = SampleSettings.from_config(config, spec, PROMPT)
    return SampleSettings((PROMPT,), frames, height, width, steps, 1.0, 5, 24.0, settings.comfyui)


def _told(pipeline) -> list[float]:
    told: list[float] = []
    pipeline.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: told.append(float(kwargs["timestep"].flatten()[0])), with_kwargs=True)
    return told


@pytest.mark.parametrize(("family", "scheduler", "shift"), [
    ("ltx-video", "ltxv", None), ("ltx-2", "ltxv", None), ("wan", "simple", 5.0), ("mochi", "linear_quadratic", None),
    ("hunyuan-video", "beta", 7.0)])
def test_the_denoiser_is_told_comfyuis_noise_levels(make_config, family, scheduler, shift, tmp_path):
    """Each denoising step is at a level of ComfyUI's schedule for the sample's size: the pipeline's own scheduler
    (LTX-Video's resolution shift, Wan's UniPC, Mochi's inverted sigmas) is replaced for the sample, then put
    back."""
    config = make_config(family, validation={"sampler": "comfyui", "comfyui_scheduler": scheduler,
                                             "comfyui_shift": shift})
    spec, pipeline = _spec_and_pipeline(config)
    settings = _settings(config, spec)
    own = pipeline.scheduler
    told = _told(pipeline)
    render_sample(spec, pipeline, PROMPT, settings, 5, tmp_path / "s.mp4")
    expected = comfyui_sigmas(spec, settings)
    assert settings.comfyui == ComfyUISchedule(scheduler, shift or settings.comfyui.shift)
    levels = expected[:-1]
    if pipeline.scheduler.config.get("invert_sigmas"):  # Mochi's transformer is told 1 - sigma
        levels = 1 - levels
    assert told == pytest.approx((levels * 1000).tolist(), rel=1e-5, abs=1e-3)
    assert pipeline.scheduler is own


def test_a_comfyui_sample_is_the_pipeline_handed_comfyuis_sigmas(make_config, tmp_path):
    """HunyuanVideoPipeline takes `sigmas`: given ComfyUI's (without the final 0) and an Euler scheduler that
    shifts nothing, it makes the same latents as `validation.sampler: comfyui`."""
    config = make_config("hunyuan-video", validation={"sampler": "comfyui", "comfyui_shift": 7.0})
    spec, pipeline = _spec_and_pipeline(config)
    settings = _settings(config, spec)
    render_sample(spec, pipeline, PROMPT, settings, 5, tmp_path / "s.mp4", latents_path=tmp_path / "s.safetensors")
    with safe_open(tmp_path / "s.safetensors", "pt") as saved:
        through_comfyui = saved.get_tensor("latents")
    pipeline.scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    sigmas = ComfyUISchedule("simple", 7.0).sigmas(settings.num_inference_steps)
    given = pipeline(prompt=PROMPT, num_frames=settings.frames, height=settings.height, width=settings.width,
                     sigmas=sigmas[:-1].tolist(), num_inference_steps=settings.num_inference_steps,
                     guidance_scale=spec.guidance_scale, generator=torch.Generator().manual_seed(5),
                     output_type="latent", prompt_template=PROMPT_TEMPLATE,
                     max_sequence_length=spec.max_sequence_length).frames
    expected = spec.latents_from_pipeline(given, settings.frames, settings.height, settings.width)
    torch.testing.assert_close(through_comfyui, expected.float(), rtol=1e-5, atol=1e-6)


def test_the_sheet_says_the_sample_was_made_as_comfyui_makes_it(make_config):
    from vidtune.sampling import sheet_caption

    config = make_config("wan", validation={"sampler": "comfyui", "comfyui_shift": 5.0})
    spec = get_spec_class("wan")(config.model, frame_rate=config.frame_rate)
    settings = SampleSettings.from_config(config, spec, PROMPT)
    assert "as ComfyUI: euler, simple, shift 5" in sheet_caption(PROMPT, settings, 0)[1]


def test_the_shift_defaults_to_the_family_schedulers(make_config):
    config = make_config("wan", validation={"sampler": "comfyui"})
    spec = get_spec_class("wan")(config.model, frame_rate=config.frame_rate)
    scheduler = spec.load_scheduler().config
    expected = scheduler.get("flow_shift") or scheduler.get("shift")
    assert SampleSettings.from_config(config, spec, PROMPT).comfyui == ComfyUISchedule("simple", float(expected))


@pytest.mark.parametrize("family", ["cogvideox", "sana-video", "skyreels-v2"])
def test_a_family_without_a_comfyui_workflow_refuses_the_comfyui_sampler_before_training(make_config, family):
    from vidtune.trainers import build_trainer

    config = make_config(family, validation={"sampler": "comfyui"})
    with pytest.raises(ConfigError, match=r"validation.sampler=comfyui: .*\nWhat to do: use validation.sampler="
                                          r"pipeline"):
        build_trainer(config).set_up()


def test_an_unknown_comfyui_scheduler_is_a_config_error(make_config, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  name: wan\nvalidation:\n  comfyui_scheduler: karras\n")
    with pytest.raises(ConfigError, match="comfyui_scheduler"):
        load_config(path)
