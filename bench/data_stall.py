"""How long a training step waits for its data, as a fraction of the step: from the cache and on the fly.

A tiny CogVideoX LoRA (9x32x32 clips decoded from 49-frame 256x256 mp4s) trains with the real trainer, whose
batch stream is timed: the time `next(stream)` takes inside a step is the time the step waited for data (a
read from the cache, or decoding and encoding on the fly). Runs, in one process, rounds alternating between
them, each measured over the steps after the first epoch (what every later epoch costs):

- cached: `precompute.enabled: true` (entries kept in memory after their first read; on a GPU, a thread reads
  ahead); and the same with the read-ahead thread on the CPU too;
- on the fly with the defaults: decoded windows and encoder outputs kept (`data.frame_store_mib`,
  `data.encoded_store_mib`);
- on the fly keeping decoded windows only (`data.encoded_store_mib: 0`);
- on the fly keeping nothing (both 0: the behaviour before the stores).

The stall is the waits' sum over the steps' sum (and, less sensitive to a loaded machine's outliers, the median
wait over the median step); ratios compare median step times with the cached run's.

    python bench/data_stall.py [--clips 8] [--epochs 6] [--workers 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from vidtune.batches import Batch
from vidtune.config import build_config
from vidtune.data.synthetic import render_shapes_dataset
from vidtune.models.tiny import write_tiny_model
from vidtune.trainers import build_trainer
from vidtune.training import setup

FRAMES, SIZE = 9, 32


def timed_run(config, read_ahead: int | None = None) -> list[float]:
    """The real LoRA trainer's run of `config`; returns the time each step waited for its batch."""
    waits: list[float] = []

    def open_source(*args, **kwargs):
        source = setup.open_batch_source(*args, **kwargs)
        if read_ahead is not None:
            source.read_ahead = read_ahead
        return source

    def batch_stream(*args, **kwargs) -> Iterator[Batch]:
        stream = setup.batch_stream(*args, **kwargs)
        while True:
            started = time.perf_counter()
            batch = next(stream)
            waits.append(time.perf_counter() - started)
            yield batch

    with mock.patch.object(setup, "open_batch_source", open_source), \
            mock.patch.object(setup, "batch_stream", batch_stream):
        build_trainer(config).run()
    return waits


def run(model: Path, data: Path, output: Path, steps: int, workers: int, **data_options) -> tuple[list, list]:
    precompute = data_options.pop("precompute", False)
    read_ahead = data_options.pop("read_ahead", None)
    config = build_config({
        "model": {"name": "cogvideox", "pretrained": str(model)},
        "data": {"root": str(data), "frames": FRAMES, "height": SIZE, "width": SIZE, "num_workers": workers,
                 "frame_sampling": "start", **data_options},
        "precompute": {"enabled": precompute, "cache_dir": str(output.parent / "cache")},
        "training": {"steps": steps, "batch_size": 1, "learning_rate": 1e-4, "precision": "fp32", "device": "cpu"},
        "checkpoint": {"every": 0, "keep": 1},
        "validation": {"enabled": False},
        "logging": {"progress": False},
        "output_dir": str(output),
    })
    waits = timed_run(config, read_ahead)
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return waits, [row["seconds_per_step"] for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="run only the runs whose name contains one of these words")
    args = parser.parse_args()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="vidtune-bench-stall-"))
    model = write_tiny_model("cogvideox", work / "model")
    data = render_shapes_dataset(work / "data", num_clips=args.clips, num_frames=49, height=256, width=256)
    steps = args.clips * args.epochs
    runs = {
        "cached": {"precompute": True},
        "cached, read ahead by a thread": {"precompute": True, "read_ahead": 2},
        "on the fly (defaults)": {},
        "on the fly, frames kept only": {"encoded_store_mib": 0},
        "on the fly, nothing kept": {"frame_store_mib": 0, "encoded_store_mib": 0},
    }
    if args.only:
        runs = {name: options for name, options in runs.items() if any(word in name for word in args.only)}
    waits: dict[str, list[float]] = {name: [] for name in runs}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(args.rounds):
        for name, options in runs.items():
            folder = name.replace(" ", "-").replace(",", "").replace("(", "").replace(")", "")
            run_waits, run_seconds = run(model, data, work / f"{folder}-{round_index}", steps, args.workers,
                                         **dict(options))
            later = slice(args.clips, None)  # after the first epoch
            waits[name] += run_waits[later]
            seconds[name] += run_seconds[later]
    results = {name: (statistics.median(waits[name]), statistics.median(seconds[name]),
                      sum(waits[name]) / sum(seconds[name])) for name in runs}
    cached_step = results["cached"][1] if "cached" in results else float("nan")
    print(f"tiny CogVideoX LoRA, {FRAMES}x{SIZE}x{SIZE}, {args.clips} clips, {steps} steps, "
          f"data.num_workers={args.workers}, torch threads {torch.get_num_threads()}, {args.rounds} rounds; "
          "after epoch 1")
    print(f"{'run':34s} {'wait ms':>8s} {'step ms':>8s} {'stall':>7s} {'median':>7s} {'step / cached':>14s}")
    for name, (wait, step, stall) in results.items():
        print(f"{name:34s} {wait * 1000:8.2f} {step * 1000:8.1f} {stall:7.1%} {wait / step:7.1%} "
              f"{step / cached_step:14.2f}")


if __name__ == "__main__":
    main()
