"""A tiny real dataset of moving shapes, for the quickstart and for tests.

The clips are real H.264 mp4 files with matching captions, so everything downstream (validation,
decoding, training) runs exactly as it would on a user's own clips.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from vidtune.data.video import write_video

SHAPES = ("circle", "square", "triangle")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (50, 200, 70),
    "yellow": (240, 220, 50),
    "orange": (250, 140, 30),
    "white": (245, 245, 245),
    "pink": (245, 110, 190),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "dark blue": (20, 30, 100),
    "black": (10, 10, 10),
    "dark green": (15, 70, 35),
    "purple": (70, 25, 105),
}
# Start and end of the shape's center, as fractions of (width, height).
DIRECTIONS: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    "from left to right": ((0.2, 0.5), (0.8, 0.5)),
    "from right to left": ((0.8, 0.5), (0.2, 0.5)),
    "from top to bottom": ((0.5, 0.2), (0.5, 0.8)),
    "from bottom to top": ((0.5, 0.8), (0.5, 0.2)),
}


@dataclass(frozen=True)
class ShapeClip:
    """What one synthetic clip shows; `caption` describes it in words."""

    shape: str
    color: str
    background: str
    direction: str

    @property
    def caption(self) -> str:
        return f"a {self.color} {self.shape} moving {self.direction} on a {self.background} background"


def render_shapes_dataset(
    folder: str | os.PathLike[str],
    num_clips: int = 4,
    num_frames: int = 25,
    height: int = 64,
    width: int = 64,
    fps: float = 24,
    seed: int = 0,
) -> Path:
    """Write `folder/clips/clip_000.mp4 ...` plus `videos.txt` and `prompts.txt`; return `folder`."""
    if num_clips < 1 or num_frames < 1:
        raise ValueError("num_clips and num_frames must be at least 1")
    folder = Path(folder)
    (folder / "clips").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    videos, prompts = [], []
    for number in range(num_clips):
        clip = ShapeClip(
            shape=SHAPES[number % len(SHAPES)],  # cycle so even 3 clips show every shape
            color=str(rng.choice(list(COLORS))),
            background=str(rng.choice(list(BACKGROUNDS))),
            direction=str(rng.choice(list(DIRECTIONS))),
        )
        relative = f"clips/clip_{number:03d}.mp4"
        write_video(folder / relative, render_shape_frames(clip, num_frames, height, width), fps)
        videos.append(relative)
        prompts.append(clip.caption)
    _write_text(folder / "videos.txt", videos)
    _write_text(folder / "prompts.txt", prompts)
    return folder


def render_shape_frames(clip: ShapeClip, num_frames: int, height: int, width: int) -> np.ndarray:
    """uint8 frames [F, H, W, 3] of the shape gliding in a straight line across a plain background."""
    (x0, y0), (x1, y1) = DIRECTIONS[clip.direction]
    radius = max(2.0, 0.15 * min(height, width))
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    for index in range(num_frames):
        t = index / (num_frames - 1) if num_frames > 1 else 0.0
        center = ((x0 + (x1 - x0) * t) * width, (y0 + (y1 - y0) * t) * height)
        image = Image.new("RGB", (width, height), BACKGROUNDS[clip.background])
        _draw_shape(ImageDraw.Draw(image), clip.shape, center, radius, COLORS[clip.color])
        frames[index] = np.asarray(image)
    return frames


def _draw_shape(
    draw: ImageDraw.ImageDraw,
    shape: str,
    center: tuple[float, float],
    radius: float,
    color: tuple[int, int, int],
) -> None:
    x, y = center
    box = (x - radius, y - radius, x + radius, y + radius)
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    elif shape == "triangle":
        draw.polygon([(x, y - radius), (x + radius, y + radius), (x - radius, y + radius)], fill=color)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def _write_text(path: Path, lines: list[str]) -> None:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")


# What `render_mixed_dataset` writes: (name, width, height, frames (0: a still), fps).
MIXED_SAMPLES: tuple[tuple[str, int, int, int, float], ...] = (
    ("pairs/clips/landscape.mp4", 64, 36, 20, 24.0),
    ("pairs/clips/wide.png", 80, 45, 0, 0.0),
    ("folder/portrait.mp4", 36, 64, 20, 30.0),
    ("folder/stills/tall.jpg", 45, 80, 0, 0.0),
    ("media/odd.mp4", 45, 43, 18, 12.5),
    ("media/square.webp", 50, 50, 0, 0.0),
    ("media/long.mp4", 48, 32, 120, 24.0),
)


def render_mixed_dataset(folder: str | os.PathLike[str], seed: int = 0, stills: bool = True
                         ) -> list[dict[str, object]]:
    """Clips (landscape, portrait, odd size and rate, long) and stills (png, jpg, webp) in four sources: a `pairs`
    folder, a `folder` with .txt captions, a .csv and a .jsonl file. Returns the `data.datasets` entries.
    `stills=False` leaves the stills out (for a model that takes no one-frame samples)."""
    folder = Path(folder)
    rng = np.random.default_rng(seed)
    captions: dict[str, str] = {}
    for number, (name, width, height, frames, fps) in enumerate(MIXED_SAMPLES):
        clip = ShapeClip(SHAPES[number % len(SHAPES)], str(rng.choice(list(COLORS))),
                         str(rng.choice(list(BACKGROUNDS))), str(rng.choice(list(DIRECTIONS))))
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if frames:
            write_video(path, render_shape_frames(clip, frames, height, width), fps)
        else:
            Image.fromarray(render_shape_frames(clip, 1, height, width)[0]).save(path)
        captions[name] = clip.caption
    if not stills:  # the still files are left out of every source
        for name, *_, frames, _ in MIXED_SAMPLES:
            if not frames:
                (folder / name).unlink()
    pairs = ["pairs/clips/landscape.mp4", *(["pairs/clips/wide.png"] if stills else [])]
    _write_text(folder / "pairs/videos.txt", [name.removeprefix("pairs/") for name in pairs])
    _write_text(folder / "pairs/prompts.txt", [captions[name] for name in pairs])
    for name in ("folder/portrait.mp4", *(["folder/stills/tall.jpg"] if stills else [])):
        _write_text((folder / name).with_suffix(".txt"), [captions[name]])
    with open(folder / "media.csv", "w", encoding="utf-8", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["file", "text"])
        for name in ("media/odd.mp4", *(["media/square.webp"] if stills else [])):
            writer.writerow([name, captions[name]])
    _write_text(folder / "long.jsonl", [json.dumps({"video": "media/long.mp4", "caption": captions["media/long.mp4"]})])
    return [
        {"type": "pairs", "root": str(folder / "pairs")},
        {"type": "folder", "root": str(folder / "folder"), "repeats": 2},
        {"type": "metadata", "path": str(folder / "media.csv"), "video_column": "file", "caption_column": "text"},
        {"type": "metadata", "path": str(folder / "long.jsonl"), "caption_prefix": "vtstyle"},
    ]
