"""The planner's check: the real peak of allocated tensor memory of training steps on the CPU.

Measured by torch's profiler (`profile_memory=True`), which records every allocation and free of the CPU
allocator with its size: the live bytes are their running sum, independent of the dispatcher-level counting the
planner does. The model is built from its config.json files with random weights (so a real-size architecture
needs no download), through the spec's and the algorithm part's own code (quantization, adapters, gradient
checkpointing, the optimizer by name), and trained for two steps on random conditions and latents of the shapes
the planner found (two, so the optimizer state exists during the second step's passes, as in any later step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from vidtune.algorithms.build import build_part, build_spec
from vidtune.config import Config
from vidtune.memory.meta import components_on_meta
from vidtune.memory.plan import resolve_architecture, trace_encoders
from vidtune.optim import build_optimizer

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Measured:
    setup: int  # bytes live once the weights, the algorithm part's set-up and the inputs are in place
    peak: int  # the largest live bytes during the training steps


class AllocationLog:
    """The CPU allocator's running total over profiled sections; `peak` is the largest it reached."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    @contextlib.contextmanager
    def section(self) -> Iterator[None]:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield
        events = sorted((event.start_ns(), event.nbytes()) for event in prof.profiler.kineto_results.events()
                        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU)
        for _, size in events:
            self.live += size
            self.peak = max(self.peak, self.live)


def measure_training(config: Config, steps: int = 2) -> Measured:
    """Peak allocated bytes of `steps` training steps of `config` on the CPU (see the module's docstring)."""
    config, _ = resolve_architecture(config)
    encoders = trace_encoders(config, CPU)  # the shapes of the conditions and latents (meta, nothing allocated)
    log = AllocationLog()
    with log.section():
        spec = build_spec(config)
        part = build_part(config, spec)
        with components_on_meta(spec, CPU, where=CPU):
            denoiser = spec.load_denoiser(CPU)
        if config.training.gradient_checkpointing:
            denoiser.enable_gradient_checkpointing()
        parameters = part.configure(denoiser)
        optimizer = build_optimizer(parameters, config)
        generator = torch.Generator().manual_seed(0)
        batch = config.training.batch_size
        conditions = {key: _real(value, batch, generator) for key, value in encoders.conditions.items()}
        conditions.update({key: _real(value, batch, generator) for key, value in encoders.latents.items()
                           if key not in ("latents_mean", "latents_std")})
        latent = encoders.latents["latents_mean"]
        noisy = torch.randn((batch, *latent.shape[1:]), generator=generator).to(denoiser.dtype)
        timesteps = torch.full((batch,), 500.0)
    setup = log.live
    denoiser.train()
    log.peak = log.live
    with log.section():
        for _ in range(steps):
            prediction = spec.forward(denoiser, conditions, noisy, timesteps)
            loss = (prediction.float() - noisy.float()).pow(2).flatten(1).mean(dim=1).sum()
            loss.backward()
            del prediction, loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return Measured(setup, log.peak)


def _real(value: torch.Tensor, batch: int, generator: torch.Generator) -> torch.Tensor:
    shape = (batch, *value.shape[1:])
    if value.dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(value.dtype)
    return torch.ones(shape, dtype=value.dtype)
