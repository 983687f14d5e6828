"""The memory planner against the measured peak, on the CPU.

For each model and each set of options: `vidtune plan`'s training peak for the CPU (fp32) and the real peak of
allocated tensor memory of two training steps (torch's profiler, `vidtune.memory.measure`), and their ratio.
Models: the tiny model of every family (written to a temporary folder), and with `--real` LTX-Video 2B built
from its released config with random weights (about 10 GB of RAM; at a small clip size).

    python bench/memory.py                  # tiny models, the whole option grid (a few minutes)
    python bench/memory.py --real --only-real --frames 9 --height 128 --width 128
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from vidtune.config import load_config
from vidtune.memory.measure import measure_training
from vidtune.memory.plan import plan_memory
from vidtune.models.registry import available_models
from vidtune.models.tiny import TINY_SHAPES, write_tiny_model

MIB = 1024**2
# Each set of options differs from LoRA / fp32 weights / adamw / no checkpointing in one or two settings.
LORA_GRID = [
    [],
    ["training.gradient_checkpointing=true"],
    ["memory.base_weights=fp8"],
    ["memory.base_weights=int8"],
    ["memory.base_weights=nf4"],
    ["memory.base_weights=int8", "training.gradient_checkpointing=true"],
]
FULL_GRID = [
    ["training.algorithm=full"],
    ["training.algorithm=full", "training.gradient_checkpointing=true"],
    *[["training.algorithm=full", f"optimizer.name={name}"] for name in (
        "adamw8bit", "paged_adamw8bit", "adamw8bit_ao", "adamw4bit_ao", "adamw_fp8_ao", "prodigy", "came",
        "adafactor")],
]
BAND = (0.85, 1.15)


def config_for(family: str, pretrained: str, shape: tuple[int, int, int], options: list[str], rank: int):
    frames, height, width = shape
    return load_config(None, [
        f"model.name={family}", f"model.pretrained={pretrained}", "data.root=.", f"data.frames={frames}",
        f"data.height={height}", f"data.width={width}", "training.device=cpu", "precompute.enabled=true",
        f"lora.rank={rank}", f"lora.alpha={rank}", *options])


def compare(label: str, config) -> tuple[float, float, float]:
    predicted = plan_memory(config).training_peak
    measured = measure_training(config).peak
    ratio = predicted / measured
    flag = "" if BAND[0] <= ratio <= BAND[1] else "   <- outside 0.85-1.15"
    print(f"| {label} | {predicted / MIB:,.2f} | {measured / MIB:,.2f} | {ratio:.3f} |{flag}", flush=True)
    return predicted, measured, ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="*", default=available_models())
    parser.add_argument("--grid", choices=["lora", "full", "all", "default"], default="all")
    parser.add_argument("--real", action="store_true", help="also LTX-Video 2B (real size, random weights)")
    parser.add_argument("--only-real", action="store_true")
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--rank", type=int, default=128)
    args = parser.parse_args()
    grid = {"lora": LORA_GRID, "full": FULL_GRID, "all": LORA_GRID + FULL_GRID, "default": [[]]}[args.grid]
    ratios = []
    started = time.perf_counter()
    print("| model | options | predicted MiB | measured MiB | ratio |\n|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        for family in [] if args.only_real else args.families:
            model = write_tiny_model(family, Path(folder) / family)
            for options in grid:
                label = f"tiny {family} | {' '.join(options) or 'LoRA'}"
                config = config_for(family, str(model), TINY_SHAPES[family], options, args.rank)
                ratios.append(compare(label, config)[2])
        if args.real:
            shape = (args.frames, args.height, args.width)
            for options in grid:
                label = f"LTX-Video 2B {'x'.join(map(str, shape))} | {' '.join(options) or 'LoRA'}"
                config = config_for("ltx-video", "Lightricks/LTX-Video", shape, options, args.rank)
                ratios.append(compare(label, config)[2])
    inside = sum(BAND[0] <= ratio <= BAND[1] for ratio in ratios)
    print(f"\n{inside} of {len(ratios)} within {BAND[0]}-{BAND[1]}; ratios {min(ratios):.3f}-{max(ratios):.3f}; "
          f"{time.perf_counter() - started:.0f} s")
    return 0 if inside == len(ratios) else 1


if __name__ == "__main__":
    sys.exit(main())
