"""Guidance distillation: a student that gives, in one forward, what the frozen model gives with classifier-free
guidance in two.

The teacher is the frozen base model at `distillation.guidance_scale` w against `distillation.negative_prompt`
(default: the empty caption): guided = uncond + w * (cond - uncond), at the same noisy latents, timestep and
caption the student sees. The student (a LoRA by default, `distillation.student: full` for the whole denoiser) is
trained on the mean squared error to that prediction, and is then sampled without guidance (scale 1).

A LoRA student shares the frozen weights with its teacher: the teacher is the same denoiser with its adapters
turned off, so the model is held once. A full student needs the original weights beside the trained ones: the
teacher is a frozen copy (twice the denoiser's memory).

Families with a guidance embedding (HunyuanVideo) can learn a range of scales (`distillation.guidance_range`):
each visit draws w from it, the teacher guides at w and the student's embedding is given w.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from vidtune.batches import Batch
from vidtune.config import Config
from vidtune.data.buckets import visit_generator
from vidtune.errors import ConfigError
from vidtune.models.spec import Conditions
from vidtune.state import SavedState
from vidtune.trainers.base import Trainer
from vidtune.trainers.full import FullTrainer
from vidtune.trainers.lora import LoRATrainer

# Seed offset of the draws a visit adds (its guidance scale): apart from its noise, so those stay as in `lora`.
GUIDANCE_SEED_OFFSET = 7


def guided_prediction(cond: torch.Tensor, uncond: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance: uncond + w * (cond - uncond), one w per clip."""
    w = scales.to(cond).view(-1, *([1] * (cond.ndim - 1)))
    return uncond + w * (cond - uncond)


def student_validation_config(config: Config) -> Config:
    """The student is sampled without guidance: validation at scale 1 unless `validation.guidance_scale` is set
    (the resolved config the run writes says so, and `vidtune sample` reads it)."""
    if config.validation.guidance_scale is None:
        validation = config.validation.model_copy(update={"guidance_scale": 1.0})
        config = config.model_copy(update={"validation": validation})
    return config


