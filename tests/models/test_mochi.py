"""Mochi conventions (inverted time, negated velocity, config latent statistics) checked against MochiPipeline."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.mochi.pipeline_mochi import linear_quadratic_schedule, retrieve_timesteps

from vidtune.config import ModelConfig, TrainingConfig
from vidtune.models.mochi import MochiSpec
from vidtune.models.tiny import TINY_SHAPES, reference_videos
from vidtune.objectives import FlowMatching, objective_from_scheduler

CPU = torch.device("cpu")
CAPTIONS = ["a red circle moving left", "A  blue square,   spinning slowly on a dark background"]


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("mochi")


def _spec(folder, **model) -> MochiSpec:
    return MochiSpec(ModelConfig(name="mochi", pretrained=str(folder), **model))


def _pipeline(spec):
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


# ----- objective ---------------------------------------------------------------------------------------
def test_negate_target_is_set_by_inverted_sigmas():
    x0, noise = torch.randn(2, 3), torch.randn(2, 3)
    levels = torch.tensor([0.2, 0.7])
    torch.testing.assert_close(FlowMatching(negate_target=True).target(x0, noise, levels), x0 - noise)
    torch.testing.assert_close(FlowMatching().target(x0, noise, levels), noise - x0)
    assert objective_from_scheduler(FlowMatchEulerDiscreteScheduler(invert_sigmas=True)).negate_target
    assert not objective_from_scheduler(FlowMatchEulerDiscreteScheduler()).negate_target


@pytest.mark.parametrize("invert_sigmas", [False, True])
def test_an_euler_step_with_the_target_lands_on_the_next_noise_level(invert_sigmas):
    """For either convention, the scheduler stepping with the training target follows the training noising."""
    scheduler = FlowMatchEulerDiscreteScheduler(invert_sigmas=invert_sigmas)
    objective = objective_from_scheduler(scheduler, sampling="uniform")
    scheduler.set_timesteps(sigmas=linear_quadratic_schedule(8, 0.025))
    sigmas = 1.0 - scheduler.sigmas if invert_sigmas else scheduler.sigmas  # noise levels, 1 = pure noise
    x0, noise = torch.randn(1, 12, 2, 4, 4), torch.randn(1, 12, 2, 4, 4)
    latents = objective.noisy(x0, noise, sigmas[:1])
    for index, timestep in enumerate(scheduler.timesteps):
        torch.testing.assert_close(objective.timesteps(sigmas[index : index + 1]), timestep.view(1))
        latents = scheduler.step(objective.target(x0, noise, sigmas[index : index + 1]), timestep, latents).prev_sample
        torch.testing.assert_close(latents, objective.noisy(x0, noise, sigmas[index + 1 : index + 2]))
    torch.testing.assert_close(latents, x0)


def test_transformer_timestep_equals_the_pipelines_for_the_same_sigma(folder):
    spec = _spec(folder)
    objective = spec.objective(TrainingConfig())
    assert isinstance(objective, FlowMatching) and objective.invert_timesteps and objective.negate_target
    scheduler = spec.load_scheduler()
    # What MochiPipeline does: a linear-quadratic schedule of sigmas (1 = noise) handed to the scheduler.
    timesteps, _ = retrieve_timesteps(scheduler, 30, CPU, None, np.array(linear_quadratic_schedule(30, 0.025)))
    noise_levels = torch.tensor(linear_quadratic_schedule(30, 0.025), dtype=torch.float32)
    assert float(timesteps[0]) == 0.0  # pure noise is timestep 0 for Mochi
    torch.testing.assert_close(objective.timesteps(noise_levels), timesteps, atol=1e-3, rtol=0)


# ----- text ----------------------------------------------------------------------------------------------
def test_prepare_conditions_equal_the_pipeline_encode_prompt(folder):
    spec = _spec(folder)
    pipeline = _pipeline(spec)
    assert spec.max_sequence_length == pipeline.transformer.config.max_sequence_length == 16
    embeds, mask, _, _ = pipeline.encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                                max_sequence_length=spec.max_sequence_length, device=CPU)
    conditions = spec.prepare_conditions({"tokenizer": pipeline.tokenizer, "text_encoder": pipeline.text_encoder},
                                         CAPTIONS)
    torch.testing.assert_close(conditions["prompt_embeds"], embeds)
    assert torch.equal(conditions["prompt_attention_mask"], mask)


def test_force_zeros_for_empty_prompt_is_read_from_the_pipeline_config(folder, tmp_path):
    copy = shutil.copytree(folder, tmp_path / "mochi")
    index = json.loads((copy / "model_index.json").read_text())
    (copy / "model_index.json").write_text(json.dumps({**index, "force_zeros_for_empty_prompt": True}))
    spec = _spec(copy)
    assert spec.force_zeros_for_empty_prompt and not _spec(folder).force_zeros_for_empty_prompt
    pipeline = _pipeline(spec)
    assert pipeline.config.force_zeros_for_empty_prompt
    embeds, mask, _, _ = pipeline.encode_prompt("", do_classifier_free_guidance=False,
                                                max_sequence_length=spec.max_sequence_length, device=CPU)
    conditions = spec.prepare_conditions({"tokenizer": pipeline.tokenizer, "text_encoder": pipeline.text_encoder},
                                         ["", CAPTIONS[0]])
    torch.testing.assert_close(conditions["prompt_embeds"][:1], embeds)
    assert torch.equal(conditions["prompt_attention_mask"][:1], mask) and not mask.any()
    assert conditions["prompt_attention_mask"][1].any()  # per caption: the other one keeps its tokens


def test_sequence_length_defaults_to_the_transformers(folder):
    assert _spec(folder, max_sequence_length=None).max_sequence_length == 16  # unset: the family's own
    assert _spec(folder, max_sequence_length=40).max_sequence_length == 40


# ----- latents -------------------------------------------------------------------------------------------
def test_latents_are_normalised_with_the_vae_config_statistics(folder):
    spec = _spec(folder)
    vae = spec.load_vae(CPU)
    frames, size, _ = TINY_SHAPES["mochi"]
    latents = spec.prepare_latents(vae, reference_videos(frames, size))["latents_mean"]
    # The tiny VAE's statistics were measured on these very clips: unit scale per channel.
    torch.testing.assert_close(latents.mean(dim=(0, 2, 3, 4)), torch.zeros(12), atol=1e-3, rtol=0)
    torch.testing.assert_close(latents.std(dim=(0, 2, 3, 4)), torch.ones(12), atol=1e-3, rtol=0)


def test_pipeline_decodes_training_latents_to_the_vae_reconstruction(folder):
    """The latents the trainer teaches, put in the pipeline's loop, decode (denormalised) to the VAE's output."""
    spec = _spec(folder)
    pipeline = _pipeline(spec)
    frames, size, _ = TINY_SHAPES["mochi"]
    videos = reference_videos(frames, size)[:1]
    latents = spec.prepare_latents(pipeline.vae, videos)["latents_mean"]

    def inject(pipe, step, timestep, tensors):
        return {"latents": latents} if step == pipe.num_timesteps - 1 else {}

    decoded = pipeline(prompt="a", num_frames=frames, height=size, width=size, num_inference_steps=2,
                       guidance_scale=1.0, max_sequence_length=spec.max_sequence_length, output_type="pt",
                       callback_on_step_end=inject).frames
    with torch.no_grad():
        raw = pipeline.vae.encode(videos.permute(0, 2, 1, 3, 4)).latent_dist.mean
        expected = (pipeline.vae.decode(raw).sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
    torch.testing.assert_close(decoded, expected, atol=1e-4, rtol=1e-4)
