"""The per-clip inputs beside a clip and its caption: masks, reference clips and images, pose, face, background.

`INPUT_KINDS` is the table of kinds; adding a kind is one row. A data source says where each kind comes from (a
list file beside videos.txt, a file `<stem>.<kind>.<ext>` beside the clip, a CSV column or JSONL key: see
`vidtune.data.input_files`), a clip holds the paths it found (`Clip.inputs`), and a consumer (an algorithm part or a
spec, `ModelSpec.required_inputs`) says which kinds it reads. The dataset reads each with the clip's own window.

A leaf: imports nothing of vidtune and no torch, so the config's schema can check kind names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Media = Literal["video", "image", "images"]


@dataclass(frozen=True)
class InputKind:
    """One kind of per-clip input. `media`: `video` (a clip read with its clip's frames; a still is one frame the
    whole window shares), `image` (one still, cropped and resized as the clip's frames), `images` (one or more
    stills, each keeping its own aspect, resized to fit the clip's size)."""

    name: str
    media: Media
    description: str


INPUT_KINDS: dict[str, InputKind] = {kind.name: kind for kind in (
    InputKind("mask", "video", "white: the region the model learns / generates; black: kept, out of the loss. "
              "A clip, or a still for every frame."),
    InputKind("reference", "video", "a reference clip the model is conditioned on."),
    InputKind("reference_images", "images", "one or more reference images (e.g. a subject, a style)."),
    InputKind("pose", "video", "a pose clip (skeletons) the model follows."),
    InputKind("face", "video", "a clip of the face the model animates."),
    InputKind("background", "video", "a background clip the subject is placed into."),
)}
# Separates several files of an `images` input on one line of a list file, or in one CSV / JSONL value.
IMAGES_SEPARATOR = "|"
# A batch's key of an encoded input: `Batch.latents["input_mask"]`.
INPUT_PREFIX = "input_"


def input_key(kind: str) -> str:
    """The key of an encoded input among a batch's latents (and the conditions the spec's `forward` reads)."""
    return f"{INPUT_PREFIX}{kind}"


def unknown_kind_problem(kind: str) -> str | None:
    """A sentence naming the kinds there are, or None when `kind` is one."""
    if kind in INPUT_KINDS:
        return None
    return f"{kind!r} is not an input kind; the kinds are: {', '.join(INPUT_KINDS)}"


class ClipInputs(Mapping[str, tuple[Path, ...]]):
    """A clip's inputs, kind -> its files (one, or several for an `images` kind): read-only and hashable, so a
    `Clip` stays a frozen value."""

    def __init__(self, items: Mapping[str, tuple[Path, ...]] | None = None) -> None:
        self._items = {kind: tuple(paths) for kind, paths in sorted((items or {}).items())}

    def __getitem__(self, kind: str) -> tuple[Path, ...]:
        return self._items[kind]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return f"ClipInputs({self._items!r})"

    def with_kind(self, kind: str, paths: tuple[Path, ...]) -> ClipInputs:
        return ClipInputs({**self._items, kind: paths})


Rectangle = tuple[float, float, float, float]  # x0, y0, x1, y1 as fractions of the frame's width and height


def rectangle_problem(rectangle: Rectangle) -> str | None:
    """Why a `mask_rect` cannot be a mask, or None."""
    x0, y0, x1, y1 = rectangle
    if not all(0.0 <= value <= 1.0 for value in rectangle):
        return f"mask_rect {list(rectangle)}: each value is a fraction of the frame, from 0 to 1"
    if x0 >= x1 or y0 >= y1:
        return (f"mask_rect {list(rectangle)} is empty: write [x0, y0, x1, y1] with x0 < x1 and y0 < y1 (fractions of "
                "the width and height, from the top left corner)")
    return None
