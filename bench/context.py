"""Context parallelism on CPU (gloo): seconds per step and bytes moved per step against the tokens each rank holds.

The tiny LTX-Video model trains LoRA on one clip shape three ways, with the same batch: in one process (every
token on one rank), and in two processes that split each sample's tokens (`parallel.context.ulysses=2`, then
`parallel.context.ring=2`). Per run it reports the tokens of a sample on one rank (counted at the first block's
input), the median seconds of the steps after the first, and the bytes of every collective the split issues in one
step, counted on rank 0 as they are issued: diffusers' functional collectives (Ulysses' all-to-alls, ring's key /
value all-gather and gradient permutes, the output gather) and the caption gather of the cross-attention
(vidtune/parallel/context_attention.py). DDP's gradient all-reduce (the same for every split: the trained weights'
size) is left out. A "byte" is the size of what a rank puts into a collective (an all-to-all sends (N-1)/N of it, an
all-gather sends it to N-1 ranks); ratios are against the one-process run of the same invocation.

    OMP_NUM_THREADS=1 python bench/context.py [--steps 6] [--frames 33] [--size 96] [--device cpu|cuda]

`--device cuda` runs the same three on GPUs 0 and 1 with NCCL in bf16 (bench/gpu/run.py's `context` section).

On a shared or small CPU the timings are noisy (two processes compete for cores with everything else); the byte
counts are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
from collections import Counter
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

from vidtune import parallel
from vidtune.config import build_config
from vidtune.data.synthetic import render_shapes_dataset
from vidtune.models.tiny import write_tiny_model
from vidtune.trainers import build_trainer

SPLITS = {"one process": None, "ulysses 2": {"ulysses": 2}, "ring 2": {"ring": 2}}
COUNTED = ("all_to_all_single", "all_gather_tensor", "all_gather_tensor_autograd", "permute_tensor")


def _free_port() -> int:
    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        return handle.getsockname()[1]


def _count_collectives(traffic: Counter) -> None:
    """Every functional collective adds its input's bytes to `traffic` (diffusers calls them through the module);
    one called inside another (`permute_tensor` is an all-to-all) counts once, as the outer one."""
    inside: list[str] = []
    for name in COUNTED:
        original = getattr(funcol, name)

        def counted(tensor, *args, _original=original, _name=name, **kwargs):
            if not inside:
                traffic[_name] += tensor.numel() * tensor.element_size()
            inside.append(_name)
            try:
                return _original(tensor, *args, **kwargs)
            finally:
                inside.pop()

        setattr(funcol, name, counted)


def _run(rank: int, world: int, settings: dict, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    parallel.TIMEOUT = timedelta(minutes=10)
    traffic: Counter = Counter()
    _count_collectives(traffic)
    trainer = build_trainer(build_config(settings))
    tokens: list[int] = []
    configure = trainer.part.configure

    def first_block_input(module, args, kwargs) -> None:
        if not tokens:
            tokens.append(int(kwargs["hidden_states"].shape[1]))

    def recording(denoiser, *args, **kwargs):
        denoiser.transformer_blocks[0].register_forward_pre_hook(first_block_input, with_kwargs=True)
        return configure(denoiser, *args, **kwargs)

    trainer.part.configure = recording
    trainer.run()
    if rank == 0:
        rows = [json.loads(line) for line in (Path(settings["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
        seconds = [row["seconds_per_step"] for row in rows if "seconds_per_step" in row][1:]
        steps = settings["training"]["steps"]
        Path(out).write_text(json.dumps({"tokens_per_rank": tokens[0], "seconds_per_step": statistics.median(seconds),
                                         "bytes_per_step": {k: v // steps for k, v in traffic.items()}}))


def measure(steps: int, frames: int, size: int, device: str = "cpu") -> dict[str, dict]:
    """Each run of `SPLITS`: tokens per rank, median seconds per step, bytes per collective kind per step."""
    root = Path(tempfile.mkdtemp(prefix="vidtune-bench-context-"))
    model = write_tiny_model("ltx-video", root / "model")
    data = render_shapes_dataset(root / "data", num_clips=2, num_frames=frames, height=size, width=size, fps=24,
                                 seed=0)
    results = {}
    for name, split in SPLITS.items():
        settings = {
            "model": {"name": "ltx-video", "pretrained": str(model)},
            "data": {"root": str(data), "frames": frames, "height": size, "width": size, "num_workers": 0,
                     "frame_sampling": "start"},
            "training": {"steps": steps, "batch_size": 1, "precision": "fp32" if device == "cpu" else "bf16",
                         "device": device, "seed": 0},
            "checkpoint": {"every": 0}, "validation": {"enabled": False}, "logging": {"progress": False},
            "output_dir": str(root / name.replace(" ", "-")),
        }
        world = 1 if split is None else 2
        if split is not None:
            settings["parallel"] = {"context": split}
        out = root / f"{name.replace(' ', '-')}.json"
        mp.spawn(_run, args=(world, settings, _free_port(), str(out)), nprocs=world, join=True)
        results[name] = json.loads(out.read_text())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--size", type=int, default=96, help="height and width of the clip")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    results = measure(args.steps, args.frames, args.size, args.device)
    base = results["one process"]
    print(f"{'run':<12} {'tokens/rank':>11} {'s/step':>8} {'x one':>6} {'MiB/step':>9}  collectives (MiB)")
    for name, result in results.items():
        moved = result["bytes_per_step"]
        kinds = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(moved.items())) or "-"
        print(f"{name:<12} {result['tokens_per_rank']:>11} {result['seconds_per_step']:>8.3f} "
              f"{result['seconds_per_step'] / base['seconds_per_step']:>6.2f} {sum(moved.values()) / 2**20:>9.2f}  "
              f"{kinds}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
