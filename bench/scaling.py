"""Samples per second at 1 and 2 processes per strategy, as a ratio to ideal, and the communication of one step.

Each strategy (DDP, FSDP, DeepSpeed ZeRO 2 and 3) trains the tiny LTX-Video model (LoRA and full fine-tuning) on
CPU with gloo: once in one process, once in two processes with the same batch per process. The ratio to ideal is
`samples/s at 2 / (2 x samples/s at 1)` (1.0: perfect scaling). The bytes every collective of one steady-state step
moves are counted on rank 0 as they are issued through torch.distributed's Python API: FSDP's all-gathers and
reduce-scatters, DeepSpeed's (its communication backend calls the same functions: ZeRO's gradient reductions, ZeRO-3's
weight gathers), the trainer's loss all-reduce, and DDP's gradient buckets (sent through DDP's default
communication hook, which calls that API, instead of DDP's C++ path).
A "byte" here is the size of a collective's whole buffer (the gathered output, the reduce-scattered input, the
all-reduced tensor); a ring algorithm sends (N-1)/N of it per rank.

    python bench/scaling.py [--steps 8] [--algorithms lora full] [--strategies ddp fsdp deepspeed-zero2 deepspeed-zero3]

`deepspeed-zeroN` is parallel.strategy=deepspeed with parallel.zero_stage=N.

On a shared or small CPU the timings are noisy (two processes compete for cores with everything else); the byte
counts are exact.
"""

from __future__ import annotations

import argparse
import functools
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
import torch.distributed as dist
import torch.multiprocessing as mp

from vidtune import parallel
from vidtune.config import build_config
from vidtune.data.synthetic import render_shapes_dataset
from vidtune.models.tiny import TINY_SHAPES, write_tiny_model
from vidtune.parallel.ddp import DataParallelStrategy
from vidtune.trainers import build_trainer
from vidtune.training import loop

# The step whose collectives are counted: past the first (which also checks every parameter gets a gradient).
COUNTED_STEP = 3
COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
               "reduce_scatter_tensor", "broadcast", "all_gather", "reduce_scatter", "reduce",
               "all_reduce_coalesced")
# --strategies values -> the `parallel` section they stand for.
STRATEGIES = {
    "ddp": {"strategy": "ddp"},
    "fsdp": {"strategy": "fsdp"},
    "deepspeed-zero2": {"strategy": "deepspeed", "zero_stage": 2},
    "deepspeed-zero3": {"strategy": "deepspeed", "zero_stage": 3},
}
# ZeRO-3 keeps a parameter of fewer than `stage3_param_persistence_threshold` elements (1e5 by default) whole on
# every rank, and keeps gathered weights alive between forward and backward up to `stage3_max_live_parameters` (1e9
# elements). Every weight of the tiny model is under the first and the whole model under the second; a 13-14 B
# model is far over both, so most of its weights are gathered in the forward, released, and gathered again in the
# backward. The bench sets both (and the reuse and prefetch settings) to 0, a DeepSpeed JSON override, so that the
# tiny model's bytes are those of that regime.
ZERO3_PARTITION_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
                                             "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}}


class Traffic:
    """Bytes per collective kind, counted while `active`."""

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.active = False

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        if self.active:
            self.bytes[kind] += tensor.numel() * tensor.element_size()


