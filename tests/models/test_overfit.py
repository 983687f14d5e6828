"""The correctness test that matters: overfit one clip, then sample it with the family's own pipeline.

A wrong target, timestep direction, packing, normalisation or rotary scale leaves the training loss
looking fine but makes the pipeline sample something else; this test sees it.
"""

from __future__ import annotations

import pytest
import torch

from vidtune.config import ModelConfig, TrainingConfig
from vidtune.data.sources import load_text_pair_dataset
from vidtune.data.video import read_clip
from vidtune.models.registry import available_models, get_spec_class, tiny_family
from vidtune.models.tiny import TINY_SHAPES

CPU = torch.device("cpu")
FRAME_RATE = 24.0


def overfit_and_sample(spec, clip, caption, steps: int, learning_rate: float, batch: int = 4):
    frames, height, width = TINY_SHAPES[spec.name]
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
    video = read_clip(clip, frames, height, width)[None]
    conditions = spec.prepare_conditions(text, [caption])
    latents = spec.prepare_latents(vae, video)
    x0 = latents["latents_mean"]
    extra = {k: v for k, v in latents.items() if k not in ("latents_mean", "latents_std")}
    conditions = {k: v.expand(batch, *v.shape[1:]) for k, v in {**conditions, **extra}.items()}
    objective = spec.objective(TrainingConfig(sigma_sampling="uniform"))
    optimizer = torch.optim.AdamW(denoiser.parameters(), lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=learning_rate, total_steps=steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(0)
    targets = x0.expand(batch, *x0.shape[1:])
    denoiser.train()
    for _ in range(steps):
        levels = objective.sample_noise_levels(batch, generator)
        noise = torch.randn(targets.shape, generator=generator)
        prediction = spec.forward(denoiser, conditions, objective.noisy(targets, noise, levels),
                                  objective.timesteps(levels))
        loss = (prediction - objective.target(targets, noise, levels)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    denoiser.eval()
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    with torch.no_grad():
        sampled = spec.generate_latents(pipeline, caption, frames, height, width, 30,
                                        torch.Generator().manual_seed(1))
    return x0, sampled


@pytest.mark.slow
@pytest.mark.parametrize("family", available_models())
def test_overfit_one_clip_then_sample_with_pipeline(family, tiny_model_dir, shapes_dataset):
    settings = tiny_family(family).overfit  # optimizer steps, peak learning rate of a one-cycle schedule, bound
    steps, learning_rate, bound = settings.steps, settings.learning_rate, settings.bound
    torch.manual_seed(0)
    sample = load_text_pair_dataset(shapes_dataset)[0]
    spec = get_spec_class(family)(ModelConfig(name=family, pretrained=str(tiny_model_dir(family))), FRAME_RATE)
    x0, sampled = overfit_and_sample(spec, sample.video, sample.caption, steps, learning_rate, settings.batch_size)
    assert sampled.shape == x0.shape
    relative_error = float((sampled - x0).norm() / x0.norm())
    random_error = float((torch.randn_like(x0) - x0).norm() / x0.norm())
    print(f"{family}: relative error {relative_error:.3f} (random latent: {random_error:.3f})")
    assert relative_error < bound, (
        f"{family}: sampled latents are {relative_error:.3f} away (random: {random_error:.2f})"
    )
