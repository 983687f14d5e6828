"""Fixtures of the precompute tests: a dataset each test may edit, and a config with its own cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from vidtune.data.synthetic import render_shapes_dataset


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """Four real mp4 clips (17 frames, 48x48) with captions, in a folder this test owns."""
    return render_shapes_dataset(tmp_path / "data", num_clips=4, num_frames=17, height=48, width=48, fps=24, seed=0)


@pytest.fixture
def config_for(make_config, dataset: Path, tmp_path: Path):
    """config_for(**sections) -> a config on `dataset` whose cache is tmp_path/cache (precompute enabled). Frames are
    read from each clip's start (one fixed window), so a cached batch equals the batch computed on the fly."""

    def build(**sections):
        precompute = {"enabled": True, "cache_dir": str(tmp_path / "cache"), "batch_size": 2,
                      **sections.pop("precompute", {})}
        data = {"frame_sampling": "start", **sections.pop("data", {})}
        return make_config(sections.pop("family", "ltx-video"), data_root=sections.pop("data_root", dataset),
                           precompute=precompute, data=data, **sections)

    return build
