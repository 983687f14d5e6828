"""Shared fixtures: tiny models written to disk once per session, real mp4 datasets, configs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads that spin while waiting starve each other on a small, shared machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

# Under pytest-xdist the cores are shared by its workers: each computes with its share, and so do the runs it starts
# (vidtune reads OMP_NUM_THREADS), so that no more threads than cores compete.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
torch.set_num_threads(_THREADS)

from vidtune.config import Config, build_config  # noqa: E402
from vidtune.data.synthetic import render_shapes_dataset  # noqa: E402
from vidtune.models.registry import get_spec_class  # noqa: E402
from vidtune.models.tiny import TINY_SHAPES, write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """tiny_model_dir(family) -> folder of that family's tiny model, written once per session."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = write_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"))
        return cache[family]

    return get


@pytest.fixture(scope="session")
def shapes_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four real mp4 clips (33 frames, 48x48, 24 fps) with captions."""
    return render_shapes_dataset(tmp_path_factory.mktemp("shapes"), num_clips=4, num_frames=33, height=48,
                                 width=48, fps=24, seed=0)


@pytest.fixture(scope="session")
def shapes_with_controls(shapes_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The four shapes clips, each with another of them as its control clip (clip n follows clip 3 - n): the
    dataset of a family whose conditioning reads a control clip per sample."""
    root = tmp_path_factory.mktemp("shapes-controls")
    videos = [shapes_dataset / line for line in (shapes_dataset / "videos.txt").read_text().split()]
    (root / "videos.txt").write_text("".join(f"{path}\n" for path in videos))
    (root / "prompts.txt").write_text((shapes_dataset / "prompts.txt").read_text())
    (root / "controls.txt").write_text("".join(f"{path}\n" for path in reversed(videos)))
    return root


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@pytest.fixture
def make_config(tiny_model_dir, shapes_dataset: Path, shapes_with_controls: Path, tmp_path: Path):
    """make_config(family="ltx-video", **sections) -> a validated Config for a short CPU run (on the shapes clips;
    with a control clip each for a family whose conditioning reads one)."""

    def build(family: str = "ltx-video", data_root: Path | None = None, **sections: Any) -> Config:
        frames, height, width = TINY_SHAPES[family]
        if data_root is None and get_spec_class(family).reads_control_clip:
            data_root = shapes_with_controls
        base = {
            "model": {"name": family, "pretrained": str(tiny_model_dir(family))},
            # Frames from each clip's start: tests that compare with a clip's own frames (overfitting, first-frame
            # conditions) need one fixed window; tests of `random` (the default) set it.
            "data": {"root": str(data_root or shapes_dataset), "frames": frames, "height": height, "width": width,
                     "num_workers": 0, "frame_sampling": "start"},
            "training": {"steps": 4, "batch_size": 1, "learning_rate": 1e-3, "seed": 0, "precision": "fp32",
                         "device": "cpu"},
            "checkpoint": {"every": 0, "keep": 2},
            "validation": {"enabled": False, "num_inference_steps": 2},
            "logging": {"progress": False},
            "output_dir": str(tmp_path / "run"),
        }
        return build_config(merge(base, sections))

    return build
