"""Diffusion training objectives as plain tensor maths, shared by every model and trainer.

The objective of a model is chosen from its scheduler (`objective_from_scheduler`), never per model.

Flow-matching conventions (, rectified flow as used by LTX-Video, HunyuanVideo, Wan, ...):
    sigma in (0, 1), sigma = 1 is pure noise;
    noisy = (1 - sigma) * x0 + sigma * noise;
    target (velocity) = noise - x0;
    the denoiser is given timestep = sigma * 1000, which is what FlowMatchEulerDiscreteScheduler
    hands it at inference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from vidtune.errors import SchedulerError

SigmaSampling = Literal["uniform", "logit_normal"]
NUM_TRAIN_TIMESTEPS = 1000
DDPM_PREDICTIONS = ("epsilon", "v_prediction")


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


class Objective(Protocol):
    """What a trainer needs from an objective; every method is pure tensor maths.

    A "noise level" is the per-sample quantity the objective samples: sigma in (0, 1) for flow
    matching, an integer training timestep (as float) for DDPM.
    """

    def sample_noise_levels(self, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor: ...

    def noisy(self, x0: torch.Tensor, noise: torch.Tensor, levels: torch.Tensor) -> torch.Tensor: ...

    def target(self, x0: torch.Tensor, noise: torch.Tensor, levels: torch.Tensor) -> torch.Tensor: ...

    def timesteps(self, levels: torch.Tensor) -> torch.Tensor: ...

    def loss_weights(self, levels: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class FlowMatching:
    """Flow matching with a configurable sigma distribution; shift and timestep direction are data.

    `invert_timesteps`: the denoiser is told (1 - sigma) * 1000 instead of sigma * 1000 (Mochi's
    convention, `invert_sigmas` in its scheduler config).
    `negate_target`: the target is x0 - noise instead of noise - x0. A scheduler with `invert_sigmas` steps
    x += (s_next - s) * prediction over s = 1 - sigma, so the prediction it needs is d x / d s = x0 - noise.
    """

    sampling: SigmaSampling = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    invert_timesteps: bool = False
    negate_target: bool = False

    def sample_noise_levels(self, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        if self.sampling == "uniform":
            sigmas = sample_uniform_sigmas(batch_size, generator)
        else:
            sigmas = sample_logit_normal_sigmas(batch_size, self.logit_mean, self.logit_std, generator)
        return shift_sigmas(sigmas, self.shift)

    def noisy(self, x0: torch.Tensor, noise: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        return flow_matching_noisy(x0, noise, levels)

    def target(self, x0: torch.Tensor, noise: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        target = flow_matching_target(x0, noise)
        return -target if self.negate_target else target

    def timesteps(self, levels: torch.Tensor) -> torch.Tensor:
        sigmas = 1.0 - levels if self.invert_timesteps else levels
        return sigmas * NUM_TRAIN_TIMESTEPS

    def loss_weights(self, levels: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(levels)


def ddpm_noisy(x0: torch.Tensor, noise: torch.Tensor, alphas_cumprod_t: torch.Tensor) -> torch.Tensor:
    alpha = _broadcast(alphas_cumprod_t, x0)
    return alpha.sqrt() * x0 + (1 - alpha).sqrt() * noise


def ddpm_v_target(x0: torch.Tensor, noise: torch.Tensor, alphas_cumprod_t: torch.Tensor) -> torch.Tensor:
    alpha = _broadcast(alphas_cumprod_t, x0)
    return alpha.sqrt() * noise - (1 - alpha).sqrt() * x0


@dataclass(frozen=True, eq=False)
class DDPM:
    """Discrete-time diffusion with the scheduler's own alphas (epsilon or v prediction).

    `alphas_cumprod` comes from the family's scheduler instance, so model-specific tweaks of the
    schedule (zero-terminal-SNR rescaling, CogVideoX's SNR shift) are data here, not code.
    `snr_weighting`: weight each sample's loss by 1 / (1 - alpha_bar_t), as CogVideoX was trained.
    """

    alphas_cumprod: torch.Tensor
    prediction_type: Literal["epsilon", "v_prediction"] = "v_prediction"
    snr_weighting: bool = False

    def sample_noise_levels(self, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        count = len(self.alphas_cumprod)
        return torch.randint(0, count, (batch_size,), generator=generator).float()

    def _alphas(self, levels: torch.Tensor) -> torch.Tensor:
        return self.alphas_cumprod.to(torch.float32)[levels.long().cpu()]

    def noisy(self, x0: torch.Tensor, noise: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        return ddpm_noisy(x0, noise, self._alphas(levels))

    def target(self, x0: torch.Tensor, noise: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        if self.prediction_type == "epsilon":
            return noise
        return ddpm_v_target(x0, noise, self._alphas(levels))

    def timesteps(self, levels: torch.Tensor) -> torch.Tensor:
        return levels.long()

    def loss_weights(self, levels: torch.Tensor) -> torch.Tensor:
        if not self.snr_weighting:
            return torch.ones_like(levels)
        return 1.0 / (1.0 - self._alphas(levels)).clamp_min(1e-6)


SUPPORTED_SCHEDULERS = (
    "flow matching: FlowMatchEulerDiscreteScheduler (or another FlowMatch*Scheduler), or a scheduler with "
    "prediction_type 'flow_prediction' or use_flow_sigmas (e.g. UniPCMultistepScheduler, as Wan ships it); "
    "DDPM: a scheduler with alphas_cumprod (DDPMScheduler, DDIMScheduler, CogVideoXDDIMScheduler, "
    "CogVideoXDPMScheduler, DPMSolverMultistepScheduler, ...) with prediction_type 'epsilon' or 'v_prediction'"
)


def objective_from_scheduler(scheduler: Any, sampling: SigmaSampling = "logit_normal", logit_mean: float = 0.0,
                             logit_std: float = 1.0, shift: float = 1.0,
                             source: str = "the scheduler config") -> FlowMatching | DDPM:
    """Pick the objective a model was trained with from its diffusers scheduler instance.

    `source` names where the scheduler came from (its scheduler_config.json) for the SchedulerError raised when
    no objective fits."""
    config = scheduler.config
    # Flow matching is recognised by name (FlowMatch*Scheduler) or by data: multistep solvers such as
    # Wan's UniPCMultistepScheduler sample flow models with prediction_type="flow_prediction" / use_flow_sigmas.
    flow_by_config = config.get("prediction_type") == "flow_prediction" or bool(config.get("use_flow_sigmas"))
    if "FlowMatch" in type(scheduler).__name__ or flow_by_config:
        return FlowMatching(sampling=sampling, logit_mean=logit_mean, logit_std=logit_std, shift=shift,
                            invert_timesteps=bool(config.get("invert_sigmas", False)),
                            negate_target=bool(config.get("invert_sigmas", False)))
    name = type(scheduler).__name__
    if hasattr(scheduler, "alphas_cumprod"):
        prediction = config.get("prediction_type", "epsilon")
        if prediction not in DDPM_PREDICTIONS:
            raise SchedulerError(
                f"{source}: {name} with prediction_type {prediction!r} has no training objective in vidtune. "
                f"Supported: {SUPPORTED_SCHEDULERS}. Use the scheduler config the model was released with."
            )
        return DDPM(alphas_cumprod=scheduler.alphas_cumprod.clone(), prediction_type=prediction)
    raise SchedulerError(
        f"{source}: {name} has no training objective in vidtune. Supported: {SUPPORTED_SCHEDULERS}. Use the "
        "scheduler config the model was released with."
    )
