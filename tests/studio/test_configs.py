"""The configs the studio offers: every YAML config under its root, and never a walk into the folders it leaves
out (the runs page asks every few seconds)."""

from __future__ import annotations

import os
from pathlib import Path

from vidtune import outputs
from vidtune.studio import web


def test_configs_under_the_root_leave_out_hidden_run_and_checkpoint_folders(tmp_path: Path, monkeypatch):
    for name in ("a.yaml", "sub/b.yml", "sub/deeper/c.yaml", "notes.txt", ".hidden.yaml", ".cache/x.yaml",
                 "run/config.yaml", f"run/{outputs.CHECKPOINTS}/step-1/config.yaml", "node_modules/m.yaml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    (tmp_path / "run" / outputs.RESOLVED_CONFIG).write_text("{}\n")
    (tmp_path / "run" / outputs.METRICS).write_text("")
    walked: list[str] = []
    real_walk = os.walk

    def recording_walk(top, *args, **kwargs):
        for folder, children, files in real_walk(top, *args, **kwargs):
            walked.append(Path(folder).relative_to(tmp_path).as_posix())
            yield folder, children, files

    monkeypatch.setattr(web.os, "walk", recording_walk)
    assert web.configs_under(tmp_path) == ["a.yaml", "sub/b.yml", "sub/deeper/c.yaml"]
    assert "sub/deeper" in walked
    assert not any((part.startswith(".") and part != ".") or part in (outputs.CHECKPOINTS, "node_modules")
                   for folder in walked for part in folder.split("/")), walked
