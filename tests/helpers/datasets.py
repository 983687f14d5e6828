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
