"""A contact sheet of the dataset, so a user can eyeball clips and captions before training.

One row per clip: first, middle and last frame, then the line number, length, size (for a family that trains on a
clip's sound, whether it has an audio track) and caption.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont, ImageOps

from vidtune.data.sources import Clip
from vidtune.data.video import VideoInfo, describe_size, format_fps, read_frames
from vidtune.errors import VidtuneError
from vidtune.files import atomic_path

THUMB_W, THUMB_H = 160, 90
PAD = 8
TEXT_W = 460
HEADER_H = 30
NOTE_H = 30
ROW_H = THUMB_H + 2 * PAD
WIDTH = PAD + 3 * (THUMB_W + PAD) + TEXT_W
MAX_ROWS = 32

_BACKGROUND = (24, 24, 28)
_THUMB_BACKGROUND = (0, 0, 0)
_TEXT = (235, 235, 235)
_DIM_TEXT = (160, 160, 170)
_CAPTION_WIDTH = 62  # characters per caption line; the default font is about 7 px per character
_CAPTION_LINES = 3


def overview_size(num_clips: int, max_rows: int = MAX_ROWS) -> tuple[int, int]:
    """(width, height) of the sheet for `num_clips` clips."""
    rows = min(num_clips, max_rows)
    note = NOTE_H if num_clips > max_rows else 0
    return WIDTH, HEADER_H + rows * ROW_H + note


def write_dataset_overview(
    clips: Sequence[Clip],
    infos: Sequence[VideoInfo],
    path: str | os.PathLike[str],
    max_rows: int = MAX_ROWS,
    sound: bool = False,
) -> Path:
    """Write the contact sheet as a PNG at `path` (atomically) and return the path. `sound`: each row says whether
    the clip has an audio track."""
    if len(clips) != len(infos):
        raise ValueError(f"got {len(clips)} clips but {len(infos)} video infos")
    path = Path(path)
    sheet = Image.new("RGB", overview_size(len(clips), max_rows), _BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default(size=13)
    shown = min(len(clips), max_rows)
    header = f"{len(clips)} clip{'s' if len(clips) != 1 else ''}"
    if shown < len(clips):
        header += f" (showing the first {shown})"
    _text(draw, (PAD, PAD), header + "   |   first, middle and last frame of each clip", font, _TEXT)
    for row, (clip, info) in enumerate(zip(clips[:shown], infos[:shown], strict=True)):
        _draw_row(sheet, draw, font, HEADER_H + row * ROW_H, clip, info, sound)
    if shown < len(clips):
        more = len(clips) - shown
        note = f"... and {more} more clip{'s' if more != 1 else ''} not shown."
        _text(draw, (PAD, HEADER_H + shown * ROW_H + PAD), note, font, _DIM_TEXT)
    _save_png(sheet, path)
    return path


def _draw_row(
    sheet: Image.Image,
    draw: ImageDraw.ImageDraw,
    font: ImageFont.ImageFont,
    top: int,
    clip: Clip,
    info: VideoInfo,
    sound: bool,
) -> None:
    last = max(info.num_frames - 1, 0)
    for column, index in enumerate((0, last // 2, last)):
        left = PAD + column * (THUMB_W + PAD)
        sheet.paste(_thumbnail(clip.video, index), (left, top + PAD))
    text_left = PAD + 3 * (THUMB_W + PAD)
    lines = [(f"{clip.where}: {clip.video.name}", _TEXT), (clip_details(clip, info, sound), _DIM_TEXT)]
    lines += [(line, _TEXT) for line in _wrap_caption(clip.caption)]
    for number, (line, color) in enumerate(lines):
        _text(draw, (text_left, top + PAD + number * 17), line, font, color)


def clip_details(clip: Clip, info: VideoInfo, sound: bool = False) -> str:
    """A row's second line: frames, rate, size, length (`still` and size for a picture); with `sound`, whether the
    clip has an audio track (without one it trains video only)."""
    if clip.is_image:
        return f"still, {describe_size(info)}"
    details = f"{info.num_frames} frames, {format_fps(info.fps)} fps, {describe_size(info)}, {info.duration:.1f} s"
    if sound:
        details += ", sound track" if info.has_audio else ", no sound track"
    return details


def _thumbnail(video: Path, index: int) -> Image.Image:
    """The whole frame scaled into a THUMB_W x THUMB_H box (letterboxed), or a marked placeholder."""
    box = Image.new("RGB", (THUMB_W, THUMB_H), _THUMB_BACKGROUND)
    try:
        frame = Image.fromarray(read_frames(video, [index])[0])
    except VidtuneError:
        draw = ImageDraw.Draw(box)
        draw.text((PAD, THUMB_H // 2 - 6), "could not read", fill=(220, 80, 80))
        return box
    frame = ImageOps.contain(frame, (THUMB_W, THUMB_H), Image.Resampling.LANCZOS)  # small clips grow too
    box.paste(frame, ((THUMB_W - frame.width) // 2, (THUMB_H - frame.height) // 2))
    return box


def _wrap_caption(caption: str) -> list[str]:
    lines = textwrap.wrap(caption, _CAPTION_WIDTH) or [""]
    if len(lines) > _CAPTION_LINES:
        lines = lines[:_CAPTION_LINES]
        lines[-1] = lines[-1][: _CAPTION_WIDTH - 3].rstrip() + "..."
    return lines


def _text(
    draw: ImageDraw.ImageDraw,
    xy: tuple[int, int],
    text: str,
    font: ImageFont.ImageFont,
    color: tuple[int, int, int],
) -> None:
    try:
        draw.text(xy, text, font=font, fill=color)
    except UnicodeEncodeError:  # bitmap fallback font (Pillow without FreeType) only knows Latin-1
        draw.text(xy, text.encode("latin-1", "replace").decode("latin-1"), font=font, fill=color)


def _save_png(image: Image.Image, path: Path) -> None:
    with atomic_path(path) as temporary:
        image.save(temporary, format="PNG")
