"""A hub cache folder written in a test (the layout `hf download` leaves: refs/main -> snapshots/<commit>/...)."""

from __future__ import annotations

import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(cache: Path, repo_id: str, model: Path, without: tuple[str, ...] = ()) -> Path:
    """Put `model` into a hub cache folder as `repo_id` at main, leaving out the subfolders `without`."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(model, snapshot, ignore=shutil.ignore_patterns(*without))
    return snapshot
