"""Small datasets written for a test: one clip, and (control, target) pairs."""

from __future__ import annotations

import shutil
from pathlib import Path

from vidtune.config import DataConfig
from vidtune.data.sources import Clip, load_dataset

CONTROL_CAPTION = "a shape moving"


def pair_samples(root: Path, frames: int = 2, **data) -> list[Clip]:
    """The samples of a `pairs` dataset folder (videos.txt, prompts.txt) as training reads them: `load_dataset`,
    each probed and in the one bucket of `frames` frames."""
    return load_dataset(DataConfig(root=str(root), frames=frames, num_workers=0, **data), progress=False)


def control_dataset(shapes_dataset: Path, root: Path) -> tuple[Path, list[Path], list[Path]]:
    """Two samples with one caption: targets clips 0 and 1, controls clips 2 and 3 (so only the control tells
    them apart). Returns (root, targets, controls)."""
    clips = [clip.video for clip in pair_samples(shapes_dataset)]
    root.mkdir(parents=True, exist_ok=True)
    targets, controls = clips[:2], clips[2:4]
    (root / "videos.txt").write_text("".join(f"{path}\n" for path in targets))
    (root / "prompts.txt").write_text(f"{CONTROL_CAPTION}\n{CONTROL_CAPTION}\n")
    (root / "controls.txt").write_text("".join(f"{path}\n" for path in controls))
    return root, targets, controls


def one_clip_dataset(video: Path, caption: str, root: Path) -> Path:
    root.mkdir(parents=True)
    shutil.copy(video, root / video.name)
    (root / "videos.txt").write_text(video.name + "\n")
    (root / "prompts.txt").write_text(caption + "\n")
    return root


def captioned_dataset(shapes_dataset: Path, root: Path, captions: list[str]) -> Path:
    """A `pairs` folder naming the shapes dataset's clips (as many as `captions`, by absolute path) with `captions`."""
    clips = [clip.video for clip in pair_samples(shapes_dataset)][: len(captions)]
    root.mkdir(parents=True, exist_ok=True)
    (root / "videos.txt").write_text("".join(f"{path}\n" for path in clips))
    (root / "prompts.txt").write_text("".join(f"{caption}\n" for caption in captions))
    return root


def write_mask(path: Path, height: int, width: int, frames: int = 1, fps: float = 24.0,
               white: tuple[float, float, float, float] = (0.0, 0.0, 1.0, 1.0)) -> Path:
    """A mask file: a still (.png) or a clip (.mp4) of `frames` frames, white inside `white` ([x0, y0, x1, y1] as
    fractions of the width and height), black elsewhere."""
    import numpy as np
    from PIL import Image

    from vidtune.data.video import write_video

    image = np.zeros((height, width, 3), dtype=np.uint8)
    x0, y0, x1, y1 = white
    image[round(y0 * height):round(y1 * height), round(x0 * width):round(x1 * width)] = 255
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".png":
        Image.fromarray(image).save(path)
    else:
        write_video(path, np.stack([image] * frames), fps)
    return path


def masked_dataset(shapes_dataset: Path, root: Path, count: int = 2,
                   white: tuple[float, float, float, float] = (0.0, 0.0, 1.0, 1.0), still: bool = True) -> Path:
    """A `pairs` folder of the shapes dataset's first `count` clips with a mask each (masks.txt), white in `white`:
    a png, or a 33-frame clip (`still` False)."""
    clips = pair_samples(shapes_dataset)[:count]
    root.mkdir(parents=True, exist_ok=True)
    masks = [write_mask(root / f"mask{number}.{'png' if still else 'mp4'}", 48, 48, 33, white=white)
             for number in range(count)]
    (root / "videos.txt").write_text("".join(f"{clip.video}\n" for clip in clips))
    (root / "prompts.txt").write_text("".join(f"{clip.caption}\n" for clip in clips))
    (root / "masks.txt").write_text("".join(f"{mask.name}\n" for mask in masks))
    return root