class GuidanceDistillation(Trainer):
    """The teacher, its guided prediction and the loss; the student's kind comes from the class it is mixed
    with (`LoRATrainer` or `FullTrainer`)."""

    algorithm = "guidance-distillation"
    negative: Conditions | None = None  # the teacher's unconditional caption, a batch of one

    def __init__(self, config: Config) -> None:
        super().__init__(student_validation_config(config))

    def check_inputs(self) -> None:
        """Also, before the model loads: a range of scales needs a guidance embedding (read from its config)."""
        super().check_inputs()
        options = self.config.distillation
        if options.guidance_range is None:
            return
        config = self.spec.load_config(self.spec.denoiser_class, "transformer")
        if not config.get("guidance_embeds", False):
            raise ConfigError(
                f"distillation.guidance_range: {self.spec.name} has no guidance embedding, so its student can learn "
                f"one scale only.\nWhat to do: remove distillation.guidance_range (the student learns "
                f"distillation.guidance_scale={options.guidance_scale:g})."
            )

    def load_models(self) -> list[nn.Parameter]:
        parameters = super().load_models()
        self.negative = self.negative_conditions()
        return parameters

    def negative_conditions(self) -> Conditions:
        """The conditions of `distillation.negative_prompt` (default: the empty caption), from the batch source:
        the precompute cache holds them beside the captions' (`precompute.plan.extra_prompts`)."""
        return self.source.prompt(self.config.distillation.negative_prompt)

    def validate(self) -> list[Path]:
        """A student of a range of scales samples with its embedding told `distillation.guidance_scale` (not
        `model.guidance_scale`, the teacher's embedding, which stays as trained)."""
        if self.config.distillation.guidance_range is None:
            return super().validate()
        model, trained = self.config.model, self.config.model.guidance_scale
        model.guidance_scale = self.config.distillation.guidance_scale  # the spec reads it when sampling
        try:
            return super().validate()
        finally:
            model.guidance_scale = trained

    def guidance_scales(self, batch: Batch) -> torch.Tensor:
        """Each clip's guidance scale: `guidance_scale`, or drawn from `guidance_range` by the visit's generator."""
        options = self.config.distillation
        if options.guidance_range is None:
            return torch.full((len(batch.positions),), options.guidance_scale)
        low, high = options.guidance_range
        seed = self.config.training.seed + GUIDANCE_SEED_OFFSET
        draws = [float(torch.rand(1, generator=visit_generator(seed, int(p)))) for p in batch.positions]
        return low + (high - low) * torch.tensor(draws)

    def teacher(self) -> contextlib.AbstractContextManager[nn.Module]:
        """The frozen base model, without gradients (the student's kind decides how it is had)."""
        raise NotImplementedError

    def predict(self, denoiser: nn.Module, conditions: Conditions, noisy: torch.Tensor, timesteps: torch.Tensor,
                embedded: torch.Tensor | None) -> torch.Tensor:
        """One forward; `embedded`: the guidance embedding's scale per clip (None: the family's own)."""
        extra = {} if embedded is None else {"guidance_scale": embedded}
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_bf16):
            return self.spec.forward(denoiser, conditions, noisy, timesteps, **extra).float()

    def teacher_prediction(self, conditions: Conditions, noisy: torch.Tensor, timesteps: torch.Tensor,
                           scales: torch.Tensor) -> torch.Tensor:
        """uncond + w (cond - uncond) of the frozen model; video-derived conditions are kept in both."""
        uncond = {**conditions, **{k: v.expand_as(conditions[k]).to(conditions[k]) for k, v in self.negative.items()}}
        with self.teacher() as teacher:
            cond_prediction = self.predict(teacher, conditions, noisy, timesteps, None)
            uncond_prediction = self.predict(teacher, uncond, noisy, timesteps, None)
        return guided_prediction(cond_prediction, uncond_prediction, scales)

    def compute_loss(self, batch: Batch) -> torch.Tensor:
        """Sum over the micro-batch of each clip's mean squared error to the teacher's guided prediction."""
        inputs = self.noisy_inputs(batch)
        noisy = inputs.noisy.to(self.denoiser.dtype)
        scales = self.guidance_scales(batch)
        target = self.teacher_prediction(inputs.conditions, noisy, inputs.timesteps, scales)
        embedded = scales if self.config.distillation.guidance_range is not None else None
        denoiser = self.denoiser if self.trained_denoiser is None else self.trained_denoiser
        prediction = self.predict(denoiser, inputs.conditions, noisy, inputs.timesteps, embedded)
        per_clip = self.spec.per_clip_error((prediction - target).pow(2), inputs.conditions)
        self.note_noise(inputs, per_clip)
        return per_clip.sum()


class GuidanceDistillationTrainer(GuidanceDistillation, LoRATrainer):
    """A LoRA student; the teacher is the same denoiser with its adapters turned off."""

    algorithm = "guidance-distillation"
    resume_fixed_keys = (*LoRATrainer.resume_fixed_keys, "distillation.student")

    def teacher(self) -> contextlib.AbstractContextManager[nn.Module]:
        return self.frozen_base()


class FullGuidanceDistillationTrainer(GuidanceDistillation, FullTrainer):
    """A fully fine-tuned student (`distillation.student: full`); the teacher is a frozen copy of the denoiser."""

    algorithm = "guidance-distillation"
    resume_fixed_keys = (*FullTrainer.resume_fixed_keys, "distillation.student")
    frozen_teacher: nn.Module | None = None

    def configure_trainable(self, denoiser: nn.Module) -> list[nn.Parameter]:
        # Copied before the trained weights change (and before they become fp32).
        self.frozen_teacher = copy.deepcopy(denoiser).requires_grad_(False).eval()
        return super().configure_trainable(denoiser)

    def set_up(self, saved: SavedState | None) -> list[nn.Parameter]:
        parameters = super().set_up(saved)
        # FSDP shards the teacher like the student (see FullyShardedStrategy.prepare_frozen).
        self.frozen_teacher = self.strategy.prepare_frozen(self.frozen_teacher)
        return parameters

    @contextlib.contextmanager
    def teacher(self) -> Iterator[nn.Module]:
        with torch.no_grad():
            yield self.frozen_teacher


def guidance_distillation_trainer(config: Config) -> Trainer:
    """The trainer for `training.algorithm: guidance-distillation`, by `distillation.student`."""
    if config.distillation.student == "full":
        return FullGuidanceDistillationTrainer(config)
    return GuidanceDistillationTrainer(config)
