"""Two denoisers split by noise level (Wan 2.2 A14B's mixture of experts), trained as one module.

The high-noise expert (`transformer`) serves timesteps >= the boundary, the low-noise expert (`transformer_2`) the
rest, as the family's pipeline switches between them. `TwoExperts` routes each sample of a batch to its expert by
its timestep, so the trainer sees one denoiser: its state dict keys start with `transformer.` / `transformer_2.`,
which keeps checkpoints, exact resume and the moving average covering both without knowing there are two.

Which experts train (`model.experts`) decides which get an adapter; the other stays as loaded. Memory: both experts
are loaded onto the device (so adapters, optimizer state and the weights' average are made there); from the first
forward on, only the expert that runs holds the device: the other's frozen weights wait in CPU memory and are
moved back when a forward (the trainer's or the pipeline's) calls it. Trainable weights never move, so the
optimizer's state stays put (a full fine-tune, where every weight trains, keeps both experts on the device).
A micro-batch whose samples fall on both sides of the boundary runs both experts in one forward, so both stay on
the device until its backward is done; one clip per micro-batch (the usual for 14B experts) never
needs that. On a CPU both simply stay where they are.

A control run (vidtune/control.py) passes the batch's control latents as a keyword argument: a tensor with a batch
dimension, so a split batch hands each expert its own samples' rows, like every other per-sample input.

Under torchrun each rank routes its own samples, so one rank may run an expert the other ranks do not:
`leaves_parameters_unused` tells DDP to find the parameters a rank left out (vidtune/parallel/ddp.py). Sharded
training (FSDP, DeepSpeed) cannot follow that: each expert's shards are gathered and its gradients reduced in
collectives every rank must join. There the noise levels are routed per step (`StepRouted`,
`model.expert_routing: step`): every rank runs the same expert in a step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vidtune.errors import ConfigError
from vidtune.objectives import Objective

EXPERT_NAMES = ("transformer", "transformer_2")  # high-noise, low-noise: the pipeline's component names


def expert_file(file_name: str, expert: str) -> str:
    """The file of `expert` for a run's file `file_name`: the high-noise expert's is `file_name` itself, the
    low-noise one's takes `_transformer_2` before the suffix (`pytorch_lora_weights_transformer_2.safetensors`, the
    name diffusers' Wan 2.2 examples load; `control_input_transformer_2.safetensors` likewise)."""
    if expert == EXPERT_NAMES[0]:
        return file_name
    stem, suffix = os.path.splitext(file_name)
    return f"{stem}_{expert}{suffix}"


def _move_frozen(module: nn.Module, device: torch.device) -> None:
    """Move `module`'s frozen parameters and its buffers to `device` in place; trainable parameters stay.
    Copies onto the accelerator are queued (the stream keeps their order); copies back to the CPU wait."""
    non_blocking = device.type != "cpu"
    with torch.no_grad():
        for parameter in module.parameters():
            if not parameter.requires_grad and parameter.device != device:
                parameter.data = parameter.data.to(device, non_blocking=non_blocking)
        for child in module.modules():
            for name, buffer in child.named_buffers(recurse=False):
                if buffer.device != device:
                    child._buffers[name] = buffer.to(device, non_blocking=non_blocking)


