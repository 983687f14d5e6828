"""The run's metrics: `metrics.jsonl` (one JSON object per logged step) and its picture, `loss.png`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from vidtune import parallel
from vidtune.files import atomic_path, atomic_write_text
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
               samples: int, compile_seconds: float = 0.0) -> None:
        """One logged step; `samples`: how many samples all ranks took in it; `compile_seconds`: the time
        torch.compile took during the step (not part of `seconds`)."""
        if parallel.is_main():
            row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "seconds_per_step": seconds}
            if compile_seconds > 0:
                row["compile_seconds"] = compile_seconds
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")
        for tracker in self.trackers:
            tracker.log_metrics(step, step_values(loss, lr, grad_norm, seconds, samples))
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


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the rows of metrics.jsonl up to `step` (rows a killed run wrote after its checkpoint go)."""
    if not path.is_file():
        return
    kept = []
    for text in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(text)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(text)
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def plot_loss_curve(metrics_path: Path, output: Path) -> Path | None:
    """loss.png: raw loss per step and a moving average, from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not metrics_path.is_file():
        return None
    rows = [json.loads(line) for line in metrics_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [row for row in rows if "loss" in row]  # a held-out score's rows have their own picture (eval_loss.png)
    if not rows:
        return None
    steps = np.array([row["step"] for row in rows])
    losses = np.array([row["loss"] for row in rows])
    window = max(1, len(losses) // 20)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    figure, axis = plt.subplots(figsize=(8, 4.5), dpi=100)
    axis.plot(steps, losses, color="#9bbbd4", linewidth=0.8, label="loss")
    axis.plot(steps[window - 1 :], smooth, color="#1f4e79", linewidth=2, label=f"mean of {window}")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("loss")
    axis.set_title("Training loss")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    with atomic_path(output) as temporary:
        figure.savefig(temporary, format="png")
    plt.close(figure)
    return output
