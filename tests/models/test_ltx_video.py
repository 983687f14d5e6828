"""LTX-Video specifics that must match what LTXPipeline does at inference."""

from __future__ import annotations

import pytest
import torch

from vidtune.config import ModelConfig
from vidtune.models.ltx_video import LTXVideoSpec

CPU = torch.device("cpu")


@pytest.fixture
def spec(tiny_model_dir):
    return LTXVideoSpec(ModelConfig(name="ltx-video", pretrained=str(tiny_model_dir("ltx-video"))), frame_rate=24.0)


def test_forward_gives_the_denoiser_exactly_what_the_pipeline_gives_it(spec):
    """Rotary scale, sizes, mask and timestep: a mismatch here trains a model the pipeline cannot use."""
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
    seen: list[dict] = []
    denoiser.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    frames, height, width = 9, 32, 32
    spec.sample(pipeline, "a red circle", frames=frames, height=height, width=width, num_inference_steps=1,
                generator=torch.Generator().manual_seed(0))
    from_pipeline = seen.pop()

    conditions = spec.prepare_conditions(text, ["a red circle"])
    latents = torch.randn(1, 8, 3, 8, 8)
    with torch.no_grad():
        spec.forward(denoiser, conditions, latents, torch.tensor([1000.0]))
    from_training = seen.pop()

    assert from_training["rope_interpolation_scale"] == pytest.approx(from_pipeline["rope_interpolation_scale"])
    assert from_training["rope_interpolation_scale"] == pytest.approx((4 / 24.0, 4, 4))
    for key in ("num_frames", "height", "width"):
        assert from_training[key] == from_pipeline[key]
    torch.testing.assert_close(from_training["encoder_hidden_states"], from_pipeline["encoder_hidden_states"])
    assert torch.equal(from_training["encoder_attention_mask"], from_pipeline["encoder_attention_mask"])
    # The pipeline's first timestep is sigma=1 -> 1000, the scale the trainer uses (objective.timesteps).
    assert float(from_pipeline["timestep"][0]) == pytest.approx(1000.0)


def test_prepared_latents_decode_like_the_pipeline_decodes(spec):
    """Normalisation: the pipeline's denormalise + VAE decode of our latents reproduces the VAE's reconstruction."""
    vae = spec.load_vae(CPU)
    video = torch.rand(1, 9, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = spec.prepare_latents(vae, video)["latents_mean"]
    from diffusers import LTXPipeline

    raw = vae.encode(video.permute(0, 2, 1, 3, 4)).latent_dist.mean
    denormalised = LTXPipeline._denormalize_latents(latents, vae.latents_mean, vae.latents_std,
                                                    vae.config.scaling_factor)
    torch.testing.assert_close(denormalised, raw, rtol=1e-4, atol=1e-5)
    # Normalised latents have roughly unit scale, like a trained model's.
    assert 0.3 < latents.std() < 3.0


def test_gradient_checkpointing_gives_the_same_step(make_config, tmp_path):
    from vidtune.trainers import build_trainer

    results = []
    for flag in (False, True):
        config = make_config(training={"steps": 2, "gradient_checkpointing": flag},
                             output_dir=str(tmp_path / str(flag)))
        trainer = build_trainer(config)
        result = trainer.run()
        assert trainer.context.denoiser.gradient_checkpointing is flag
        results.append((result.losses, trainer.part.state_dict()))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    for key, value in results[0][1].items():
        torch.testing.assert_close(value, results[1][1][key], rtol=1e-4, atol=1e-6)