class TwoExperts(nn.Module):
    """`transformer` (high noise) and `transformer_2` (low noise) behind one forward that routes by timestep.

    `boundary_timestep`: the pipeline's `boundary_ratio * num_train_timesteps`. `trained`: the experts that get
    adapters (`add_adapter`). `device`: where the running expert lives; with `offload`, the idle one's frozen
    weights live in CPU memory."""

    # A step may leave an expert out of the loss (every sample on one side of the boundary). Under torchrun, DDP
    # must look for such parameters each backward (`find_unused_parameters`; see vidtune/parallel/ddp.py).
    leaves_parameters_unused = True

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary_timestep: float,
                 trained: tuple[str, ...] = EXPERT_NAMES, device: torch.device | None = None,
                 offload: bool = False) -> None:
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_timestep = float(boundary_timestep)
        self.trained = tuple(trained)
        self.device_of_work = device or next(transformer.parameters()).device
        self.offload = offload and self.device_of_work.type != "cpu"
        self._keep_both = False
        for expert in self.experts():
            # The pipeline calls the experts directly: each call brings its expert onto the device first.
            expert.register_forward_pre_hook(self._before_expert)

    def experts(self) -> list[nn.Module]:
        return [self.transformer, self.transformer_2]

    def expert(self, name: str) -> nn.Module:
        return getattr(self, name)

    # ----- what the trainer and the pipeline ask of a diffusers denoiser -------------------------------------------
    @property
    def config(self) -> Any:
        return self.transformer.config

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def peft_config(self) -> dict[str, Any]:
        """The adapter settings (the same for every trained expert), as peft's state-dict helpers read them."""
        return self.expert(self.trained[0]).peft_config

    def add_adapter(self, adapter_config: Any, adapter_name: str = "default") -> None:
        """Each trained expert gets an adapter of its own (same settings, own weights)."""
        for name in self.trained:
            self.expert(name).add_adapter(adapter_config, adapter_name=adapter_name)

    def disable_adapters(self) -> None:
        for name in self.trained:
            self.expert(name).disable_adapters()

    def enable_adapters(self) -> None:
        for name in self.trained:
            self.expert(name).enable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.experts():
            expert.enable_gradient_checkpointing()

    # ----- routing -----------------------------------------------------------------------------------------------
    def is_high_noise(self, timestep: torch.Tensor) -> torch.Tensor:
        """Per sample: whether the high-noise expert serves it. Timesteps per token (Wan 2.2 TI2V) route by their
        largest value, the one the pipeline's loop compares (a kept-clean first frame is at 0)."""
        per_sample = timestep.flatten(1).amax(dim=1) if timestep.ndim > 1 else timestep
        return per_sample >= self.boundary_timestep

    def activate(self, active: nn.Module) -> None:
        """With offloading: `active`'s frozen weights onto the device, the other expert's into CPU memory."""
        if not self.offload:
            return
        for expert in self.experts():
            if expert is active or self._keep_both:
                _move_frozen(expert, self.device_of_work)
            else:
                _move_frozen(expert, torch.device("cpu"))

    def _before_expert(self, module: nn.Module, _args: Any) -> None:
        self.activate(module)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, return_dict: bool = False,
                **kwargs: Any) -> tuple[torch.Tensor]:
        high = self.is_high_noise(timestep.to(hidden_states.device))
        if bool(high.all()) or not bool(high.any()):
            expert = self.transformer if bool(high.all()) else self.transformer_2
            return (expert(hidden_states=hidden_states, timestep=timestep, return_dict=False, **kwargs)[0],)
        batch = hidden_states.shape[0]
        output: torch.Tensor | None = None
        self._keep_both = True  # both run before the backward: neither may leave the device now
        try:
            for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
                index = rows.nonzero().flatten()
                part = {key: value.index_select(0, index.to(value.device))
                        if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == batch else value
                        for key, value in kwargs.items()}
                prediction = expert(hidden_states=hidden_states[index], timestep=timestep[index.to(timestep.device)],
                                    return_dict=False, **part)[0]
                if output is None:
                    output = prediction.new_zeros((batch, *prediction.shape[1:]))
                output = output.index_copy(0, index.to(output.device), prediction)
        finally:
            self._keep_both = False
        return (output,)


@dataclass
class NoiseRange:
    """An objective whose noise levels are drawn only where their timesteps lie in [low, high): one expert's side
    of the boundary. The draw is the objective's own, rejected outside the range, so the distribution within the
    range is unchanged and the visit's generator alone decides it (resume stays exact)."""

    objective: Objective
    low: float
    high: float

    def sample_noise_levels(self, batch_size: int, generator: torch.Generator | None = None,
                            tokens: int | None = None, frames: int | None = None) -> torch.Tensor:
        """One level per clip inside the range (`frames` is ignored: a step's clips route to one expert each)."""
        kept: list[torch.Tensor] = []
        for _ in range(10_000):
            levels = self.objective.sample_noise_levels(batch_size, generator, tokens)
            timesteps = self.objective.timesteps(levels)
            kept.extend(levels[(timesteps >= self.low) & (timesteps < self.high)])
            if len(kept) >= batch_size:
                return torch.stack(kept[:batch_size])
        raise ConfigError(f"model.experts: the noise levels of training.sigma_sampling almost never fall between "
                          f"timesteps {self.low:g} and {self.high:g} (this expert's side of the boundary).\n"
                          "What to do: use training.sigma_sampling=uniform, or train both experts.")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.objective, name)


def step_generator(seed: int, step: int) -> torch.Generator:
    """The randomness of one optimizer step that every rank shares (which expert the step trains)."""
    return torch.Generator().manual_seed((seed * 1_000_211 + step * 6_007 + 29) % 2**63)


@dataclass
class StepRouted:
    """Noise levels routed per step (`model.expert_routing: step`): each optimizer step trains one expert, the
    same on every rank and every micro-batch of the step, so sharded training's collectives match.

    The step's expert is the side of the boundary on which one noise level, drawn from the objective with the
    step's generator (`step_generator`, seeded alike on every rank), falls: the high-noise expert with probability
    P(timestep >= boundary), its share of the noise-level distribution. Each sample's level is then drawn inside
    that expert's band from the sample's own visit generator (`NoiseRange`). A sample's level thus has the
    objective's distribution (P(expert) times the distribution within its band); only the levels of one step's
    samples are no longer independent of each other."""

    objective: Objective
    boundary_timestep: float
    seed: int

    def for_step(self, step: int, tokens: int | None = None) -> NoiseRange:
        """The objective of step `step` (counted from 0): the noise levels of the step's expert only (`tokens`: the
        step's token count, for distributions that depend on it)."""
        level = self.objective.sample_noise_levels(1, step_generator(self.seed, step), tokens)
        if bool(self.objective.timesteps(level)[0] >= self.boundary_timestep):
            return NoiseRange(self.objective, self.boundary_timestep, float("inf"))
        return NoiseRange(self.objective, float("-inf"), self.boundary_timestep)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.objective, name)
