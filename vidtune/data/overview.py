"""A contact sheet of the dataset: what each sample trains as, to eyeball before training.

One row per sample: the first, middle and last frame of the window training reads from it (a still: its one
frame), each resized to the sample's bucket as training resizes it (`data.resize`), so the crop is the one the model
sees; then where it was named, its bucket (frames x height x width), its file's length, rate and size, and its
caption. A sample that will not train (no bucket fits it, the file cannot be read) is drawn too, from its source
frames, framed in red with the reason; lines of a source that give no sample at all (a missing file, an empty
caption) are listed in red at the end of the last page. The header counts what trains and what does not.
"""

from __future__ import annotations

import functools
import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageDraw, ImageFont, ImageOps

from vidtune.data.buckets import Shape, describe_shape, window_starts
from vidtune.data.sources import Clip, probe
from vidtune.data.video import VideoDecodeError, VideoInfo, describe_size, format_fps, read_frames, select_frame_indices
from vidtune.errors import VidtuneError
from vidtune.files import atomic_path

if TYPE_CHECKING:  # the config's data section, named for annotations only (vidtune.config sits above data/)
    from vidtune.config import DataConfig

THUMB_W, THUMB_H = 160, 90
PAD = 8
TEXT_W = 460
LINE_H = 17
HEADER_H = 2 * LINE_H + 2 * PAD
NOTE_H = 30
ROW_H = THUMB_H + 2 * PAD
WIDTH = PAD + 3 * (THUMB_W + PAD) + TEXT_W
MAX_ROWS = 32

_BACKGROUND = (24, 24, 28)
_OUTLINE = (110, 110, 120)  # around each frame: the bucket's shape at a glance
_TEXT = (235, 235, 235)
_DIM_TEXT = (160, 160, 170)
_TRAINS = (140, 210, 140)
_MARK = (225, 70, 70)  # what will not train
_TEXT_PX = TEXT_W - PAD  # a row's text column, in pixels
_NOTE_PX = WIDTH - 2 * PAD
_NOTE_LINES = 3  # lines of each source problem at the end of the sheet, at most


@dataclass(frozen=True)
class SheetRow:
    """One sample as the sheet draws it: the frames shown (at the bucket's size when it trains; its source frames,
    or none when unreadable, when it does not) and why it will not train (empty: it trains)."""

    clip: Clip
    info: VideoInfo | None
    shape: Shape | None  # its bucket, frames x height x width
    frames: tuple[np.ndarray, ...]
    window: tuple[int, int] | None  # first and last source frame of the window shown (clips that train)
    problems: tuple[str, ...]

    @property
    def trains(self) -> bool:
        return self.shape is not None and not self.problems


def sheet_rows(clips: Sequence[Clip], data: DataConfig, problems: dict[int, list[str]] | None = None) -> list[SheetRow]:
    """What the sheet shows of each sample of `clips` (their `index` keys `problems`; a clip without `info` is
    probed here). `data`: the config's data section (buckets, fps, resize, frame_sampling), read as training does."""
    shapes = data.bucket_shapes()
    rows = []
    for clip in clips:
        found = list((problems or {}).get(clip.index, []))
        info = clip.info
        if info is None:
            probed = probe(clip)
            if isinstance(probed, VideoDecodeError):
                found = found or [probed.reason]
            else:
                info = probed
        shape = shapes[clip.bucket] if clip.bucket is not None else None
        if shape is None and not found:
            found = ["it is in no bucket"]
        frames: tuple[np.ndarray, ...] = ()
        window = None
        if info is not None:
            try:
                frames, window = _frames(clip, info, shape if not found else None, data)
            except VidtuneError as error:  # a file damaged past its header: the reason is the row's mark
                found.append(str(getattr(error, "reason", error)))
        rows.append(SheetRow(clip, info, shape, frames, window, tuple(found)))
    return rows


