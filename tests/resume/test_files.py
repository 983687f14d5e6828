"""Atomic files and folder swaps: a kill at any point leaves either the old or the new, never a mix or nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vidtune.config import build_config
from vidtune.files import atomic_folder, atomic_path, atomic_write_text, recover_folders
from vidtune.resume import resolve_resume


def _folder(path: Path, text: str) -> Path:
    path.mkdir(parents=True)
    (path / "weights").write_text(text)
    return path


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing_else(tmp_path):
    target = atomic_write_text(tmp_path / "result.txt", "old")
    with pytest.raises(RuntimeError), atomic_path(target) as temporary:
        temporary.write_text("half")
        raise RuntimeError("killed")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["result.txt"]


def test_a_folder_is_replaced_only_by_a_complete_one(tmp_path):
    target = _folder(tmp_path / "transformer", "old")
    with pytest.raises(RuntimeError), atomic_folder(target) as temporary:
        (temporary / "weights").write_text("half")
        raise RuntimeError("disk full")
    assert (target / "weights").read_text() == "old" and os.listdir(tmp_path) == ["transformer"]
    with atomic_folder(target) as temporary:
        (temporary / "weights").write_text("new")
    assert (target / "weights").read_text() == "new" and os.listdir(tmp_path) == ["transformer"]


def test_recovery_finishes_a_swap_cut_short_between_the_renames(tmp_path):
    # Killed after the old folder was renamed aside and before the new one took its name.
    _folder(tmp_path / ".stale-transformer-4242", "old")
    _folder(tmp_path / ".incomplete-transformer-4242", "new, maybe cut short")
    recover_folders(tmp_path)
    assert os.listdir(tmp_path) == ["transformer"] and (tmp_path / "transformer" / "weights").read_text() == "old"


def test_recovery_drops_the_old_folder_once_the_new_one_is_in_place(tmp_path):
    _folder(tmp_path / "transformer", "new")
    _folder(tmp_path / ".stale-transformer-4242", "old")
    recover_folders(tmp_path)
    assert os.listdir(tmp_path) == ["transformer"] and (tmp_path / "transformer" / "weights").read_text() == "new"


def test_a_run_recovers_its_final_weights_before_deciding_anything(tmp_path):
    """A final save of a full fine-tune killed mid-swap: the next start finds the finished run, not a fresh dir."""
    output = tmp_path / "run"
    _folder(output / ".stale-transformer-4242", "old")
    config = build_config({"model": {"name": "ltx-video", "pretrained": str(tmp_path / "model")},
                           "data": {"root": str(tmp_path)}, "output_dir": str(output)})
    with pytest.raises(Exception, match="already holds a run"):
        resolve_resume(config)
    assert (output / "transformer" / "weights").read_text() == "old"
