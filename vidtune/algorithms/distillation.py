"""What the distillation algorithms add to their student (its kind: `LoRAPart`, or `FullPart` for a full
guidance-distilled student): their settings' checks, the teacher's negative prompt, and how the student is
sampled. Their losses are in `vidtune.algorithms.losses`; docs/algorithms.md describes both methods.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from vidtune.algorithms import traits_of
from vidtune.algorithms.part import AlgorithmPart, Wrapping
from vidtune.errors import ConfigError
from vidtune.objectives import FlowMatching
from vidtune.schedulers import student_scheduler

if TYPE_CHECKING:
    from vidtune.batches import BatchSource
    from vidtune.config import Config
    from vidtune.data.sources import Clip
    from vidtune.models.spec import Conditions, ModelSpec
    from vidtune.objectives import Objective


def validation_config(config: Config) -> Config:
    """A distilled student is sampled as it is meant to be used: without guidance (validation at scale 1 unless
    `validation.guidance_scale` is set) and, for a step-distilled one, in its K steps unless
    `validation.num_inference_steps` is set. Other algorithms' configs as they are. The resolved config a run
    writes says so, and `vidtune sample` reads it."""
    traits = traits_of(config)
    validation = config.validation
    update: dict[str, Any] = {}
    if traits.distils and validation.guidance_scale is None:
        update["guidance_scale"] = 1.0
    if traits.learns_sampling_steps and "num_inference_steps" not in validation.model_fields_set:
        update["num_inference_steps"] = config.distillation.student_steps
    if not update:
        return config
    return config.model_copy(update={"validation": validation.model_copy(update=update)})


def with_model(spec: ModelSpec, **changes: Any) -> ModelSpec:
    """Another spec of the same family with `changes` to its `model` settings (the first is left as it is)."""
    return type(spec)(spec.config.model_copy(update=changes), frame_rate=spec.frame_rate,
                      text_encoder_weights=spec.text_encoder_weights, vae_tiling=spec.vae_tiling)


class GuidanceDistillationPart(Wrapping):
    """Guidance distillation: the teacher guides against `distillation.negative_prompt`; a student of a range of
    scales (`distillation.guidance_range`) has its guidance embedding told the scale."""

    own_fixed_keys = ("distillation.student",)

    def __init__(self, inner: AlgorithmPart) -> None:
        super().__init__(inner)
        self._negative: Conditions | None = None

    @property
    def negative(self) -> Conditions:
        """The teacher's unconditional caption, a batch of one (`prepare_inputs` reads it)."""
        if self._negative is None:
            raise RuntimeError("the negative prompt's conditions are read by prepare_inputs(source)")
        return self._negative

    def check(self, clips: Sequence[Clip], objective: Objective, resuming: bool) -> None:
        """Also, before the model loads: a range of scales needs a guidance embedding (read from its config)."""
        self.inner.check(clips, objective, resuming)
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

    def prepare_inputs(self, source: BatchSource) -> None:
        """The conditions of `distillation.negative_prompt` (default: the empty caption), from the batch source:
        the precompute cache holds them beside the captions' (`precompute.plan.extra_prompts`)."""
        self._negative = source.prompt(self.config.distillation.negative_prompt)
        self.inner.prepare_inputs(source)

    def sampling_spec(self, spec: ModelSpec) -> ModelSpec:
        """A student of a range of scales samples with its embedding told `distillation.guidance_scale` (not
        `model.guidance_scale`, the teacher's embedding, which training keeps)."""
        spec = self.inner.sampling_spec(spec)
        if self.config.distillation.guidance_range is None:
            return spec
        return with_model(spec, guidance_scale=self.config.distillation.guidance_scale)


class StepDistillationPart(Wrapping):
    """Few-step distillation of a flow-matching model: the student is sampled over its own K sigmas."""

    own_fixed_keys = ("distillation.student_steps", "distillation.teacher_steps", "distillation.sigma_shift",
                      "distillation.window_start")

    def check(self, clips: Sequence[Clip], objective: Objective, resuming: bool) -> None:
        self.inner.check(clips, objective, resuming)
        if not isinstance(objective, FlowMatching):
            raise ConfigError(
                f"training.algorithm: {self.traits.name} distils flow-matching models; {self.spec.name} samples "
                "with a DDPM scheduler, whose solver the student's straight windows do not describe.\nWhat to do: "
                "use a flow-matching family (ltx-video, hunyuan-video, mochi, wan, wan-i2v), or "
                "training.algorithm=lora / guidance-distillation for this one."
            )

    @contextlib.contextmanager
    def sampling(self, pipeline: Any, vae: nn.Module, clips: Sequence[Clip]) -> Iterator[Any]:
        """The family's pipeline stepping through the student's own K sigmas (see vidtune/schedulers.py)."""
        with self.inner.sampling(pipeline, vae, clips) as inner:
            inner.scheduler = student_scheduler(inner.scheduler, self.config.distillation.sigma_shift)
            yield inner
