"""`vidtune plan`: the peak memory of the training device for a config, before any weights are loaded.

The numbers come from running the code, not from formulas about it. The family's components are built from their
config.json files on the `meta` device (`vidtune.memory.meta`), through the spec's and the trainer's own code:
the denoiser is loaded, gradient checkpointing switched on and the adapter (or the full set of trained weights)
configured exactly as training does; then one real-size training step (conditions, latents, the spec's forward,
the loss, the backward pass) runs on meta tensors while `LiveMemory` counts every tensor it creates. The text
encoders and the VAE run the same way over one batch of captions and clips (the precompute stage).

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

import torch
from torch import nn

from vidtune.config import Config
from vidtune.errors import ConfigError, ModelError
from vidtune.memory import _frozen_linears, _skip_patterns
from vidtune.memory.architectures import architecture_folder
from vidtune.memory.meta import META, autocast_on_meta, components_on_meta
from vidtune.memory.tracking import LiveMemory, fused_attention
from vidtune.memory.values import KnownValues, UnknownValue
from vidtune.models.experts import TwoExperts
from vidtune.models.registry import get_spec_class
from vidtune.trainers import build_trainer

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

    @property
    def training_peak(self) -> int:
        return sum(self.training.values())

    @property
    def peak(self) -> int:
        """The largest of the stages (training, or each encoder alone during precompute)."""
        return max([self.training_peak, *self.precompute.values()])

    def to_json(self) -> dict:
        gib = {key: round(value / GIB, 3) for key, value in self.training.items()}
        return {
            "family": self.family, "architecture": self.architecture, "device": self.device,
            "frames_height_width": list(self.shape), "gpus": self.world_size,
            "peak_gib": round(self.peak / GIB, 3), "training_gib": gib,
            "training_peak_gib": round(self.training_peak / GIB, 3),
            "precompute_gib": {key: round(value / GIB, 3) for key, value in self.precompute.items()},
            "encoders_on_training_device": self.on_the_fly, "notes": self.notes,
        }


# ----- the traces ------------------------------------------------------------------------------------------------
@dataclass
class StepTrace:
    """One traced training step: the denoiser as training configured it (on meta), the trained tensors, and the
    largest live count of the forward and backward passes (activations, temporaries and gradients)."""

    denoiser: nn.Module
    parameters: list[nn.Parameter]
    live_peak: int
    traced_grad_bytes: int


def _planned_device(config: Config) -> torch.device:
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


def weight_bytes(denoiser: nn.Module, base_weights: str, blocks_to_swap: int) -> int:
    """Resident bytes of the denoiser's parameters and buffers: quantized layers at their stored size, and with
    block swap only the blocks that stay plus two in flight (the one computing, the one being copied)."""
    sizes = {name: p.untyped_storage().nbytes() for name, p in denoiser.named_parameters()}
    sizes.update({f"buffer:{name}": b.untyped_storage().nbytes() for name, b in denoiser.named_buffers()})
    if base_weights in ("int8", "nf4"):  # traced unquantized; their stored size replaces the dense one
        for name, linear in _frozen_linears(denoiser):
            sizes[f"{name}.weight"] = quantized_linear_bytes(linear, base_weights)
    if blocks_to_swap:
        blocks = transformer_blocks(denoiser)
        if blocks_to_swap > len(blocks):
            raise ConfigError(
                f"memory.blocks_to_swap={blocks_to_swap}, but this denoiser has {len(blocks)} transformer blocks.\n"
                f"What to do: set memory.blocks_to_swap to at most {len(blocks)}."
            )
        swapped = blocks[:blocks_to_swap]
        block_bytes = [sum(sizes.get(f"{prefix}.{name}", 0) for name, p in block.named_parameters()
                           if not p.requires_grad) for prefix, block in swapped]
        for (prefix, block), _ in zip(swapped, block_bytes, strict=True):
            for name, parameter in block.named_parameters():
                if not parameter.requires_grad:
                    sizes[f"{prefix}.{name}"] = 0
        sizes["blocks in flight"] = sum(sorted(block_bytes)[-2:])
    return sum(sizes.values())


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
def _offloading_saved_tensors(live: LiveMemory, enabled: bool) -> Iterator[None]:
    """`memory.activation_offload`: tensors saved for the backward pass leave the device until it reads them."""
    if not enabled:
        yield
        return

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        live.offload(tensor)
        return tensor

    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        live.reload(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def trace_step(config: Config, conditions: dict, latent_shape: tuple[int, ...], device: torch.device) -> StepTrace:
    """Load the denoiser as training does (on meta), configure what trains, then run one training step's forward
    and backward passes, counting what they keep alive."""
    traced_config = config
    if config.memory.base_weights in ("int8", "nf4"):  # quantized storage does not run on meta: traced unquantized
        traced_config = config.model_copy(update={"memory": config.memory.model_copy(
            update={"base_weights": "auto"})})
    trainer = build_trainer(traced_config)
    spec = trainer.spec
    with components_on_meta(spec, device):
        denoiser = spec.load_denoiser(META)
    if isinstance(denoiser, TwoExperts):  # its expert offloading moves weights to the host: accounted instead
        denoiser.offload = False
    if config.training.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    parameters = trainer.configure_trainable(denoiser)
    trained_dtypes = [p.dtype for p in parameters]
    if _uses_bf16(config, device):  # autocast computes the adapters in bf16: traced with bf16 copies of them
        for parameter in parameters:
            parameter.data = parameter.data.to(torch.bfloat16)
    live = LiveMemory()
    live.known([*denoiser.parameters(), *denoiser.buffers(), *_leaves(conditions)])
    denoiser.train()
    batch = config.training.batch_size
    values = KnownValues()
    with fused_attention(device.type), autocast_on_meta(), live, \
            _offloading_saved_tensors(live, config.memory.activation_offload), values:
        noisy = torch.zeros((batch, *latent_shape[1:]), dtype=denoiser.dtype, device=META)
        timesteps = torch.full((batch,), 500.0, device=META)
        batch_conditions = {key: _batched(value, batch) for key, value in conditions.items()}
        # What branches may read, as the measurement feeds it: masks of ones (every token real, the longest
        # caption), encoder outputs that are not all zeros (HunyuanVideo 1.5 tells image-to-video by that).
        for value in batch_conditions.values():
            if isinstance(value, torch.Tensor):
                values.mark(value, 1)
        prediction = spec.forward(denoiser, batch_conditions, noisy, timesteps)
        loss = (prediction.float() - noisy.float()).pow(2).flatten(1).mean(dim=1).sum()
        loss.backward()
        del prediction, loss, noisy, batch_conditions
    traced_grad_bytes = _unique_storage_bytes([p.grad for p in parameters if p.grad is not None])
    for parameter, dtype in zip(parameters, trained_dtypes, strict=True):  # as they train, for the accounting
        parameter.data = parameter.data.to(dtype)
        parameter.grad = None
    return StepTrace(denoiser, parameters, live.peak, traced_grad_bytes)


def account_step(trace: StepTrace, config: Config, device: torch.device) -> dict[str, int]:
    """Weights, gradients, optimizer state and activations of the traced step under `config`'s storage options."""
    parameters, options = trace.parameters, config.optimizer
    gradients = sum(p.numel() * p.element_size() for p in parameters)
    # Traced gradients were the bf16 copies' where training keeps fp32 ones: the difference is added.
    step_peak = max(trace.live_peak + gradients - trace.traced_grad_bytes,
                    gradients + optimizer_step_temporaries(parameters, options.name, device))
    weights = weight_bytes(trace.denoiser, config.memory.base_weights, config.memory.blocks_to_swap)
    if isinstance(trace.denoiser, TwoExperts) and device.type == "cuda" and config.training.batch_size == 1:
        # Wan 2.2 A14B on a GPU: a batch of one clip runs one expert; the idle one's frozen weights wait in host
        # memory (a larger batch may hold clips of both experts, and keeps both on the device).
        weights -= min(_frozen_bytes(expert, config.memory.base_weights) for expert in trace.denoiser.experts())
    return {
        "weights": weights,
        "gradients": gradients,
        "optimizer state": optimizer_state_bytes(parameters, options.name,
                                                 options.cpu_offload and device.type == "cuda"),
        "activations": step_peak - gradients,
    }


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
            for _, linear in _frozen_linears(module):
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
                                        skip_modules_pattern=_skip_patterns(encoder))
        live = LiveMemory()
        live.known([t for encoder in encoders for t in (*encoder.parameters(), *encoder.buffers())])
        with fused_attention(device.type), live, KnownValues():
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
    with fused_attention(device.type), live, KnownValues():
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
    device = _planned_device(config)
    options = config.memory
    if options.blocks_to_swap and config.training.algorithm in ("full", "control-full"):
        raise ConfigError("memory.blocks_to_swap works with adapter training only: full fine-tuning updates the "
                          "swapped weights.\nWhat to do: set memory.blocks_to_swap=0, or train a LoRA.")
    encoders = _encoders(config, device)
    training = shard(account_step(_step(config, device, encoders), config, device), config, world_size)
    on_the_fly = not config.precompute.enabled
    if on_the_fly:  # the encoders stay loaded beside the denoiser; the step's peak is after they ran
        training["text encoders + VAE"] = encoders.text_weights + encoders.vae_weights
        training["activations"] = max(training["activations"], encoders.text_bytes - encoders.text_weights,
                                      encoders.vae_bytes - encoders.vae_weights)
    shape = max(config.data.bucket_shapes(), key=lambda s: s[0] * s[1] * s[2])
    notes = []
    if device.type != "cuda" and (options.blocks_to_swap or options.activation_offload):
        notes.append("blocks_to_swap and activation_offload act on CUDA only; the plan for this device counts them "
                     "as CUDA would.")
    return MemoryPlan(config.model.name, label, device.type, shape, training,
                      {"precompute: text encoders": encoders.text_bytes, "precompute: VAE": encoders.vae_bytes},
                      on_the_fly, world_size, notes)


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


