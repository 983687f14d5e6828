"""Trainers, one per algorithm."""

from __future__ import annotations

from vidtune.config import Config
from vidtune.trainers.base import Trainer, TrainResult

# training.algorithm -> the trainer class (or a function of the config that picks one).
ALGORITHMS = {
    "lora": "vidtune.trainers.lora:LoRATrainer",
    "full": "vidtune.trainers.full:FullTrainer",
    "control-lora": "vidtune.trainers.control:ControlLoRATrainer",
    "control-full": "vidtune.trainers.control:ControlFullTrainer",
    "guidance-distillation": "vidtune.trainers.guidance_distillation:guidance_distillation_trainer",
    "step-distillation": "vidtune.trainers.step_distillation:StepDistillationTrainer",
}


def build_trainer(config: Config) -> Trainer:
    import importlib

    module_name, class_name = ALGORITHMS[config.training.algorithm].split(":")
    return getattr(importlib.import_module(module_name), class_name)(config)


__all__ = ["ALGORITHMS", "TrainResult", "Trainer", "build_trainer"]
