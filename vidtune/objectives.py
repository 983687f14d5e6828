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

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch

from vidtune.errors import SchedulerError

SigmaSampling = Literal["uniform", "logit_normal", "token_shifted_logit_normal"]
LossWeighting = Literal["none", "bell"]
# Noise levels across a clip's latent frames: one for all (`shared`), one per frame drawn apart (`independent`), or
# one per frame drawn apart and sorted so that later frames are never less noisy (`non_decreasing`: diffusion forcing
# as SkyReels V2 trains it).
FrameNoise = Literal["shared", "independent", "non_decreasing"]
NUM_TRAIN_TIMESTEPS = 1000
DDPM_PREDICTIONS = ("epsilon", "v_prediction")
# Lightricks' trainers (LTX-Video-Trainer and LTX-2's ltx-trainer, `timestep_samplers.py`): the logit-normal's mean
# grows linearly with the denoiser's token count, from 0.95 at 1024 tokens to 2.05 at 4096 (and on beyond).
TOKEN_SHIFT_POINTS = ((1024, 0.95), (4096, 2.05))
# ltx-trainer's percentile stretching: the 0.5th and 99.9th percentiles of N(0, 1), and the floor small sigmas are
# reflected at.
STRETCH_LOW_QUANTILE, STRETCH_HIGH_QUANTILE, STRETCH_EPS = -2.5758, 3.0902, 1e-3