def _frames(clip: Clip, info: VideoInfo, shape: Shape | None, data: DataConfig
            ) -> tuple[tuple[np.ndarray, ...], tuple[int, int] | None]:
    """The frames shown and, for a clip that trains, its window's first and last source frame. With `shape`, the
    window training reads (its first, middle and last frame) at the bucket's size; without, the source's frames."""
    if clip.is_image:
        size = shape[1:] if shape is not None else None
        return tuple(read_frames(clip.video, [0], size, data.resize)), None
    if shape is None:
        last = max(info.num_frames - 1, 0)
        return tuple(read_frames(clip.video, sorted({0, last // 2, last}))), None
    start = window_starts(info, shape[0], data.fps, data.frame_sampling, 1)[0]
    indices = select_frame_indices(info, shape[0], data.fps, start)
    shown = list(dict.fromkeys([indices[0], indices[len(indices) // 2], indices[-1]]))
    return tuple(read_frames(clip.video, shown, shape[1:], data.resize)), (indices[0], indices[-1])


def summary(clips: Sequence[Clip], problems: dict[int, list[str]] | None = None, unused: Sequence[str] = ()) -> str:
    """The header: how many samples train (clips, stills) and how many will not, and the lines giving none."""
    trains = [clip for clip in clips if clip.bucket is not None and not (problems or {}).get(clip.index)]
    stills = sum(clip.is_image for clip in trains)
    marked = len(clips) - len(trains)
    text = (f"{_count(len(clips), 'sample')}: {_count(len(trains) - stills, 'clip')} and {_count(stills, 'still')} "
            f"train, {marked} will not (in red)")
    if unused:
        text += f"; {_lines_without_sample(len(unused))} (listed at the end)"
    return text


def _lines_without_sample(number: int) -> str:
    return f"{_count(number, 'line')} of the sources {'gives' if number == 1 else 'give'} no sample"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def overview_size(num_rows: int, max_rows: int = MAX_ROWS, unused: Sequence[str] = ()) -> tuple[int, int]:
    """(width, height) of the sheet for `num_rows` samples and the `unused` source lines listed at its end."""
    rows = min(num_rows, max_rows)
    note = NOTE_H if num_rows > max_rows else 0
    return WIDTH, HEADER_H + rows * ROW_H + note + _unused_height(unused)


def write_dataset_overview(
    clips: Sequence[Clip],
    data: DataConfig,
    path: str | os.PathLike[str],
    problems: dict[int, list[str]] | None = None,
    unused: Sequence[str] = (),
    max_rows: int = MAX_ROWS,
    sound: bool = False,
    header: str | None = None,
) -> Path:
    """Write the contact sheet of `clips` as a PNG at `path` (atomically) and return the path. `problems`: why a
    sample will not train, by its index; `unused`: the source lines that give no sample; `sound`: each row says
    whether the clip has an audio track; `header`: the first line (default: the counts of these clips)."""
    path = Path(path)
    rows = sheet_rows(clips[:max_rows], data, problems)
    more = len(clips) - len(rows)
    sheet = Image.new("RGB", overview_size(len(clips), max_rows, unused), _BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    font = sheet_font()
    if header is None:
        header = summary(clips, problems, unused)
    _text(draw, (PAD, PAD), header + (f" (showing the first {len(rows)})" if more else ""), font, _TEXT)
    _text(draw, (PAD, PAD + LINE_H), "Each sample as it trains: first, middle and last frame of the window read, at "
          f"its bucket's size ({data.resize}); a still: its one frame.", font, _DIM_TEXT)
    for number, row in enumerate(rows):
        _draw_row(sheet, draw, font, HEADER_H + number * ROW_H, row, sound)
    bottom = HEADER_H + len(rows) * ROW_H
    if more:
        _text(draw, (PAD, bottom + PAD), f"... and {_count(more, 'more sample')} not shown.", font, _DIM_TEXT)
        bottom += NOTE_H
    _draw_unused(draw, font, bottom, unused)
    _save_png(sheet, path)
    return path


def _draw_row(sheet: Image.Image, draw: ImageDraw.ImageDraw, font: ImageFont.ImageFont, top: int, row: SheetRow,
              sound: bool) -> None:
    for column in range(3):
        left = PAD + column * (THUMB_W + PAD)
        if column < len(row.frames):
            _paste_frame(sheet, draw, row.frames[column], left, top + PAD)
        elif column == 0:  # nothing could be read
            _text(draw, (left + PAD, top + PAD + THUMB_H // 2 - 6), "could not read", font, _MARK)
        elif column == 1 and row.clip.is_image:
            _text(draw, (left + PAD, top + PAD + THUMB_H // 2 - 6), "a still: one frame", font, _DIM_TEXT)
    text_left = PAD + 3 * (THUMB_W + PAD)
    lines = [(f"{row.clip.where}: {row.clip.video.name}", _TEXT)]
    if row.trains:
        lines.append((_trains_as(row), _TRAINS))
    else:
        reason = _wrap("WILL NOT TRAIN: " + "; ".join(row.problems), _TEXT_PX)
        lines += [(line, _MARK) for line in _cut(reason, 2)]
    if row.info is not None:
        lines.append((clip_details(row.clip, row.info, sound), _DIM_TEXT))
    room = ROW_H // LINE_H - len(lines)
    lines += [(line, _TEXT) for line in _cut(_wrap(row.clip.caption, _TEXT_PX) or [""], room)]
    for number, (line, color) in enumerate(lines):
        _text(draw, (text_left, top + PAD + number * LINE_H), line, font, color)
    if not row.trains:
        draw.rectangle((PAD // 2, top + PAD // 2, WIDTH - PAD // 2 - 1, top + ROW_H - PAD // 2 - 1), outline=_MARK,
                       width=2)


def _trains_as(row: SheetRow) -> str:
    assert row.shape is not None
    text = f"trains as {describe_shape(row.shape)} (frames x height x width)"
    if row.window is not None:
        text += f", source frames {row.window[0]}-{row.window[1]}"
    return text + (f", repeats {row.clip.repeats}" if row.clip.repeats > 1 else "")


def clip_details(clip: Clip, info: VideoInfo, sound: bool = False) -> str:
    """The file as it is: frames, rate, size (height x width), length (`still` and size for a picture); with
    `sound`, whether the clip has an audio track (without one it trains video only)."""
    if clip.is_image:
        return f"file: still, {describe_size(info)}"
    details = f"file: {info.num_frames} frames, {format_fps(info.fps)} fps, {describe_size(info)}, " \
              f"{info.duration:.1f} s"
    if sound:
        details += ", sound track" if info.has_audio else ", no sound track"
    return details


def _paste_frame(sheet: Image.Image, draw: ImageDraw.ImageDraw, frame: np.ndarray, left: int, top: int) -> None:
    """The frame scaled into a THUMB_W x THUMB_H box keeping its shape (small frames grow too), outlined."""
    image = ImageOps.contain(Image.fromarray(frame), (THUMB_W - 2, THUMB_H - 2), Image.Resampling.LANCZOS)
    x, y = left + (THUMB_W - image.width) // 2, top + (THUMB_H - image.height) // 2
    sheet.paste(image, (x, y))
    draw.rectangle((x - 1, y - 1, x + image.width, y + image.height), outline=_OUTLINE)


def _unused_lines(unused: Sequence[str]) -> list[str]:
    if not unused:
        return []
    lines = [f"{_lines_without_sample(len(unused))} (they will not train):"]
    for problem in unused:
        lines += _cut(_wrap(problem, _NOTE_PX, initial_indent="- ", subsequent_indent="  "), _NOTE_LINES)
    return lines


def _unused_height(unused: Sequence[str]) -> int:
    lines = _unused_lines(unused)
    return len(lines) * LINE_H + 2 * PAD if lines else 0


def _draw_unused(draw: ImageDraw.ImageDraw, font: ImageFont.ImageFont, top: int, unused: Sequence[str]) -> None:
    for number, line in enumerate(_unused_lines(unused)):
        _text(draw, (PAD, top + PAD + number * LINE_H), line, font, _MARK)


@functools.cache
def sheet_font() -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=13)


def _wrap(text: str, width: int, **options: str) -> list[str]:
    """`text` in lines at most `width` pixels wide in the sheet's font (textwrap's breaks at measured widths; a
    word longer than a line is broken)."""
    font = sheet_font()
    chars = max(8, int(width / max(font.getlength("n"), 1.0)))
    while True:
        lines = textwrap.wrap(text, chars, **options)
        if chars <= 8 or all(font.getlength(line) <= width for line in lines):
            return lines
        chars -= 2


def _fit(text: str, width: float) -> str:
    """`text` as one line at most `width` pixels wide, ending in "..." when cut."""
    font = sheet_font()
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "...") > width:
        text = text[:-1]
    return text.rstrip() + "..."


def _cut(lines: list[str], count: int) -> list[str]:
    """At most `count` lines, the last ending in "..." when some were left out."""
    if len(lines) <= count:
        return lines
    kept = lines[: max(count, 1)]
    kept[-1] = kept[-1].rstrip() + "..."
    return kept


def _text(
    draw: ImageDraw.ImageDraw,
    xy: tuple[int, int],
    text: str,
    font: ImageFont.ImageFont,
    color: tuple[int, int, int],
) -> None:
    text = _fit(text, WIDTH - PAD - xy[0])  # never past the sheet's right edge
    try:
        draw.text(xy, text, font=font, fill=color)
    except UnicodeEncodeError:  # bitmap fallback font (Pillow without FreeType) only knows Latin-1
        draw.text(xy, text.encode("latin-1", "replace").decode("latin-1"), font=font, fill=color)


def _save_png(image: Image.Image, path: Path) -> None:
    with atomic_path(path) as temporary:
        image.save(temporary, format="PNG")