def _step_key(config: Config, device: torch.device) -> tuple:
    """What the traced step depends on (weights' storage and the optimizer are accounted after it)."""
    training = config.training
    return (config.model.model_dump_json(), device.type, tuple(config.data.bucket_shapes()), training.algorithm,
            training.batch_size, training.gradient_checkpointing, training.precision, config.lora.model_dump_json(),
            config.full.model_dump_json(), config.memory.base_weights == "fp8", config.memory.activation_offload)


_ENCODERS: dict[tuple, EncoderTrace] = {}
_STEPS: dict[tuple, StepTrace] = {}


def _encoders(config: Config, device: torch.device) -> EncoderTrace:
    key = _encoder_key(config, device)
    if key not in _ENCODERS:
        _ENCODERS[key] = trace_encoders(config, device)
    return _ENCODERS[key]


def _step(config: Config, device: torch.device, encoders: EncoderTrace) -> StepTrace:
    key = _step_key(config, device)
    if key not in _STEPS:
        latent = encoders.latents["latents_mean"]
        video_conditions = {k: v for k, v in encoders.latents.items() if k not in ("latents_mean", "latents_std")}
        _STEPS[key] = trace_step(config, {**encoders.conditions, **video_conditions}, tuple(latent.shape), device)
    return _STEPS[key]
