"""Memory savers that change how weights are stored, not what is trained.

`memory.base_weights` stores the frozen denoiser of an adapter run in less memory:
- `fp8`: float8 (e4m3) storage, each layer upcast to the compute dtype as it runs (linear layers by their own
  forward, whose backward pass keeps the float8 weight: vidtune/memory/float8.py; any other layer by diffusers'
  layerwise casting);
- `int8`: torchao's int8 weight-only quantization of the frozen linear layers (CPU and CUDA);
- `nf4`: bitsandbytes' 4-bit NormalFloat linear layers (QLoRA), computing in the denoiser's dtype.
The layers diffusers keeps in full precision for layerwise casting (norms, patch / position embeddings, the input
and output projections) keep it here too. The adapter itself is always fp32 and saved on its own, so it loads
into the normal, unquantized pipeline.

`memory.text_encoder_weights` does the same for the text encoders (`store_text_encoder_weights`), wherever
captions are encoded.

`prepare_base_weights` runs before the adapter is added (peft then wraps the 4-bit layers with its own
bitsandbytes LoRA layer), `finish_base_weights` after it (the int8 weights are swapped in under the adapter's
wrapped layers, which leaves the adapter's own layers untouched).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from vidtune.algorithms.adapters import LOHA_TENSORS, LOKR_TENSORS
from vidtune.errors import ConfigError, ModelError
from vidtune.memory.float8 import FLOAT8_DTYPES, store_linear_in_float8

if TYPE_CHECKING:
    from vidtune.models.spec import TextComponents

ADAPTER_LAYERS = ("lora_A", "lora_B", "lora_embedding", "lora_magnitude_vector", *LOKR_TENSORS, *LOHA_TENSORS)


def store_frozen_weights_in_fp8(denoiser: nn.Module, keep: tuple[str, ...] = ()) -> None:
    """Keep the denoiser's weights in float8 (e4m3) and upcast each layer to the compute dtype as it runs.

    Done before adapters are added, so only the frozen base layers are affected; norms, embeddings and other
    precision-sensitive layers are skipped by the model's (or diffusers' default) layerwise casting patterns. The
    compute dtype is the one the denoiser was loaded in (bf16 on GPU, fp32 on CPU by default). The linear layers
    become `Float8StorageLinear`s (vidtune/memory/float8.py: the backward pass keeps the float8 weight, not an
    upcast copy; torch.compile traces the upcast); any other layer layerwise casting would cast gets diffusers'
    hook.
    """
    experts = getattr(denoiser, "experts", None)
    if callable(experts):  # Wan 2.2 A14B's two experts (vidtune.models.experts): each casts its own layers
        for name, expert in zip(("transformer", "transformer_2"), experts(), strict=True):
            store_frozen_weights_in_fp8(expert, tuple(k.removeprefix(f"{name}.") for k in keep
                                                      if k.startswith(f"{name}.")))
        return
    from diffusers.hooks.layerwise_casting import apply_layerwise_casting_hook

    compute_dtype = denoiser.dtype
    linears, others = fp8_layers(denoiser, keep)
    for _, linear in linears:
        store_linear_in_float8(linear, compute_dtype)
    for _, layer in others:
        weight = getattr(layer, "weight", None)  # a float8 file's own float8 dtype is kept (e5m2 too)
        storage = weight.dtype if weight is not None and weight.dtype in FLOAT8_DTYPES else torch.float8_e4m3fn
        apply_layerwise_casting_hook(layer, storage, compute_dtype, non_blocking=False)
    if denoiser.dtype != compute_dtype:  # its first weight is float8 (every family's is a layer kept as it is)
        raise ModelError(f"memory.base_weights=fp8: {type(denoiser).__name__}'s first weight is stored in float8, "
                         "which would make it compute in float8.\nWhat to do: set memory.base_weights=int8 (or "
                         "auto) for this model.")


def fp8_layers(denoiser: nn.Module, keep: tuple[str, ...] = ()) -> tuple[list[tuple[str, nn.Linear]],
                                                                          list[tuple[str, nn.Module]]]:
    """The layers `memory.base_weights=fp8` stores in float8: (linear layers, other layers diffusers' layerwise
    casting casts), found as layerwise casting finds them: a module whose full name matches one of the model's
    patterns (else diffusers' defaults), its fp32 modules or `keep` is skipped with everything under it."""
    from diffusers.hooks.layerwise_casting import _GO_LC_SUPPORTED_PYTORCH_LAYERS, DEFAULT_SKIP_MODULES_PATTERN

    own = tuple(getattr(denoiser, "_skip_layerwise_casting_patterns", None) or DEFAULT_SKIP_MODULES_PATTERN)
    fp32 = tuple(getattr(denoiser, "_keep_in_fp32_modules", None) or ())
    patterns = own + fp32 + tuple(rf"^{re.escape(name)}$" for name in keep)
    linears: list[tuple[str, nn.Linear]] = []
    others: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, name: str) -> None:
        # An adapter's own layers (the planner looks at a denoiser that has one) are never stored in float8.
        if any(re.search(pattern, name) for pattern in patterns) or name.rpartition(".")[2] in ADAPTER_LAYERS:
            return
        if type(module) is nn.Linear:
            linears.append((name, module))
        elif isinstance(module, _GO_LC_SUPPORTED_PYTORCH_LAYERS):
            others.append((name, module))
        else:
            for child_name, child in module.named_children():
                visit(child, f"{name}.{child_name}" if name else child_name)

    visit(denoiser, "")
    return linears, others


