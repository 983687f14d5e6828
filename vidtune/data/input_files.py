"""Where each source finds a clip's inputs (`vidtune.data.inputs`), their checks, and how one is read for a window.

- `pairs`: the dataset entry's `inputs: {mask: masks.txt}` names a list beside videos.txt; line n holds the input of
  the clip on line n (an empty line, or no line n: none), several images of an `images` kind separated by `|`;
- `folder`: files beside the clip named `<stem>.<kind>.<ext>` (`clip.mask.mp4`, `clip.mask.png`), several images as
  `<stem>.<kind>.<n>.<ext>`; they are inputs, not samples;
- `metadata`: `inputs: {mask: mask_path}` maps a kind to a CSV column or JSONL key (an empty value: none).

Paths are relative to the list's folder (pairs, metadata) like the clips'. Every problem is collected with the file
and line; `probe_inputs` adds what only the files can tell (an input that does not decode, a mask of another
aspect, a clip input shorter than its clip) before anything loads. An input is read with its clip's own window:
the same source frames at the same times (an input of another frame rate is resampled by timestamp), and the same
crop and resize, so a mask of half the clip's size covers the same region.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from vidtune.data.inputs import IMAGES_SEPARATOR, INPUT_KINDS, ClipInputs, Rectangle
from vidtune.data.video import (
    IMAGE_SUFFIXES,
    VIDEO_SUFFIXES,
    ClipTooShortError,
    ClipWindow,
    VideoDecodeError,
    VideoInfo,
    describe_length,
    describe_size,
    is_image_path,
    probe_image,
    probe_video,
    read_frames,
    resize_image,
    select_frame_indices,
)

# A mask whose aspect ratio is this far (relative) from its clip's is another picture, not the same one smaller.
ASPECT_TOLERANCE = 0.01
_INPUT_NAME = re.compile(r"^(?P<stem>.+)\.(?P<kind>[A-Za-z_]+)(?:\.(?P<number>\d+))?$")


def _resolve(base: Path, text: str) -> Path:
    """An input's absolute path (quotes and backslashes accepted, as for clips)."""
    unquoted = text[1:-1].strip() if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text
    for candidate in (text, unquoted, unquoted.replace("\\", "/")):
        path = Path(candidate).expanduser()
        path = path if path.is_absolute() else base / path
        if path.exists():
            return path
    path = Path(text).expanduser()
    return path if path.is_absolute() else base / path


def parse_input_value(kind: str, text: str, base: Path, where: str) -> tuple[tuple[Path, ...], list[str]]:
    """The files a list line or a metadata value names for `kind` ('' -> none), and a problem for each that is not
    a file, or for several files where the kind takes one."""
    text = text.strip()
    if not text:
        return (), []
    parts = [part.strip() for part in text.split(IMAGES_SEPARATOR)] if INPUT_KINDS[kind].media == "images" \
        else [text]
    problems: list[str] = []
    paths: list[Path] = []
    for part in parts:
        if not part:
            problems.append(f"{where}: an empty file name between '{IMAGES_SEPARATOR}'s; write one image path "
                            f"between each pair of '{IMAGES_SEPARATOR}'.")
            continue
        path = _resolve(base, part)
        if not path.is_file():
            state = "is a folder, not a file" if path.is_dir() else "was not found"
            problems.append(f"{where}: the {kind} {part!r} {state} (looked for {path}). Check the spelling, or write "
                            f"the path relative to {base}.")
            continue
        if INPUT_KINDS[kind].media != "video" and not is_image_path(path):
            problems.append(f"{where}: the {kind} {part!r} is not an image ({', '.join(IMAGE_SUFFIXES)}).")
            continue
        paths.append(path)
    return (tuple(paths) if not problems else ()), problems


