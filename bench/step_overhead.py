"""Time per optimizer step of vidtune's trainer against a bare hand-written loop, in the same process.

Both train the same tiny-but-not-trivial LTX-Video LoRA on the same precomputed tensors (conditions
and VAE posterior), so the ratio is the trainer's own overhead: per-sample seeded randomness, autocast
and precision handling, gradient clipping, LR schedule, metrics. Rounds alternate between the two
to cancel drift; medians are compared.

    python bench/step_overhead.py [--steps 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from peft import LoraConfig

from vidtune.config import build_config
from vidtune.data.stream import Batch, BatchSource
from vidtune.data.synthetic import render_shapes_dataset
from vidtune.models.tiny import write_tiny_ltx_video
from vidtune.trainers.lora import LoRATrainer

FRAMES, SIZE = 17, 64


class FixedBatches(BatchSource):
    """The same precomputed tensors at every position of the stream."""

    def __init__(self, tensors: tuple[dict, dict]) -> None:
        self.tensors = tensors

    def batches(self, start_position: int):
        position = start_position
        while True:
            yield Batch(*self.tensors, positions=torch.tensor([position]), indices=torch.tensor([0]))
            position += 1

    def loader(self, sampler):
        raise NotImplementedError("FixedBatches yields its batches directly")

    encode = loader

    def empty_caption(self):
        raise NotImplementedError("caption dropout is off in this benchmark")


class PrecomputedLoRATrainer(LoRATrainer):
    """The real trainer, fed the same precomputed tensors as the bare loop (no decoding, no encoders)."""

    tensors: tuple[dict, dict]

    def open_batch_source(self) -> BatchSource:
        return FixedBatches(self.tensors)


def make_config(model: Path, data: Path, output: Path, steps: int, clip: bool):
    return build_config({
        "model": {"name": "ltx-video", "pretrained": str(model)},
        "data": {"root": str(data), "frames": FRAMES, "height": SIZE, "width": SIZE, "num_workers": 0},
        "training": {"steps": steps, "batch_size": 1, "learning_rate": 1e-4, "precision": "fp32", "device": "cpu",
                     "max_grad_norm": 1.0 if clip else None},
        "checkpoint": {"every": 0, "keep": 1},
        "validation": {"enabled": False},
        "logging": {"progress": False},
        "output_dir": str(output),
    })


def trainer_step_times(config, tensors) -> list[float]:
    trainer = PrecomputedLoRATrainer(config)
    trainer.tensors = tensors
    trainer.run()
    rows = [json.loads(line) for line in (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [row["seconds_per_step"] for row in rows[2:]]  # skip warm-up steps


def bare_step_times(spec, denoiser_factory, tensors, steps: int, lora: LoraConfig) -> list[float]:
    conditions, latents = tensors
    denoiser = denoiser_factory()
    denoiser.requires_grad_(False)
    denoiser.add_adapter(lora)
    parameters = [p for p in denoiser.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=1e-4)
    x0 = latents["latents_mean"]
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        sigma = torch.rand(1)
        noise = torch.randn_like(x0)
        noisy = (1 - sigma) * x0 + sigma * noise
        prediction = spec.forward(denoiser, conditions, noisy, sigma * 1000)
        loss = (prediction - (noise - x0)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return times[2:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="vidtune-bench-"))
    model = write_tiny_ltx_video(work / "model", num_layers=4, attention_head_dim=16, num_attention_heads=4)
    data = render_shapes_dataset(work / "data", num_clips=1, num_frames=FRAMES, height=SIZE, width=SIZE)

    probe = PrecomputedLoRATrainer(make_config(model, data, work / "probe", 1, True))
    probe.check_inputs()
    text, vae = probe.spec.load_text_components(probe.device), probe.spec.load_vae(probe.device)
    from vidtune.data.video import read_clip

    video = read_clip(probe.clips[0].video, FRAMES, SIZE, SIZE)[None]
    tensors = (probe.spec.prepare_conditions(text, [probe.clips[0].caption]), probe.spec.prepare_latents(vae, video))
    lora = LoraConfig(r=16, lora_alpha=16, target_modules=list(probe.spec.default_lora_targets))

    results: dict[str, list[float]] = {"bare": [], "trainer": [], "trainer_no_clip": []}
    for round_index in range(args.rounds):
        results["bare"] += bare_step_times(probe.spec, lambda: probe.spec.load_denoiser(probe.device), tensors,
                                           args.steps, lora)
        for name, clip in (("trainer", True), ("trainer_no_clip", False)):
            output = work / f"{name}-{round_index}"
            results[name] += trainer_step_times(make_config(model, data, output, args.steps, clip), tensors)

    bare = statistics.median(results["bare"])
    print(f"tokens per sample: {tensors[1]['latents_mean'][0, 0].numel()}, threads: {torch.get_num_threads()}")
    print(f"bare loop        median {bare * 1000:7.1f} ms/step")
    for name in ("trainer", "trainer_no_clip"):
        value = statistics.median(results[name])
        print(f"{name:16s} median {value * 1000:7.1f} ms/step   ratio {value / bare:.3f}")


if __name__ == "__main__":
    main()
