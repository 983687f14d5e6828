"""fp8 base weights against bf16 ones: the measured and the planned peak of a real-size LTX-Video 2B LoRA step.

LTX-Video 2B is built from its released config with random weights in bf16 (about 4 GB), and trained two LoRA
steps on the CPU at a small clip size, with and without gradient checkpointing: the frozen weights in bf16, in
float8 as vidtune stores them (`Float8StorageLinear`, whose backward pass keeps the float8 weight), and in float8
through diffusers' layerwise casting on every layer (how fp8 was stored before: autograd keeps each layer's upcast
copy until the backward pass). The peak is the CPU allocator's (torch's profiler, `vidtune.memory.measure`), of the
training steps alone; the plan is `vidtune plan`'s training peak for the same config. Each case runs in a process
of its own, one after another (the largest needs about 8 GB of RAM).

    python bench/fp8_memory.py --frames 9 --height 64 --width 64
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time

GIB = 1024**3
CASES = {
    "bf16": [],
    "fp8": ["memory.base_weights=fp8"],
    "fp8, layerwise casting (before)": ["memory.base_weights=fp8"],
}


def config_for(options: list[str], shape: tuple[int, int, int], rank: int, checkpointing: bool):
    from vidtune.config import load_config

    frames, height, width = shape
    return load_config(None, [
        "model.name=ltx-video", "model.pretrained=Lightricks/LTX-Video", "model.dtype=bfloat16", "data.root=.",
        f"data.frames={frames}", f"data.height={height}", f"data.width={width}", "training.device=cpu",
        "training.precision=bf16", "precompute.enabled=true", f"lora.rank={rank}", f"lora.alpha={rank}",
        f"training.gradient_checkpointing={str(checkpointing).lower()}", *options])


@contextlib.contextmanager
def built_in(dtype):
    """Random weights made in `dtype` directly (not fp32 and then cast): half the RAM while the model is built."""
    import torch

    from vidtune.memory import meta

    original = meta.build_from_config

    def build(cls, folder, wanted, where=meta.META):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            return original(cls, folder, wanted, where)
        finally:
            torch.set_default_dtype(previous)

    meta.build_from_config = build
    try:
        yield
    finally:
        meta.build_from_config = original


@contextlib.contextmanager
def layerwise_casting():
    """fp8 as diffusers' layerwise casting stores it on every layer it casts (the former way)."""
    import torch

    import vidtune.memory as memory

    original = memory.store_frozen_weights_in_fp8

    def store(denoiser, keep=()):
        patterns = tuple(denoiser._skip_layerwise_casting_patterns or ()) + tuple(keep)
        denoiser.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=denoiser.dtype,
                                          skip_modules_pattern=patterns)

    memory.store_frozen_weights_in_fp8 = store
    try:
        yield
    finally:
        memory.store_frozen_weights_in_fp8 = original


def run_case(case: str, shape: tuple[int, int, int], rank: int, checkpointing: bool) -> dict:
    import torch

    from vidtune.memory.measure import measure_training
    from vidtune.memory.plan import plan_memory

    torch.manual_seed(0)
    config = config_for(CASES[case], shape, rank, checkpointing)
    planned = plan_memory(config).training_peak if case in ("bf16", "fp8") else None
    started = time.perf_counter()
    with built_in(torch.bfloat16), layerwise_casting() if "layerwise" in case else contextlib.nullcontext():
        measured = measure_training(config)
    return {"case": case, "checkpointing": checkpointing, "measured": measured.peak, "setup": measured.setup,
            "planned": planned, "seconds": time.perf_counter() - started}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--rank", type=int, default=128)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in this process
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.frames, args.height, args.width)
    if args.case:
        print(json.dumps(run_case(args.case, shape, args.rank, args.checkpointing)))
        return 0
    rows = []
    for checkpointing in (False, True):
        for case in CASES:
            command = [sys.executable, __file__, "--case", case, "--frames", str(args.frames), "--height",
                       str(args.height), "--width", str(args.width), "--rank", str(args.rank),
                       *(["--checkpointing"] if checkpointing else [])]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return done.returncode
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{case}, checkpointing={checkpointing}: measured {rows[-1]['measured'] / GIB:.2f} GiB "
                  f"({rows[-1]['seconds']:.0f} s)", file=sys.stderr, flush=True)
    size = "x".join(map(str, shape))
    print(f"LTX-Video 2B (random weights, bf16), LoRA r{args.rank}, {size}, two steps on the CPU\n")
    print("| base weights | gradient checkpointing | measured peak GiB | / bf16 | planned GiB |")
    print("|---|---|---:|---:|---:|")
    for row in rows:
        bf16 = next(r["measured"] for r in rows if r["case"] == "bf16" and r["checkpointing"] == row["checkpointing"])
        planned = "" if row["planned"] is None else f"{row['planned'] / GIB:.2f}"
        print(f"| {row['case']} | {'on' if row['checkpointing'] else 'off'} | {row['measured'] / GIB:.2f} | "
              f"{row['measured'] / bf16:.2f} | {planned} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
