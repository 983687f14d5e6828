"""A denoiser read from one .safetensors file in its original or ComfyUI layout (`model.transformer_file`).

The file's keys are renamed (and fused layers split) by diffusers' own single-file converter for the denoiser's
class (`diffusers.loaders.single_file_model.SINGLE_FILE_LOADABLE_CLASSES`); the denoiser's config.json comes from
`model.pretrained`. Everything that can be checked is checked from the file's header, before any weight is read:
what the file holds (an adapter, another model, a whole pipeline), that the converted keys and shapes are exactly
the denoiser's, and how its float8 weights are stored.

float8 files: an `e4m3fn` / `e5m2` weight of a layer that `memory.base_weights: fp8` stores in float8 is kept as
it is in the file (vidtune/memory/float8.py keeps a float8 weight's own dtype); every other weight is upcast to the
compute dtype (exact: every float8 value is a bf16 and an fp32 value). ComfyUI's "scaled fp8" files (a per-layer
`scale_weight`, marked by a `scaled_fp8` key): with `memory.base_weights: fp8` a linear layer keeps the file's
float8 weight and its scale (rounding `weight * scale_weight` to float8 again would lose what the scale kept);
every other weight is dequantised, `weight * scale_weight` computed in fp32. Files made for float8 matmuls (a
per-layer `scale_input`) are refused.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES, infer_diffusers_model_type
from safetensors import SafetensorError, safe_open
from torch import nn

from vidtune.errors import ModelError
from vidtune.memory import fp8_layers
from vidtune.memory.float8 import FLOAT8_DTYPES as FLOAT8
from vidtune.memory.float8 import SCALE_BUFFER

# ComfyUI's scaled fp8: the marker key and the per-layer scales beside each `weight`.
SCALED_MARKER = "scaled_fp8"
SCALE_WEIGHT = ".scale_weight"
SCALE_INPUT = ".scale_input"
# ComfyUI's mixed-precision quantisation format (its QUANTIZATION.md): scales and a layer config beside each layer.
COMFY_QUANT_SUFFIXES = (".weight_scale", ".weight_scale_2", ".pre_quant_scale", ".input_scale", ".comfy_quant")
# Keys that only adapter files hold (peft, kohya / ComfyUI LoRA, LyCORIS LoKr / LoHa, DoRA).
ADAPTER_MARKERS = ("lora_A.", "lora_B.", "lora_down.", "lora_up.", "lokr_w", "hada_w", "dora_scale",
                   "lora_magnitude_vector")
# Prefixes of the other components a whole-pipeline checkpoint holds beside its denoiser.
OTHER_COMPONENTS = {"vae.": "a VAE", "first_stage_model.": "a VAE", "audio_vae.": "an audio VAE",
                    "vocoder.": "a vocoder", "text_encoders.": "text encoders", "text_encoder.": "a text encoder",
                    "cond_stage_model.": "a text encoder", "conditioner.": "text encoders",
                    "text_embedding_projection.": "a text projection"}
COMFYUI_PREFIX = "model.diffusion_model."  # ComfyUI's files hold the denoiser under it
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class FileHeader:
    """What a .safetensors file's header says: each tensor's dtype and shape, and the file's size on disk."""

    path: Path
    key: str  # the config key that names it, for messages
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    size: int

    @property
    def where(self) -> str:
        return f"{self.key}: {self.path}"

    def bytes_by_dtype(self) -> dict[torch.dtype, int]:
        found: Counter[torch.dtype] = Counter()
        for dtype, shape in self.tensors.values():
            found[dtype] += dtype.itemsize * _numel(shape)
        return dict(found)

    @property
    def float8(self) -> torch.dtype | None:
        """The float8 dtype of the file's weights (the one holding the most bytes), or None."""
        sizes = {dtype: size for dtype, size in self.bytes_by_dtype().items() if dtype in FLOAT8}
        return max(sizes, key=sizes.__getitem__) if sizes else None

    @property
    def scaled(self) -> bool:
        return SCALED_MARKER in self.tensors or any(key.endswith(SCALE_WEIGHT) for key in self.tensors)

    def describe_dtypes(self) -> str:
        sizes = sorted(self.bytes_by_dtype().items(), key=lambda item: -item[1])
        text = ", ".join(f"{str(dtype).removeprefix('torch.')} {size / 1024**3:.2f} GiB" for dtype, size in sizes)
        return f"{text}{' (ComfyUI scaled fp8)' if self.scaled else ''}"

    def meta_tensors(self) -> Tensors:
        """Shape-only stand-ins of the file's tensors, for converting and checking without reading weights."""
        return {key: torch.empty(shape, dtype=dtype, device="meta") for key, (dtype, shape) in self.tensors.items()}


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def read_header(path_text: str, key: str) -> FileHeader:
    """The header of the file `key` names; a missing file, another format or a damaged file is a ModelError."""
    path = Path(path_text).expanduser()
    if not path.is_file():
        what = "a folder" if path.is_dir() else "missing"
        raise ModelError(f"{key}: {path} is {what}.\nWhat to do: give the path of the transformer's .safetensors "
                         f"file (a diffusers folder goes in model.pretrained or model.subfolders instead).")
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise ModelError(f"{key}: {path} is a pickle checkpoint ({path.suffix}); only .safetensors files are read "
                         "(a pickle runs code when it is opened).\nWhat to do: use the model's .safetensors release.")
    if path.suffix.lower() == ".gguf":
        raise ModelError(f"{key}: {path} is a GGUF file; vidtune trains from .safetensors files.\nWhat to do: use "
                         "the .safetensors release of the model (fp8 files are kept in float8 with "
                         "memory.base_weights: fp8).")
    try:
        with safe_open(str(path), framework="pt") as opened:
            tensors = {}
            for name in opened.keys():  # noqa: SIM118 (safe_open is not a mapping)
                view = opened.get_slice(name)
                tensors[name] = (_dtype(view.get_dtype()), tuple(view.get_shape()))
    except (SafetensorError, OSError, ValueError) as error:
        raise ModelError(f"{key}: {path} cannot be read as a .safetensors file ({error}); it may be damaged or an "
                         "incomplete download.\nWhat to do: download it again.") from None
    return FileHeader(path, key, tensors, path.stat().st_size)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def _dtype(name: str) -> torch.dtype:
    if name not in _SAFETENSORS_DTYPES:
        raise ValueError(f"a tensor of dtype {name}, which vidtune does not read")
    return _SAFETENSORS_DTYPES[name]


