"""The sampling schedule of a step-distilled student, as a diffusers scheduler any flow-matching pipeline takes.

A student of `training.algorithm: step-distillation` learnt one Euler step per window between the K-step sampling
sigmas `sampling_sigmas(K, distillation.sigma_shift)`. The families' pipelines sample with schedules of their own
(LTX-Video's resolution-dependent shift, Wan's UniPC multistep solver, Mochi's linear-quadratic sigmas), which
query the student at other noise levels. `StudentEulerScheduler` replaces the pipeline's scheduler: whatever
sigmas, timesteps or shift the pipeline passes, it steps with Euler through exactly those K sigmas (K: the
pipeline's step count), so the pipeline samples what `sample_euler` samples.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from vidtune.objectives import shift_sigmas


def sampling_sigmas(steps: int, shift: float = 1.0) -> torch.Tensor:
    """The `steps + 1` sigmas of Euler sampling, from 1 (noise) to 0 (clean), shifted like
    FlowMatchEulerDiscreteScheduler's `shift`."""
    return shift_sigmas(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), shift).float()


class StudentEulerScheduler(FlowMatchEulerDiscreteScheduler):
    """Euler through `sampling_sigmas(steps, sigma_shift)`, `steps` being what the pipeline asks for."""

    sigma_shift: float = 1.0

    def set_timesteps(self, num_inference_steps: int | None = None, device: str | torch.device | None = None,
                      sigmas: list[float] | None = None, mu: float | None = None,
                      timesteps: list[float] | None = None) -> None:
        # Pipelines name the step count either way: as a number, or as the length of their own schedule.
        given = sigmas if sigmas is not None else timesteps
        steps = num_inference_steps if num_inference_steps is not None else len(given)
        own = sampling_sigmas(steps, self.sigma_shift)[:-1].tolist()
        # No shift of the scheduler's own (shift 1, no dynamic shifting): the sigmas are used as they are.
        super().set_timesteps(sigmas=own, device=device)


def student_scheduler(scheduler: Any, sigma_shift: float) -> StudentEulerScheduler:
    """A StudentEulerScheduler in the time convention of the family's `scheduler` (its training timesteps, Mochi's
    inverted sigmas)."""
    config = scheduler.config
    student = StudentEulerScheduler(num_train_timesteps=config.get("num_train_timesteps", 1000), shift=1.0,
                                    use_dynamic_shifting=False, invert_sigmas=config.get("invert_sigmas", False))
    student.sigma_shift = sigma_shift
    return student


class FixedSigmasEulerScheduler(FlowMatchEulerDiscreteScheduler):
    """Euler through the sigmas `fixed` (highest first, ending in 0), whatever the pipeline asks for: ComfyUI's
    schedule of a run's workflow (`validation.sampler: comfyui`, vidtune/export/comfyui_sigmas.py)."""

    fixed: tuple[float, ...] = ()

    def set_timesteps(self, num_inference_steps: int | None = None, device: str | torch.device | None = None,
                      sigmas: list[float] | None = None, mu: float | None = None,
                      timesteps: list[float] | None = None) -> None:
        # Shift 1, no dynamic shifting: the sigmas are used as they are; the scheduler appends the final 0.
        super().set_timesteps(sigmas=list(self.fixed[:-1]), device=device)


def fixed_sigmas_scheduler(scheduler: Any, sigmas: torch.Tensor) -> FixedSigmasEulerScheduler:
    """A FixedSigmasEulerScheduler through `sigmas` in the time convention of the family's `scheduler` (its
    training timesteps, Mochi's inverted sigmas)."""
    config = scheduler.config
    fixed = FixedSigmasEulerScheduler(num_train_timesteps=config.get("num_train_timesteps", 1000), shift=1.0,
                                      use_dynamic_shifting=False, invert_sigmas=config.get("invert_sigmas", False))
    fixed.fixed = tuple(float(sigma) for sigma in sigmas)
    return fixed
