"""What each training algorithm is, as properties the rest of vidtune reads instead of comparing names.

This module is a leaf (it imports nothing of vidtune), so the config, the memory planner, sampling and the model
families can all ask it. `training.algorithm` names appear here and in the config's allowed values only; the parts
that train and save (`vidtune.algorithms.lora`, `.full`, ...) and the losses build on these properties.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from vidtune.config import Config

Student = Literal["lora", "full"]


@dataclass(frozen=True)
class AlgorithmTraits:
    """The properties of one `training.algorithm` (for guidance distillation: with one `distillation.student`)."""

    name: str
    trains_base_weights: bool  # the denoiser's own weights train (full fine-tuning, a full student)
    control: bool = False  # the denoiser also sees a control clip (a widened input layer that trains fully)
    # A student learns from the frozen model's outputs rather than from the data (distillation).
    distils: bool = False
    chooses_student: bool = False  # `distillation.student` picks what trains (LoRA or the whole denoiser)
    teacher_guidance: bool = False  # the teacher guides against `distillation.negative_prompt`
    # The student learns the sampler's own steps: sampled with its K sigmas, every stream at the video's levels.
    learns_sampling_steps: bool = False

    @property
    def trains_adapter(self) -> bool:
        """Whether the result is a LoRA adapter (the base weights stay frozen and may be stored quantized)."""
        return not self.trains_base_weights

    @property
    def scored_on_held_out(self) -> bool:
        """Whether the held-out denoising score measures what it trains for (not for a distilled student)."""
        return not self.distils

    @property
    def preserves_base(self) -> bool:
        """Whether `training.preserve_base` applies: an adapter that can be switched off to give the base model's
        prediction, with a plain denoising loss (no control input, no teacher)."""
        return self.trains_adapter and not self.control and not self.distils

    @property
    def weights_elements(self) -> bool:
        """Whether the loss is each latent element's denoising error, which a mask can weight
        (`training.masked_loss`); a distilled student's is the error to the teacher's output."""
        return not self.distils

    @property
    def stream_noise_levels(self) -> bool:
        """Whether other streams (LTX-2's audio) get noise levels of their own, or follow the video's."""
        return not self.learns_sampling_steps


_TRAITS = {
    "lora": AlgorithmTraits("lora", trains_base_weights=False),
    "full": AlgorithmTraits("full", trains_base_weights=True),
    "control-lora": AlgorithmTraits("control-lora", trains_base_weights=False, control=True),
    "control-full": AlgorithmTraits("control-full", trains_base_weights=True, control=True),
    "guidance-distillation": AlgorithmTraits("guidance-distillation", trains_base_weights=False, distils=True,
                                             chooses_student=True, teacher_guidance=True),
    "step-distillation": AlgorithmTraits("step-distillation", trains_base_weights=False, distils=True,
                                         learns_sampling_steps=True),
}
ALGORITHM_NAMES = tuple(_TRAITS)


def algorithm_traits(algorithm: str, student: Student = "lora") -> AlgorithmTraits:
    """The traits of `training.algorithm` (`student`: `distillation.student`, read where the algorithm chooses)."""
    traits = _TRAITS[algorithm]
    if traits.chooses_student and student == "full":
        return AlgorithmTraits(traits.name, trains_base_weights=True, distils=traits.distils, chooses_student=True,
                               teacher_guidance=traits.teacher_guidance,
                               learns_sampling_steps=traits.learns_sampling_steps)
    return traits


def traits_of(config: Config) -> AlgorithmTraits:
    """The traits of a config's `training.algorithm` and `distillation.student`."""
    return algorithm_traits(config.training.algorithm, config.distillation.student)
