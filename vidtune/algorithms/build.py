"""The algorithm part of a config: the student's kind, wrapped by what the algorithm adds (see `part.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vidtune.algorithms import traits_of
from vidtune.algorithms.control import ControlPart
from vidtune.algorithms.distillation import GuidanceDistillationPart, StepDistillationPart
from vidtune.algorithms.full import FullPart
from vidtune.algorithms.in_context import InContextPart
from vidtune.algorithms.lora import LoRAPart
from vidtune.algorithms.part import AlgorithmPart
from vidtune.models.registry import get_spec_class

if TYPE_CHECKING:
    from vidtune.config import Config
    from vidtune.models.spec import ModelSpec


def build_part(config: Config, spec: ModelSpec) -> AlgorithmPart:
    """The part that trains and saves what `training.algorithm` (and `distillation.student`) names."""
    traits = traits_of(config)
    part: AlgorithmPart = FullPart(config, spec) if traits.trains_base_weights else LoRAPart(config, spec)
    if traits.in_context:  # a LoRA whose samples carry reference tokens: nothing wraps it
        return InContextPart(config, spec)
    if traits.control:
        part = ControlPart(part)
    if traits.teacher_guidance:
        part = GuidanceDistillationPart(part)
    if traits.learns_sampling_steps:
        part = StepDistillationPart(part)
    return part


def build_spec(config: Config) -> ModelSpec:
    """The family's spec for a config's model and the settings it reads."""
    return get_spec_class(config.model.name)(config.model, frame_rate=config.frame_rate,
                                             text_encoder_weights=config.memory.text_encoder_weights,
                                             vae_tiling=config.memory.vae_tiling,
                                             base_weights=config.memory.base_weights)
