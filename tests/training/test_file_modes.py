"""Every file a run, an export and a precompute write follows the user's umask, like any other file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from vidtune.export.command import export_checkpoint
from vidtune.trainers import build_trainer


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _modes(root: Path, folders: tuple[str, ...]) -> dict[str, tuple[bool, int]]:
    """name relative to `root` -> (is a folder, permission bits), for everything under `folders`."""
    return {str(path.relative_to(root)): (path.is_dir(), stat.S_IMODE(path.stat().st_mode))
            for folder in folders for path in (root / folder).rglob("*")}


@pytest.mark.parametrize("algorithm", ["lora", "full"])
def test_outputs_follow_the_umask(make_config, tmp_path, umask_022, algorithm):
    config = make_config(training={"steps": 2, "algorithm": algorithm}, checkpoint={"every": 1},
                         validation={"enabled": True, "num_inference_steps": 1},
                         precompute={"enabled": True, "cache_dir": str(tmp_path / "cache")},
                         output_dir=str(tmp_path / "run"))
    build_trainer(config).run()
    export_checkpoint(tmp_path / "run", tmp_path / "exported")
    written = _modes(tmp_path, ("run", "exported", "cache"))
    weights = "pytorch_lora_weights.safetensors" if algorithm == "lora" else "transformer/config.json"
    # The walk saw what matters: weights, pictures, config, metrics, samples, checkpoints, exports, cache entries.
    assert {f"run/{weights}", f"exported/{weights}", "run/dataset_overview.png", "run/loss.png", "run/config.yaml",
            "run/metrics.jsonl", "run/checkpoints/step-00000002/weights.safetensors"} <= written.keys()
    assert any(name.startswith("run/samples/") and name.endswith(".png") for name in written)
    assert any(name.startswith("cache/latents/") and not is_dir for name, (is_dir, _) in written.items())
    wrong = {name: oct(mode) for name, (is_dir, mode) in written.items() if mode != (0o755 if is_dir else 0o644)}
    assert not wrong, wrong
