"""Optimizers and learning-rate schedules by name."""

from __future__ import annotations

from typing import Any

import torch
from diffusers.optimization import get_scheduler
from torch import nn

from vidtune.config import Config


def build_optimizer(parameters: list[nn.Parameter], config: Config) -> torch.optim.Optimizer:
    options = config.optimizer
    if options.name == "adamw":
        return torch.optim.AdamW(
            parameters,
            lr=config.training.learning_rate,
            betas=(options.beta1, options.beta2),
            eps=options.eps,
            weight_decay=options.weight_decay,
        )
    raise ValueError(f"unknown optimizer {options.name}")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: Config, completed_steps: int = 0) -> Any:
    """Warm-up then constant / linear decay / cosine decay, counted in optimizer steps.

    The rate is a pure function of the step (each schedule is a LambdaLR of it), so a resumed run builds the
    schedule at its `completed_steps` (the groups' `initial_lr` set) instead of loading a saved one."""
    name = config.optimizer.lr_scheduler
    warmup = config.optimizer.warmup_steps
    if name == "constant":
        name = "constant_with_warmup"
    return get_scheduler(
        name, optimizer, num_warmup_steps=warmup, num_training_steps=config.training.steps,
        last_epoch=completed_steps - 1,
    )
