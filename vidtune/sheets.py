"""Pictures of samples to judge without a player: one sample's contact sheet, and a run's samples side by side.

- `write_contact_sheet`: a sample's frames in a grid (up to 8, evenly spaced, each numbered), under its prompt and
  what made it (training step, seed, shape, denoising steps);
- `write_samples_by_step`: every validation of a run, one row per prompt and one column per training step (the
  first, middle and last frame of each sample), to see what training changed.

Frames smaller than a readable cell are scaled up (nearest neighbour, so pixels stay pixels), larger ones down.
"""

from __future__ import annotations

import functools
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from vidtune.data.video import probe_video, read_frames
from vidtune.files import atomic_path

COLUMNS = 4  # frames per grid row
MOST_FRAMES = 8  # frames a contact sheet shows
CELL_WIDTH = (160, 320)  # a frame's width on a sheet, at least and at most
PAD = 6
LINE = 16  # text line height
BACKGROUND, TEXT, DIM = (24, 24, 28), (235, 235, 235), (160, 160, 170)
SAMPLE_NAME = re.compile(r"step-(\d+)-(\d+)\.mp4$")  # validation samples: step-00000040-0.mp4


@functools.cache
def _font() -> ImageFont.ImageFont:
    return ImageFont.load_default(size=13)


def _cell(frame: np.ndarray) -> Image.Image:
    """One frame at a width between CELL_WIDTH's bounds (aspect kept)."""
    image = Image.fromarray(frame)
    width = min(max(image.width, CELL_WIDTH[0]), CELL_WIDTH[1])
    if width == image.width:
        return image
    height = max(1, round(image.height * width / image.width))
    method = Image.Resampling.NEAREST if width > image.width else Image.Resampling.LANCZOS
    return image.resize((width, height), method)


