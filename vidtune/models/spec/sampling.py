"""Sampling with a family's own diffusers pipeline: the pipeline assembled from loaded components, the inputs of its
call, and `sample`, the one way a spec samples: validation and `vidtune sample` (frames, and a family's sound), and
the checks that what training teaches is what the pipeline samples (the final latents)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from PIL import Image
from torch import nn

from vidtune.errors import ModelError
from vidtune.models.conditioning import Given
from vidtune.models.spec.base import frames_to_pil
from vidtune.models.spec.encoding import Encoding
from vidtune.models.spec.loading import TextComponents

# A diffusers pipeline's `callback_on_step_end`: (pipeline, step, timestep, {"latents": ...}) -> that dict.
StepCallback = Callable[[Any, int, Any, dict[str, Any]], dict[str, Any]]
# What `sample` returns: the decoded video (and sound), or the final latents in the training layout.
SampleOutput = Literal["video", "latents"]
SAMPLE_OUTPUTS: tuple[SampleOutput, ...] = ("video", "latents")


@dataclass(frozen=True)
class GeneratedSample:
    """One sample as `sample` returns it. output="video": its frames and, for a family that generates sound, its
    waveform (what a run writes); output="latents": the final latents in the training layout (and, for a family
    whose denoiser takes another stream, that stream's)."""

    frames: torch.Tensor | None = None  # float [F, 3, H, W] in [-1, 1]
    audio: torch.Tensor | None = None  # float [channels, samples] in [-1, 1]
    sample_rate: int | None = None  # of `audio`, in Hz
    latents: torch.Tensor | None = None  # [B, C, F, H, W], normalised like `prepare_latents` output
    audio_latents: torch.Tensor | None = None  # [B, L, C * mel], normalised as training normalises them (LTX-2)

    def __post_init__(self) -> None:
        if self.frames is None and self.latents is None:
            raise ValueError("a sample holds its frames (output=\"video\") or its latents (output=\"latents\")")
        if self.audio is not None and (self.sample_rate is None or self.sample_rate <= 0):
            raise ValueError(f"a sample's audio needs its sample rate in Hz (positive), not {self.sample_rate}")


def step_callback(callback: StepCallback | None) -> dict[str, Any]:
    """The pipeline call's arguments for `callback` (none without one)."""
    if callback is None:
        return {}
    return {"callback_on_step_end": callback, "callback_on_step_end_tensor_inputs": ["latents"]}


class Sampling(Encoding):
    """The family's pipeline and `sample`. It extends Encoding: a pipeline call may take encoded captions, and it
    reads the caption length."""

    # Classifier-free guidance the family's pipeline recommends; validation samples use it unless configured.
    validation_guidance_scale: ClassVar[float] = 1.0
    # Image-to-video families sample from a first frame: `sample(..., reference=video)` hands it to
    # `pipeline_inputs`. A spec holds no per-run state, so the reference is always an argument.
    image_to_video: ClassVar[bool] = False
    # The per-clip input kinds (vidtune/data's `pose`, `face`, ...) the family's pipeline call takes beside the
    # reference: `sample(..., inputs={kind: [3, F, H, W] video})` hands them to `call_pipeline(..., inputs=...)`.
    sampling_inputs: ClassVar[tuple[str, ...]] = ()
    # The sampling input a family that `reads_control_clip` takes its control clip as (Wan Animate: its pose video);
    # None: the control clip is the pipeline's conditioning video, handed over as `reference` (Wan VACE).
    control_input_kind: ClassVar[str | None] = None

    @abstractmethod
    def pipeline(self, text: TextComponents, vae: nn.Module, denoiser: nn.Module) -> Any:
        """The family's diffusers pipeline assembled from already loaded components."""

    def sample(self, pipeline: Any, prompt: str, *, frames: int, height: int, width: int, num_inference_steps: int,
               generator: torch.Generator, guidance_scale: float = 1.0, reference: torch.Tensor | None = None,
               callback: StepCallback | None = None, output: SampleOutput = "video",
               given: Given | None = None, inputs: Mapping[str, torch.Tensor] | None = None) -> GeneratedSample:
        """One sample with the family's pipeline and its own scheduler. output="video": the decoded frames (and the
        sound of a family whose pipeline makes it); output="latents": the final latents in the training layout,
        normalised like `prepare_latents` output (with guidance_scale 1, what the trainer teaches is what this
        samples). `reference`: the clip ([F, 3, H, W] in [-1, 1]) an image-to-video family starts from.
        `callback(pipeline, step, timestep, {"latents": ...})` runs after each denoising step (it returns the
        dict). `given`: a conditioning mode's frames (and mask) to sample from instead of `reference`. `inputs`: the
        sample's own input videos ([3, F, H, W] in [-1, 1]) of the kinds in `sampling_inputs`."""
        if output not in SAMPLE_OUTPUTS:
            raise ValueError(f"sample(output={output!r}): output is one of {', '.join(SAMPLE_OUTPUTS)}")
        unknown = sorted(set(inputs or {}) - set(self.sampling_inputs))
        if unknown:
            raise ModelError(f"{self.name} samples from no {', '.join(unknown)} input (it takes: "
                             f"{', '.join(self.sampling_inputs) or 'none'}).\nWhat to do: leave those inputs out.")
        # Only a family that takes them receives these keywords: the others' `call_pipeline` keeps its signature.
        extra: dict[str, Any] = {}
        if given is not None:
            self.check_given(given)
            extra["given"] = given
        if inputs:
            extra["inputs"] = dict(inputs)
        result = self.call_pipeline(pipeline, prompt, frames, height, width, num_inference_steps, guidance_scale,
                                    generator, "latent" if output == "latents" else "pt", reference, callback,
                                    **extra)
        if output == "latents":
            return self.sampled_latents(pipeline, result, frames, height, width)
        return self.sampled_video(pipeline, result)

    # ----- the parts of `sample` a family overrides ---------------------------------------------------------
    def call_pipeline(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                      num_inference_steps: int, guidance_scale: float, generator: torch.Generator, output_type: str,
                      reference: torch.Tensor | None = None, callback: StepCallback | None = None,
                      given: Given | None = None) -> Any:
        """One call of the family's pipeline (`output_type` "pt" or "latent"), returning its whole output (`.frames`,
        and what else a family's pipeline returns). `callback`: the pipeline's `callback_on_step_end`, given the
        step's latents. `given`: a conditioning mode's inputs (only families with `conditioning_modes` take it)."""
        inputs = self.pipeline_inputs(reference) if given is None else self.given_inputs(given, frames, height, width)
        return pipeline(
            **self.prompt_inputs(pipeline, prompt, guidance_scale),
            num_frames=frames,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            max_sequence_length=self.max_sequence_length,
            generator=generator,
            output_type=output_type,
            **self.guidance_inputs(guidance_scale),
            **inputs,
            **step_callback(callback),
        )

    def sampled_video(self, pipeline: Any, result: Any) -> GeneratedSample:
        """The pipeline's "pt" output as a sample: its frames [F, 3, H, W] in [-1, 1] (a family whose pipeline also
        makes sound adds the waveform)."""
        return GeneratedSample(result.frames[0].float() * 2.0 - 1.0)

    def sampled_latents(self, pipeline: Any, result: Any, frames: int, height: int, width: int) -> GeneratedSample:
        """The pipeline's "latent" output as a sample: the final latents in the training layout."""
        return GeneratedSample(latents=self.latents_from_pipeline(result.frames, frames, height, width))

    def prompt_inputs(self, pipeline: Any, prompt: str, guidance_scale: float) -> dict[str, Any]:
        """How the caption reaches the pipeline call (by default as text: the pipeline encodes it)."""
        return {"prompt": prompt}

    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        """Family-specific inputs of the pipeline call (a frame rate, an image-to-video first frame, ...).
        `reference`: the clip ([F, 3, H, W] in [-1, 1]) whose first frame image-to-video families start from."""
        return {}

    @property
    def samples_from_image(self) -> bool:
        """Whether sampling starts from a first frame (validation's first clip, `vidtune sample --image`): an
        image-to-video family's, or one a run trained to take it (MiniMax H3's keyframe workflow)."""
        return self.image_to_video

    def check_given(self, given: Given) -> None:
        """A mode the family samples: first-frame for image-to-video families, else one of `conditioning_modes`."""
        takes = (("first_frame",) if self.samples_from_image else ()) + tuple(self.conditioning_modes)
        if given.mode not in takes:
            raise ModelError(f"{self.name} cannot sample {given.mode.replace('_', '-')} conditioning: "
                             f"{self.conditioning_refusal}\nWhat to do: sample it with "
                             f"{' / '.join(takes) or 'text alone'} (docs/models.md, \"Conditioning modes\").")

    def given_inputs(self, given: Given, frames: int, height: int, width: int) -> dict[str, Any]:
        """The pipeline call's inputs of a conditioning mode (by default first-frame: `pipeline_inputs`)."""
        return self.pipeline_inputs(given.frames)

    def guidance_inputs(self, guidance_scale: float) -> dict[str, Any]:
        """Further inputs of the pipeline call that follow the guidance scale (a pipeline with other guidances
        turns them off without guidance)."""
        return {}

    def latents_from_pipeline(self, latents: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
        """The pipeline's `output_type="latent"` result in the training layout [B, C, F, H, W]."""
        return latents

    def given_reference(self, reference: torch.Tensor | None) -> torch.Tensor:
        """The clip ([F, 3, H, W] in [-1, 1]) an image-to-video family samples from; a ModelError without one."""
        if reference is None:
            raise ModelError(f"{self.name} samples from a clip's first frame (or its keyframes): pass the clip as "
                             "`reference` (validation uses the first dataset clip; `vidtune sample` takes --image).\n"
                             "What to do: give the reference clip or image.")
        return reference

    def first_frame_image(self, reference: torch.Tensor | None) -> Image.Image:
        """The reference clip's first frame as the RGB picture a user hands an image-to-video pipeline."""
        return frames_to_pil(self.given_reference(reference)[:1])[0]

    def reference_frame_count(self, frames: int) -> int:
        """Frames of the reference clip an image-to-video family samples from (the first, unless keyframes)."""
        return 1
