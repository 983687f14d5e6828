"""Memory savers that change how weights are stored, not what is trained.

`memory.base_weights` stores the frozen denoiser of an adapter run in less memory:
- `fp8`: float8 (e4m3) storage, each layer upcast to the compute dtype as it runs (diffusers' layerwise casting;
  inside compiled blocks, an upcast within the layer's forward: vidtune/memory/float8.py);
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

from vidtune.compile import repeated_blocks
from vidtune.errors import ConfigError
from vidtune.memory.float8 import store_block_linears_in_float8

if TYPE_CHECKING:
    from vidtune.models.spec import TextComponents

ADAPTER_LAYERS = ("lora_A", "lora_B", "lora_embedding", "lora_magnitude_vector")


def store_frozen_weights_in_fp8(denoiser: nn.Module, keep: tuple[str, ...] = (), compiled: bool = False) -> None:
    """Keep the denoiser's weights in float8 (e4m3) and upcast each layer to the compute dtype as it runs.

    Done before adapters are added, so only the frozen base layers are affected; norms, embeddings and other
    precision-sensitive layers are skipped by diffusers' default patterns. The compute dtype is the one the
    denoiser was loaded in (bf16 on GPU, fp32 on CPU by default). `compiled` (training.compile): the layers inside
    the transformer blocks upcast inside their own forward (vidtune/memory/float8.py), which torch.compile traces;
    the rest keep diffusers' layerwise casting, as in an eager run.
    """
    experts = getattr(denoiser, "experts", None)
    if callable(experts):  # Wan 2.2 A14B's two experts (vidtune.models.experts): each casts its own layers
        for name, expert in zip(("transformer", "transformer_2"), experts(), strict=True):
            store_frozen_weights_in_fp8(expert, tuple(k.removeprefix(f"{name}.") for k in keep
                                                      if k.startswith(f"{name}.")))
        return
    compute_dtype = denoiser.dtype
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    # The model's own patterns (as diffusers would take them), and the modules that train fully.
    own = tuple(getattr(denoiser, "_skip_layerwise_casting_patterns", None) or DEFAULT_SKIP_MODULES_PATTERN)
    patterns = own + tuple(rf"^{re.escape(name)}$" for name in keep)
    blocks: list[tuple[str, nn.Module]] = []
    if compiled:
        chosen = {id(block) for block in repeated_blocks(denoiser)}
        blocks = [(name, module) for name, module in denoiser.named_modules() if id(module) in chosen]
    for name, block in blocks:
        store_block_linears_in_float8(block, name, patterns, compute_dtype)
    # Layerwise casting skips a module whose name matches, with everything under it: here the blocks done above.
    done = tuple(rf"^{re.escape(name)}$" for name, _ in blocks)
    denoiser.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=compute_dtype,
                                      skip_modules_pattern=patterns + done)


def _skip_patterns(model: nn.Module) -> tuple[str, ...]:
    """The layers layerwise casting would skip (the model's own patterns, else diffusers' defaults), and those a
    transformers model keeps in fp32 (T5's `wo`: T5 casts its input to that layer's weight dtype)."""
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    patterns = tuple(getattr(model, "_skip_layerwise_casting_patterns", None) or DEFAULT_SKIP_MODULES_PATTERN)
    fp32 = getattr(model, "_keep_in_fp32_modules", None) or ()
    return patterns + tuple(rf"(^|\.){re.escape(name)}($|\.)" for name in fp32)


def _kept_in_full_precision(model: nn.Module) -> Callable[[str], bool]:
    patterns = _skip_patterns(model)
    return lambda name: any(re.search(pattern, name) for pattern in patterns)


def _frozen_linears(denoiser: nn.Module, keep_modules: tuple[str, ...] = ()) -> list[tuple[str, nn.Linear]]:
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


def prepare_base_weights(denoiser: nn.Module, option: str, keep: tuple[str, ...] = (),
                         compiled: bool = False) -> None:
    """`fp8` and `nf4`: before the adapter is added (the denoiser frozen already). `keep`: names of modules
    that train fully (a control run's widened input layer) and so stay as they are; `compiled`: the blocks will
    be compiled (training.compile)."""
    if option == "fp8":
        store_frozen_weights_in_fp8(denoiser, keep, compiled)
    elif option == "nf4":
        _linears_to_nf4(denoiser, keep)


def finish_base_weights(denoiser: nn.Module, option: str, keep: tuple[str, ...] = ()) -> None:
    """`int8`: after the adapter is added (`keep` as in `prepare_base_weights`)."""
    if option == "int8":
        _linears_to_int8(denoiser, keep)


def _linears_to_int8(denoiser: nn.Module, keep: tuple[str, ...] = ()) -> None:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    chosen = {id(module) for _, module in _frozen_linears(denoiser, keep)}
    quantize_(denoiser, Int8WeightOnlyConfig(), filter_fn=lambda module, _name: id(module) in chosen)


def _linears_to_nf4(denoiser: nn.Module, keep: tuple[str, ...] = ()) -> None:
    """Each frozen linear layer becomes a bitsandbytes `Linear4bit` (NF4 blocks of 64, computing in the
    denoiser's dtype); its weight is quantized as it is placed on the denoiser's device."""
    import bitsandbytes as bnb

    compute_dtype = denoiser.dtype
    for name, linear in _frozen_linears(denoiser, keep):
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
                                    skip_modules_pattern=_skip_patterns(module))
        elif option == "int8":
            _linears_to_int8(module)
        elif option == "nf4":
            _linears_to_nf4(module)
