"""Context parallelism (`parallel.context: {ulysses: U, ring: R}`): each sample's tokens split over U x R ranks.

A 720p clip of 81 frames is tens of thousands of tokens: its activations, not its weights, fill the GPU, and FSDP
or ZeRO split only the weights. Here the processes form one device mesh `(data, ring, ulysses)`: D = world / (U x R)
data groups, each of U x R ranks that share one sample. The engine is diffusers' context parallelism: a model's
`_cp_plan` says where its token sequence is split (the input of the first block, the rotary tables) and where the
output is gathered (`proj_out`); inside attention, Ulysses swaps the split from tokens to heads with one all-to-all
before and one after, ring passes the keys and values round the ranks and merges the partial attentions by their
log-sum-exp (vidtune/parallel/context_attention.py gives diffusers' `native` backend the log-sum-exp it lacks).

What makes it train what one process trains:
- the data stream hands every rank of a data group the same samples (`data_rank`, `data_world`), and the noise,
  noise level and caption dropout come from each sample's own generator, so the group draws them alike;
- the gathered output is whole on every rank of a group, so each computes the same loss; its backward gives every
  rank the gradient of its own tokens only (diffusers' gather passes back each rank's slice), and the sum over the
  group is the sample's gradient. DDP and FSDP average over all D x U x R ranks, so the loss is scaled by U x R
  before backward: the average is then the mean over the D data groups' samples;
- FSDP shards over the whole mesh flattened (data x context), as torchtitan shards over `dp_shard x cp`: the
  context ranks hold different shards instead of copies, and one reduce-scatter sums and averages as above.

Forwards that rank 0 runs alone (validation samples, the final files) run without the split (`suspended`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vidtune import parallel
from vidtune.config import Config
from vidtune.data.sources import Clip
from vidtune.errors import ConfigError
from vidtune.models.spec import ModelSpec
from vidtune.parallel import context_attention
from vidtune.parallel.ddp import DataParallelStrategy
from vidtune.parallel.fsdp import FullyShardedStrategy
from vidtune.parallel.strategy import Strategy

DIMS = ("data", "ring", "ulysses")


@dataclass(frozen=True)
class ContextMesh:
    """The run's device mesh (data, ring, ulysses), ranks numbered data-major: a data group's ranks are adjacent
    (on one node, where the all-to-all and ring traffic is cheapest)."""

    mesh: Any  # torch DeviceMesh

    @classmethod
    def build(cls, config: Config, device: torch.device) -> ContextMesh:
        from torch.distributed.device_mesh import init_device_mesh

        context = config.parallel.context
        shape = (parallel.world_size() // context.degree, context.ring, context.ulysses)
        return cls(init_device_mesh(device.type, shape, mesh_dim_names=DIMS))

    @property
    def context_mesh(self) -> Any:
        """The (ring, ulysses) sub-mesh of this rank's data group."""
        return self.mesh["ring", "ulysses"]

    def flattened(self) -> Any:
        """The whole mesh as one dimension, for FSDP's sharding."""
        return self.mesh[DIMS]._flatten("data_context")


def check_context(config: Config) -> None:
    """Refuse a context layout the processes cannot form, before any model is loaded."""
    context, world = config.parallel.context, parallel.world_size()
    if world % context.degree:
        raise ConfigError(f"parallel.context: ulysses x ring = {context.degree} does not divide the {world} "
                          "processes. What to do: start a multiple of it (torchrun --nproc_per_node), or change "
                          "parallel.context.")
    if config.model.attention_backend not in ("auto", "native"):
        raise ConfigError(f"parallel.context with model.attention_backend={config.model.attention_backend}: split "
                          "attention runs on diffusers' `native` backend (torch's scaled_dot_product_attention, which "
                          "picks a flash or memory-efficient kernel on CUDA itself), the one vidtune completes for "
                          "ring and cross-attention. What to do: set model.attention_backend=auto (or native).")


def context_plan(spec: ModelSpec, config: Config) -> dict[str, Any]:
    """The family's plan of where its sequence is split and gathered, or a ConfigError with the reason it has none;
    the attention heads are checked against the Ulysses degree."""
    plan = spec.context_parallel_plan()
    if isinstance(plan, str):
        raise ConfigError(f"parallel.context: {spec.name} cannot split its token sequence: {plan}.\nWhat to do: "
                          "remove parallel.context (use parallel.strategy=fsdp and memory.* to fit it), or train "
                          "a family that can (see docs/distributed.md).")
    ulysses = config.parallel.context.ulysses
    # Every stream's heads (LTX-2's audio has its own: `audio_num_attention_heads`).
    settings = spec.load_config(spec.denoiser_class, "transformer")
    for key, heads in settings.items():
        if key.endswith("num_attention_heads") and isinstance(heads, int) and heads % ulysses:
            raise ConfigError(f"parallel.context.ulysses={ulysses} does not divide the {heads} attention heads of "
                              f"{spec.name} ({key} in its transformer's config). What to do: choose a Ulysses "
                              f"degree that divides {heads}, and give the rest of the context degree to "
                              "parallel.context.ring.")
    return plan