# ----- pairs -------------------------------------------------------------------------------------------------------
def read_list_inputs(root: Path, declared: Mapping[str, str], clips: Sequence[Any], problems: list[str],
                     read_lines: Any) -> list[Any]:
    """The clips of a `pairs` source with the inputs its lists name (line n: the clip on line n)."""
    root = root.expanduser().absolute()
    found: dict[int, dict[str, tuple[Path, ...]]] = {clip.line: {} for clip in clips}
    for kind, list_file in declared.items():
        path = root / list_file
        name = Path(list_file).name if Path(list_file).is_absolute() else list_file
        if not path.is_file():
            problems.append(f"{path} is missing: the dataset entry's `inputs` names it for the {kind} of each clip "
                            f"(one a line, in the clips' order). Create it, or remove {kind} from `inputs`.")
            continue
        try:
            lines = read_lines(path)
        except Exception as error:  # a DataError: not UTF-8, unreadable; its problems name the file
            problems.extend(getattr(error, "problems", [str(error)]))
            continue
        for clip in clips:
            if clip.line > len(lines):  # blank lines at the end of a file are not kept: none, like an empty line
                continue
            paths, line_problems = parse_input_value(kind, lines[clip.line - 1], root, f"{name} line {clip.line}")
            problems.extend(line_problems)
            if paths:
                found[clip.line][kind] = paths
        if len(lines) > max((clip.line for clip in clips), default=0) and clips:
            problems.append(f"{name} has {len(lines)} lines but the clip list fewer: line n holds the {kind} of the "
                            f"clip on line n. Remove the extra lines from {name}.")
    return [_with_inputs(clip, found[clip.line]) for clip in clips]


def _with_inputs(clip: Any, inputs: Mapping[str, tuple[Path, ...]]) -> Any:
    return replace(clip, inputs=ClipInputs({**clip.inputs, **inputs})) if inputs else clip


# ----- folder ------------------------------------------------------------------------------------------------------
def split_folder_inputs(media: Sequence[Path]) -> tuple[list[Path], dict[Path, dict[str, tuple[Path, ...]]],
                                                          list[str]]:
    """A folder's media files as (samples, each sample's inputs, problems): `<stem>.<kind>[.<n>].<ext>` beside a
    sample `<stem>.<ext>` is that sample's input of `kind`, never a sample itself."""
    by_stem: dict[tuple[Path, str], Path] = {}
    candidates: list[tuple[Path, str, str, int]] = []
    for path in media:
        match = _INPUT_NAME.match(path.stem)
        if match and match["kind"] in INPUT_KINDS:
            candidates.append((path, match["stem"], match["kind"], int(match["number"] or 0)))
        else:
            by_stem[(path.parent, path.stem)] = path
    inputs: dict[Path, dict[str, list[tuple[int, Path]]]] = {}
    problems: list[str] = []
    for path, stem, kind, number in candidates:
        sample = by_stem.get((path.parent, stem))
        if sample is None:
            problems.append(f"{path} is named as the {kind} of a clip {stem!r} ({stem}.<ext>), but no clip or image "
                            f"of that name is beside it. Rename it, or add the clip.")
            continue
        inputs.setdefault(sample, {}).setdefault(kind, []).append((number, path))
    result: dict[Path, dict[str, tuple[Path, ...]]] = {}
    for sample, kinds in inputs.items():
        result[sample] = {}
        for kind, numbered in kinds.items():
            numbered.sort()
            if INPUT_KINDS[kind].media != "images" and len(numbered) > 1:
                names = ", ".join(p.name for _, p in numbered)
                problems.append(f"{sample} has {len(numbered)} {kind} files ({names}); a clip takes one {kind}: keep "
                                "one of them.")
                continue
            bad = [p for _, p in numbered if INPUT_KINDS[kind].media != "video" and not is_image_path(p)]
            if bad:
                problems.append(f"{bad[0]}: the {kind} must be an image ({', '.join(IMAGE_SUFFIXES)}).")
                continue
            result[sample][kind] = tuple(p for _, p in numbered)
    samples = [path for path in media if (path.parent, path.stem) in by_stem and by_stem[(path.parent, path.stem)]
               == path]
    return samples, result, problems


# ----- checks that read the files ----------------------------------------------------------------------------------
def _probe(path: Path) -> VideoInfo | VideoDecodeError:
    try:
        return probe_image(path) if is_image_path(path) else probe_video(path)
    except VideoDecodeError as error:
        return error


def probe_inputs(clip: Any, info: VideoInfo, probed: dict[Path, VideoInfo | VideoDecodeError]
                 ) -> tuple[dict[str, tuple[VideoInfo, ...]], list[str]]:
    """Each input's probe, and the problems the files show: one that does not decode, a mask (any input but an
    `images` kind) whose aspect differs from the clip's, a clip input shorter than its clip."""
    infos: dict[str, tuple[VideoInfo, ...]] = {}
    problems: list[str] = []
    for kind, paths in clip.inputs.items():
        kind_infos = []
        for path in paths:
            if path not in probed:
                probed[path] = _probe(path)
            found = probed[path]
            if isinstance(found, VideoDecodeError):
                problems.append(f"its {kind} {path} cannot be read: {found.reason}")
                continue
            kind_infos.append(found)
            problem = _fit_problem(kind, path, found, clip, info)
            if problem:
                problems.append(problem)
        infos[kind] = tuple(kind_infos)
    return infos, problems