# ----- what a file is ---------------------------------------------------------------------------------------------
def looks_like(header: FileHeader) -> str:
    """A short description of what the file holds, for messages about a file that does not fit."""
    keys = list(header.tensors)
    adapter = [key for key in keys if any(marker in key for marker in ADAPTER_MARKERS)]
    if adapter:
        return (f"it is an adapter (LoRA) file, not a model: {len(adapter)} of its {len(keys)} tensors are adapter "
                f"weights (e.g. {adapter[0]})")
    others = sorted({what for key in keys for prefix, what in OTHER_COMPONENTS.items()
                     if key.startswith(prefix) or f".{prefix}" in key[:40]})
    recognised = _diffusers_model_type(header)
    parts = []
    if others:
        parts.append(f"it holds {' and '.join(others)} beside a model (a whole-pipeline checkpoint)")
    if recognised:
        parts.append(f"diffusers recognises it as a `{recognised}` checkpoint")
    if not parts:
        parts.append(f"diffusers does not recognise its {len(keys)} keys (e.g. {', '.join(keys[:3])})")
    return "; ".join(parts)


def _diffusers_model_type(header: FileHeader) -> str | None:
    """The model type diffusers' `infer_diffusers_model_type` finds from the keys and shapes, if it finds one
    (its fallback, Stable Diffusion 1, only when that model's own key is there)."""
    checkpoint = header.meta_tensors()
    try:
        found = infer_diffusers_model_type(checkpoint)
    except (KeyError, IndexError, AttributeError, TypeError, RuntimeError):
        return None
    if found == "v1" and CHECKPOINT_KEY_NAMES["v1"] not in checkpoint:
        return None
    return found


