"""The attention kernel the denoiser trains with (`model.attention_backend`), through diffusers' attention dispatcher.

`auto` picks the fastest backend that is installed and has a backward pass on the training device: FlashAttention 3
on Hopper (sm90+) GPUs, then FlashAttention 2, else torch's own scaled_dot_product_attention (`native`, which on
CUDA already picks a flash or memory-efficient kernel itself). Any other name of the installed diffusers'
`AttentionBackendName` may be chosen; one whose package is missing, that runs only on CUDA, or that has no backward
pass (SageAttention: inference only) is refused before the model loads, with the package to install.

Only denoisers whose attention processors call diffusers' `dispatch_attention_fn` (LTX-Video, HunyuanVideo, Wan)
can switch kernels; CogVideoX and Mochi call torch's scaled_dot_product_attention directly, so they take `native`
(and `auto`) only, which is checked once the denoiser is loaded.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from vidtune.errors import ConfigError

logger = logging.getLogger(__name__)

KEY = "model.attention_backend"
AUTO = "auto"
NATIVE = "native"

# Backends that train on the CPU too (FlexAttention has no backward pass there); every other one needs CUDA.
CPU_BACKENDS = frozenset({"native", "_native_math"})
# Backends without a backward pass: their output carries no gradient to the query / key / value projections.
INFERENCE_ONLY_PREFIXES = ("sage", "_sage")
# The pip package each backend needs, for the error message (the first matching prefix wins).
PACKAGES = (
    ("_flash_3", "flash-attn 3 (the `flash_attn_interface` module, built from the flash-attention repository's "
                 "hopper/ folder)"),
    ("flash_4", "kernels"),
    ("flash", "flash-attn"),
    ("aiter", "kernels"),
    ("sage", "sageattention"),
    ("_sage", "sageattention"),
    ("xformers", "xformers"),
    ("_native_npu", "torch_npu"),
    ("_native_xla", "torch_xla"),
)


def available_backend_names() -> list[str]:
    """Every backend name the installed diffusers knows."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return [member.value for member in AttentionBackendName]


def _package(name: str) -> str:
    if name.endswith("_hub"):
        return "kernels"
    return next((package for prefix, package in PACKAGES if name.startswith(prefix)), "torch")


def _installed(name: str) -> bool:
    """Whether diffusers can use `name` here (its package imports at a version diffusers accepts)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    try:
        _check_attention_backend_requirements(AttentionBackendName(name))
    except (RuntimeError, ImportError):
        return False
    return True


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend `name` stands for on `device` (`auto` resolved), or a ConfigError naming what is wrong."""
    known = available_backend_names()
    if name == AUTO:
        return _fastest_training_backend(device)
    if name not in known:
        public = sorted(n for n in known if not n.startswith("_"))
        raise ConfigError(
            f"{KEY}={name!r} is not an attention backend of the installed diffusers.\n"
            f"What to do: use auto or one of {', '.join(public)}."
        )
    if name.startswith(INFERENCE_ONLY_PREFIXES):
        raise ConfigError(
            f"{KEY}={name}: SageAttention has no backward pass (it is made for sampling), so the adapter or weights "
            "before attention would receive no gradient.\nWhat to do: set it to auto, native or flash."
        )
    if device.type != "cuda" and name not in CPU_BACKENDS:
        raise ConfigError(
            f"{KEY}={name} runs on CUDA GPUs only, and this run trains on {device.type}.\n"
            f"What to do: set it to auto or one of {', '.join(sorted(CPU_BACKENDS))}."
        )
    if not _installed(name):
        raise ConfigError(
            f"{KEY}={name} needs the package {_package(name)}, which is not installed (or too old for the installed "
            f"diffusers).\nWhat to do: pip install {_package(name).split(' ')[0]}, or set {KEY}=auto."
        )
    return name


def _fastest_training_backend(device: torch.device) -> str:
    if device.type != "cuda":
        return NATIVE
    major, _ = torch.cuda.get_device_capability(device)
    # FlashAttention 3 is written for Hopper; both flash builds need fp16 / bf16 inputs (training on GPU is bf16).
    if major >= 9 and importlib.util.find_spec("flash_attn_interface") and _installed("_flash_3"):
        return "_flash_3"
    if importlib.util.find_spec("flash_attn") and _installed("flash"):
        return "flash"
    return NATIVE


def _calls_dispatcher(processor: object) -> bool:
    code = getattr(type(processor).__call__, "__code__", None)
    return code is not None and "dispatch_attention_fn" in code.co_names


def uses_dispatcher(denoiser: nn.Module) -> bool:
    """Whether the denoiser's attention goes through diffusers' dispatcher (so a backend can be chosen). Some
    families keep a small side module on plain scaled_dot_product_attention (HunyuanVideo's token refiner): the
    main blocks decide."""
    return any(_calls_dispatcher(module.processor) for module in denoiser.modules() if hasattr(module, "processor"))


def set_attention_backend(denoiser: nn.Module, backend: str, family: str) -> None:
    """Make the denoiser's attention layers compute with `backend` (already resolved). `native` on a denoiser that
    does not use the dispatcher is what it does anyway."""
    if not uses_dispatcher(denoiser):
        if backend != NATIVE:
            raise ConfigError(
                f"{KEY}={backend}: the {family} denoiser computes attention with torch's scaled_dot_product_attention "
                "directly, not through diffusers' attention dispatcher, so its kernel cannot be chosen.\n"
                f"What to do: set {KEY}=auto (or native) for {family}."
            )
        return
    if backend == NATIVE and _active_backend() == NATIVE:
        return  # the dispatcher's default already
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    previous = _AttentionBackendRegistry.get_active_backend()[0]
    denoiser.set_attention_backend(backend)
    # diffusers also makes `backend` the process-wide default, which every model built later in this process (a
    # second run, the planner's trace) would compute with: the denoiser's layers keep it, the default goes back.
    _AttentionBackendRegistry.set_active_backend(previous)
    logger.info("Attention backend: %s.", backend)


def _active_backend() -> str:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    return _AttentionBackendRegistry.get_active_backend()[0].value
