"""loss.png is drawn with each checkpoint; a finished run draws it once more only when its last step was not saved
by the loop (drawing it costs about as much as a tiny model's step)."""

from __future__ import annotations

from pathlib import Path

from vidtune import outputs
from vidtune.metrics import plot_loss_curve
from vidtune.trainers import build_trainer
from vidtune.training import loop, validation


def test_a_run_draws_its_loss_curve_once_at_the_end(make_config, monkeypatch):
    drawn: list[Path] = []

    def counting(metrics_path: Path, output: Path) -> Path | None:
        drawn.append(output)
        return plot_loss_curve(metrics_path, output)

    monkeypatch.setattr(loop, "plot_loss_curve", counting)
    monkeypatch.setattr(validation, "plot_loss_curve", counting)
    config = make_config(training={"steps": 1})
    result = build_trainer(config).run()
    picture = result.output_dir / outputs.LOSS_PLOT
    assert drawn == [picture] and picture.stat().st_size > 0

    # Continuing a finished run trains nothing and saves no checkpoint: its final files draw the picture.
    picture.unlink()
    build_trainer(make_config(training={"steps": 1}, checkpoint={"resume": "latest"})).run()
    assert drawn == [picture, picture] and picture.stat().st_size > 0
