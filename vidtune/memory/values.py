"""The values a shape-only trace needs: meta tensors filled with one known value.

A meta tensor has a shape and no data, so code that branches on a tensor's value (`if torch.all(embeds == 0)`,
HunyuanVideo 1.5's text-to-video check) or copies one to the host (`timesteps.cpu().tolist()`, LTX-2's audio noise
keyed by the timestep) cannot run on it. Most such tensors in a training step are constant: the traced timesteps
(all 500), masks (every token real), zero image tokens. `KnownValues` follows them: a tensor made by `zeros` /
`ones` / `full` (or copied to meta from a host tensor holding one value) is marked with its value, the value is
carried through copies, views and elementwise arithmetic with numbers, and reading it (`item()`, a copy to the host)
gives that value. Reading a tensor whose value the trace does not know raises `UnknownValue`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten


class UnknownValue(RuntimeError):
    """The traced code read a value the trace does not have."""


# Operators whose result holds the value of their first argument: copies, views, reshapes.
_SAME_VALUE = {
    aten._to_copy.default, aten.clone.default, aten.detach.default, aten.alias.default, aten.view.default,
    aten._unsafe_view.default, aten.expand.default, aten.slice.Tensor, aten.select.int, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.permute.default, aten.transpose.int,
    aten.t.default, aten.repeat.default, aten.contiguous.default, aten.reshape.default, aten.lift_fresh.default,
    aten.amax.default, aten.amin.default, aten.max.default, aten.min.default,
}
# Elementwise operators of a tensor and a number (or another tensor of known value).
_ELEMENTWISE: dict[Any, Callable[[Any, Any], Any]] = {
    aten.eq.Scalar: operator.eq, aten.eq.Tensor: operator.eq, aten.ne.Scalar: operator.ne,
    aten.ne.Tensor: operator.ne, aten.mul.Scalar: operator.mul, aten.mul.Tensor: operator.mul,
    aten.div.Scalar: operator.truediv, aten.div.Tensor: operator.truediv, aten.add.Scalar: operator.add,
    aten.add.Tensor: operator.add, aten.sub.Scalar: operator.sub, aten.sub.Tensor: operator.sub,
    aten.gt.Scalar: operator.gt, aten.lt.Scalar: operator.lt, aten.ge.Scalar: operator.ge,
    aten.le.Scalar: operator.le,
}
# Operators that return parts of their first argument.
_PARTS = {aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
_NEGATION = {aten.bitwise_not.default, aten.logical_not.default}
# Reductions to a truth value: all / any of a tensor of one value is that value's truth.
_TRUTH = {aten.all.default, aten.any.default, aten.all.dim, aten.any.dim, aten.all.dims, aten.any.dims}
_CREATED = {
    aten.zeros.default: 0, aten.ones.default: 1, aten.new_zeros.default: 0, aten.new_ones.default: 1,
    aten.zeros_like.default: 0, aten.ones_like.default: 1,
}
_FILLED = {aten.full.default: 1, aten.new_full.default: 2, aten.full_like.default: 1}


class KnownValues(TorchDispatchMode):
    """While inside: meta tensors of one known value keep it through the operators above (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self._values: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def mark(self, tensor: torch.Tensor, value: float | bool) -> None:
        """Declare that every element of `tensor` is `value`."""
        self._values[tensor] = value

    def value(self, tensor: object) -> Any:
        """The known value of `tensor` (a number is its own value), or None."""
        if isinstance(tensor, torch.Tensor):
            if tensor in self._values:
                return self._values[tensor]
            if not tensor.is_meta and tensor.numel() == 1:  # a host scalar: its value is at hand
                return tensor.item()
            return None
        return tensor if isinstance(tensor, (int, float, bool)) else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args else None
        if func is aten._local_scalar_dense.default and isinstance(source, torch.Tensor) and source.is_meta:
            return self._read(source)
        if func is aten._to_copy.default and isinstance(source, torch.Tensor) and source.is_meta \
                and torch.device(kwargs.get("device", "meta")).type != "meta":
            value = self._read(source)  # a copy to a real device: a tensor of that value there
            return torch.full(source.shape, value, dtype=kwargs.get("dtype") or source.dtype, device=kwargs["device"])
        if func is aten.index.Tensor and isinstance(source, torch.Tensor) and source.is_meta:
            selected = self._select_by_mask(source, args[1])
            if selected is not None:
                return selected
        result = func(*args, **kwargs)
        if isinstance(result, torch.Tensor) and result.is_meta:
            value = self._result_value(func, args, kwargs, source)
            if value is not None:
                self._values[result] = _cast(value, result.dtype)
        elif func in _PARTS and (value := self.value(source)) is not None:  # iterating a tensor unbinds it
            for part in result:
                self._values[part] = value
        return result

    def _read(self, tensor: torch.Tensor) -> Any:
        value = self.value(tensor)
        if value is None:
            raise UnknownValue(f"the traced code reads the value of a {tuple(tensor.shape)} {tensor.dtype} tensor "
                               "whose value a shape-only trace does not know")
        return _cast(value, tensor.dtype)

    def _select_by_mask(self, source: torch.Tensor, indices: list) -> torch.Tensor | None:
        """`source[mask]` for a boolean mask of one known value: every element (True) or none (False) of the
        dimensions it covers. (On meta, torch would assume every element is selected.)"""
        if len(indices) != 1 or not isinstance(indices[0], torch.Tensor) or indices[0].dtype != torch.bool:
            return None
        mask, value = indices[0], self.value(indices[0])
        if value is None:
            return None
        covered = mask.dim()
        count = math.prod(source.shape[:covered]) if value else 0
        selected = source.new_empty((count, *source.shape[covered:]))
        if count:
            self._values.pop(selected, None)
            if (known := self.value(source)) is not None:
                self._values[selected] = known
        return selected

    def _result_value(self, func: Any, args: tuple, kwargs: dict, source: object) -> Any:
        if func in _CREATED:
            return _CREATED[func]
        if func in _FILLED:
            return args[_FILLED[func]]
        if func is aten._to_copy.default and isinstance(source, torch.Tensor) and not source.is_meta:
            # A host tensor copied to meta (a tokenizer's mask): its value when it holds one.
            flat = source.flatten()
            if flat.numel() > 0 and bool((flat == flat[0]).all()):
                return flat[0].item()
            return None
        if func in _NEGATION:
            value = self.value(source)
            return None if value is None else not value
        if func in _SAME_VALUE or func in _TRUTH:
            value = self.value(source)
            return bool(value) if func in _TRUTH and value is not None else value
        if func in _ELEMENTWISE and len(args) == 2:
            first, second = self.value(args[0]), self.value(args[1])
            if first is not None and second is not None:
                try:
                    return _ELEMENTWISE[func](first, second)
                except ZeroDivisionError:
                    return None
        return None


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return bool(value)
    if dtype.is_floating_point or dtype.is_complex:
        return float(value)
    return int(value)
