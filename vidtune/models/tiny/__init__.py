"""Tiny random models of each family, saved in the diffusers layout.

They exist for tests and for `vidtune quickstart`: no download, seconds on a CPU, and they go through
exactly the same loading code as the real checkpoints. Weights are random but seeded.

Each family's tiny model lives in the module of this package named like its spec module
(`vidtune/models/cogvideox.py` -> `vidtune/models/tiny/cogvideox.py`), which declares a `TinyFamily` per
registered family in `TINY`: the writer, a clip shape the model accepts and the overfit test's settings.
`vidtune.models.registry.tiny_family(name)` finds it by that convention; the tables below are derived from it.
"""

from __future__ import annotations

from pathlib import Path

from vidtune.models.registry import available_models, tiny_family
from vidtune.models.tiny.common import (
    OverfitSettings,
    TinyFamily,
    build_tiny_t5,
    build_tiny_tokenizer,
    reference_videos,
)
from vidtune.models.tiny.ltx_video import write_tiny_ltx_video

__all__ = [
    "TINY_SHAPES",
    "TINY_WRITERS",
    "OverfitSettings",
    "TinyFamily",
    "build_tiny_t5",
    "build_tiny_tokenizer",
    "reference_videos",
    "tiny_family",
    "write_tiny_ltx_video",
    "write_tiny_model",
]

# family -> writer, family -> a clip shape (frames, height, width) its tiny model accepts (tests, the quickstart).
TINY_WRITERS = {name: tiny_family(name).write for name in available_models()}
TINY_SHAPES: dict[str, tuple[int, int, int]] = {name: tiny_family(name).shape for name in available_models()}


def write_tiny_model(family: str, folder: str | Path, **kwargs: object) -> Path:
    """Write the tiny model of a family (see TINY_WRITERS) into `folder`."""
    if family not in TINY_WRITERS:
        raise KeyError(f"no tiny model for '{family}'; available: {', '.join(sorted(TINY_WRITERS))}")
    return TINY_WRITERS[family](folder, **kwargs)