def probe_control(clip: Any, info: VideoInfo, probed: dict[Path, VideoInfo | VideoDecodeError]
                  ) -> tuple[VideoInfo | None, list[str]]:
    """A control clip's probe (`Clip.control`) and its problems, checked like an input's: it decodes, has its clip's
    aspect, and lasts as long."""
    if clip.control is None:
        return None, []
    path = clip.control
    if path not in probed:
        probed[path] = _probe(path)
    found = probed[path]
    if isinstance(found, VideoDecodeError):
        return None, [f"its control clip {path} cannot be read: {found.reason}"]
    problem = _fit_problem("control clip", path, found, clip, info)
    return found, [problem] if problem else []


def control_window(clip: Any, window: ClipWindow) -> ClipWindow:
    """The window of a clip's control clip: the clip's own, or (a control at another frame rate) the same times:
    the first frame at the same time, the frames resampled to the clip's rate (`data.fps` when set)."""
    found = clip.input_info.get("control", ())
    if clip.is_image or clip.info is None or not found:
        return window
    clip_fps, control_fps = clip.info.fps, found[0].fps
    if clip_fps <= 0 or control_fps <= 0 or clip_fps == control_fps:
        return window
    return replace(window, fps=window.fps or clip_fps, start=_mapped_index(window.start, clip_fps, control_fps))


def _fit_problem(kind: str, path: Path, found: VideoInfo, clip: Any, info: VideoInfo) -> str | None:
    if kind in INPUT_KINDS and INPUT_KINDS[kind].media == "images":
        return None
    aspect, own = found.width / found.height, info.width / info.height
    if abs(math.log(aspect / own)) > ASPECT_TOLERANCE:
        return (f"its {kind} {path.name} is {describe_size(found)}, another shape than the clip's "
                f"{describe_size(info)} (aspect {aspect:.3f} vs {own:.3f}): it would cover another part of the frame. "
                f"Export the {kind} at the clip's aspect ratio (any size).")
    if clip.is_image or is_image_path(path):
        return None
    rates_known = info.fps > 0 and found.fps > 0 and info.fps != found.fps
    short = found.duration + 0.5 / found.fps < info.duration - 1e-6 if rates_known else \
        found.num_frames < info.num_frames
    if short:
        return (f"its {kind} {path.name} is shorter than the clip: it has "
                f"{describe_length(found.num_frames, found.fps)}, the clip "
                f"{describe_length(info.num_frames, info.fps)}. Export the {kind} as long as its clip.")
    return None


def missing_input_problems(clips: Sequence[Any], kinds: Sequence[str]) -> dict[int, list[str]]:
    """By sample number, the needed kinds a sample has no input of (a source's `mask_rect` gives every clip a mask)."""
    problems: dict[int, list[str]] = {}
    for number, clip in enumerate(clips):
        for kind in kinds:
            if kind in clip.inputs or (kind == "mask" and clip.mask_rect is not None):
                continue
            how = " or set `mask_rect: [x0, y0, x1, y1]` on its dataset entry" if kind == "mask" else ""
            problems.setdefault(number, []).append(
                f"it has no {kind}, which this run needs: name one for it (a list file in the entry's `inputs`, a "
                f"file {clip.video.stem}.{kind}.<ext> beside it, or a column){how}.")
    return problems


# ----- reading an input with its clip's window ---------------------------------------------------------------------
def _mapped_index(index: int, clip_fps: float, input_fps: float) -> int:
    """The input's frame at the time of the clip's source frame `index` (nearest; the same index at equal rates)."""
    if clip_fps <= 0 or input_fps <= 0 or clip_fps == input_fps:
        return index
    return math.floor(index * input_fps / clip_fps + 0.5 + 1e-9)


