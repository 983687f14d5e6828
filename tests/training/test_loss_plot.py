"""loss.png is drawn from metrics.jsonl with each checkpoint and at the end of a run, and only when its rows
changed since it was last drawn: a finished run draws its last checkpoint's picture once."""

from __future__ import annotations

import json

from PIL import Image

from vidtune import metrics, outputs
from vidtune.trainers import build_trainer


def _write_rows(path, steps) -> None:
    path.write_text("".join(json.dumps({"step": step, "loss": 1.0 / step}) + "\n" for step in steps))


def test_the_picture_is_redrawn_only_when_its_rows_change(tmp_path):
    rows, picture = tmp_path / "metrics.jsonl", tmp_path / "loss.png"
    _write_rows(rows, [1, 2])
    assert metrics.plot_loss_curve(rows, picture) == picture
    drawn = picture.stat()
    with Image.open(picture) as image:
        assert len(image.text[metrics.ROWS_DIGEST_KEY]) == 64
    # The same rows: the very file is left (the same inode: not even rewritten).
    assert metrics.plot_loss_curve(rows, picture) == picture
    assert (picture.stat().st_ino, picture.stat().st_mtime_ns) == (drawn.st_ino, drawn.st_mtime_ns)
    # A row more: drawn again, with another digest.
    _write_rows(rows, [1, 2, 3])
    metrics.plot_loss_curve(rows, picture)
    assert picture.stat().st_ino != drawn.st_ino
    # A picture without a digest (another program's, or an older run's) is drawn over.
    Image.new("RGB", (8, 8)).save(picture)
    plain = picture.stat().st_ino
    metrics.plot_loss_curve(rows, picture)
    assert picture.stat().st_ino != plain
    with Image.open(picture) as image:
        assert image.size == (800, 450)  # loss.png's own figure (8 x 4.5 in at 100 dpi), not the plain one


def test_a_finished_run_draws_its_loss_curve_once(make_config, monkeypatch):
    """The last checkpoint draws loss.png; the finished run's results find it up to date."""
    drawn = []
    original = metrics.loss_figure
    monkeypatch.setattr(metrics, "loss_figure", lambda rows: drawn.append(len(rows)) or original(rows))
    result = build_trainer(make_config(training={"steps": 2})).run()
    assert drawn == [2]
    assert (result.output_dir / outputs.LOSS_PLOT).stat().st_size > 0
