"""The trainer: one loop for every algorithm; what an algorithm trains and saves is its part (`vidtune.algorithms`)."""

from __future__ import annotations

from vidtune.config import Config
from vidtune.trainers.base import Trainer, TrainResult


def build_trainer(config: Config) -> Trainer:
    """The trainer of a config: `build_trainer(config).run()` trains it and returns a `TrainResult`."""
    return Trainer(config)


__all__ = ["TrainResult", "Trainer", "build_trainer"]