def checkpoint_converter(denoiser_class: type) -> Callable[..., Tensors] | None:
    """diffusers' function that renames an original-layout checkpoint of `denoiser_class`, or None (no converter)."""
    entry = SINGLE_FILE_LOADABLE_CLASSES.get(denoiser_class.__name__)
    return None if entry is None else entry["checkpoint_mapping_fn"]


# ----- scaled fp8 -------------------------------------------------------------------------------------------------
def check_quantisation(header: FileHeader) -> None:
    """ComfyUI's newer per-layer quantisation format (`weight_scale`, `input_scale`, `comfy_quant` beside each layer:
    float8, int8 blocks, ...) is refused with that reason, rather than as a file of another model."""
    found = sorted(key for key in header.tensors if key.endswith(COMFY_QUANT_SUFFIXES))
    if found:
        raise ModelError(
            f"{header.where} is a checkpoint in ComfyUI's mixed-precision quantisation format ({len(found)} "
            f"quantisation tensors beside the layers, e.g. {found[0]}), which vidtune does not read.\nWhat to do: "
            "use the model's plain fp8 (e4m3fn), scaled fp8 (`scale_weight`) or bf16 file."
        )


def check_scaled(header: FileHeader) -> None:
    """Scaled fp8 files are read when each scale is a per-layer (or per-row) factor of its weight; a file made for
    float8 matmuls (`scale_input`) is refused: its layers were calibrated to run their inputs in float8."""
    inputs = [key for key in header.tensors if key.endswith(SCALE_INPUT)]
    if inputs:
        raise ModelError(
            f"{header.where} is a ComfyUI scaled fp8 file made for float8 matmuls: {len(inputs)} layers have an "
            f"input scale (e.g. {inputs[0]}), calibrated for running their inputs in float8, which training does "
            "not do.\nWhat to do: use the model's plain fp8 (e4m3fn) or bf16 file, or its scaled fp8 release "
            "without input scales."
        )
    for key, (_, shape) in header.tensors.items():
        if not key.endswith(SCALE_WEIGHT):
            continue
        weight = key.removesuffix(SCALE_WEIGHT) + ".weight"
        if weight not in header.tensors:
            raise ModelError(f"{header.where}: the scale {key} has no weight {weight} beside it.\nWhat to do: "
                             "download the file again; it does not look like a complete scaled fp8 file.")
        weight_shape = header.tensors[weight][1]
        if _numel(shape) not in (1, weight_shape[0] if weight_shape else 1):
            raise ModelError(f"{header.where}: the scale {key} has shape {list(shape)}, neither one value nor one "
                             f"per row of {weight} {list(weight_shape)}.\nWhat to do: use the model's plain fp8 or "
                             "bf16 file; this scaling is not one vidtune knows.")


def dequantise(tensors: Tensors, dtype: torch.dtype) -> Tensors:
    """ComfyUI's scaled fp8 weights as values: `weight * scale_weight` in fp32, then `dtype`; scales and the marker
    key are dropped. Other tensors are left as they are."""
    out = {}
    for key, tensor in tensors.items():
        if key == SCALED_MARKER or key.endswith(SCALE_WEIGHT):
            continue
        scale = tensors.get(key.removesuffix(".weight") + SCALE_WEIGHT) if key.endswith(".weight") else None
        if scale is None:
            out[key] = tensor
            continue
        factor = scale.to(torch.float32).reshape(-1, *([1] * (tensor.dim() - 1))) if scale.numel() > 1 else \
            scale.to(torch.float32).reshape(())
        out[key] = (tensor.to(torch.float32) * factor).to(dtype)
    return out


