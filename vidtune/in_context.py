"""Sampling an in-context LoRA (`training.algorithm: in-context-lora`): the family's in-context pipeline
(LTX2InContextPipeline) given the reference clip as training read it, and the factor the LoRA file records.

The reference clip is read with the clip's window at 1/N of its size (`control.reference_downscale_factor`), as the
training data reads it, and handed to the pipeline at that size: the pipeline's own resize to (height / N, width / N)
then keeps it as it is. The factor is written into the LoRA files' safetensors metadata under
`reference_downscale_factor`, the key Lightricks' IC-LoRA files carry and LTX2InContextPipeline's documentation
names, so a user of the file alone passes the right factor.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vidtune.data.video import ClipWindow, read_clip
from vidtune.files import atomic_path, follow_umask
from vidtune.processors import ProcessorChoice, apply_processor
from vidtune.storage.digests import stamp_digest

# The safetensors metadata key of the reference downscale factor (Lightricks' IC-LoRA files).
FACTOR_KEY = "reference_downscale_factor"


def read_reference(path: str | Path, frames: int, height: int, width: int, factor: int, fps: float | None = None,
                   resize: str = "crop", processor: ProcessorChoice | None = None) -> torch.Tensor:
    """A reference clip [F, 3, H / factor, W / factor] in [-1, 1], read like the training data reads it from its
    start; with `processor`, the clip is the source the reference is computed from."""
    video = read_clip(Path(path), ClipWindow(frames, height // factor, width // factor, fps=fps, resize=resize))
    if processor is not None:
        video = apply_processor(processor[0], dict(processor[1]), video)
    return video


class ReferencedPipeline:
    """An in-context pipeline whose every call is given the same reference arguments; everything else (its
    components, progress bar, `load_lora_weights`) is the pipeline's."""

    def __init__(self, pipeline: Any, inputs: dict[str, Any]) -> None:
        self.pipeline = pipeline
        self.inputs = inputs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.pipeline(*args, **kwargs, **self.inputs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipeline, name)


def referenced(spec: Any, pipeline: Any, reference: torch.Tensor, factor: int, attention_strength: float
               ) -> ReferencedPipeline:
    """`pipeline` (the family's in-context pipeline) bound to a reference clip read by `read_reference`."""
    return ReferencedPipeline(pipeline, spec.reference_inputs(reference, factor, attention_strength))


def record_factor(path: Path | None, factor: int) -> None:
    """Add the reference downscale factor to a LoRA file's safetensors metadata (rewritten in place, atomically)."""
    if path is None or not Path(path).is_file():
        return
    with safe_open(str(path), framework="pt") as opened:
        metadata = dict(opened.metadata() or {})
        tensors = {key: opened.get_tensor(key) for key in opened.keys()}  # noqa: SIM118 (safe_open is no dict)
    metadata[FACTOR_KEY] = str(factor)
    with atomic_path(Path(path)) as temporary:
        save_file(tensors, str(temporary), metadata=metadata)
        stamp_digest(temporary)
        follow_umask(temporary)


def recorded_factor(path: str | os.PathLike[str]) -> int | None:
    """The reference downscale factor a LoRA file's metadata records (None: none recorded)."""
    with safe_open(str(path), framework="pt") as opened:
        value = (opened.metadata() or {}).get(FACTOR_KEY)
    return int(value) if value is not None else None
