"""Precompute against the alternatives, on the same clips, in one run.

1. Throughput (clips/s, model loading included) of `precompute` against a naive sequential loop (decode one
   clip, encode its caption, encode it, write, next) and against a sequential loop with the same batch size
   as precompute (so the gain of overlapping decode, text and VAE work shows apart from batching).
2. Reading one sample from the cache against one training step.
3. Step time trained from the cache against on the fly (decode + text encoder + VAE in every step).
4. Peak RSS of a training run from a warm cache against on the fly, each in its own process.

A fresh tiny LTX-Video model (with a wider text encoder than the test one) is written into a temp folder.

    python bench/precompute.py [--clips 12] [--frames 17] [--size 96] [--steps 4] [--rounds 3]
                               [--step-rounds 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from vidtune.config import build_config, load_config
from vidtune.data.sources import load_dataset
from vidtune.data.synthetic import render_shapes_dataset
from vidtune.data.video import ClipWindow, read_clip
from vidtune.models.tiny import write_tiny_ltx_video
from vidtune.precompute import CachedClips, CacheStore, precompute
from vidtune.precompute.encode import build_spec, split_items
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")


def make_config(model: Path, root: Path, work: Path, name: str, args: argparse.Namespace, **extra) -> dict:
    config = {
        "model": {"name": "ltx-video", "pretrained": str(model)},
        "data": {"root": str(root), "frames": args.frames, "height": args.size, "width": args.size,
                 "num_workers": 0},
        "training": {"steps": args.steps, "batch_size": 1, "learning_rate": 1e-4, "precision": "fp32",
                     "device": "cpu", "seed": 0},
        "checkpoint": {"every": 0, "keep": 1},
        "validation": {"enabled": False},
        "logging": {"progress": False},
        "precompute": {"cache_dir": str(work / f"cache-{name}"), "batch_size": args.batch_size},
        "output_dir": str(work / f"run-{name}"),
    }
    for section, values in extra.items():
        config[section] = {**config.get(section, {}), **values}
    return config


def sequential_loop(config_dict: dict, batch_size: int) -> float:
    """Decode a batch, encode its captions, encode its clips, write, next: nothing overlaps."""
    config = build_config(config_dict)
    started = time.perf_counter()
    spec = build_spec(config)
    samples = load_dataset(config.data, progress=False)
    store = CacheStore(config.precompute.cache_dir)
    text, vae = spec.load_text_components(CPU), spec.load_vae(CPU)
    data = config.data
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        videos = torch.stack([read_clip(s.video, ClipWindow(data.frames, data.height, data.width)) for s in chunk])
        conditions = split_items(spec.prepare_conditions(text, [s.caption for s in chunk]), len(chunk))
        latents = split_items(spec.prepare_latents(vae, videos), len(chunk))
        for number, sample in enumerate(chunk):
            store.write("conditions", f"{sample.index:064x}", conditions[number])
            store.write("latents", f"{sample.index:064x}", latents[number])
    return time.perf_counter() - started


def timed_precompute(config_dict: dict) -> float:
    config = build_config(config_dict)
    started = time.perf_counter()
    summary = precompute(config, progress=False)
    seconds = time.perf_counter() - started
    assert summary.latents_reused == 0 and summary.conditions_reused == 0, "the cache was not cold"
    return seconds


def step_times(config_dict: dict) -> list[float]:
    build_trainer(build_config(config_dict)).run()
    rows = [json.loads(line) for line in Path(config_dict["output_dir"], "metrics.jsonl").read_text().splitlines()]
    return [row["seconds_per_step"] for row in rows[1:]]  # the first step warms up


def read_time_per_sample(config_dict: dict, rounds: int = 5) -> float:
    config = build_config(config_dict)
    summary = precompute(config, progress=False)
    samples = load_dataset(config.data, progress=False)
    dataset = CachedClips(config, build_spec(config), summary.plan, samples)
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for index in range(len(dataset)):
            dataset[index]
        times.append((time.perf_counter() - started) / len(dataset))
    return statistics.median(times)


def peak_rss_mb(config_path: Path, *overrides: str) -> float:
    """Peak RSS of `build_trainer(config).run()` in a fresh process.

    Read from /proc/self/status (VmHWM), not getrusage: Linux carries ru_maxrss over fork + exec, so a child
    of this (large) process would report at least this process's RSS.
    """
    code = (
        "import re, sys; from vidtune.config import load_config; from vidtune.trainers import build_trainer; "
        "build_trainer(load_config(sys.argv[1], sys.argv[2:])).run(); "
        "print(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))"
    )
    result = subprocess.run([sys.executable, "-c", code, str(config_path), *overrides], capture_output=True,
                            text=True, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return int(result.stdout.strip().splitlines()[-1]) / 1024


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=12)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the throughput comparison")
    parser.add_argument("--step-rounds", type=int, default=2, help="training runs per mode")
    # 1 by default: on a shared, oversubscribed CPU, 2 intra-op threads make timings swing by 5x (spinning).
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the step and main throughput runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    began = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="vidtune-bench-") as folder:
        work = Path(folder)
        model = write_tiny_ltx_video(work / "model", text_hidden=256)
        data = render_shapes_dataset(work / "data", num_clips=args.clips, num_frames=49, height=160, width=160,
                                     fps=24, seed=0)
        clips = args.clips

        # 1. throughput, cold caches. Rounds alternate to spread the drift of a shared machine, and the fastest
        # round counts. With 1 torch thread and with the default: on an oversubscribed CPU, intra-op threads
        # can cost more than they give.
        naive = [sequential_loop(make_config(model, data, work, "naive", args), 1)]
        batched: dict[int, list[float]] = {}
        ours: dict[int, list[float]] = {}
        for round_ in range(args.rounds):
            for threads in sorted({1, 2, args.threads}):
                torch.set_num_threads(threads)
                name = f"{threads}-{round_}"
                batched.setdefault(threads, []).append(
                    sequential_loop(make_config(model, data, work, f"seq{name}", args), args.batch_size))
                ours.setdefault(threads, []).append(timed_precompute(make_config(
                    model, data, work, f"pre{name}", args, data={"num_workers": args.threads})))
        torch.set_num_threads(args.threads)
        naive_s = naive[0]
        warm = f"pre{args.threads}-0"

        # 2. + 3. steps from the (warm) cache and on the fly, alternating runs; reads from the cache
        cached_steps, live_steps = [], []
        for round_ in range(args.step_rounds):
            cached = make_config(model, data, work, warm, args, precompute={"enabled": True})
            cached["output_dir"] = str(work / f"run-cached{round_}")
            cached_steps += step_times(cached)
            live_steps += step_times(make_config(model, data, work, f"live{round_}", args))
        read_s = read_time_per_sample(cached)
        cached_step, live_step = statistics.median(cached_steps), statistics.median(live_steps)

        # 4. peak RSS, one process per mode (the cache is warm: no encoder is ever loaded)
        config_path = work / "rss.json"
        config_path.write_text(json.dumps(make_config(model, data, work, warm, args)))
        load_config(config_path)  # check it
        rss_live = peak_rss_mb(config_path, f"output_dir={work / 'rss-live'}", "training.steps=3")
        rss_cached = peak_rss_mb(config_path, f"output_dir={work / 'rss-cached'}", "training.steps=3",
                                 "precompute.enabled=true")
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    print(f"clips: {clips} x {args.frames} frames at {args.size}x{args.size} (decoded from 49 frames of 160x160 mp4), "
          f"batch {args.batch_size}, {args.threads} torch threads, {os.cpu_count()} cores")
    print(f"naive loop (decode, encode, write one clip at a time): {naive_s:.2f} s = {clips / naive_s:.2f} clips/s")
    for threads in sorted(ours):
        pre, seq = min(ours[threads]), min(batched[threads])
        print(f"torch threads {threads}: precompute {clips / pre:.2f} clips/s (rounds {_fmt(ours[threads])} s); "
              f"sequential loop, batch {args.batch_size}: {clips / seq:.2f} clips/s "
              f"(rounds {_fmt(batched[threads])} s)")
        print(f"  ratio precompute / naive throughput: {naive_s / pre:.2f}x; "
              f"precompute / sequential batched: {seq / pre:.2f}x")
    print(f"cache read per sample: {read_s * 1000:.2f} ms; training step from the cache: {cached_step * 1000:.0f} ms")
    print(f"ratio step / cache read: {cached_step / read_s:.0f}x")
    print(f"step on the fly: {live_step * 1000:.0f} ms; from the cache: {cached_step * 1000:.0f} ms "
          f"(medians of {len(live_steps)} and {len(cached_steps)} steps)")
    print(f"ratio step on the fly / from the cache: {live_step / cached_step:.2f}x")
    print(f"peak RSS on the fly: {rss_live:.0f} MiB; from the cache: {rss_cached:.0f} MiB "
          f"({rss_live - rss_cached:.0f} MiB less, ratio {rss_live / rss_cached:.2f}x)")
    print(f"(this process peaked at {own:.0f} MiB; the whole benchmark took {time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
