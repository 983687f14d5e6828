"""float8 storage that torch.compile can trace: the upcast is part of the layer's forward.

diffusers' layerwise casting (what `memory.base_weights=fp8` uses in eager runs) casts a layer's weight to the
compute dtype in a hook before the layer runs and back to float8 in a hook after it, replacing the parameter's
data in place. Eager autograd keeps the upcast copy it saved for the backward pass; a compiled block's backward
reads the parameter itself, which is float8 again by then. Inside compiled blocks the frozen linear layers are
therefore `Float8StorageLinear`s instead: the weight stays float8, `forward` upcasts it into a new tensor, and
that compute-dtype tensor is what autograd saves. Both ways store the same float8 values (weight and bias) and
compute with the same upcast values, so eager and compiled runs train the same model.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

STORAGE_DTYPE = torch.float8_e4m3fn


class Float8StorageLinear(nn.Linear):
    """A frozen `nn.Linear` whose weight and bias are stored in float8 and upcast to `compute_dtype` as it runs.

    Made from an existing layer by `store_linear_in_float8` (the class is swapped in place): parameter names,
    `isinstance(layer, nn.Linear)` (peft wraps it like any linear layer) and the state dict keys stay the same."""

    compute_dtype: torch.dtype

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return F.linear(input, self.weight.to(self.compute_dtype), bias)


def store_linear_in_float8(linear: nn.Linear, compute_dtype: torch.dtype) -> None:
    """`linear` (frozen) becomes a `Float8StorageLinear` in place, its weight and bias rounded to float8."""
    with torch.no_grad():
        linear.weight.data = linear.weight.data.to(STORAGE_DTYPE)
        if linear.bias is not None:
            linear.bias.data = linear.bias.data.to(STORAGE_DTYPE)
    linear.__class__ = Float8StorageLinear
    linear.compute_dtype = compute_dtype


def store_block_linears_in_float8(block: nn.Module, prefix: str, skip_patterns: tuple[str, ...],
                                  compute_dtype: torch.dtype) -> int:
    """Every linear layer of `block` (named `prefix` in the denoiser) stored as `Float8StorageLinear`, except those
    under a module whose full name matches one of `skip_patterns` (searched as diffusers' layerwise casting
    searches them, so the same layers stay in full precision). Returns how many were stored.

    Only linear layers are stored in float8 here: the blocks of every supported family hold no other layer
    layerwise casting would cast (convolutions and embeddings sit outside them)."""
    if any(re.search(pattern, prefix) for pattern in skip_patterns):
        return 0
    if isinstance(block, nn.Linear):
        store_linear_in_float8(block, compute_dtype)
        return 1
    return sum(store_block_linears_in_float8(child, f"{prefix}.{name}", skip_patterns, compute_dtype)
               for name, child in block.named_children())
