"""What generic code asks a model family about its denoiser besides computing with it.

`ModelSpec` inherits these defaults, which fit a family with one denoiser. A family whose denoiser module holds
several denoisers, each serving part of the noise levels (Wan 2.2 A14B's two experts, vidtune/models/wan22.py),
overrides them; parallel strategies, the memory planner, control training, sampling and the trainer's noise draw
then never look inside its module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vidtune.models.spec.base import SpecBase

if TYPE_CHECKING:
    from vidtune.config import Config
    from vidtune.objectives import Objective


class DenoiserHooks(SpecBase):
    """The defaults: one denoiser, which stays where it was placed and trains at every noise level."""

    def denoiser_parts(self, denoiser: nn.Module) -> dict[str, nn.Module]:
        """The denoisers inside the denoiser module, by the prefix of their keys in its state dict (without the
        dot); one denoiser: {"": denoiser}. FSDP shards each part's blocks."""
        return {"": denoiser}

    def control_parts(self, denoiser: nn.Module) -> dict[str, nn.Module]:
        """The parts whose input layer a control run widens and trains, keyed as `denoiser_parts` keys them (one
        denoiser: {"": denoiser}; several: each one that trains, with a control file of its own)."""
        return self.denoiser_parts(denoiser)

    def control_target(self, denoiser: nn.Module, pipeline: Any) -> nn.Module:
        """The module a trained control input is attached to for sampling: what the pipeline calls, its
        `transformer`. A family whose pipeline calls several parts gives the module holding them all."""
        return pipeline.transformer

    def step_objective(self, objective: Objective, config: Config, step: int, tokens: int | None = None
                       ) -> Objective:
        """The objective optimizer step `step` (counted from 0) draws its noise levels from (`tokens`: the
        step's token count, for distributions that depend on it): `objective` itself. A family narrows it per step
        where every rank must run the same part of its denoiser in a step (sharded training's collectives)."""
        return objective

    @classmethod
    def context_parallel_plan(cls) -> dict[str, Any] | str:
        """Where context parallelism (`parallel.context`) splits the denoiser's token sequence and gathers its
        output, in diffusers' `_cp_plan` form: the denoiser class's own plan. A family without one (or whose plan
        does not fit how it trains) gives the reason instead, and such a run is refused before anything loads."""
        plan = getattr(cls.denoiser_class, "_cp_plan", None)
        if not plan:
            return (f"diffusers' {cls.denoiser_class.__name__} has no context-parallel plan (`_cp_plan`): where to "
                    "split its tokens and gather its output is unknown")
        return plan

    def context_token_counts(self, frames: int, height: int, width: int, frame_rate: float | None
                             ) -> dict[str, int]:
        """The lengths the context-parallel plan splits for one clip of that shape told `frame_rate`, by name (each
        must divide by the context degree), checked before anything loads. Empty (the default): diffusers' split
        checks the lengths itself when it runs."""
        return {}

    def keep_weights_placed(self, denoiser: nn.Module) -> None:
        """Stop the denoiser from moving its own weights between the device and host memory, where something else
        places them (FSDP's shards, the memory planner's trace on the meta device). One denoiser moves none."""

    def parts_taking_turns(self, denoiser: nn.Module, device: torch.device, batch_size: int) -> list[nn.Module]:
        """The parts of the denoiser that hold `device` one at a time in a training step with `batch_size` clips
        per micro-batch, the others' frozen weights waiting in host memory meanwhile (the memory planner counts
        them there). Empty (the default): the whole denoiser stays on the device."""
        return []