def is_scale(key: str) -> bool:
    """A key of scaled fp8's bookkeeping (the marker, a layer's `scale_weight`), not a weight of the denoiser."""
    return key == SCALED_MARKER or key.endswith(SCALE_WEIGHT)


def converted_scales(header: FileHeader, tensors: Tensors, converter: Callable[..., Tensors],
                     config: dict[str, Any], expected: dict[str, torch.Size], family: str) -> Tensors:
    """Each scaled weight's scale under the denoiser's name: one value ([]), or one per row ([rows, 1, ...]).
    Found by converting, in place of the weights, their scales broadcast to the weights' shapes (views that take no
    memory), so the converter's renames, splits and fusions move each scale with its weight."""
    views = {}
    for key, tensor in tensors.items():
        if is_scale(key):
            continue
        scale = tensors.get(key.removesuffix(".weight") + SCALE_WEIGHT) if key.endswith(".weight") else None
        if scale is None:
            views[key] = torch.empty(tensor.shape, dtype=torch.float32, device="meta")
        else:
            rows = scale.to(torch.float32).reshape(-1, *([1] * (tensor.dim() - 1)))
            views[key] = rows.expand(tensor.shape)
    converted = convert(header, views, converter, config, expected, family)
    return {key: _one_scale(header, key, view) for key, view in converted.items() if view.device.type != "meta"}


def _one_scale(header: FileHeader, key: str, view: torch.Tensor) -> torch.Tensor:
    rows = view.reshape(view.shape[0], -1) if view.dim() > 1 else view.reshape(-1, 1)
    first = rows[:, :1]
    if rows.stride(1) != 0 and not bool((rows == first).all()):  # the converter joined weights along a row
        raise ModelError(f"{header.where}: the weight {key} joins layers of different scales within its rows, which "
                         "float8 storage cannot keep.\nWhat to do: use the model's plain fp8 (e4m3fn) or bf16 file.")
    if first.stride(0) == 0 or bool((first == first[0]).all()):
        return first[0, 0].clone()
    return first.clone().reshape(-1, *([1] * (view.dim() - 1)))


def apply_scales(converted: Tensors, scales: Tensors, dtype: torch.dtype, kept: set[str]) -> Tensors:
    """The converted weights with their scales applied (`weight * scale` in fp32, then `dtype`), except those in
    `kept`, which stay float8 to be stored scaled (`attach_scales`). `converted` is emptied as it goes."""
    out = {}
    for key in list(converted):
        tensor = converted.pop(key)
        scale = scales.get(key)
        out[key] = tensor if scale is None or key in kept else (tensor.to(torch.float32) * scale).to(dtype)
    return out


def attach_scales(denoiser: nn.Module, scales: Tensors) -> None:
    """Each weight's scale on its layer (vidtune/memory/float8.py `SCALE_BUFFER`), for its float8 storage."""
    for key, scale in scales.items():
        layer = denoiser.get_submodule(key.removesuffix(".weight"))
        layer.register_buffer(SCALE_BUFFER, scale.to(torch.float32), persistent=False)