def check_context_tokens(config: Config, spec: ModelSpec, clips: list[Clip]) -> None:
    """Refuse, before anything loads, clip shapes (bucket, and the frame rate a family's sound length follows)
    whose split lengths (`ModelSpec.context_token_counts`) do not divide by the context degree: diffusers splits
    into equal parts, and padding would add tokens every attention sees."""
    degree = config.parallel.context.degree
    if degree == 1 or parallel.world_size() == 1:  # one process trains without a split
        return
    shapes = config.data.bucket_shapes()
    examples: dict[tuple[tuple[int, int, int], float | None], Clip] = {}
    for clip in clips:
        shape = shapes[clip.bucket or 0]
        examples.setdefault((shape, spec.clip_frame_rate(clip, config.data.fps)), clip)
    problems = []
    for ((frames, height, width), rate), clip in examples.items():
        uneven = {name: count for name, count in spec.context_token_counts(frames, height, width, rate).items()
                  if count % degree}
        if uneven:
            told = "" if rate is None else f" at {rate:g} fps"
            problems.append(f"  - {frames} frames of {height}x{width}{told} (e.g. {clip.where}): "
                            + ", ".join(f"{count} {name}" for name, count in uneven.items()))
    if problems:
        raise ConfigError(
            f"parallel.context: {spec.name} splits each clip's tokens into {degree} equal parts (ulysses x ring), "
            "but these clip shapes give lengths that do not divide by it:\n" + "\n".join(problems)
            + "\nWhat to do: choose data.frames / data.buckets (and data.fps, which sets the sound's length) whose "
            "lengths divide by the degree, or another parallel.context degree.")


def uses_half(config: Config) -> bool:
    return config.training.precision in ("bf16", "auto")


class SplitModel:
    """diffusers' context parallelism on each denoiser of a module: on (`enable`), off and on again (`suspended`)."""

    def __init__(self, parts: list[nn.Module], plan: dict[str, Any], config: Config, mesh: ContextMesh,
                 device: torch.device) -> None:
        from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

        context = config.parallel.context
        self.parts, self.plan = parts, plan
        self.settings = ParallelConfig(context_parallel_config=ContextParallelConfig(
            ring_degree=context.ring, ulysses_degree=context.ulysses, mesh=mesh.context_mesh))
        self.settings.setup(parallel.rank(), parallel.world_size(), device, mesh=mesh.context_mesh)
        self.enabled = False

    def processors(self) -> Iterator[Any]:
        from diffusers.models.attention import AttentionModuleMixin
        from diffusers.models.attention_processor import Attention

        for part in self.parts:
            for module in part.modules():
                processor = getattr(module, "processor", None)
                if isinstance(module, Attention | AttentionModuleMixin) and hasattr(processor, "_parallel_config"):
                    yield processor

    def enable(self) -> None:
        from diffusers.hooks.context_parallel import apply_context_parallel

        context_attention.install()
        for processor in self.processors():
            processor._parallel_config = self.settings
            # `auto` may have chosen FlashAttention: split attention runs on `native` (see `check_context`).
            processor._attention_backend = "native"
        for part in self.parts:
            apply_context_parallel(part, self.settings.context_parallel_config, self.plan)
        self.enabled = True

    def disable(self) -> None:
        from diffusers.hooks.context_parallel import remove_context_parallel

        for processor in self.processors():
            processor._parallel_config = None
        for part in self.parts:
            remove_context_parallel(part, self.plan)
        self.enabled = False

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Within the block the denoisers compute on whole sequences (a forward on one rank alone)."""
        if not self.enabled:
            yield
            return
        self.disable()
        try:
            yield
        finally:
            self.enable()


class ContextParallel(Strategy):
    """Mixed in before DDP's or FSDP's strategy: the same, plus each sample's tokens split over a data group."""

    # Every rank of a group must run the same forwards (held-out scores, a teacher's): they are collectives.
    forwards_gather_weights = True
    split: SplitModel | None = None

    def check(self) -> None:
        check_context(self.config)
        super().check()
        self.layout = ContextMesh.build(self.config, self.device)

    @property
    def degree(self) -> int:
        return self.config.parallel.context.degree

    def load_denoiser(self, spec: ModelSpec, load_on: torch.device) -> nn.Module:
        self.plan = context_plan(spec, self.config)  # refused before the weights are read
        if self.config.parallel.context.ring > 1 and self.device.type == "cuda" and not uses_half(self.config):
            raise ConfigError("parallel.context.ring on CUDA computes attention with cuDNN, which needs bf16: set "
                              "training.precision=bf16 (or auto), or split with parallel.context.ulysses.")
        return super().load_denoiser(spec, load_on)

    def prepare(self, module: nn.Module, parameters: list[nn.Parameter]) -> list[nn.Parameter]:
        parameters = super().prepare(module, parameters)
        if parallel.is_distributed():
            parts = list(self.family.denoiser_parts(module).values())
            self.split = SplitModel(parts, self.plan, self.config, self.layout, self.device)
            self.split.enable()
        return parameters

    def backward(self, loss: torch.Tensor) -> None:
        """Each rank's gradient is that of its tokens; the strategy's average over all ranks then needs the loss
        scaled by the ranks of a group (see the module's docstring)."""
        super().backward(loss * self.degree if self.split is not None else loss)

    @contextlib.contextmanager
    def gathered(self, module: nn.Module, everything: bool = False) -> Iterator[None]:
        with super().gathered(module, everything), (self.split.suspended() if self.split is not None
                                                    else contextlib.nullcontext()):
            yield


class ContextDataParallel(ContextParallel, DataParallelStrategy):
    """DDP over all ranks, each sample's tokens split over its data group."""

    name = "ddp"


class ContextFullySharded(ContextParallel, FullyShardedStrategy):
    """FSDP2 sharding over the whole (data x context) mesh, each sample's tokens split over its data group."""

    name = "fsdp"

    def mesh(self) -> Any:
        """FSDP's mesh: the whole (data x context) mesh as one dimension."""
        return self.layout.flattened()
