"""What `vidtune plan` says about a denoiser read from one file (`model.transformer_file`): the file's size and
dtypes, how its weights are stored once loaded, and the host memory reading it takes.

A single file is read whole into host memory (safetensors), then each tensor is copied in the dtype it loads in
while the file's own tensor is let go (vidtune/models/single_file.py `placed`): the host holds the larger of the
file and the loaded weights, plus one tensor. A scaled fp8 file is dequantised beside the file's tensors, except for
the linear layers `memory.base_weights: fp8` keeps in float8 with their scales.
"""

from __future__ import annotations

import torch
from torch import nn

from vidtune.models.single_file import FLOAT8, FileHeader
from vidtune.models.spec import ModelSpec

GIB = 1024**3


def headers(spec: ModelSpec) -> list[FileHeader]:
    """The checked single files of the spec's config (checked against its architecture's config.json)."""
    return [spec.single_file(component).header for component in spec.single_file_components()]


def kept_in_float8(header: FileHeader, base_weights: str) -> bool:
    return base_weights == "fp8" and header.float8 is not None


def loading_bytes(header: FileHeader, loaded: int, base_weights: str = "auto") -> int:
    """Host bytes while one file becomes a denoiser of `loaded` bytes (see the module's docstring)."""
    largest = max((dtype.itemsize * _numel(shape) for dtype, shape in header.tensors.values()), default=0)
    if header.scaled and not kept_in_float8(header, base_weights):
        return header.size + loaded  # the dequantised weights are made while the file's float8 ones are still held
    return max(header.size, loaded) + largest


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def notes(headers_found: list[FileHeader], base_weights: str, dtype: torch.dtype) -> list[str]:
    lines = []
    compute = str(dtype).removeprefix("torch.")
    for header in headers_found:
        line = f"{header.key}: {header.path.name}, {header.size / GIB:.2f} GiB ({header.describe_dtypes()})"
        if header.scaled and kept_in_float8(header, base_weights):
            line += ("; the float8 linear layers keep its weights and scales (memory.base_weights: fp8), the rest is "
                     f"dequantised to {compute}")
        elif header.scaled:
            line += f"; dequantised to {compute}"
        elif kept_in_float8(header, base_weights):
            line += "; its float8 weights stay as they are (memory.base_weights: fp8)"
        elif header.float8 is not None:
            line += (f"; upcast to {compute} (memory.base_weights={base_weights}; `fp8` keeps the file's float8 "
                     "weights as they are, in about half the weights' memory)")
        lines.append(line + ".")
    return lines


def denoiser_dtype(denoiser: nn.Module) -> torch.dtype:
    """The traced denoiser's compute dtype (its first floating weight that is not float8)."""
    for parameter in denoiser.parameters():
        if parameter.is_floating_point() and parameter.dtype not in FLOAT8:
            return parameter.dtype
    return torch.float32
