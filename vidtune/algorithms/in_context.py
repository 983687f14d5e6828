"""In-context LoRA (`training.algorithm: in-context-lora`, LTX-2's IC-LoRA): each sample's control clip is read with
the clip's window (at 1/N of its size with `control.reference_downscale_factor`), encoded by the same VAE, and its
latent tokens join the denoiser's sequence clean (timestep 0), out of the loss, placed as the family's in-context
pipeline places them (`ModelSpec.in_context_conditions`; LTX-2: vidtune/models/in_context.py). Only the adapter trains,
so step 0 is the base model and the result is a plain LoRA file (and its ComfyUI file) that the family's in-context
pipeline loads with `load_lora_weights`; both files record the downscale factor in their metadata.

An algorithm rather than a family variant: the model, its files and its loaders are LTX-2's own; what changes is
what each sample trains with (a reference clip) and how it is sampled (LTX2InContextPipeline), as for control-lora.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vidtune.algorithms.control import check_control_clips
from vidtune.algorithms.lora import LoRAPart
from vidtune.ema import EMA
from vidtune.errors import ConfigError
from vidtune.in_context import read_reference, record_factor, referenced
from vidtune.outputs import LORA_EMA_WEIGHTS
from vidtune.processors import configured_processor
from vidtune.sampling import SampleSettings

if TYPE_CHECKING:
    from vidtune.data.sources import Clip
    from vidtune.objectives import Objective


class InContextPart(LoRAPart):
    """A LoRA trained with each sample's reference tokens in context, sampled with the family's in-context
    pipeline."""

    # The reference a checkpoint's adapter learnt from cannot change under it.
    resume_fixed_keys = (*LoRAPart.resume_fixed_keys, "control.processor", "control.reference_downscale_factor")

    @property
    def factor(self) -> int:
        return self.config.control.reference_downscale_factor

    def check(self, clips: Sequence[Clip], objective: Objective, resuming: bool) -> None:
        """The family trains in context, the shapes take the downscale factor, and every sample has a control clip."""
        if self.spec.in_context_pipeline_class is None:
            self.spec.in_context_conditions({}, torch.zeros(0), False)  # the family's own refusal
            raise ConfigError(f"training.algorithm: in-context-lora: {self.spec.name} samples without an in-context "
                              "pipeline.\nWhat to do: use ltx-2 (model.first_frame_conditioning gives a share of the "
                              "samples their first frame beside the reference).")
        super().check(clips, objective, resuming)
        self.check_reference_shapes()
        check_control_clips(self.config, self.traits.name, clips)

    def check_reference_shapes(self) -> None:
        """Each bucket's size over the downscale factor is one the model takes (a whole latent grid)."""
        factor = self.factor
        if factor == 1:
            return
        for frames, height, width in self.config.data.bucket_shapes():
            try:
                self.spec.check_video_shape(frames, height // factor, width // factor)
            except ConfigError:
                raise ConfigError(
                    f"control.reference_downscale_factor: {factor}: the clips' size {width}x{height} over {factor} "
                    f"({width // factor}x{height // factor}) is not a size {self.spec.name} takes.\nWhat to do: choose "
                    "a factor that leaves the height and width multiples of the model's size step, or sizes "
                    "(data.height, data.width, data.buckets) that are such multiples times the factor."
                ) from None

    def save_final(self, folder: Path, ema: EMA | None, name: str | None = None) -> Path:
        """The LoRA (and its ComfyUI file, its moving average) with the reference downscale factor recorded."""
        written = super().save_final(folder, ema, name)
        for path in (written, Path(folder) / LORA_EMA_WEIGHTS):
            record_factor(path, self.factor)
        return written

    def export(self, weights: dict[str, torch.Tensor], output: Path, ema: dict[str, torch.Tensor] | None = None,
               name: str | None = None) -> Path:
        written = super().export(weights, output, ema, name)
        for path in (written, Path(output) / LORA_EMA_WEIGHTS):
            record_factor(path, self.factor)
        return written

    def save_comfyui(self, folder: Path, state: dict[str, torch.Tensor], name: str) -> Path | None:
        written = super().save_comfyui(folder, state, name)
        record_factor(written, self.factor)
        return written

    @contextlib.contextmanager
    def sampling(self, pipeline: Any, vae: nn.Module, clips: Sequence[Clip]) -> Iterator[Any]:
        """Validation samples go through the family's in-context pipeline, given the first dataset clip's control
        clip (or, with `control.processor`, its processed first clip) as training reads it."""
        config = self.config
        settings = SampleSettings.from_config(config, self.spec, default_prompt=clips[0].caption)
        processor = configured_processor(config)
        source = clips[0].video if processor is not None else clips[0].control
        reference = read_reference(source, settings.frames, settings.height, settings.width, self.factor,
                                   fps=config.data.fps, resize=config.data.resize, processor=processor)
        yield referenced(self.spec, self.spec.in_context_pipeline(pipeline), reference, self.factor,
                         config.control.attention_strength)