@dataclass(frozen=True)
class InputRead:
    """How one input file (or a source's rectangle) becomes pixels for one window: which source frames, at which
    size and resize. Describes itself for the cache's keys and the frame store."""

    path: str | None  # None: the rectangle `rect`, drawn at the clip's size `clip_size` (width, height)
    indices: tuple[int, ...]
    height: int
    width: int
    resize: str
    fit_own_aspect: bool = False  # an `images` kind: fitted inside the size, padded, keeping its aspect
    rect: Rectangle | None = None
    clip_size: tuple[int, int] | None = None

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {"indices": list(self.indices), "height": self.height, "width": self.width,
                                     "resize": "fit" if self.fit_own_aspect else self.resize}
        if self.rect is not None:
            described.update(rect=list(self.rect), clip_size=list(self.clip_size or ()))
        return described

    def frames(self) -> np.ndarray:
        """uint8 [F, H, W, 3]."""
        if self.path is None:
            assert self.rect is not None and self.clip_size is not None
            return np.stack([rectangle_image(self.rect, self.clip_size, self.height, self.width, self.resize)]
                            * len(self.indices))
        resize = "fit" if self.fit_own_aspect else self.resize
        return np.stack(read_frames(self.path, list(self.indices), (self.height, self.width), resize))


def rectangle_image(rect: Rectangle, clip_size: tuple[int, int], height: int, width: int, resize: str) -> np.ndarray:
    """A white rectangle on black at the clip's size, resized as its frames are (then black or white): uint8
    [H, W, 3]."""
    clip_width, clip_height = clip_size
    canvas = np.zeros((clip_height, clip_width, 3), dtype=np.uint8)
    x0, y0, x1, y1 = rect
    canvas[round(y0 * clip_height):round(y1 * clip_height), round(x0 * clip_width):round(x1 * clip_width)] = 255
    resized = resize_image(Image.fromarray(canvas), height, width, resize)
    return np.where(resized >= 128, 255, 0).astype(np.uint8)  # sharp edges: no resampling ringing in a drawn mask


def input_reads(clip: Any, kind: str, window: ClipWindow) -> tuple[InputRead, ...]:
    """How `clip`'s input of `kind` is read for the clip's `window`: one read per file (several for an `images`
    kind); a mask from the source's rectangle when the clip has no mask file."""
    info = clip.info
    if info is None:
        raise ValueError(f"{clip.where}: the clip must be probed (load_dataset) before its inputs are read")
    clip_indices = [0] if clip.is_image else select_frame_indices(info, window.frames, window.fps, window.start)
    media = INPUT_KINDS[kind].media
    if kind not in clip.inputs:
        if kind == "mask" and clip.mask_rect is not None:
            return (InputRead(None, tuple(clip_indices), window.height, window.width, window.resize,
                              rect=clip.mask_rect, clip_size=(info.width, info.height)),)
        raise KeyError(f"{clip.where} has no {kind}")
    infos = clip.input_info.get(kind, ())
    reads = []
    for number, path in enumerate(clip.inputs[kind]):
        if media != "video" or is_image_path(path):
            indices: tuple[int, ...] = (0,)
        else:
            found = infos[number] if number < len(infos) else probe_video(path)
            # The nearest frame at each time; the input's last one for a time within its last frame's half.
            indices = tuple(min(_mapped_index(i, 0.0 if clip.is_image else info.fps, found.fps), found.num_frames - 1)
                            for i in clip_indices)
        reads.append(InputRead(str(path), indices, window.height, window.width, window.resize,
                               fit_own_aspect=media == "images"))
    return tuple(reads)


def frames_tensor(frames: np.ndarray) -> torch.Tensor:
    """uint8 [F, H, W, 3] -> float32 [3, F, H, W] in [-1, 1] (the layout of an input)."""
    return torch.from_numpy(frames).permute(3, 0, 1, 2).contiguous().float().div_(127.5).sub_(1.0)


def read_input(clip: Any, kind: str, window: ClipWindow) -> torch.Tensor | list[torch.Tensor]:
    """`clip`'s input of `kind` for its `window`: [3, F, H, W] (a clip) or [3, 1, H, W] (a still) in [-1, 1]; a list
    of [3, 1, H, W] for an `images` kind."""
    try:
        read = [frames_tensor(one.frames()) for one in input_reads(clip, kind, window)]
    except (VideoDecodeError, ClipTooShortError) as error:
        raise VideoDecodeError(getattr(error, "path", clip.video), error.reason,
                               where=f"the {kind} of {clip.where}") from error
    return read if INPUT_KINDS[kind].media == "images" else read[0]


INPUT_SUFFIXES = IMAGE_SUFFIXES + VIDEO_SUFFIXES
