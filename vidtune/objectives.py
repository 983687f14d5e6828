"""Diffusion training objectives as plain tensor maths, shared by every model and trainer.

Conventions (flow matching, rectified flow as used by LTX-Video, HunyuanVideo, Wan, ...):
    sigma in (0, 1), sigma = 1 is pure noise;
    noisy = (1 - sigma) * x0 + sigma * noise;
    target (velocity) = noise - x0;
    the denoiser is given timestep = sigma * 1000, which is what FlowMatchEulerDiscreteScheduler
    hands it at inference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

SigmaSampling = Literal["uniform", "logit_normal"]
NUM_TRAIN_TIMESTEPS = 1000


def sample_uniform_sigmas(batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.rand(batch_size, generator=generator, dtype=torch.float64).float()


def sample_logit_normal_sigmas(
    batch_size: int, mean: float = 0.0, std: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """sigma = sigmoid(N(mean, std)): concentrates training on the middle of the noise range (SD3)."""
    normal = torch.randn(batch_size, generator=generator, dtype=torch.float64) * std + mean
    return torch.sigmoid(normal).float()


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """The time shift of SD3 / FlowMatchEulerDiscreteScheduler: shift > 1 moves sigmas towards noise."""
    if shift == 1.0:
        return sigmas
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_matching_noisy(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    sigmas = _broadcast(sigmas, x0)
    return (1.0 - sigmas) * x0 + sigmas * noise


def flow_matching_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise - x0


def _broadcast(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.to(device=like.device, dtype=like.dtype).view(-1, *([1] * (like.ndim - 1)))


@dataclass(frozen=True)
class FlowMatching:
    """Flow matching with a configurable sigma distribution; `shift` is data, not code."""

    sampling: SigmaSampling = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0

    def sample_sigmas(self, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        if self.sampling == "uniform":
            sigmas = sample_uniform_sigmas(batch_size, generator)
        else:
            sigmas = sample_logit_normal_sigmas(batch_size, self.logit_mean, self.logit_std, generator)
        return shift_sigmas(sigmas, self.shift)

    def noisy(self, x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        return flow_matching_noisy(x0, noise, sigmas)

    def target(self, x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        return flow_matching_target(x0, noise)

    def timesteps(self, sigmas: torch.Tensor) -> torch.Tensor:
        return sigmas * NUM_TRAIN_TIMESTEPS


Objective = FlowMatching
