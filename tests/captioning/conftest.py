"""Fixtures of the captioning tests: tiny random Qwen2.5-VL and Qwen3-VL models written once per session, and
small real clips."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers.vlm import write_tiny_qwen3_vl, write_tiny_qwen25_vl
from vidtune.data.video import write_video


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen25_vl(tmp_path_factory.mktemp("tiny-qwen25-vl"))


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3-vl"))


@pytest.fixture
def clips(tmp_path: Path):
    """clips(folder, names) -> writes a short real clip (9 frames, 32x48, 8 fps) per name ending in .mp4, a small
    png per name ending in .png, and returns the folder."""

    def write(folder: Path, names: list[str]) -> Path:
        rng = np.random.default_rng(len(names))
        for name in names:
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if name.endswith(".png"):
                from PIL import Image

                Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(path)
            else:
                write_video(path, rng.integers(0, 256, (9, 32, 48, 3), dtype=np.uint8), fps=8)
        return folder

    return write