def skip_patterns(model: nn.Module) -> tuple[str, ...]:
    """The layers layerwise casting would skip (the model's own patterns, else diffusers' defaults), and those a
    transformers model keeps in fp32 (T5's `wo`: T5 casts its input to that layer's weight dtype)."""
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    patterns = tuple(getattr(model, "_skip_layerwise_casting_patterns", None) or DEFAULT_SKIP_MODULES_PATTERN)
    fp32 = getattr(model, "_keep_in_fp32_modules", None) or ()
    return patterns + tuple(rf"(^|\.){re.escape(name)}($|\.)" for name in fp32)


def _kept_in_full_precision(model: nn.Module) -> Callable[[str], bool]:
    patterns = skip_patterns(model)
    return lambda name: any(re.search(pattern, name) for pattern in patterns)


def frozen_linears(denoiser: nn.Module, keep_modules: tuple[str, ...] = ()) -> list[tuple[str, nn.Linear]]:
    """(name, layer) of the plain linear layers `memory.base_weights` stores in fewer bits: not those kept in full
    precision (`skip_patterns`), not `keep_modules`, not an adapter's own layers."""
    keep = _kept_in_full_precision(denoiser)
    return [(name, module) for name, module in denoiser.named_modules()
            if type(module) is nn.Linear and not keep(name) and name not in keep_modules
            and not any(part in name for part in ADAPTER_LAYERS)]


def check_base_weights(option: str, key: str = "memory.base_weights") -> None:
    """Before any long work: the package the option needs imports (a missing one names its pip extra)."""
    extra = {"int8": "torchao", "nf4": "bitsandbytes"}.get(option)
    try:
        if option == "int8":
            import torchao.quantization  # noqa: F401
        elif option == "nf4":
            import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            f"{key}={option} needs the package {extra}, which could not be imported: {error}\n"
            f"What to do: pip install 'vidtune[{extra}]', or set {key}=auto."
        ) from None


def prepare_base_weights(denoiser: nn.Module, option: str, keep: tuple[str, ...] = ()) -> None:
    """`fp8` and `nf4`: before the adapter is added (the denoiser frozen already). `keep`: names of modules
    that train fully (a control run's widened input layer) and so stay as they are."""
    if option == "fp8":
        store_frozen_weights_in_fp8(denoiser, keep)
    elif option == "nf4":
        _linears_to_nf4(denoiser, keep)


def finish_base_weights(denoiser: nn.Module, option: str, keep: tuple[str, ...] = ()) -> None:
    """`int8`: after the adapter is added (`keep` as in `prepare_base_weights`)."""
    if option == "int8":
        _linears_to_int8(denoiser, keep)


def _linears_to_int8(denoiser: nn.Module, keep: tuple[str, ...] = ()) -> None:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    chosen = {id(module) for _, module in frozen_linears(denoiser, keep)}
    quantize_(denoiser, Int8WeightOnlyConfig(), filter_fn=lambda module, _name: id(module) in chosen)


def _linears_to_nf4(denoiser: nn.Module, keep: tuple[str, ...] = ()) -> None:
    """Each frozen linear layer becomes a bitsandbytes `Linear4bit` (NF4 blocks of 64, computing in the
    denoiser's dtype); its weight is quantized as it is placed on the denoiser's device."""
    import bitsandbytes as bnb

    compute_dtype = denoiser.dtype
    for name, linear in frozen_linears(denoiser, keep):
        device = linear.weight.device
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  compute_dtype=compute_dtype, quant_type="nf4", device="meta")
        layer.weight = bnb.nn.Params4bit(linear.weight.data.to("cpu"), requires_grad=False, quant_type="nf4")
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        parent_name, _, child = name.rpartition(".")
        parent = denoiser.get_submodule(parent_name) if parent_name else denoiser
        setattr(parent, child, layer.to(device))


def store_text_encoder_weights(text: TextComponents, option: str) -> None:
    """`memory.text_encoder_weights`: every text encoder of `text` (already frozen, on its device) stored as
    `option` says: `fp8` upcast layer by layer, `int8` and `nf4` quantized linear layers (norms and embeddings
    kept). Used wherever captions are encoded: on the fly, by precompute, for validation and `vidtune sample`."""
    if option == "auto":
        return
    check_base_weights(option, "memory.text_encoder_weights")
    for name, module in text.modules.items():
        if not name.startswith("text_encoder") or not isinstance(module, nn.Module):
            continue
        if option == "fp8":
            from diffusers.hooks import apply_layerwise_casting

            apply_layerwise_casting(module, storage_dtype=torch.float8_e4m3fn, compute_dtype=module.dtype,
                                    skip_modules_pattern=skip_patterns(module))
        elif option == "int8":
            _linears_to_int8(module)
        elif option == "nf4":
            _linears_to_nf4(module)