def _buffer_of(kind: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The collective's whole buffer: the gathered output, the reduce-scattered input, else the tensor."""
    if kind in ("all_gather_into_tensor", "all_gather_single"):  # (output, input): the gathered output
        return args[0] if args else kwargs.get("output_tensor", kwargs.get("output"))
    if kind in ("reduce_scatter_tensor", "reduce_scatter_single"):  # (output, input): the whole input
        return args[1] if len(args) > 1 else kwargs.get("input")
    if kind in ("all_gather", "reduce_scatter", "all_reduce_coalesced"):
        tensors = args[0] if args else []
        return torch.cat([t.flatten() for t in tensors]) if tensors else None
    return args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("tensor")


def count_collectives(traffic: Traffic) -> None:
    """Wrap torch.distributed's collectives (FSDP2 calls them through the module; DeepSpeed's backend keeps the
    functions it finds when it starts, which is after this) to count their bytes."""
    for kind in COLLECTIVES:
        original = getattr(dist, kind, None)
        if original is None:  # a name this torch does not have
            continue

        @functools.wraps(original)
        def counted(*args, _kind=kind, _original=original, **kwargs):
            buffer = _buffer_of(_kind, args, kwargs)
            if buffer is not None:
                traffic.add(_kind, buffer)
            return _original(*args, **kwargs)

        setattr(dist, kind, counted)


def route_ddp_through_python() -> None:
    """DDP all-reduces its gradient buckets in C++; with DDP's own default communication hook registered, each
    bucket goes through torch.distributed.all_reduce instead, where `count_collectives` sees it."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    wrap = DataParallelStrategy.wrap

    def wrapped(self, module, parameters, optimizer):
        wrapped_module = wrap(self, module, parameters, optimizer)
        if isinstance(wrapped_module, torch.nn.parallel.DistributedDataParallel):
            wrapped_module.register_comm_hook(None, allreduce_hook)
        return wrapped_module

    DataParallelStrategy.wrap = wrapped


def run_rank(rank: int, world: int, config: dict, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    parallel.TIMEOUT = timedelta(minutes=5)
    traffic = Traffic()
    count_collectives(traffic)
    route_ddp_through_python()
    trainer = build_trainer(build_config(config))
    step_outcome = loop.train_step

    def counted_step(context, *args, **kwargs):
        traffic.active = context.state.step + 1 == COUNTED_STEP
        try:
            return step_outcome(context, *args, **kwargs)
        finally:
            traffic.active = False

    loop.train_step = counted_step
    trainer.run()
    if rank == 0:
        rows = [json.loads(line) for line in (Path(config["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
        seconds = statistics.median(row["seconds_per_step"] for row in rows[2:])  # past the warm-up steps
        parameters = list(trainer.context.denoiser.parameters())
        sizes = {"weights": sum(_numel(p) * p.element_size() for p in parameters),
                 "trainable": sum(_numel(p) * p.element_size() for p in parameters if p.requires_grad)}
        Path(out).write_text(json.dumps({"seconds_per_step": seconds, "bytes": dict(traffic.bytes), **sizes}))


def _numel(parameter: torch.nn.Parameter) -> int:
    """The whole parameter's size (ZeRO-3 leaves an empty placeholder where its shard was gathered from)."""
    return int(getattr(parameter, "ds_numel", parameter.numel()))


def measure(config: dict, world: int, folder: Path) -> dict:
    out = folder / "result.json"
    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        port = handle.getsockname()[1]
    mp.spawn(run_rank, args=(world, config, port, str(out)), nprocs=world, join=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--algorithms", nargs="+", default=["lora", "full"])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES),
                        help="parallel.strategy, deepspeed-zeroN: deepspeed with parallel.zero_stage=N")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="vidtune-scaling-"))
    model = write_tiny_model("ltx-video", root / "model")
    data = render_shapes_dataset(root / "data", num_clips=8, num_frames=33, height=48, width=48, fps=24, seed=0)
    frames, height, width = TINY_SHAPES["ltx-video"]
    print("| algorithm | strategy | samples/s, 1 process | samples/s, 2 processes | ratio to ideal | "
          "collective bytes per step (2 processes, rank 0) | weights / trainable (fp32) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for algorithm in args.algorithms:
        for strategy in args.strategies:
            rates, traffic, sizes = {}, {}, {}
            settings = dict(STRATEGIES[strategy])
            if settings.get("zero_stage") == 3:
                override = root / "zero3.json"
                override.write_text(json.dumps(ZERO3_PARTITION_ALL))
                settings["deepspeed_config"] = str(override)
            for world in (1, 2):
                run = root / f"{algorithm}-{strategy}-{world}"
                config = {
                    "model": {"name": "ltx-video", "pretrained": str(model)},
                    "data": {"root": str(data), "frames": frames, "height": height, "width": width,
                             "num_workers": 0, "frame_sampling": "start"},
                    "training": {"algorithm": algorithm, "steps": args.steps, "batch_size": 1, "seed": 0,
                                 "precision": "fp32", "device": "cpu", "learning_rate": 1e-4},
                    "precompute": {"enabled": True, "cache_dir": str(root / "cache"), "batch_size": 1},
                    "checkpoint": {"every": 0}, "validation": {"enabled": False}, "logging": {"progress": False},
                    "parallel": settings, "output_dir": str(run),
                }
                run.mkdir()
                result = measure(config, world, run)
                rates[world] = world / result["seconds_per_step"]
                traffic, sizes = result["bytes"], result
            detail = ", ".join(f"{kind} {size / 2**20:.2f} MiB" for kind, size in sorted(traffic.items()))
            print(f"| {algorithm} | {strategy} | {rates[1]:.2f} | {rates[2]:.2f} | {rates[2] / (2 * rates[1]):.2f} | "
                  f"{sum(traffic.values()) / 2**20:.2f} MiB ({detail}) | {sizes['weights'] / 2**20:.2f} / "
                  f"{sizes['trainable'] / 2**20:.2f} MiB |", flush=True)


if __name__ == "__main__":
    main()
