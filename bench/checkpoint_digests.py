"""What the digest manifest costs a checkpoint: writing one with and without `manifest.json`, and checking one
against it (the resume and `vidtune checkpoint verify` path), on checkpoints of a LoRA's size and of a larger one.

Rounds alternate the two writes (and which goes first) on the same tensors (trained weights plus AdamW's two
moments, as a checkpoint holds them); the medians, their ratio, and the check's throughput are printed. One torch
thread, so a busy machine skews both cases alike. The files are read back from the page cache, as right after a
write; a cold check reads at the disk's speed.

    python bench/checkpoint_digests.py [--mib 64 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vidtune import checkpoint as checkpoints
from vidtune.config import build_config
from vidtune.storage import manifest


def state_of(mib: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Weights of `mib` MiB in all (a third the weights, two thirds the optimizer's moments)."""
    elements = (mib << 20) // 4 // 3
    rows = 1024
    weights = {f"layer{i}.weight": torch.randn(rows, elements // rows // 8) for i in range(8)}
    moments = {i: {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(w), "exp_avg_sq": torch.rand_like(w)}
               for i, w in enumerate(weights.values())}
    return weights, {"state": moments, "param_groups": [{"params": list(range(len(weights)))}]}


def timed_save(root: Path, step: int, weights, optimizer, config, with_manifest: bool) -> float:
    real = checkpoints.write_manifest
    if not with_manifest:
        checkpoints.write_manifest = lambda folder, progress=False: None
    try:
        started = time.perf_counter()
        checkpoints.save(root, step=step, weights=weights, optimizer=optimizer, extra={}, config=config, keep=1)
        return time.perf_counter() - started
    finally:
        checkpoints.write_manifest = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = build_config({"model": {"name": "ltx-video", "pretrained": "Lightricks/LTX-Video"},
                           "data": {"root": "."}, "output_dir": "bench-run"})
    print(f"threads for hashing: {manifest.THREADS}")
    for mib in args.mib:
        weights, optimizer = state_of(mib)
        with tempfile.TemporaryDirectory(prefix="vidtune-digests-") as scratch:
            root = Path(scratch)
            plain, digested, checks, step = [], [], [], 0
            for number in range(args.rounds):
                cases = ((False, plain), (True, digested))
                for with_manifest, into in cases if number % 2 == 0 else cases[::-1]:  # neither always second
                    step += 1
                    into.append(timed_save(root, step, weights, optimizer, config, with_manifest))
                folder = checkpoints.latest(root)
                started = time.perf_counter()
                assert checkpoints.verify(folder).intact
                checks.append(time.perf_counter() - started)
            size = sum(path.stat().st_size for path in checkpoints.latest(root).rglob("*") if path.is_file())
            shutil.rmtree(root, ignore_errors=True)
        a, b, c = statistics.median(plain), statistics.median(digested), statistics.median(checks)
        print(f"{size / 2**20:7.0f} MiB checkpoint: write {a:.3f} s without manifest, {b:.3f} s with "
              f"(x{b / a:.2f}); check {c:.3f} s ({size / 2**20 / c:.0f} MiB/s)")


if __name__ == "__main__":
    main()
