"""Host memory per rank while FSDP loads and shards the denoiser: every rank reading the weights, or rank 0 alone
(`parallel.load_on_rank0`).

A mid-size LTX-Video transformer (random weights, fp32, `--layers` blocks of width `--width`) is written once with
`save_pretrained`. Then, for each setting, two CPU processes (gloo) run what training runs before its first step:
`FullyShardedStrategy.load_denoiser`, every weight made trainable (a full fine-tune), `prepare` (fully_shard, and
with rank-0 loading the shards filled from rank 0). Each rank reports the peak resident memory it added over what it
held before loading (Linux's VmHWM, reset just before: a transient copy counts) and what it still holds after. The
ratio is rank 1's peak with rank-0 loading over its peak when every rank loads.

    python bench/rank0_loading.py [--layers 16] [--width 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.multiprocessing as mp

from vidtune import parallel
from vidtune.config import load_config
from vidtune.models.registry import get_spec_class
from vidtune.parallel.choose import choose_strategy

CPU = torch.device("cpu")
HEAD_DIM = 64


def write_model(folder: Path, layers: int, width: int) -> int:
    """A random LTX-Video transformer in `folder/transformer`; returns its size in bytes."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(in_channels=128, out_channels=128, num_layers=layers,
                                       num_attention_heads=width // HEAD_DIM, attention_head_dim=HEAD_DIM,
                                       cross_attention_dim=width, caption_channels=256)
    model.save_pretrained(folder / "transformer", safe_serialization=True)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def status_mib(field: str) -> float:
    """A field of /proc/self/status (VmRSS: resident now, VmHWM: its high-water mark), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak() -> None:
    """Start VmHWM again from the current resident size (Linux: `5` into clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def rank_main(rank: int, folder: str, setting: str, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    parallel.TIMEOUT = timedelta(minutes=10)
    config = load_config(None, ["model.name=ltx-video", f"model.pretrained={folder}", "data.root=unused",
                                "training.device=cpu", "parallel.strategy=fsdp",
                                f"parallel.load_on_rank0={setting}"])
    spec = get_spec_class("ltx-video")(config.model)
    with parallel.process_group(CPU):
        strategy = choose_strategy(config, CPU)
        reset_peak()
        before = status_mib("VmRSS")
        denoiser = strategy.load_denoiser(spec, CPU)
        parameters = [p.requires_grad_(True) for p in denoiser.parameters()]
        parameters = strategy.prepare(denoiser, parameters)  # the unsharded ones dropped, as the trainer does
        parallel.barrier()
        local = sum(p.to_local().numel() * p.element_size() for p in denoiser.parameters())
        Path(out, f"{setting}-{rank}.json").write_text(json.dumps(
            {"added_mib": status_mib("VmHWM") - before, "held_mib": status_mib("VmRSS") - before,
             "shard_mib": local / 2**20}))


def free_port() -> int:
    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        return handle.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        folder, out = Path(temporary, "model"), Path(temporary, "results")
        out.mkdir()
        size = write_model(folder, args.layers, args.width)
        print(f"LTX-Video transformer, {args.layers} blocks of width {args.width}: {size / 2**20:.0f} MiB (fp32)")
        print("| parallel.load_on_rank0 | rank | peak host memory added (MiB) | held after sharding (MiB) | "
              "its shard (MiB) |")
        print("| --- | --- | --- | --- | --- |")
        peaks = {}
        for setting in ("false", "true"):
            mp.spawn(rank_main, args=(str(folder), setting, free_port(), str(out)), nprocs=2, join=True)
            for rank in range(2):
                result = json.loads(Path(out, f"{setting}-{rank}.json").read_text())
                peaks[setting, rank] = result["added_mib"]
                print(f"| {setting} | {rank} | {result['added_mib']:.0f} | {result['held_mib']:.0f} | "
                      f"{result['shard_mib']:.0f} |")
        print(f"rank 1, rank-0 loading / every rank loading: {peaks['true', 1] / peaks['false', 1]:.2f}")


if __name__ == "__main__":
    main()
