"""The run's metrics: `metrics.jsonl` (one JSON object per logged step) and its picture, `loss.png`.

A step's row also holds its samples' noise levels ("sigmas", or "timesteps" for DDPM families; LTX-2 adds
"audio_sigmas", null for a clip without sound) and each sample's loss ("sample_losses", in the same order), which
`loss.png` bins into the loss by noise level.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from vidtune import parallel
from vidtune.files import append_line, atomic_path, atomic_write_text
from vidtune.trackers import Tracker, step_values


class StepLog:
    """What a run shows and records of its steps: the progress bar, metrics.jsonl (one JSON object per logged
    step, written by rank 0 and flushed as it is written), the trackers the config chose (`vidtune.trackers`, rank 0
    only) and the losses this process logged."""

    def __init__(self, path: Path, total: int, initial: int, show: bool, trackers: list[Tracker]) -> None:
        self.path = path
        self.trackers = trackers
        self.losses: list[float] = []
        self.progress = tqdm(total=total, initial=initial, desc="training", unit="step", disable=not show,
                             dynamic_ncols=True)

    def record(self, step: int, loss: float, lr: float, grad_norm: float | None, seconds: float,
               samples: int, compile_seconds: float = 0.0, noise: dict[str, list[float]] | None = None,
               parts: dict[str, float] | None = None) -> None:
        """One logged step; `samples`: how many samples all ranks took in it; `compile_seconds`: the time
        torch.compile took during the step (not part of `seconds`); `noise`: the samples' noise levels and losses by
        key (NaN: a level a sample has not, written as null); `parts`: named shares of the loss
        ("loss/regularization", "loss/preservation"), also given to the trackers."""
        parts = parts or {}
        if parallel.is_main():
            row: dict[str, Any] = {"step": step, "loss": loss, **parts, "lr": lr, "grad_norm": grad_norm,
                                   "seconds_per_step": seconds}
            if compile_seconds > 0:
                row["compile_seconds"] = compile_seconds
            for key, values in (noise or {}).items():
                row[key] = [None if math.isnan(value) else value for value in values]
            append_line(self.path, json.dumps(row))
        for tracker in self.trackers:
            tracker.log_metrics(step, {**step_values(loss, lr, grad_norm, seconds, samples), **parts})
        self.losses.append(loss)
        self.progress.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")

    def samples(self, step: int, videos: list[Path], fps: float) -> None:
        for tracker in self.trackers:
            tracker.log_samples(step, videos, fps)

    def advance(self) -> None:
        self.progress.update(1)

    def end_progress(self) -> None:
        self.progress.close()

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.progress.close()
        for tracker in self.trackers:
            tracker.close()


def metrics_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """metrics.jsonl's rows with their text, in file order; a line a kill cut short (or none at all) is skipped."""
    if not path.is_file():
        return []
    lines = []
    for text in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(text)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(row, dict):
            lines.append((text, row))
    return lines


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the rows of metrics.jsonl up to `step` (rows a killed run wrote after its checkpoint go)."""
    if not path.is_file():
        return
    kept = [text for text, row in metrics_lines(path) if isinstance(row.get("step"), int) and row["step"] <= step]
    atomic_write_text(path, "".join(line + "\n" for line in kept))


NOISE_BINS = 10  # equal bins of the noise range in loss.png's loss-by-noise-level panel
# A row's noise-level key -> the value of pure noise, which the panel's bins divide by.
NOISE_LEVEL_SCALES = {"sigmas": 1.0, "timesteps": 1000.0}


def loss_by_noise_level(rows: list[dict[str, Any]]) -> tuple[str, np.ndarray, np.ndarray] | None:
    """(level key, mean sample loss per bin [NOISE_BINS], samples per bin) of `rows`' samples, binned by noise
    level over [0, 1] (DDPM timesteps over 1000); None when no row holds noise levels."""
    key = next((name for name in NOISE_LEVEL_SCALES if any(name in row for row in rows)), None)
    if key is None:
        return None
    levels = [level for row in rows for level in row.get(key, [])]
    losses = [loss for row in rows for loss in row.get("sample_losses", [])]
    if not levels or len(levels) != len(losses):
        return None
    bins = np.clip((np.asarray(levels, dtype=float) / NOISE_LEVEL_SCALES[key] * NOISE_BINS).astype(int), 0,
                   NOISE_BINS - 1)
    counts = np.bincount(bins, minlength=NOISE_BINS)
    sums = np.bincount(bins, weights=np.asarray(losses, dtype=float), minlength=NOISE_BINS)
    with np.errstate(invalid="ignore", divide="ignore"):
        return key, np.where(counts > 0, sums / np.maximum(counts, 1), np.nan), counts


def loss_figure(rows: list[dict[str, Any]]) -> Any:
    """The matplotlib figure of loss.png: the loss per step with a moving average; beside it, where the rows hold
    noise levels, the mean loss by noise level for the first and the second half of the logged steps (which part of
    the noise range the run learnt) with the samples drawn per level."""
    # A Figure of its own, not pyplot's: no global figure manager to import, select a backend for, or close.
    from matplotlib.figure import Figure

    steps = np.array([row["step"] for row in rows])
    losses = np.array([row["loss"] for row in rows])
    window = max(1, len(losses) // 20)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    binned = loss_by_noise_level(rows)
    figure = Figure(figsize=(14 if binned else 8, 4.5), dpi=100)
    axes = figure.subplots(1, 2 if binned else 1, squeeze=False)
    axis = axes[0][0]
    axis.plot(steps, losses, color="#9bbbd4", linewidth=0.8, label="loss")
    axis.plot(steps[window - 1 :], smooth, color="#1f4e79", linewidth=2, label=f"mean of {window}")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("loss")
    axis.set_title("Training loss")
    axis.grid(alpha=0.3)
    axis.legend()
    if binned:
        key, _, counts = binned
        axis = axes[0][1]
        centres = (np.arange(NOISE_BINS) + 0.5) / NOISE_BINS
        half = (len(rows) + 1) // 2
        for part, colour, label in ((rows[:half], "#9bbbd4", "first half of the steps"),
                                    (rows[half:], "#1f4e79", "second half of the steps")):
            part_binned = loss_by_noise_level(part)
            if part_binned is not None:
                axis.plot(centres, part_binned[1], "o-", color=colour, linewidth=2, label=label)
        axis.set_xlim(0, 1)
        axis.set_xlabel("noise level (sigma)" if key == "sigmas" else "noise level (timestep / 1000)")
        axis.set_ylabel("mean sample loss")
        axis.set_title("Loss by noise level")
        axis.grid(alpha=0.3)
        axis.legend(loc="upper left")
        drawn = axis.twinx()
        drawn.bar(centres, counts, width=0.8 / NOISE_BINS, color="#d9d9d9", alpha=0.5, zorder=0)
        drawn.set_ylabel("samples drawn")
        axis.set_zorder(drawn.get_zorder() + 1)
        axis.patch.set_visible(False)
    figure.tight_layout()
    return figure


# The PNG text key under which loss.png records a digest of the rows it was drawn from.
ROWS_DIGEST_KEY = "vidtune-rows"


def plot_loss_curve(metrics_path: Path, output: Path) -> Path | None:
    """loss.png from metrics.jsonl (see `loss_figure`); left as it is when it already shows these very rows (the
    run's last checkpoint drew it, and the finished run would draw the same picture again)."""
    if not metrics_path.is_file():
        return None
    # A held-out score's rows have their own picture (eval_loss.png).
    lines = [(text, row) for text, row in metrics_lines(metrics_path) if "loss" in row]
    if not lines:
        return None
    rows = [row for _, row in lines]
    digest = hashlib.sha256("\n".join(text for text, _ in lines).encode("utf-8")).hexdigest()
    if drawn_digest(output) == digest:
        return output
    figure = loss_figure(rows)
    with atomic_path(output) as temporary:
        figure.savefig(temporary, format="png", metadata={ROWS_DIGEST_KEY: digest})
    return output


def drawn_digest(picture: Path) -> str | None:
    """The rows digest a loss.png was drawn with; None when there is no such picture or it holds none (an older
    run's, or one cut short)."""
    from PIL import Image

    try:
        with Image.open(picture) as image:
            return getattr(image, "text", {}).get(ROWS_DIGEST_KEY)
    except (OSError, SyntaxError):  # no file, or not a picture PIL can read: draw it afresh
        return None