def _wrap(text: str, width_px: int) -> list[str]:
    return textwrap.wrap(text, max(20, width_px // 7)) or [""]


def _draw_lines(draw: ImageDraw.ImageDraw, top: int, lines: Sequence[tuple[str, tuple[int, int, int]]]) -> None:
    for number, (line, color) in enumerate(lines):
        try:
            draw.text((PAD, top + number * LINE), line, font=_font(), fill=color)
        except UnicodeEncodeError:  # the bitmap fallback font (Pillow without FreeType) knows Latin-1 only
            draw.text((PAD, top + number * LINE), line.encode("latin-1", "replace").decode("latin-1"),
                      font=_font(), fill=color)


def _save(sheet: Image.Image, path: Path) -> Path:
    with atomic_path(path) as temporary:
        sheet.save(temporary, format="PNG")
    return path


def contact_sheet(frames: np.ndarray, caption: Sequence[str] = ()) -> Image.Image:
    """Up to MOST_FRAMES evenly spaced frames ([F, H, W, 3] uint8) in rows of COLUMNS, each numbered, under the
    `caption` lines (the first one, the prompt, wrapped)."""
    count = min(MOST_FRAMES, len(frames))
    picks = np.linspace(0, len(frames) - 1, count).round().astype(int)
    cells = [_cell(frames[index]) for index in picks]
    columns = min(COLUMNS, count)
    rows = -(-count // columns)
    cell_w, cell_h = cells[0].size
    width = columns * cell_w + (columns + 1) * PAD
    lines: list[tuple[str, tuple[int, int, int]]] = []
    for number, text in enumerate(caption):
        lines += [(line, TEXT if number == 0 else DIM) for line in _wrap(text, width - 2 * PAD)]
    header = PAD + len(lines) * LINE + PAD if lines else 0
    label = LINE
    sheet = Image.new("RGB", (width, header + rows * (cell_h + label + PAD) + PAD), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    _draw_lines(draw, PAD, lines)
    for slot, (index, cell) in enumerate(zip(picks, cells, strict=True)):
        left = PAD + (slot % columns) * (cell_w + PAD)
        top = header + (slot // columns) * (cell_h + label + PAD) + PAD
        draw.text((left, top), f"frame {index + 1}/{len(frames)}", font=_font(), fill=DIM)
        sheet.paste(cell, (left, top + label))
    return sheet


def write_contact_sheet(frames: np.ndarray, path: Path, caption: Sequence[str] = ()) -> Path:
    """`contact_sheet` as a PNG at `path` (atomically)."""
    return _save(contact_sheet(frames, caption), path)


def validation_samples(folder: Path) -> dict[int, dict[int, Path]]:
    """The validation samples in a run's samples folder: {prompt number: {training step: mp4}}."""
    found: dict[int, dict[int, Path]] = {}
    for path in sorted(folder.glob("step-*.mp4")):
        match = SAMPLE_NAME.search(path.name)
        if match:
            found.setdefault(int(match.group(2)), {})[int(match.group(1))] = path
    return found


def sample_files(folder: Path) -> list[Path]:
    """The validation samples in `folder`, by training step, then prompt."""
    samples = validation_samples(folder)
    return [path for _, _, path in sorted((step, number, path) for number, by_step in samples.items()
                                          for step, path in by_step.items())]


def write_samples_by_step(folder: Path, path: Path) -> Path | None:
    """Every validation sample in `folder`, one row per prompt (its text above it) and one column per training step
    (the first, middle and last frame, stacked), as a PNG at `path`; None when there is none."""
    samples = validation_samples(folder)
    if not samples:
        return None
    steps = sorted({step for by_step in samples.values() for step in by_step})
    blocks: list[tuple[list[str], list[Image.Image | None]]] = []
    for number in sorted(samples):
        by_step = samples[number]
        prompt_file = next(iter(by_step.values())).with_suffix(".txt")
        prompt = prompt_file.read_text(encoding="utf-8").strip() if prompt_file.is_file() else f"prompt {number + 1}"
        cells: list[Image.Image | None] = []
        for step in steps:
            if step not in by_step:
                cells.append(None)
                continue
            last = max(probe_video(by_step[step]).num_frames - 1, 0)
            picked = read_frames(by_step[step], sorted({0, last // 2, last}))
            thumbs = [_cell(frame) for frame in picked]
            column = Image.new("RGB", (thumbs[0].width, sum(t.height for t in thumbs) + PAD * (len(thumbs) - 1)),
                               BACKGROUND)
            for slot, thumb in enumerate(thumbs):
                column.paste(thumb, (0, slot * (thumb.height + PAD)))
            cells.append(column)
        blocks.append(([f"prompt {number + 1}: {prompt}"], cells))
    cell_w = max(cell.width for _, cells in blocks for cell in cells if cell is not None)
    cell_h = max(cell.height for _, cells in blocks for cell in cells if cell is not None)
    width = max(len(steps) * (cell_w + PAD) + PAD, 480)
    heights = [PAD + len(_wrap(caption[0], width - 2 * PAD)) * LINE + LINE + cell_h + PAD for caption, _ in blocks]
    title = _wrap("Validation samples by training step: the first, middle and last frame of each", width - 2 * PAD)
    sheet = Image.new("RGB", (width, PAD + len(title) * LINE + sum(heights) + PAD), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    _draw_lines(draw, PAD, [(line, DIM) for line in title])
    top = PAD + len(title) * LINE
    for (caption, cells), height in zip(blocks, heights, strict=True):
        lines = [(line, TEXT) for line in _wrap(caption[0], width - 2 * PAD)]
        _draw_lines(draw, top + PAD, lines)
        row = top + PAD + len(lines) * LINE
        for column, (step, cell) in enumerate(zip(steps, cells, strict=True)):
            left = PAD + column * (cell_w + PAD)
            draw.text((left, row), f"step {step}", font=_font(), fill=DIM)
            if cell is not None:
                sheet.paste(cell, (left, row + LINE))
        top += height
    return _save(sheet, path)
