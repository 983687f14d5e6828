"""`vidtune plan`: the peak memory of the training device for a config, before any weights are loaded.

The numbers come from running the code, not from formulas about it. The family's components are built from their
config.json files on the `meta` device (`vidtune.memory.meta`), through the spec's and the algorithm part's own code:
the denoiser is loaded, gradient checkpointing switched on and the adapter (or the full set of trained weights)
configured exactly as training does; then one real-size training step (conditions, latents, training's own
loss over the spec's forward, the backward pass) runs on meta tensors while `LiveMemory` counts every tensor it
creates. The text encoders and the VAE run the same way over one batch of captions and clips (the precompute
stage).

What is added by hand, because it does not run on meta tensors or depends on where tensors live:
- the weights, counted from the built modules: frozen linear layers stored as `int8` / `nf4` take their exact
  quantized size (from their shape); `memory.blocks_to_swap` leaves only the resident blocks plus two in flight;
- the optimizer state, from each trained tensor's shape and the optimizer's state layout (`optimizer_state_bytes`);
- bf16 training on CUDA: the step is traced with the trained weights in bf16 (what autocast computes with); their
  gradients are fp32 in training, so the difference is added.
See docs/memory.md ("The planner") for what it does not see.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from vidtune.algorithms import traits_of
from vidtune.algorithms.build import build_part, build_spec
from vidtune.algorithms.losses import NoisyInputs, clip_losses
from vidtune.config import Config
from vidtune.errors import ConfigError, ModelError
from vidtune.memory import fp8_layers, frozen_linears, skip_patterns, stored
from vidtune.memory import single_file as single_files
from vidtune.memory.architectures import architecture_folder
from vidtune.memory.context import split_activations
from vidtune.memory.meta import META, autocast_on_meta, components_on_meta
from vidtune.memory.repeated import RepeatedOps
from vidtune.memory.tracking import LiveMemory, fused_attention, pinned_size
from vidtune.memory.values import KnownValues, UnknownValue
from vidtune.models.registry import get_spec_class
from vidtune.models.spec import Conditions, ModelSpec
from vidtune.offload import check_swapped_weights_frozen

if TYPE_CHECKING:
    from vidtune.algorithms.part import AlgorithmPart
    from vidtune.parallel.strategy import Strategy

GIB = 1024**3
# Tensors smaller than this keep fp32 optimizer state in the low-bit optimizers (bitsandbytes and torchao alike),
# and stay on the GPU under torchao's CPU-offload optimizer.
SMALL_TENSOR = 4096


@dataclass
class MemoryPlan:
    """Bytes on the training device. `training`: weights, gradients, optimizer state, activations (with the
    backward pass's temporaries); `precompute`: the text encoders' and the VAE's stage (each alone on the device,
    weights plus working memory)."""

    family: str
    architecture: str  # the folder whose config.json files were read
    device: str
    shape: tuple[int, int, int]
    training: dict[str, int]
    precompute: dict[str, int]
    on_the_fly: bool  # the text encoders and the VAE stay on the training device while it trains
    world_size: int = 1
    notes: list[str] = field(default_factory=list)
    # Host memory vidtune's savers take while training (pinned offload buffers, swapped blocks, the optimizer's
    # CPU state, an idle expert), and while a quantized base is loaded (the unquantized weights, for a moment).
    host: dict[str, int] = field(default_factory=dict)
    host_loading: int = 0

    @property
    def training_peak(self) -> int:
        return sum(self.training.values())

    @property
    def peak(self) -> int:
        """The largest of the stages (training, or each encoder alone during precompute)."""
        return max([self.training_peak, *self.precompute.values()])

    @property
    def host_peak(self) -> int:
        """The most host memory the savers take (training), or loading a quantized base takes."""
        return max(sum(self.host.values()), self.host_loading)

    def to_json(self) -> dict:
        gib = {key: round(value / GIB, 3) for key, value in self.training.items()}
        return {
            "family": self.family, "architecture": self.architecture, "device": self.device,
            "frames_height_width": list(self.shape), "gpus": self.world_size,
            "peak_gib": round(self.peak / GIB, 3), "training_gib": gib,
            "training_peak_gib": round(self.training_peak / GIB, 3),
            "precompute_gib": {key: round(value / GIB, 3) for key, value in self.precompute.items()},
            "encoders_on_training_device": self.on_the_fly, "notes": self.notes,
            "host_gib": {key: round(value / GIB, 3) for key, value in self.host.items()},
            "host_loading_gib": round(self.host_loading / GIB, 3), "host_peak_gib": round(self.host_peak / GIB, 3),
        }


# ----- the traces ------------------------------------------------------------------------------------------------
@dataclass
class StepTrace:
    """One traced training step: the denoiser as training configured it (on meta), the trained tensors, and the
    largest live count of the forward and backward passes (activations, temporaries and gradients), with every
    tensor on the device and as `memory.activation_offload` holds them (`offload_peak`, with `host_activations`
    bytes of pinned host memory at most)."""

    denoiser: nn.Module
    parameters: list[nn.Parameter]
    live_peak: int
    traced_grad_bytes: int
    offload_peak: int
    host_activations: int


def planned_device(config: Config) -> torch.device:
    """The device the plan is for: training.device, CUDA when `auto` (the planner's question is about a GPU)."""
    device = config.training.device
    return torch.device("cuda" if device == "auto" else device.split(":")[0])


def _uses_bf16(config: Config, device: torch.device) -> bool:
    precision = config.training.precision
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def _unique_storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


def quantized_linear_bytes(linear: nn.Linear, option: str) -> int:
    """The stored size of a frozen linear layer's weight under `option` (`memory.base_weights`)."""
    values = linear.in_features * linear.out_features
    if option == "int8":
        # torchao int8 weight-only: one byte a value, one scale per output row in the weight's dtype.
        return values + linear.out_features * linear.weight.element_size()
    if option == "nf4":
        # bitsandbytes NF4: half a byte a value; one absmax per 64 values, itself quantized to one byte with an
        # fp32 scale per 256 of them (bitsandbytes' default nested quantization), plus the nested offset.
        blocks = math.ceil(values / 64)
        return math.ceil(values / 2) + blocks + 4 * math.ceil(blocks / 256) + 4
    if option == "fp8":
        return values
    return values * linear.weight.element_size()


def _weight_sizes(denoiser: nn.Module, base_weights: str) -> dict[str, int]:
    """Each parameter's and buffer's stored bytes under `base_weights` (traced unquantized: the quantized layers'
    stored size replaces the dense one)."""
    sizes = {name: p.untyped_storage().nbytes() for name, p in denoiser.named_parameters()}
    sizes.update({f"buffer:{name}": b.untyped_storage().nbytes() for name, b in denoiser.named_buffers()})
    if base_weights in ("int8", "nf4"):
        for name, linear in frozen_linears(denoiser):
            sizes[f"{name}.weight"] = quantized_linear_bytes(linear, base_weights)
    elif base_weights == "fp8":  # one byte a value, the layers `store_frozen_weights_in_fp8` casts
        for prefix, layers in _fp8_modules(denoiser):
            for name, layer in layers:
                full = f"{prefix}.{name}" if prefix else name
                for parameter_name, parameter in layer.named_parameters(recurse=False):
                    if not parameter.requires_grad:
                        sizes[f"{full}.{parameter_name}"] = parameter.numel()
    return sizes


def _fp8_modules(denoiser: nn.Module) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
    """(prefix, the layers stored in float8) of the denoiser, or of each of its experts."""
    experts = getattr(denoiser, "experts", None)
    parts = list(zip(("transformer", "transformer_2"), experts(), strict=True)) if callable(experts) \
        else [("", denoiser)]
    found = []
    for prefix, part in parts:
        linears, others = fp8_layers(part)
        found.append((prefix, [*linears, *others]))
    return found


def upcast_bytes(denoiser: nn.Module) -> int:
    """fp8: the largest frozen linear layer's weight and bias in the compute dtype, the copy that exists while it
    computes (one layer at a time, forward and backward: vidtune/memory/float8.py)."""
    largest = 0
    for _, layers in _fp8_modules(denoiser):
        for _, layer in layers:
            values = sum(p.numel() for p in layer.parameters(recurse=False))
            largest = max(largest, values * next(layer.parameters()).element_size())
    return largest


def frozen_block_tensors(denoiser: nn.Module) -> list[list[str]]:
    """The names of each transformer block's frozen parameters, in the order the blocks run."""
    return [[f"{prefix}.{name}" for name, p in block.named_parameters() if not p.requires_grad]
            for prefix, block in transformer_blocks(denoiser)]


def swapped_weight_bytes(denoiser: nn.Module, sizes: dict[str, int], blocks_to_swap: int,
                         blocks: list[list[str]] | None = None) -> list[dict[str, int]]:
    """The frozen tensors' bytes of each of the `blocks_to_swap` swapped blocks (the last ones, as block swap
    picks them). `blocks`: `frozen_block_tensors(denoiser)` when already at hand."""
    blocks = frozen_block_tensors(denoiser) if blocks is None else blocks
    if blocks_to_swap > len(blocks):
        raise ConfigError(
            f"memory.blocks_to_swap={blocks_to_swap}, but this denoiser has {len(blocks)} transformer blocks.\n"
            f"What to do: set memory.blocks_to_swap to at most {len(blocks)}."
        )
    swapped = blocks[len(blocks) - blocks_to_swap:] if blocks_to_swap else []
    return [{name: sizes.get(name, 0) for name in block} for block in swapped]


def weight_bytes(denoiser: nn.Module, base_weights: str, blocks_to_swap: int,
                 sizes: dict[str, int] | None = None, blocks: list[list[str]] | None = None) -> int:
    """The denoiser's weights on the training device: all parameters and buffers, quantized layers at their stored
    size; with block swap only the blocks that stay plus two in flight (the one computing, the one being copied).
    `sizes`, `blocks`: `_weight_sizes(denoiser, base_weights)`, `frozen_block_tensors(denoiser)` when at hand."""
    sizes = dict(_weight_sizes(denoiser, base_weights) if sizes is None else sizes)
    if not blocks_to_swap:
        return sum(sizes.values())
    swapped = swapped_weight_bytes(denoiser, sizes, blocks_to_swap, blocks)
    for block in swapped:
        for name in block:
            sizes[name] = 0
    return sum(sizes.values()) + sum(sorted(sum(block.values()) for block in swapped)[-2:])


def _frozen_bytes(module: nn.Module, base_weights: str) -> int:
    trained = sum(p.untyped_storage().nbytes() for p in module.parameters() if p.requires_grad)
    return weight_bytes(module, base_weights, 0) - trained


def transformer_blocks(denoiser: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks (the items of every `...blocks` ModuleList), in the order they run."""
    return [(f"{name}.{index}", block) for name, child in denoiser.named_children()
            if isinstance(child, nn.ModuleList) and name.endswith("blocks") for index, block in enumerate(child)]


def optimizer_state_bytes(parameters: list[nn.Parameter], name: str, cpu_offload: bool) -> int:
    """The optimizer state on the training device for these trained tensors (docs/memory.md's table)."""
    total = 0
    for parameter in parameters:
        values, size = parameter.numel(), parameter.element_size()
        if cpu_offload and values >= SMALL_TENSOR:
            continue  # torchao's CPU-offload optimizer keeps it in host memory
        small = values < SMALL_TENSOR
        if name in ("adamw8bit", "paged_adamw8bit", "adamw8bit_ao", "adamw_fp8_ao"):
            # Two one-byte moments, an fp32 scale per block of 256 (bitsandbytes: also per 256).
            total += 2 * values * size if small else 2 * values + 2 * 4 * math.ceil(values / 256)
        elif name == "adamw4bit_ao":
            total += 2 * values * size if small else values + 2 * 4 * math.ceil(values / 128)
        elif name == "prodigy":
            total += 4 * values * size  # moments, the starting point and its running sum
        elif name in ("came", "adafactor"):
            rows_cols = sum(parameter.shape[-2:]) if parameter.dim() >= 2 else values
            # CAME: the first moment, row / column statistics of the second moment and of the confidence.
            total += (values + 2 * rows_cols) * size if name == "came" else rows_cols * size
        else:  # adamw
            total += 2 * values * size
    return total


def optimizer_step_temporaries(parameters: list[nn.Parameter], name: str, device: torch.device) -> int:
    """Working memory of the optimizer's step: torch's AdamW on CUDA runs on all tensors at once (`foreach`), one
    temporary the size of all trained weights; elsewhere one tensor at a time."""
    if not parameters:
        return 0
    largest = max(p.numel() * p.element_size() for p in parameters)
    if name in ("adamw", "prodigy") and device.type == "cuda":
        return sum(p.numel() * p.element_size() for p in parameters)
    if name in ("adamw8bit", "paged_adamw8bit") and device.type != "cuda":
        # bitsandbytes' CPU kernel (backends/cpu/ops.py) dequantizes both moments to fp32 beside an fp32 copy of the
        # gradient, and its update makes two more: five fp32 copies of a tensor at a time (CUDA's kernel is fused).
        return 5 * max(p.numel() * 4 for p in parameters)
    return 2 * largest


@contextlib.contextmanager
def _saved_tensors_counted(live: LiveMemory) -> Iterator[None]:
    """Tensors saved for the backward pass are counted as `memory.activation_offload` would hold them (in host
    memory until the backward pass reads them), beside the plain count."""

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        live.offload(tensor)
        return tensor

    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        live.reload(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


@dataclass
class TracedModel:
    """The denoiser loaded and configured as training does (on meta), ready for traced steps."""

    spec: ModelSpec
    part: AlgorithmPart
    denoiser: nn.Module
    parameters: list[nn.Parameter]
    trained_dtypes: list[torch.dtype]
    conditions: dict
    latent_shape: tuple[int, ...]


@dataclass(frozen=True)
class _Counts:
    """What one traced step gives: the device's peak with and without activation offload, the most saved bytes in
    host memory at once, and the gradients' bytes."""

    live_peak: int
    offload_peak: int
    host_activations: int
    grad_bytes: int

    def __sub__(self, other: _Counts) -> _Counts:
        return _Counts(*(a - b for a, b in zip(self.values(), other.values(), strict=True)))

    def values(self) -> tuple[int, ...]:
        return (self.live_peak, self.offload_peak, self.host_activations, self.grad_bytes)

    def plus(self, other: _Counts, times: int) -> _Counts:
        return _Counts(*(a + times * b for a, b in zip(self.values(), other.values(), strict=True)))


class UnweightedLoss:
    """The objective as the traced loss sees it: its loss weights multiply each clip's error (a value per clip, no
    memory to count), so they are left at one; the shipped architectures hold no scheduler settings to read them."""

    level_name = "sigmas"

    def loss_weights(self, levels: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(levels)


@dataclass(frozen=True)
class TracedStep:
    """What training's loss reads (`vidtune.algorithms.losses.LossContext`), for a traced step on meta: autocast is
    the trace's own (`autocast_on_meta`), no data-parallel wrapper, no caption dropout."""

    config: Config
    model: TracedModel
    planned: torch.device

    @property
    def spec(self) -> ModelSpec:
        return self.model.spec

    @property
    def part(self) -> AlgorithmPart:
        return self.model.part

    objective = UnweightedLoss()

    @property
    def denoiser(self) -> nn.Module:
        return self.model.denoiser

    @property
    def trained_denoiser(self) -> nn.Module:
        return self.model.denoiser

    device = torch.device(META)
    bf16 = False
    empty_caption: Conditions = field(default_factory=dict)
    step = 0

    @property
    def strategy(self) -> Strategy:
        raise NotImplementedError("a traced step has no parallel strategy")


# Lists of blocks are traced with this many blocks and one and two more (see `trace_step`): the first block is
# unlike the others (its input carries no gradient), so the counts grow evenly from the second on.
TRACED_BLOCKS = 2
# Blocks traced beyond 4 at most, one at a time, while the counts do not grow evenly yet (see `_partial_counts`).
MORE_BLOCKS = 3


def build_traced_model(config: Config, conditions: dict, latent_shape: tuple[int, ...],
                       device: torch.device) -> TracedModel:
    """Load the denoiser as training does (on meta) and configure what trains. Storage options (`fp8`, `int8`,
    `nf4`, block swap) and the activation savers are accounted from the trace, so it is built with none of them."""
    memory = config.memory.model_copy(update={"base_weights": "auto", "blocks_to_swap": 0,
                                              "activation_offload": False})
    training = config.training.model_copy(update={"gradient_checkpointing": False})
    traced = config.model_copy(update={"memory": memory, "training": training})
    spec = build_spec(traced)
    part = build_part(traced, spec)
    with components_on_meta(spec, device):
        denoiser = spec.load_denoiser(META)
    spec.keep_weights_placed(denoiser)  # a denoiser moving its own weights to the host: accounted instead
    with torch.device(META):  # the adapter's new weights are made on meta too (nothing to initialise)
        parameters = part.configure(denoiser)
    return TracedModel(spec, part, denoiser, parameters, [p.dtype for p in parameters], conditions, latent_shape)


def trace_step(model: TracedModel, config: Config, device: torch.device, checkpointing: bool) -> StepTrace:
    """One training step's forward and backward passes on meta, counting what they keep alive.

    Transformer blocks repeat: each block after the first keeps what the one before it kept, so the counts grow
    by the same amount with each block. Each long list of blocks is traced with 2, 3 and 4 of its blocks (the
    others left out; a few more when the first counts do not grow evenly yet), and the growth is carried on to all
    N; when no three in a row lie on a line (or the model cannot run with fewer blocks), the whole model is traced
    instead. Where the peak of a few blocks is one
    block's working memory rather than what piles up, the device's peaks are carried on by the blocks' gradients
    (an upper bound, by at most the gradients' bytes: tests/memory/test_memory_plan.py)."""
    denoiser = model.denoiser
    _set_checkpointing(denoiser, checkpointing)
    if _uses_bf16(config, device):  # autocast computes the adapters in bf16: traced with bf16 copies of them
        for parameter in model.parameters:
            parameter.data = parameter.data.to(torch.bfloat16)
    try:
        lists = [blocks for blocks in _block_lists(denoiser) if len(blocks) > TRACED_BLOCKS + 2]
        counts = _partial_counts(model, config, device, lists) if lists else None
        if counts is None:
            counts = _count_step(model, config, device)
    finally:
        for parameter, dtype in zip(model.parameters, model.trained_dtypes, strict=True):  # as they train
            parameter.data = parameter.data.to(dtype)
            parameter.grad = None
    return StepTrace(denoiser, model.parameters, counts.live_peak, counts.grad_bytes, counts.offload_peak,
                     counts.host_activations)


def _partial_counts(model: TracedModel, config: Config, device: torch.device,
                    lists: list[nn.ModuleList]) -> _Counts | None:
    """The counts of the whole model from steps with a few blocks of each list (None: they are not linear in the
    number of blocks, or the model does not run with fewer blocks).

    Each list is traced with 2, 3 and 4 of its blocks, the others at 2. Where the first blocks' counts do not grow
    evenly yet (the peak with 2 blocks is one block's working memory, with more the blocks' gradients piling up), one
    more block at a time is traced, up to `MORE_BLOCKS` more, until three in a row grow by the same amount."""
    base = [TRACED_BLOCKS] * len(lists)
    try:
        with _first_blocks(lists, base):
            first = _count_step(model, config, device)
        total = first
        for index, blocks in enumerate(lists):
            steps = [first]
            for count in range(TRACED_BLOCKS + 1, min(len(blocks), TRACED_BLOCKS + 2 + MORE_BLOCKS) + 1):
                with _first_blocks(lists, [count if i == index else c for i, c in enumerate(base)]):
                    steps.append(_count_step(model, config, device))
                if len(steps) >= 3 and steps[-1] - steps[-2] == steps[-2] - steps[-3]:
                    break
            else:
                return None
            per_block = steps[-1] - steps[-2]
            # A peak of a few blocks may be one block's working memory (the same for any number of blocks) where
            # many blocks' gradients, which pile up in the backward pass, would exceed it: the device's peaks grow
            # at least by a block's gradients (at most the gradients' bytes over the true peak).
            grown = max(per_block.grad_bytes, 0)
            per_block = _Counts(max(per_block.live_peak, grown), max(per_block.offload_peak, grown),
                                per_block.host_activations, per_block.grad_bytes)
            # This list's share: what it added up to the first of the three even steps, the growth from there on.
            start = TRACED_BLOCKS + len(steps) - 3
            total = total.plus(steps[-3] - first, 1).plus(per_block, len(blocks) - start)
    except (IndexError, KeyError, ValueError):  # the model reads blocks beyond those left (e.g. by index)
        for parameter in model.parameters:  # the whole model is traced next, from no gradients
            parameter.grad = None
        return None
    return total


def _count_step(model: TracedModel, config: Config, device: torch.device) -> _Counts:
    denoiser = model.denoiser
    live = LiveMemory()
    live.known([*denoiser.parameters(), *denoiser.buffers(), *_leaves(model.conditions)])
    denoiser.train()
    batch = config.training.batch_size
    values = KnownValues()
    with RepeatedOps(), fused_attention(device.type), autocast_on_meta(), live, _saved_tensors_counted(live), values:
        noisy = torch.zeros((batch, *model.latent_shape[1:]), dtype=denoiser.dtype, device=META)
        timesteps = torch.full((batch,), 500.0, device=META)
        batch_conditions = {key: _batched(value, batch) for key, value in model.conditions.items()}
        # What branches may read, as the measurement feeds it: masks of ones (every token real, the longest
        # caption), encoder outputs that are not all zeros (HunyuanVideo 1.5 tells image-to-video by that).
        for value in batch_conditions.values():
            if isinstance(value, torch.Tensor):
                values.mark(value, 1)
        # Training's own per-clip loss (vidtune/algorithms/losses.py), the noisy latents standing in for the target.
        inputs = NoisyInputs(batch_conditions, noisy, timesteps, noisy.float(), torch.full((batch,), 0.5))
        loss = clip_losses(TracedStep(config, model, device), inputs, denoiser).sum()
        loss.backward()
        del inputs, loss, noisy, batch_conditions
    grad_bytes = _unique_storage_bytes([p.grad for p in model.parameters if p.grad is not None])
    for parameter in model.parameters:
        parameter.grad = None
    return _Counts(live.peak, live.offload_peak, live.host_peak, grad_bytes)


def _block_lists(denoiser: nn.Module) -> list[nn.ModuleList]:
    """Every list of repeated transformer blocks (`...blocks` ModuleLists, an expert's included): blocks of one
    shape. A list whose blocks change the width as they go (Wan Animate's motion encoder `res_blocks`) cannot run
    with fewer of them, and is traced whole."""
    return [module for name, module in denoiser.named_modules()
            if isinstance(module, nn.ModuleList) and name.rpartition(".")[2].endswith("blocks")
            and len({tuple(p.shape for p in block.parameters()) for block in module}) <= 1]


@contextlib.contextmanager
def _first_blocks(lists: list[nn.ModuleList], counts: list[int]) -> Iterator[None]:
    """While inside: each list holds only its first `count` blocks."""
    saved = [blocks._modules for blocks in lists]
    for blocks, count in zip(lists, counts, strict=True):
        blocks._modules = dict(list(blocks._modules.items())[:count])
    try:
        yield
    finally:
        for blocks, modules in zip(lists, saved, strict=True):
            blocks._modules = modules


def _set_checkpointing(denoiser: nn.Module, enabled: bool) -> None:
    if enabled:
        denoiser.enable_gradient_checkpointing()
        return
    for module in denoiser.modules():
        if hasattr(module, "disable_gradient_checkpointing") and hasattr(module, "_gradient_checkpointing_func"):
            module.disable_gradient_checkpointing()


def account_step(trace: StepTrace, config: Config, device: torch.device) -> dict[str, int]:
    """Weights, gradients, optimizer state and activations of the traced step under `config`'s storage options."""
    parameters, options = trace.parameters, config.optimizer
    gradients = sum(p.numel() * p.element_size() for p in parameters)
    offloaded = config.memory.activation_offload
    live_peak = trace.offload_peak if offloaded else trace.live_peak
    if config.memory.base_weights == "fp8":  # one layer's upcast copy at a time (traced unquantized)
        live_peak += _cached(trace, "upcast", lambda: upcast_bytes(trace.denoiser))
    # Traced gradients were the bf16 copies' where training keeps fp32 ones: the difference is added.
    step_peak = max(live_peak + gradients - trace.traced_grad_bytes,
                    gradients + optimizer_step_temporaries(parameters, options.name, device))
    base, blocks = config.memory.base_weights, config.memory.blocks_to_swap
    weights = _cached(trace, ("weights", base, blocks),
                      lambda: weight_bytes(trace.denoiser, base, blocks, _sizes(trace, base), _blocks(trace)))
    # Parts of the denoiser that take turns on the device (Wan 2.2 A14B's experts): the idle ones' frozen weights
    # wait in host memory.
    weights -= _idle_part_bytes(trace, config, device)
    return {
        "weights": weights,
        "gradients": gradients,
        "optimizer state": optimizer_state_bytes(parameters, options.name,
                                                 options.cpu_offload and device.type == "cuda"),
        "activations": step_peak - gradients,
    }


def _idle_part_bytes(trace: StepTrace, config: Config, device: torch.device) -> int:
    """The frozen weights of the denoiser's parts that wait in host memory while another part holds the device
    (`ModelSpec.parts_taking_turns`): all but the largest part's, whichever part a step runs."""
    spec = get_spec_class(config.model.name)(config.model)
    parts = spec.parts_taking_turns(trace.denoiser, device, config.training.batch_size)
    if not parts:
        return 0
    base_weights = config.memory.base_weights
    frozen = _cached(trace, ("idle", base_weights, *map(id, parts)),
                     lambda: [_frozen_bytes(part, base_weights) for part in parts])
    return sum(frozen) - max(frozen)


def _sizes(trace: StepTrace, base_weights: str) -> dict[str, int]:
    return _cached(trace, ("sizes", base_weights), lambda: _weight_sizes(trace.denoiser, base_weights))


def _blocks(trace: StepTrace) -> list[list[str]]:
    return _cached(trace, "blocks", lambda: frozen_block_tensors(trace.denoiser))


def _cached(trace: StepTrace, key: object, compute):
    """Sums over the denoiser's tensors, computed once per traced denoiser (the suggestion search asks often)."""
    full = (id(trace.denoiser), key)
    accounted = TRACES.accounted
    if full not in accounted:
        accounted[full] = compute()
    return accounted[full]


def account_host(trace: StepTrace, config: Config, device: torch.device) -> dict[str, int]:
    """What the memory savers keep in host memory while training: activation offload's pinned copies of the saved
    activations (the most held at once), block swap's pinned copies of the swapped blocks' frozen weights, torchao's
    CPU-offload optimizer (a pinned copy of each large trained tensor and of its gradient, and the optimizer's state),
    and Wan 2.2 A14B's idle expert. Pinned blocks are rounded up to a power of two, as torch's host allocator does."""
    memory, host = config.memory, {}
    if memory.activation_offload:
        host["activation offload (pinned)"] = trace.host_activations
    if memory.blocks_to_swap:
        host["block swap (pinned)"] = _cached(trace, ("swapped", memory.base_weights, memory.blocks_to_swap),
                                              lambda: _swapped_host_bytes(trace, memory.base_weights,
                                                                          memory.blocks_to_swap))
    if config.optimizer.cpu_offload and device.type == "cuda":
        large = [p for p in trace.parameters if p.numel() >= SMALL_TENSOR]
        host["optimizer (CPU offload)"] = sum(2 * pinned_size(p.numel() * p.element_size()) for p in large) + \
            optimizer_state_bytes(large, config.optimizer.name, cpu_offload=False)
    idle = _idle_part_bytes(trace, config, device)
    if idle:
        host["idle expert"] = idle
    return host


def _swapped_host_bytes(trace: StepTrace, base_weights: str, blocks_to_swap: int) -> int:
    swapped = swapped_weight_bytes(trace.denoiser, _sizes(trace, base_weights), blocks_to_swap, _blocks(trace))
    # int8 / nf4 tensors are not plain tensors: copied to pageable host memory at their size.
    pinned = base_weights in ("auto", "fp8")
    return sum(pinned_size(size) if pinned else size for block in swapped for size in block.values())


def loading_host(trace: StepTrace, config: Config, device: torch.device,
                 files: list[single_files.FileHeader] | None = None) -> int:
    """A quantized base for a GPU is loaded and quantized in host memory (vidtune/offload.py `loading_device`): the
    unquantized weights are there for a moment. A denoiser from single files (`files`) is read in host memory on
    any device (vidtune/memory/single_file.py)."""
    base_weights = config.memory.base_weights
    quantized = 0
    if base_weights != "auto" and device.type == "cuda":
        quantized = _cached(trace, ("weights", "auto", 0),
                            lambda: weight_bytes(trace.denoiser, "auto", 0, _sizes(trace, "auto")))
    if not files:
        return quantized
    kept = "fp8" if all(single_files.kept_in_float8(header, base_weights) for header in files) else "auto"
    loaded = _cached(trace, ("weights", kept, 0), lambda: weight_bytes(trace.denoiser, kept, 0, _sizes(trace, kept)))
    experts = getattr(trace.denoiser, "experts", None)
    per_file = loaded // (2 if callable(experts) else 1)  # the files are read one after the other
    return max(quantized, *(single_files.loading_bytes(header, per_file, base_weights) for header in files))


def _leaves(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    return []


def _batched(value: object, batch: int) -> object:
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == 1 and batch > 1:
        return value.expand(batch, *value.shape[1:]).contiguous()
    return value


# ----- the precompute stage ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EncoderTrace:
    conditions: dict  # meta tensors of one caption's conditions
    latents: dict  # meta tensors of one clip's latents
    text_bytes: int  # the text encoders' weights plus their working memory for one batch
    text_weights: int
    vae_bytes: int
    vae_weights: int


def _module_bytes(modules: list[nn.Module], option: str = "auto") -> int:
    total = 0
    for module in modules:
        tensors = [*module.parameters(), *module.buffers()]
        total += _unique_storage_bytes(tensors)
        if option in ("int8", "nf4"):
            for _, linear in frozen_linears(module):
                total += quantized_linear_bytes(linear, option) - linear.weight.untyped_storage().nbytes()
    return total


def trace_encoders(config: Config, device: torch.device) -> EncoderTrace:
    """The text encoders over a batch of captions and the VAE over a batch of clips, on meta: their outputs'
    shapes, and each stage's weights and peak working memory."""
    spec = get_spec_class(config.model.name)(config.model, frame_rate=config.frame_rate)
    option = config.memory.text_encoder_weights
    frames, height, width = max(config.data.bucket_shapes(), key=lambda shape: shape[0] * shape[1] * shape[2])
    batch = 1 if config.memory.vae_tiling else config.precompute.batch_size
    with components_on_meta(spec, device):
        text = spec.load_text_components(META)
        encoders = [module for name, module in text.modules.items()
                    if name.startswith("text_encoder") and isinstance(module, nn.Module)]
        if option == "fp8":
            from diffusers.hooks import apply_layerwise_casting

            for encoder in encoders:
                apply_layerwise_casting(encoder, storage_dtype=torch.float8_e4m3fn, compute_dtype=encoder.dtype,
                                        skip_modules_pattern=skip_patterns(encoder))
        live = LiveMemory()
        live.known([t for encoder in encoders for t in (*encoder.parameters(), *encoder.buffers())])
        with RepeatedOps(), fused_attention(device.type), live, KnownValues():
            conditions = spec.prepare_conditions(text, ["a"] * config.precompute.batch_size)
        text_weights = _module_bytes(encoders, option)
        text_bytes = text_weights + live.peak
        conditions = {key: value[:1] for key, value in conditions.items()}
        vae = spec.load_vae(META)
    vae_modules = [module for module in (vae, *vars(vae).values()) if isinstance(module, nn.Module)]
    if config.memory.vae_tiling:
        for module in vae_modules:
            if hasattr(module, "enable_tiling"):
                module.enable_tiling()
    live = LiveMemory()
    live.known([t for module in vae_modules for t in (*module.parameters(), *module.buffers())])
    # The clips are real (zeros) host tensors, as decoded clips are: image-to-video families read the first frame's
    # pixels (an image processor, a seed from its content). Only the device's copy of them is counted.
    videos = torch.zeros(batch, frames, 3, height, width)
    with RepeatedOps(), fused_attention(device.type), live, KnownValues():
        latents = spec.prepare_latents(vae, videos)
        latents = {key: value[:1] for key, value in latents.items()}
    vae_weights = _module_bytes(vae_modules)
    return EncoderTrace(conditions, latents, text_bytes, text_weights, vae_weights + live.peak, vae_weights)


# ----- the plan ------------------------------------------------------------------------------------------------
def resolve_architecture(config: Config) -> tuple[Config, str]:
    """The config with model.pretrained pointing at the folder whose config.json files describe the model (a local
    folder as it is; a hub id: the architecture shipped with vidtune)."""
    folder, label = architecture_folder(config.model.pretrained, config.model.name)
    model = config.model.model_copy(update={"pretrained": str(folder)})
    return config.model_copy(update={"model": model}), label


def plan_memory(config: Config, world_size: int = 1) -> MemoryPlan:
    """The predicted peak memory of one training device for `config` (see the module's docstring)."""
    try:
        return _plan(config, world_size)
    except UnknownValue as error:
        raise ModelError(f"vidtune plan cannot plan {config.model.name} with these settings: {error}.\nWhat to do: "
                         "measure instead: a short `vidtune train` with training.steps=2 and `nvidia-smi` beside it."
                         ) from error


def _plan(config: Config, world_size: int) -> MemoryPlan:
    config, label = resolve_architecture(config)
    device = planned_device(config)
    options = config.memory
    check_swapped_weights_frozen(options.blocks_to_swap, traits_of(config))
    encoders = _encoders(config, device)
    step = _step(config, device, encoders)
    training = shard(account_step(step, config, device), config, world_size)
    # parallel.context: each rank holds part of every sample's tokens (vidtune/memory/context.py).
    training = split_activations(training, config, world_size, getattr(step.denoiser, "config", {}),
                                 tuple(encoders.latents["latents_mean"].shape), 2 if _uses_bf16(config, device) else 4)
    on_the_fly = not config.precompute.enabled
    if on_the_fly:  # the encoders stay loaded beside the denoiser; the step's peak is after they ran
        training["text encoders + VAE"] = encoders.text_weights + encoders.vae_weights
        training["activations"] = max(training["activations"], encoders.text_bytes - encoders.text_weights,
                                      encoders.vae_bytes - encoders.vae_weights)
    shape = max(config.data.bucket_shapes(), key=lambda s: s[0] * s[1] * s[2])
    files = single_files.headers(build_spec(config))
    notes = single_files.notes(files, options.base_weights, single_files.denoiser_dtype(step.denoiser))
    if config.parallel.context.degree > world_size:
        notes.append(f"parallel.context splits each sample over {config.parallel.context.degree} GPUs; this plan for "
                     f"{world_size} does not split it (plan with --gpus {config.parallel.context.degree} or more).")
    if device.type != "cuda" and (options.blocks_to_swap or options.activation_offload):
        notes.append("blocks_to_swap and activation_offload act on CUDA only; the plan for this device counts them "
                     "as CUDA would.")
    return MemoryPlan(config.model.name, label, device.type, shape, training,
                      {"precompute: text encoders": encoders.text_bytes, "precompute: VAE": encoders.vae_bytes},
                      on_the_fly, world_size, notes, account_host(step, config, device),
                      loading_host(step, config, device, files))


def shard(training: dict[str, int], config: Config, world_size: int) -> dict[str, int]:
    """Per-device bytes when `parallel.strategy` shards over `world_size` devices (FSDP2: weights, but a quantized
    base, gradients and optimizer state; DeepSpeed ZeRO 1 / 2 / 3: the optimizer state, then gradients, then
    weights)."""
    if world_size <= 1:
        return training
    strategy = config.parallel.strategy
    # FSDP keeps a quantized base whole on every device (only the small adapter's weights would divide).
    fsdp = ("gradients", "optimizer state") if config.memory.base_weights != "auto" else \
        ("weights", "gradients", "optimizer state")
    sharded = {"fsdp": fsdp,
               "deepspeed": ("optimizer state", "gradients", "weights")[:config.parallel.zero_stage]}.get(strategy, ())
    return {key: math.ceil(value / world_size) if key in sharded else value for key, value in training.items()}


# The traces depend on a few settings only; the suggestion search re-uses them across many candidate configs.
def _encoder_key(config: Config, device: torch.device) -> tuple:
    return (config.model.model_dump_json(), device.type, config.memory.text_encoder_weights,
            config.memory.vae_tiling, config.precompute.batch_size, tuple(config.data.bucket_shapes()))


def _model_key(config: Config, device: torch.device) -> tuple:
    """What the traced denoiser and its steps depend on: the weights' storage, block swap, activation offload and
    the optimizer are accounted from the trace; gradient checkpointing is one of its two kinds of step."""
    training = config.training
    return (config.model.model_dump_json(), device.type, tuple(config.data.bucket_shapes()), training.algorithm,
            training.batch_size, training.precision, config.lora.model_dump_json(), config.full.model_dump_json(),
            config.adapter.model_dump_json())


@dataclass
class Traces:
    """What the planner traced in this process, by the settings each depends on: the encoders' outputs, the traced
    denoisers, their steps, and sums over a traced denoiser's tensors. The suggestion search plans many configs that
    share them. `TRACES` is the process's; replace it with a new `Traces()` to plan from nothing (a test that counts
    the traces)."""

    encoders: dict[tuple, EncoderTrace] = field(default_factory=dict)
    models: dict[tuple, TracedModel] = field(default_factory=dict)
    steps: dict[tuple, StepTrace] = field(default_factory=dict)
    accounted: dict[tuple, object] = field(default_factory=dict)


TRACES = Traces()
# `vidtune plan` keeps the traces on disk between runs (vidtune/memory/stored.py); the library does not by default.
STORED_TRACES = False


@contextlib.contextmanager
def traces_kept_on_disk() -> Iterator[None]:
    """While inside: traces are read from and written to disk (vidtune/memory/stored.py)."""
    global STORED_TRACES
    before, STORED_TRACES = STORED_TRACES, True
    try:
        yield
    finally:
        STORED_TRACES = before


def _stored_key(kind: str, config: Config, key: tuple) -> str:
    """The trace's digest: its key with the model folder's path replaced by its settings files' contents."""
    model = config.model.model_copy(update={"pretrained": stored.folder_digest(config.model.pretrained)})
    return stored.trace_digest(kind, (model.model_dump_json(), *key[1:]))


def _encoders(config: Config, device: torch.device) -> EncoderTrace:
    key = _encoder_key(config, device)
    encoders = TRACES.encoders
    if key not in encoders:
        encoders[key] = _stored_encoders(config, device, key) if STORED_TRACES else trace_encoders(config, device)
    return encoders[key]


def _stored_encoders(config: Config, device: torch.device, key: tuple) -> EncoderTrace:
    digest = _stored_key("encoders", config, key)
    found = stored.load(digest)
    if found is not None:
        return EncoderTrace(stored.tensors_from_json(found["conditions"]), stored.tensors_from_json(found["latents"]),
                            *found["bytes"])
    trace = trace_encoders(config, device)
    conditions, latents = stored.tensors_to_json(trace.conditions), stored.tensors_to_json(trace.latents)
    if conditions is not None and latents is not None:
        stored.store(digest, {"conditions": conditions, "latents": latents, "bytes": [
            trace.text_bytes, trace.text_weights, trace.vae_bytes, trace.vae_weights]})
    return trace


def _traced_model(config: Config, device: torch.device, encoders: EncoderTrace) -> TracedModel:
    key = _model_key(config, device)
    models = TRACES.models
    if key not in models:
        latent = encoders.latents["latents_mean"]
        video_conditions = {k: v for k, v in encoders.latents.items() if k not in ("latents_mean", "latents_std")}
        models[key] = build_traced_model(config, {**encoders.conditions, **video_conditions}, tuple(latent.shape),
                                         device)
    return models[key]


def _step(config: Config, device: torch.device, encoders: EncoderTrace) -> StepTrace:
    checkpointing = config.training.gradient_checkpointing
    key = (*_model_key(config, device), checkpointing)
    steps = TRACES.steps
    if key not in steps:
        model = _traced_model(config, device, encoders)
        if not STORED_TRACES:
            steps[key] = trace_step(model, config, device, checkpointing)
            return steps[key]
        digest = _stored_key("step", config, key)
        found = stored.load(digest)
        if found is None:
            trace = trace_step(model, config, device, checkpointing)
            stored.store(digest, {"counts": [trace.live_peak, trace.traced_grad_bytes, trace.offload_peak,
                                             trace.host_activations]})
        else:
            trace = StepTrace(model.denoiser, model.parameters, *found["counts"])
        steps[key] = trace
    return steps[key]


def traced_step(config: Config, device: torch.device) -> StepTrace:
    """The traced training step of `config` (its architecture resolved: see `resolve_architecture`) on `device`,
    traced once per process for the settings it depends on."""
    return _step(config, device, _encoders(config, device))