# ----- converting and checking -----------------------------------------------------------------------------------
def convert(header: FileHeader, tensors: Tensors, converter: Callable[..., Tensors], config: dict[str, Any],
            expected: dict[str, torch.Size], family: str) -> Tensors:
    """The file's tensors under the denoiser's names (diffusers' converter, unless they are named so already), the
    tensors of other components a whole-pipeline file holds left out; a file whose converted tensors are not
    exactly the denoiser's is a ModelError saying what the file looks like. ComfyUI's `model.diffusion_model.` prefix
    is taken off first (not every converter does)."""
    tensors = {key.removeprefix(COMFYUI_PREFIX): tensor for key, tensor in tensors.items()}
    if set(tensors) == set(expected):
        converted = dict(tensors)
    else:
        try:
            converted = converter(checkpoint=dict(tensors), config=config)
        except (KeyError, IndexError, RuntimeError, ValueError) as error:
            raise _not_the_denoiser(header, family, f"diffusers' converter stopped at {error!r}") from None
    converted = {key: value for key, value in converted.items()
                 if key in expected or not any(key.startswith(prefix) for prefix in OTHER_COMPONENTS)}
    missing = sorted(set(expected) - set(converted))
    unexpected = sorted(set(converted) - set(expected))
    if missing or unexpected:
        found = []
        if missing:
            found.append(f"{len(missing)} of the denoiser's {len(expected)} tensors are missing (e.g. "
                         f"{', '.join(missing[:3])})")
        if unexpected:
            found.append(f"{len(unexpected)} tensors are not the denoiser's (e.g. {', '.join(unexpected[:3])})")
        raise _not_the_denoiser(header, family, "; ".join(found))
    wrong = [(key, tuple(value.shape), tuple(expected[key])) for key, value in converted.items()
             if tuple(value.shape) != tuple(expected[key])]
    if wrong:
        key, got, wanted = wrong[0]
        raise ModelError(
            f"{header.where} is a {family} transformer of another size than model.pretrained's config.json says: "
            f"{len(wrong)} tensors differ in shape (e.g. {key}: {list(got)} in the file, {list(wanted)} in the "
            "config).\nWhat to do: point model.pretrained at the same size of the model as the file (e.g. the "
            "14B folder for a 14B file), or use the file of the size model.pretrained has."
        )
    return converted


def _not_the_denoiser(header: FileHeader, family: str, detail: str) -> ModelError:
    return ModelError(
        f"{header.where} is not a {family} transformer in its original, ComfyUI or diffusers layout: {detail}; "
        f"{looks_like(header)}.\nWhat to do: give the file of the {family} transformer itself (e.g. the one ComfyUI "
        "loads as a diffusion model), or check model.name."
    )


def float8_keys(denoiser: nn.Module) -> set[str]:
    """The tensors `memory.base_weights: fp8` stores in float8 (weights and biases of the layers it casts)."""
    linears, others = fp8_layers(denoiser)
    return {f"{name}.{parameter}" for name, layer in [*linears, *others]
            for parameter, _ in layer.named_parameters(recurse=False)}


def float8_linear_weights(denoiser: nn.Module) -> set[str]:
    """The weights `memory.base_weights: fp8` stores in float8 linear layers, the ones that can keep a scale."""
    linears, _ = fp8_layers(denoiser)
    return {f"{name}.weight" for name, _ in linears}


def placed(tensors: Tensors, dtype: torch.dtype, keep_float8: set[str], keep_fp32: tuple[str, ...]) -> Tensors:
    """Each tensor in the dtype `from_pretrained(torch_dtype=dtype)` gives it: fp32 in the modules the class keeps in
    fp32 (`keep_fp32`, matched by name part as diffusers matches them), else `dtype`; float8 tensors named in
    `keep_float8` and integer tensors keep their dtype. Each is a new tensor of its own, not a view into the file's
    buffer at whatever offset the file put it (the denoiser holds no part of the file; its weights are aligned for
    the kernels). `tensors` is emptied as it goes, so only one tensor is held twice at a time."""
    out = {}
    for key in list(tensors):
        tensor = tensors.pop(key)
        if (tensor.dtype in FLOAT8 and key in keep_float8) or not tensor.is_floating_point():
            wanted = tensor.dtype
        elif any(module in key.split(".") for module in keep_fp32):
            wanted = torch.float32
        else:
            wanted = dtype
        out[key] = tensor.to(wanted, copy=True)
    return out


def load_assigned(cls: Any, config: dict[str, Any], tensors: Tensors) -> nn.Module:
    """`cls` built from `config` without initialising its weights (as `from_pretrained` builds it), holding
    `tensors` as they are; its buffers outside the state dict stay as `__init__` made them."""
    with init_empty_weights():
        model = cls.from_config(config)
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.eval()
