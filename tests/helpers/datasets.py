"""Small datasets written for a test: one clip, and (control, target) pairs."""

from __future__ import annotations

import shutil
from pathlib import Path

from vidtune.data.sources import load_text_pair_dataset

CONTROL_CAPTION = "a shape moving"


def control_dataset(shapes_dataset: Path, root: Path) -> tuple[Path, list[Path], list[Path]]:
    """Two samples with one caption: targets clips 0 and 1, controls clips 2 and 3 (so only the control tells
    them apart). Returns (root, targets, controls)."""
    clips = [clip.video for clip in load_text_pair_dataset(shapes_dataset)]
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