def sample_uniform_sigmas(batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.rand(batch_size, generator=generator, dtype=torch.float64).float()


def sample_logit_normal_sigmas(
    batch_size: int, mean: float = 0.0, std: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """sigma = sigmoid(N(mean, std)): concentrates training on the middle of the noise range (SD3)."""
    normal = torch.randn(batch_size, generator=generator, dtype=torch.float64) * std + mean
    return torch.sigmoid(normal).float()


def token_shifted_mean(tokens: int) -> float:
    """The logit-normal mean Lightricks' trainers use for a sequence of `tokens` denoiser tokens (not capped: the
    trainers' own line, extended past 4096 tokens)."""
    (low_tokens, low_mean), (high_tokens, high_mean) = TOKEN_SHIFT_POINTS
    return low_mean + (tokens - low_tokens) * (high_mean - low_mean) / (high_tokens - low_tokens)


def sample_token_shifted_sigmas(batch_size: int, tokens: int, std: float = 1.0, offset: float = 0.0,
                                stretch: bool = False, uniform_fraction: float = 0.0,
                                generator: torch.Generator | None = None) -> torch.Tensor:
    """sigma = sigmoid(N(mu, std)) with mu = `token_shifted_mean(tokens)` + `offset` (LTX-Video-Trainer's
    `shifted_logit_normal`). `stretch`: ltx-trainer's (LTX-2) percentile stretching, which maps the logit-normal's
    0.5th..99.9th percentiles onto [0, 1] (small values reflected above 1e-3, the rest clamped), so high token counts
    still reach both ends; `uniform_fraction`: that share of the draws is uniform on [1e-3, 1) instead (ltx-trainer:
    0.1). Computed in float64, where the percentiles stay apart for any practical token count."""
    mu = token_shifted_mean(tokens) + offset
    sigmas = torch.sigmoid(torch.randn(batch_size, generator=generator, dtype=torch.float64) * std + mu)
    if stretch:
        low = 1.0 / (1.0 + math.exp(-(mu + STRETCH_LOW_QUANTILE * std)))
        high = 1.0 / (1.0 + math.exp(-(mu + STRETCH_HIGH_QUANTILE * std)))
        sigmas = (sigmas - low) / (high - low)
        sigmas = torch.where(sigmas >= STRETCH_EPS, sigmas, 2 * STRETCH_EPS - sigmas).clamp(0.0, 1.0)
    if uniform_fraction > 0:
        uniform = (1 - STRETCH_EPS) * torch.rand(batch_size, generator=generator, dtype=torch.float64) + STRETCH_EPS
        chosen = torch.rand(batch_size, generator=generator, dtype=torch.float64) < uniform_fraction
        sigmas = torch.where(chosen, uniform, sigmas)
    return sigmas.float()


def bell_loss_weights(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """DiffSynth-Studio's loss weight of flow-matching training (`FlowMatchScheduler.set_training_weight`): the bell
    exp(-2 (sigma - 1/2)^2) less its minimum over the training grid (1000 sigmas, linear from 1, shifted by
    `shift`), scaled so its mean over that grid is 1. Heaviest in the middle of the noise range, 0 at the grid's
    extreme."""
    grid = shift_sigmas(torch.linspace(1.0, 0.0, NUM_TRAIN_TIMESTEPS + 1, dtype=torch.float64)[:-1], shift)
    floor = torch.exp(-2 * (grid - 0.5) ** 2).min()
    scale = len(grid) / (torch.exp(-2 * (grid - 0.5) ** 2) - floor).sum()
    bell = torch.exp(-2 * (sigmas.double() - 0.5) ** 2)
    return ((bell - floor) * scale).clamp_min(0.0).float()


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
    """Per-clip values [B] over latents [B, C, F, H, W]; per-frame values [B, F] over their frames."""
    values = values.to(device=like.device, dtype=like.dtype)
    if values.ndim == 2:
        return values.view(values.shape[0], 1, values.shape[1], *([1] * (like.ndim - 3)))
    return values.view(-1, *([1] * (like.ndim - 1)))


def per_clip_levels(levels: torch.Tensor) -> torch.Tensor:
    """Each clip's noise level [B]: per-frame levels [B, F] averaged over the frames (metrics, loss weights)."""
    return levels.mean(dim=-1) if levels.ndim == 2 else levels


class Objective(Protocol):
    """What a trainer needs from an objective; every method is pure tensor maths.

    A "noise level" is the per-sample quantity the objective samples: sigma in (0, 1) for flow
    matching, an integer training timestep (as float) for DDPM; `level_name` names them in metrics.jsonl.
    `tokens`: the denoiser's token count for the sample (the video's, or another stream's), which some
    distributions depend on (`token_shifted_logit_normal`); the others ignore it. `frames`: the clip's latent
    frames, which an objective drawing a level per frame (flow matching's `frame_noise`) draws [B, F] levels for;
    the others return one level per clip [B]. Loss weights are one per clip.
    """

    level_name: str

    def sample_noise_levels(self, batch_size: int, generator: torch.Generator | None = None,
                            tokens: int | None = None, frames: int | None = None) -> torch.Tensor: ...

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
    `token_shifted_logit_normal` adds `logit_mean` to the token count's mean and takes `stretch` and
    `uniform_fraction` (see `sample_token_shifted_sigmas`); `weighting` "bell": DiffSynth-Studio's loss weight (of
    a clip with per-frame levels: the mean of its frames' weights).
    `frame_noise` (see `FrameNoise`): with `frames` given, `independent` and `non_decreasing` draw each latent frame's
    sigma from the distribution above ([B, F]; `non_decreasing` sorts each clip's draws along its frames); the
    denoiser is then told a timestep per frame.
    """

    level_name: ClassVar[str] = "sigmas"
    sampling: SigmaSampling = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    invert_timesteps: bool = False
    negate_target: bool = False
    stretch: bool = False
    uniform_fraction: float = 0.0
    weighting: LossWeighting = "none"
    frame_noise: FrameNoise = "shared"

    def sample_noise_levels(self, batch_size: int, generator: torch.Generator | None = None,
                            tokens: int | None = None, frames: int | None = None) -> torch.Tensor:
        if self.frame_noise == "shared" or frames is None:
            return self._sample_sigmas(batch_size, generator, tokens)
        sigmas = self._sample_sigmas(batch_size * frames, generator, tokens).view(batch_size, frames)
        return sigmas.sort(dim=1).values if self.frame_noise == "non_decreasing" else sigmas

    def _sample_sigmas(self, batch_size: int, generator: torch.Generator | None, tokens: int | None) -> torch.Tensor:
        if self.sampling == "uniform":
            sigmas = sample_uniform_sigmas(batch_size, generator)
        elif self.sampling == "token_shifted_logit_normal":
            if tokens is None:
                raise ValueError("token_shifted_logit_normal noise levels need the sample's token count")
            sigmas = sample_token_shifted_sigmas(batch_size, tokens, self.logit_std, self.logit_mean, self.stretch,
                                                 self.uniform_fraction, generator)
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
        if self.weighting == "bell":
            return per_clip_levels(bell_loss_weights(levels, self.shift))
        return torch.ones_like(per_clip_levels(levels))


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

    level_name: ClassVar[str] = "timesteps"
    alphas_cumprod: torch.Tensor
    prediction_type: Literal["epsilon", "v_prediction"] = "v_prediction"
    snr_weighting: bool = False

    def sample_noise_levels(self, batch_size: int, generator: torch.Generator | None = None,
                            tokens: int | None = None, frames: int | None = None) -> torch.Tensor:
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
                             source: str = "the scheduler config", stretch: bool = False,
                             uniform_fraction: float = 0.0, weighting: LossWeighting = "none",
                             frame_noise: FrameNoise = "shared") -> FlowMatching | DDPM:
    """Pick the objective a model was trained with from its diffusers scheduler instance.

    `source` names where the scheduler came from (its scheduler_config.json) for the SchedulerError raised when
    no objective fits. The noise-level settings (`sampling` ... `weighting`) are flow matching's; DDPM draws
    timesteps uniformly, one per clip (`frame_noise` other than `shared` is refused for it)."""
    config = scheduler.config
    # Flow matching is recognised by name (FlowMatch*Scheduler) or by data: multistep solvers such as
    # Wan's UniPCMultistepScheduler sample flow models with prediction_type="flow_prediction" / use_flow_sigmas.
    flow_by_config = config.get("prediction_type") == "flow_prediction" or bool(config.get("use_flow_sigmas"))
    if "FlowMatch" in type(scheduler).__name__ or flow_by_config:
        return FlowMatching(sampling=sampling, logit_mean=logit_mean, logit_std=logit_std, shift=shift,
                            invert_timesteps=bool(config.get("invert_sigmas", False)),
                            negate_target=bool(config.get("invert_sigmas", False)), stretch=stretch,
                            uniform_fraction=uniform_fraction, weighting=weighting, frame_noise=frame_noise)
    name = type(scheduler).__name__
    if hasattr(scheduler, "alphas_cumprod"):
        prediction = config.get("prediction_type", "epsilon")
        if prediction not in DDPM_PREDICTIONS:
            raise SchedulerError(
                f"{source}: {name} with prediction_type {prediction!r} has no training objective in vidtune. "
                f"Supported: {SUPPORTED_SCHEDULERS}. Use the scheduler config the model was released with."
            )
        if frame_noise != "shared":
            raise SchedulerError(f"{source}: {name} is a DDPM scheduler, whose timesteps are drawn one per clip; "
                                 f"training.frame_noise={frame_noise} needs a flow-matching model.")
        return DDPM(alphas_cumprod=scheduler.alphas_cumprod.clone(), prediction_type=prediction)
    raise SchedulerError(
        f"{source}: {name} has no training objective in vidtune. Supported: {SUPPORTED_SCHEDULERS}. Use the "
        "scheduler config the model was released with."
    )
