"""Seconds per optimizer step of vidtune's trainer, eager, compiled (`training.compile`) and with each attention
backend that can train here (`model.attention_backend`), against a bare hand-written loop, in one process.

Every run trains the same LTX-Video LoRA (rank 16 on the attention projections) on the same fixed tensors
(conditions and VAE posterior), so the ratios are the trainer's own cost and what compiling or another kernel
saves. Rounds alternate between the runs to cancel drift; medians of the steps after the first two are compared
(a compiled run's first steps also compile; the trainer keeps that time out of `seconds_per_step` and reports it
as `compile_seconds`, summed here). The compiled run's losses are compared with the eager run's (same seeds).

- `--size bench` (default): a tiny-but-not-trivial model (4 layers, 64 wide), 17x64x64 clips, fp32;
- `--size ltx-2b`: the real LTX-Video 2B transformer (28 layers, 32 heads of 64; random weights) at 49x512x768
  in bf16; the latents have the real VAE's shape (128 channels, 7x16x24). Meant for a GPU (`--device cuda`).

`--buckets F H W F H W ...`: batches of these bucket shapes in turn (one clip of each), to compare compiling once
per bucket shape (what `training.compile` does) with compiling once with dynamic shapes (`compile_blocks(...,
dynamic=True)`, swapped in for that run): both runs are added, and each compiled run's compile time is printed.

    python bench/speed.py [--steps 30] [--rounds 3]
    python bench/speed.py --device cuda --size ltx-2b --steps 20 --rounds 2
    python bench/speed.py --buckets 17 64 64 17 64 96 17 96 64 --backends
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from peft import LoraConfig

from vidtune.attention import CPU_BACKENDS, available_backend_names, resolve_attention_backend
from vidtune.batches import Batch, BatchSource
from vidtune.compile import compile_blocks
from vidtune.config import build_config
from vidtune.data.synthetic import render_shapes_dataset
from vidtune.errors import ConfigError
from vidtune.models.tiny import write_tiny_ltx_video
from vidtune.trainers import Trainer, build_trainer

WARMUP = 2  # steps left out of each run's median


@dataclass(frozen=True)
class Size:
    frames: int
    height: int
    width: int
    precision: str
    real_vae: bool = False  # latents in the real LTX-Video VAE's shape (128 channels, 8x temporal, 32x spatial)

    @property
    def latent_shape(self) -> tuple[int, int, int, int] | None:
        if not self.real_vae:
            return None
        return 128, (self.frames - 1) // 8 + 1, self.height // 32, self.width // 32


SIZES = {
    "bench": Size(17, 64, 64, "fp32"),
    "ltx-2b": Size(49, 512, 768, "bf16", real_vae=True),
}


class FixedBatches(BatchSource):
    """The same precomputed tensors at every position of the stream; with several (one per bucket, clip i of
    bucket i), each in turn."""

    def __init__(self, tensors: list[tuple[dict, dict]]) -> None:
        self.tensors = tensors

    def batches(self, start_position: int):
        position = start_position
        while True:
            index = position % len(self.tensors)
            yield Batch(*self.tensors[index], positions=torch.tensor([position]), indices=torch.tensor([index]))
            position += 1

    def loader(self, sampler):
        raise NotImplementedError("FixedBatches yields its batches directly")

    encode = loader

    def preservation(self, raw: dict):
        raise NotImplementedError("base preservation is off in this benchmark")

    def prompt(self, text: str):
        raise NotImplementedError("no prompt beyond the captions is read in this benchmark")


def write_model(folder: Path, size: str) -> Path:
    if size == "bench":
        return write_tiny_ltx_video(folder, num_layers=4, attention_head_dim=16, num_attention_heads=4)
    # LTX-Video 2B: the tiny folder (its tokenizer, text encoder and scheduler are what the spec loads), with the
    # real-size transformer of random weights in place of the tiny one.
    from diffusers import LTXVideoTransformer3DModel

    write_tiny_ltx_video(folder, text_hidden=4096, latent_channels=128)
    shutil.rmtree(folder / "transformer")
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: never 8 GB of fp32 weights in memory
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            transformer = LTXVideoTransformer3DModel()  # the 2B defaults
    finally:
        torch.set_default_dtype(default_dtype)
    transformer.save_pretrained(folder / "transformer")
    del transformer
    return folder


def make_config(model: Path, data: list[Path], output: Path, steps: int, device: str, sizes: list[Size],
                clip: bool = True, compile: bool = False, backend: str = "auto"):
    """One clip folder and size, or (buckets) one folder per bucket shape."""
    if len(sizes) == 1:
        size = sizes[0]
        shape = {"root": str(data[0]), "frames": size.frames, "height": size.height, "width": size.width}
    else:
        shape = {"datasets": [{"type": "pairs", "root": str(folder)} for folder in data],
                 "buckets": [[size.frames, size.height, size.width] for size in sizes]}
    return build_config({
        "model": {"name": "ltx-video", "pretrained": str(model), "attention_backend": backend},
        "data": {**shape, "num_workers": 0},
        "training": {"steps": steps, "batch_size": 1, "learning_rate": 1e-4, "precision": sizes[0].precision,
                     "device": device, "max_grad_norm": 1.0 if clip else None, "compile": compile},
        "checkpoint": {"every": 0, "keep": 1},
        "validation": {"enabled": False},
        "logging": {"progress": False},
        "output_dir": str(output),
    })


def fixed_tensors(probe: Trainer, clips: list, size: Size, index: int = 0) -> tuple[dict, dict]:
    """The conditions of clip `index`'s caption and a VAE posterior: encoded from that clip, or (a real-size
    latent shape) drawn at random in that shape."""
    text = probe.spec.load_text_components(probe.device)
    conditions = probe.spec.prepare_conditions(text, [clips[index].caption])
    if size.latent_shape is not None:
        generator = torch.Generator().manual_seed(0)
        mean = torch.randn((1, *size.latent_shape), generator=generator).to(probe.device)
        return conditions, {"latents_mean": mean, "latents_std": torch.full_like(mean, 0.05)}
    from vidtune.data.video import ClipWindow, read_clip

    vae = probe.spec.load_vae(probe.device)
    video = read_clip(clips[index].video, ClipWindow(size.frames, size.height, size.width))[None].to(probe.device)
    return conditions, probe.spec.prepare_latents(vae, video)


def trainer_run(config, tensors, dynamic: bool = False) -> tuple[list[float], list[float], float]:
    """(seconds per step after the warm-up, every logged loss, seconds spent compiling); `dynamic`: the blocks
    compiled once with dynamic shapes instead of once per shape."""
    compiling = partial(compile_blocks, dynamic=True) if dynamic else compile_blocks
    # The real trainer, fed the same precomputed tensors as the bare loop (no decoding, no encoders).
    with mock.patch("vidtune.training.setup.compile_blocks", compiling), \
            mock.patch("vidtune.training.setup.open_batch_source", lambda *args, **kwargs: FixedBatches(tensors)):
        build_trainer(config).run()
    rows = [json.loads(line) for line in (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()]
    # Each bucket's first step is a warm-up too (its first compiled kernels run there).
    warmup = max(WARMUP, len(tensors))
    return ([row["seconds_per_step"] for row in rows[warmup:]], [row["loss"] for row in rows],
            sum(row.get("compile_seconds", 0.0) for row in rows))


def bare_step_times(spec, denoiser_factory, tensors: list[tuple[dict, dict]], steps: int, lora: LoraConfig,
                    device: torch.device, bf16: bool) -> list[float]:
    """A hand-written LoRA loop over the same tensors (several: one per bucket, in turn)."""
    denoiser = denoiser_factory()
    denoiser.requires_grad_(False)
    denoiser.add_adapter(lora)
    parameters = [p for p in denoiser.parameters() if p.requires_grad]
    for parameter in parameters:
        parameter.data = parameter.data.float()
    optimizer = torch.optim.AdamW(parameters, lr=1e-4)
    times = []
    for step in range(steps):
        conditions, latents = tensors[step % len(tensors)]
        started = time.perf_counter()
        x0 = latents["latents_mean"].float()
        sigma = torch.rand(1, device=device)
        noise = torch.randn_like(x0)
        noisy = (1 - sigma) * x0 + sigma * noise
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            prediction = spec.forward(denoiser, conditions, noisy.to(denoiser.dtype), sigma * 1000)
        loss = (prediction.float() - (noise - x0)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()  # what the trainer's logged loss costs it, once a step
        times.append(time.perf_counter() - started)
    return times[max(WARMUP, len(tensors)):]


def training_backends(device: torch.device) -> list[str]:
    """Every backend other than `native` that can train on `device` here."""
    names = [n for n in available_backend_names() if n != "native"]
    if device.type != "cuda":
        names = [n for n in names if n in CPU_BACKENDS]
    usable = []
    for name in names:
        try:
            resolve_attention_backend(name, device)
        except ConfigError:
            continue
        usable.append(name)
    return usable


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="bench")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled run")
    parser.add_argument("--backends", nargs="*", help="attention backends to time (default: every usable one)")
    parser.add_argument("--shape", type=int, nargs=3, metavar=("FRAMES", "HEIGHT", "WIDTH"),
                        help="another clip shape than the size's (a quick check of the script)")
    parser.add_argument("--buckets", type=int, nargs="+", metavar="F H W",
                        help="several bucket shapes, frames height width each, trained in turn")
    args = parser.parse_args()
    size, device = SIZES[args.size], torch.device(args.device)
    if args.shape:
        size = replace(size, frames=args.shape[0], height=args.shape[1], width=args.shape[2])
    sizes = [size]
    if args.buckets:
        if len(args.buckets) % 3 or len(args.buckets) < 6:
            parser.error("--buckets takes two or more shapes of three numbers: frames height width")
        shapes = [args.buckets[i:i + 3] for i in range(0, len(args.buckets), 3)]
        sizes = [replace(size, frames=f, height=h, width=w) for f, h, w in shapes]
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="vidtune-bench-speed-"))
    model = write_model(work / "model", args.size)
    # One clip per bucket shape, each in a folder of its own (a source of the dataset, in bucket order).
    data = [render_shapes_dataset(work / f"data-{index}", num_clips=1, num_frames=each.frames, height=each.height,
                                  width=each.width, seed=index) for index, each in enumerate(sizes)]

    probe = build_trainer(make_config(model, data, work / "probe", 1, args.device, sizes))
    clips = probe.check_inputs().clips
    if [clip.bucket or 0 for clip in clips] != list(range(len(sizes))):
        raise SystemExit("--buckets: each shape needs its own aspect ratio (the clip of each shape must land in its "
                         f"bucket; they landed in {[clip.bucket for clip in clips]})")
    tensors = [fixed_tensors(probe, clips, each, index) for index, each in enumerate(sizes)]
    lora = LoraConfig(r=16, lora_alpha=16, target_modules=list(probe.spec.default_lora_targets))
    backends = args.backends if args.backends is not None else training_backends(device)

    runs: dict[str, dict] = {"trainer": {}, "trainer_no_clip": {"clip": False}}
    if not args.no_compile:
        runs["trainer_compiled"] = {"compile": True}
        if len(sizes) > 1:
            runs["trainer_compiled_dynamic"] = {"compile": True, "dynamic": True}
    runs.update({f"attention {name}": {"backend": name} for name in backends})
    times: dict[str, list[float]] = {"bare": [], **{name: [] for name in runs}}
    losses: dict[str, list[float]] = {}
    compile_seconds: dict[str, float] = {}
    failed: dict[str, str] = {}
    for round_index in range(args.rounds):
        times["bare"] += bare_step_times(probe.spec, lambda: probe.spec.load_denoiser(probe.device), tensors,
                                         args.steps, lora, device, size.precision == "bf16")
        for name, options in runs.items():
            if name in failed:
                continue
            output = work / f"{name.replace(' ', '-')}-{round_index}"
            settings = {key: value for key, value in options.items() if key != "dynamic"}
            try:
                seconds, run_losses, compiling = trainer_run(
                    make_config(model, data, output, args.steps, args.device, sizes, **settings), tensors,
                    dynamic=options.get("dynamic", False))
            except Exception as error:  # a backend that fails here is reported, the others still measured
                failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                traceback.print_exc()
                continue
            times[name] += seconds
            losses.setdefault(name, run_losses)
            if options.get("compile") and round_index == 0:
                compile_seconds[name] = compiling

    bare = statistics.median(times["bare"])
    described = ", ".join(f"{each.frames}x{each.height}x{each.width}" for each in sizes)
    tokens = ", ".join(str(latents["latents_mean"][0, 0].numel()) for _, latents in tensors)
    print(f"device {args.device}, size {args.size} ({described}, {size.precision}), "
          f"latent tokens per sample {tokens}, torch threads {torch.get_num_threads()}, "
          f"{args.rounds} rounds of {args.steps} steps")
    print(f"{'run':28s} {'median ms/step':>15s} {'ratio to bare':>14s} {'to trainer':>11s}")
    print(f"{'bare loop':28s} {bare * 1000:15.1f} {1.0:14.3f}")
    trainer = statistics.median(times["trainer"]) if times["trainer"] else float("nan")
    for name in runs:
        if name in failed:
            print(f"{name:28s} failed: {failed[name]}")
            continue
        value = statistics.median(times[name])
        print(f"{name:28s} {value * 1000:15.1f} {value / bare:14.3f} {value / trainer:11.3f}")
    for name, seconds in compile_seconds.items():
        print(f"compile time of {name} (first round, not in its step times): {seconds:.1f} s")
    for name in ("trainer_compiled", "trainer_compiled_dynamic"):
        if name in losses and "trainer" in losses:
            eager, compiled = torch.tensor(losses["trainer"]), torch.tensor(losses[name])
            print(f"{name} vs eager losses over {len(eager)} steps: max relative difference "
                  f"{((compiled - eager).abs() / eager.abs()).max().item():.2e}")


if __name__ == "__main__":
    main()
