"""Training steps of vidtune's own trainer on fixed random inputs: seconds per step, the device's peak memory, and
`vidtune plan`'s prediction for the same config.

The model is built from its config.json files with random weights (the planner's architecture folders for a hub
id, so a real-size model needs no download and no weights on disk), through the trainer's own loading code:
quantized base weights, adapters, checkpointing, block swap, activation offload, compiling, the attention
backend and the optimizer all come from the config as in `vidtune train`. The inputs are random tensors of the
shapes the planner traces for the config's clip shape (conditions and a VAE posterior), the same at every step.
"""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from vidtune.batches import Batch, BatchSource
from vidtune.config import Config, load_config
from vidtune.data.synthetic import render_shapes_dataset
from vidtune.memory.meta import build_from_config
from vidtune.memory.plan import plan_memory, resolve_architecture, trace_encoders
from vidtune.trainers import build_trainer

WARMUP = 2  # steps left out of the median (the first ones allocate, autotune, compile)


@dataclass(frozen=True)
class StepResult:
    seconds_per_step: float  # median after the warm-up steps
    compile_seconds: float  # spent compiling, kept out of the step times
    peak_bytes: int | None  # torch.cuda.max_memory_allocated over set-up and steps; None off CUDA
    planned_bytes: int | None  # `vidtune plan`'s training peak for the same config
    steps: int

    def to_json(self) -> dict:
        return {"seconds_per_step": round(self.seconds_per_step, 4), "compile_seconds": round(self.compile_seconds, 2),
                "peak_bytes": self.peak_bytes, "planned_bytes": self.planned_bytes, "steps": self.steps}


class FixedBatches(BatchSource):
    """The same conditions and latents at every position of the stream."""

    def __init__(self, conditions: dict, latents: dict) -> None:
        self.conditions, self.latents = conditions, latents

    def batches(self, start_position: int):
        position = start_position
        while True:
            yield Batch(self.conditions, self.latents, positions=torch.tensor([position]), indices=torch.tensor([0]))
            position += 1

    def loader(self, sampler):
        raise NotImplementedError("FixedBatches yields its batches directly")

    encode = loader

    def preservation(self, raw: dict):
        raise NotImplementedError("base preservation is off in this benchmark")

    def prompt(self, caption: str):
        raise NotImplementedError("caption dropout is off in this benchmark, and no negative prompt is encoded")


def step_config(family: str, pretrained: str, shape: tuple[int, int, int], options: list[str], device: str,
                steps: int, data_root: Path, output_dir: Path) -> Config:
    """A LoRA run of `steps` steps of `family` at `shape` (frames, height, width) with `options` (dotted
    overrides, as on vidtune's command line)."""
    frames, height, width = shape
    return load_config(None, [
        f"model.name={family}", f"model.pretrained={pretrained}", f"data.root={data_root}", f"data.frames={frames}",
        f"data.height={height}", f"data.width={width}", "data.num_workers=0", f"training.device={device}",
        f"training.steps={steps}", "precompute.enabled=true", "checkpoint.every=0", "validation.enabled=false",
        "logging.progress=false", f"output_dir={output_dir}", *options])


def _random_like(value: torch.Tensor, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    if value.dtype.is_floating_point:
        return torch.randn(value.shape, generator=generator).to(device=device, dtype=value.dtype)
    return torch.ones(value.shape, dtype=value.dtype, device=device)


def fixed_inputs(config: Config, device: torch.device) -> tuple[dict, dict]:
    """Random conditions and a VAE posterior in the shapes the planner traces for `config` (batch of one)."""
    encoders = trace_encoders(config, device)
    generator = torch.Generator().manual_seed(0)
    conditions = {key: _random_like(value, device, generator) for key, value in encoders.conditions.items()}
    latents = {key: _random_like(value, device, generator) for key, value in encoders.latents.items()}
    if "latents_std" in latents:  # a narrow posterior, as a real VAE's
        latents["latents_std"] = torch.full_like(latents["latents_std"], 0.05)
    return conditions, latents


def run_steps(family: str, tiny_folder: Path, shape: tuple[int, int, int], options: list[str], device: str,
              architecture: str | None = None, steps: int = 6, plan: bool = True) -> StepResult:
    """Train `steps` LoRA steps (see the module's docstring) and measure them. `tiny_folder`: the family's tiny
    model (its tokenizer, scheduler and, without `architecture`, its denoiser); `architecture`: a hub id whose
    real-size denoiser (random weights) replaces the tiny one, fed inputs of the real encoders' shapes."""
    with tempfile.TemporaryDirectory(prefix="vidtune-gpu-steps-") as folder:
        work = Path(folder)
        frames, height, width = shape
        data = render_shapes_dataset(work / "data", num_clips=1, num_frames=frames, height=height, width=width)
        planned_config = step_config(family, architecture or str(tiny_folder), shape, options, device, steps, data,
                                     work / "output")
        planned = plan_memory(planned_config).training_peak if plan else None
        resolved, _ = resolve_architecture(planned_config)  # a hub id -> the folder of its config.json files
        trained = [*options, f"model.subfolders={{transformer: {Path(resolved.model.pretrained) / 'transformer'}}}"]
        config = step_config(family, str(tiny_folder), shape, trained if architecture else options, device, steps,
                             data, work / "output")
        trainer = build_trainer(config)
        source = FixedBatches(*fixed_inputs(resolved, trainer.device))
        on_cuda = trainer.device.type == "cuda"
        if on_cuda:  # the inputs are on the device already, as the cache's tensors are in a real run
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with random_denoiser(trainer.spec, trainer.device), \
                mock.patch("vidtune.training.setup.open_batch_source", return_value=source):
            trainer.run()
        peak = torch.cuda.max_memory_allocated() if on_cuda else None
        rows = [json.loads(line) for line in (work / "output" / "metrics.jsonl").read_text().splitlines()]
    del trainer, source  # the weights and inputs are freed before the next measurement
    release_memory()
    if len(rows) <= WARMUP:
        raise RuntimeError(f"{len(rows)} steps logged; at least {WARMUP + 1} are needed for a median")
    times = [row["seconds_per_step"] for row in rows[WARMUP:]]
    return StepResult(statistics.median(times), sum(row.get("compile_seconds", 0.0) for row in rows), peak, planned,
                      len(rows))


@contextlib.contextmanager
def random_denoiser(spec: Any, device: torch.device):
    """While inside: `spec` builds its denoiser(s) from config.json with random weights on `device` (in the dtype
    it asks for); every other component (scheduler, tokenizer) loads as usual."""
    original = spec.load_component

    def load_component(self: Any, cls: Any, component: str, **kwargs: Any) -> Any:
        if not component.startswith("transformer"):
            return original(cls, component, **kwargs)
        source, subfolder = self.component_source(component)
        folder = Path(source) / subfolder if subfolder else Path(source)
        return build_from_config(cls, folder, kwargs.get("torch_dtype"), device)

    spec.load_component = types.MethodType(load_component, spec)
    try:
        yield
    finally:
        del spec.load_component


def release_memory() -> None:
    """What one measurement left behind (compiled graphs, cached blocks) is freed before the next."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def timed(function, *args, **kwargs) -> tuple[object, float]:
    started = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - started
