"""The noise levels a run drew: each step's row in metrics.jsonl holds its samples' noise levels and losses, and
loss.png plots the loss by noise level."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vidtune import outputs
from vidtune.metrics import NOISE_BINS, loss_figure
from vidtune.trainers import build_trainer


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / outputs.METRICS).read_text(encoding="utf-8").splitlines()]


def test_each_row_holds_its_samples_sigmas_and_losses(make_config):
    config = make_config("ltx-video", training={"steps": 3, "gradient_accumulation": 2})
    result = build_trainer(config).run()
    rows = _rows(result.output_dir)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert len(row["sigmas"]) == len(row["sample_losses"]) == 2  # one a micro-batch of one clip
        assert all(0.0 < sigma < 1.0 for sigma in row["sigmas"])
        # The step's loss is the mean of its samples' losses.
        assert row["loss"] == pytest.approx(float(np.mean(row["sample_losses"])), rel=1e-5)
    drawn = [sigma for row in rows for sigma in row["sigmas"]]
    assert len(set(drawn)) == len(drawn)  # each sample draws its own
    # The picture gains the loss by noise level.
    assert (result.output_dir / outputs.LOSS_PLOT).stat().st_size > 0
    figure = loss_figure(rows)
    assert "Loss by noise level" in [axis.get_title() for axis in figure.axes]


def test_guidance_distillation_rows_hold_sigmas_too(make_config):
    config = make_config(training={"algorithm": "guidance-distillation", "steps": 1})
    row = _rows(build_trainer(config).run().output_dir)[0]
    assert len(row["sigmas"]) == len(row["sample_losses"]) == 1
    assert row["loss"] == pytest.approx(row["sample_losses"][0], rel=1e-5)


def test_ddpm_families_log_timesteps(make_config):
    result = build_trainer(make_config("cogvideox", training={"steps": 1})).run()
    row = _rows(result.output_dir)[0]
    assert "sigmas" not in row and len(row["timesteps"]) == 1 and float(row["timesteps"][0]).is_integer()


def test_the_loss_by_noise_level_panel_bins_the_sample_losses():
    """Bins of 0.1: the panel's two lines are the mean sample loss per bin of the first and second half of the steps,
    gaps where no sample fell; the bars count the samples drawn per bin."""
    rows = [{"step": 1, "loss": 2.0, "sigmas": [0.05, 0.95], "sample_losses": [1.0, 3.0]},
            {"step": 2, "loss": 4.0, "sigmas": [0.08, 0.51], "sample_losses": [5.0, 3.0]},
            {"step": 3, "loss": 1.0, "sigmas": [0.02, 0.97], "sample_losses": [0.5, 1.5]},
            {"step": 4, "loss": 1.0, "sigmas": [0.55, 0.99], "sample_losses": [1.0, 1.0]}]
    figure = loss_figure(rows)
    panel = next(axis for axis in figure.axes if axis.get_title() == "Loss by noise level")
    first, second = (line.get_ydata() for line in panel.get_lines())
    expected_first, expected_second = np.full(NOISE_BINS, np.nan), np.full(NOISE_BINS, np.nan)
    expected_first[0], expected_first[5], expected_first[9] = 3.0, 3.0, 3.0  # (1 + 5) / 2, 3, 3
    expected_second[0], expected_second[5], expected_second[9] = 0.5, 1.0, 1.25
    np.testing.assert_allclose(first, expected_first)
    np.testing.assert_allclose(second, expected_second)
    counts = [patch.get_height() for axis in figure.axes for patch in axis.patches]
    assert counts == [3, 0, 0, 0, 0, 2, 0, 0, 0, 3]
    # Rows without noise levels (an algorithm that logs none) keep the single loss curve.
    assert len(loss_figure([{"step": 1, "loss": 1.0}]).axes) == 1
