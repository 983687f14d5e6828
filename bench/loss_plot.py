"""What loss.png costs a run: drawing it from metrics.jsonl against finding it already drawn from the same rows
(the finished run after its last checkpoint), and a short tiny LoRA run with the time its loss.png calls took.

Rounds alternate the two cases on one metrics file (`--rows` logged steps with noise levels, as a run logs them);
the medians and their ratio are printed. Then a `--steps`-step LoRA run of the tiny LTX-Video model (checkpoint
only at the end) reports its wall time, how many times loss.png was drawn and the seconds spent drawing.

    python bench/loss_plot.py [--rows 300] [--rounds 5] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from vidtune import metrics


def write_rows(path: Path, rows: int) -> None:
    draw = random.Random(0)
    lines = []
    for step in range(1, rows + 1):
        sigmas = [draw.random() for _ in range(2)]
        lines.append(json.dumps({"step": step, "loss": 1.0 / step ** 0.3, "sigmas": sigmas,
                                 "sample_losses": [0.5 * s for s in sigmas]}))
    path.write_text("\n".join(lines) + "\n")


def drawing_against_finding(work: Path, rows: int, rounds: int) -> None:
    log, picture = work / "metrics.jsonl", work / "loss.png"
    write_rows(log, rows)
    metrics.plot_loss_curve(log, picture)  # matplotlib imported and warmed up outside the timings
    drawn, found = [], []
    for _ in range(rounds):
        picture.unlink()
        started = time.perf_counter()
        metrics.plot_loss_curve(log, picture)
        drawn.append(time.perf_counter() - started)
        started = time.perf_counter()
        metrics.plot_loss_curve(log, picture)
        found.append(time.perf_counter() - started)
    draw_ms, find_ms = 1000 * statistics.median(drawn), 1000 * statistics.median(found)
    print(f"loss.png from {rows} rows, median of {rounds} rounds: drawn {draw_ms:.1f} ms, found up to date "
          f"{find_ms:.1f} ms (ratio {find_ms / draw_ms:.3f})")


def tiny_run(work: Path, steps: int) -> None:
    from vidtune.config import build_config
    from vidtune.data.synthetic import render_shapes_dataset
    from vidtune.models.tiny import TINY_SHAPES, write_tiny_model
    from vidtune.trainers import build_trainer
    from vidtune.training import loop, validation

    model = write_tiny_model("ltx-video", work / "model")
    data = render_shapes_dataset(work / "data", num_clips=4, num_frames=33, height=48, width=48, fps=24, seed=0)
    frames, height, width = TINY_SHAPES["ltx-video"]
    config = build_config({
        "model": {"name": "ltx-video", "pretrained": str(model)},
        "data": {"root": str(data), "frames": frames, "height": height, "width": width, "num_workers": 0},
        "training": {"steps": steps, "seed": 0, "precision": "fp32", "device": "cpu"},
        "validation": {"enabled": False}, "logging": {"progress": False}, "output_dir": str(work / "run")})
    spent, draws = [0.0], [0]
    original_plot, original_figure = metrics.plot_loss_curve, metrics.loss_figure

    def timed_plot(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original_plot(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started

    def counted_figure(rows):
        draws[0] += 1
        return original_figure(rows)

    loop.plot_loss_curve = validation.plot_loss_curve = timed_plot
    metrics.loss_figure = counted_figure
    started = time.perf_counter()
    build_trainer(config).run()
    total = time.perf_counter() - started
    print(f"tiny LoRA run, {steps} steps: {total:.2f} s, loss.png drawn {draws[0]} time(s), {spent[0]:.2f} s in "
          f"plot_loss_curve (the first draw imports matplotlib) = {spent[0] / total:.0%} of the run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        tiny_run(work, args.steps)
        drawing_against_finding(work, args.rows, args.rounds)


if __name__ == "__main__":
    main()
