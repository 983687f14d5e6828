"""float8 storage of frozen linear layers that costs no activation memory, eager and compiled alike.

diffusers' layerwise casting casts a layer's weight to the compute dtype in a hook before the layer runs and back
to float8 after it. The matmul's backward needs that weight (for the input's gradient), so autograd keeps the
compute-dtype copy until the backward pass: with every layer's copy alive at once, float8 weights took more
memory than unquantized ones. The frozen linear layers are therefore `Float8StorageLinear`s: the weight stays
float8 and `Float8Linear` (a custom autograd function) saves that float8 weight, upcasting it again in the
backward pass. Only one layer's upcast copy exists at a time. The upcast is part of the layer's own forward, so
torch.compile traces it with the block. Weights and values are those of layerwise casting (the same float8
rounding, the same upcast values), so the numerics are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

STORAGE_DTYPE = torch.float8_e4m3fn
# A weight already stored in one of these (a float8 single file, vidtune/models/single_file.py) keeps its values.
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# The non-persistent buffer of a linear layer whose float8 weight is stored scaled (ComfyUI's scaled fp8 files,
# vidtune/models/single_file.py): the weight's values are `weight * float8_scale` (one value, or one per row).
SCALE_BUFFER = "float8_scale"


def upcast(weight: torch.Tensor, scale: torch.Tensor | None, compute_dtype: torch.dtype) -> torch.Tensor:
    """A float8 weight's values in `compute_dtype` (times its scale, where it has one)."""
    return weight.to(compute_dtype) if scale is None else weight.to(compute_dtype) * scale.to(compute_dtype)


class Float8Linear(torch.autograd.Function):
    """`F.linear(input, weight, bias)` with a frozen float8 `weight` (and `bias`) upcast to `compute_dtype` (the
    weight times `scale` where given): the backward pass computes only the input's gradient, from the float8 weight
    upcast again."""

    @staticmethod
    def forward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype,
                scale: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(input, upcast(weight, scale, compute_dtype),
                        None if bias is None else bias.to(compute_dtype))

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        _, weight, _, compute_dtype, scale = inputs
        ctx.save_for_backward(weight, scale)  # the float8 storage itself: nothing new is kept
        ctx.compute_dtype = compute_dtype

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        weight, scale = ctx.saved_tensors
        grad_input = grad_output.matmul(upcast(weight, scale, ctx.compute_dtype)) if ctx.needs_input_grad[0] \
            else None
        return grad_input, None, None, None, None


class Float8StorageLinear(nn.Linear):
    """A frozen `nn.Linear` whose weight and bias are stored in float8 and upcast to `compute_dtype` as it runs.

    Made from an existing layer by `store_linear_in_float8` (the class is swapped in place): parameter names,
    `isinstance(layer, nn.Linear)` (peft wraps it like any linear layer) and the state dict keys stay the same."""

    compute_dtype: torch.dtype

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad):
            raise RuntimeError("a float8-stored linear layer is frozen: its weight and bias cannot train")
        return Float8Linear.apply(input, self.weight, self.bias, self.compute_dtype, getattr(self, SCALE_BUFFER, None))


def store_linear_in_float8(linear: nn.Linear, compute_dtype: torch.dtype) -> None:
    """`linear` (frozen) becomes a `Float8StorageLinear` in place, its weight and bias rounded to float8 (a tensor
    already in float8, e4m3 or e5m2, is kept as it is, with its `SCALE_BUFFER` where it has one)."""
    with torch.no_grad():
        linear.weight.data = as_float8(linear.weight.data)
        if linear.bias is not None:
            linear.bias.data = as_float8(linear.bias.data)
    linear.__class__ = Float8StorageLinear
    linear.compute_dtype = compute_dtype


def as_float8(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype in FLOAT8_DTYPES else tensor.to(STORAGE_DTYPE)
