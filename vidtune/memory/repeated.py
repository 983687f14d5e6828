"""Operators on meta tensors answered from what the same call gave before.

On the meta device torch works out each operator's result (shape, strides, dtype) in Python (its reference
implementations, `torch._refs`), a few hundred microseconds an operator; a traced training step runs tens of
thousands of them, almost all repeats (every transformer block makes the same calls on tensors of the same shapes).
`RepeatedOps` remembers the result's layout for each call and makes a new empty meta tensor of that layout on the
next identical call: a fresh storage each time, as the operator gives, so `LiveMemory` counts it the same.

Only calls whose result cannot depend on anything but the key are remembered: functional operators (no input
written to, no view or alias of an input returned), every tensor input on meta (no data), results that are meta
tensors with storages of exactly their layout's size, and no operator whose result's shape depends on values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# A layout: shape, strides, dtype. A call's key: the operator and the layouts (or values) of its arguments.
Layout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]
_PLAIN = (torch.Tensor, nn.Parameter)
# The most calls remembered per process (a few thousand distinct ones per architecture); cleared when full.
LIMIT = 200_000
# A call's key -> (the result's type: a tensor, tuple or list; the layouts of its tensors); None: not remembered.
_LAYOUTS: dict[tuple, tuple[type, tuple[Layout, ...]] | None] = {}
_CACHEABLE: dict[Any, bool] = {}
# False: every call runs the operator (the planner's figures are the same either way: tests/memory).
ENABLED = True


class _Uncacheable(Exception):
    """An argument the key cannot hold (not hashable, a tensor with data, a tensor subclass)."""


def _key_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if type(value) not in _PLAIN or not value.is_meta:
            raise _Uncacheable
        return (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_key_of(item) for item in value))
    if isinstance(value, dict):
        return tuple(sorted((name, _key_of(item)) for name, item in value.items()))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return (type(value), value)
    raise _Uncacheable


def _cacheable(func: Any) -> bool:
    """A functional operator whose result's shape does not depend on its inputs' values."""
    known = _CACHEABLE.get(func)
    if known is None:
        schema = func._schema
        known = not (schema.is_mutable or any(argument.alias_info for argument in schema.arguments)
                     or any(result.alias_info for result in schema.returns)
                     or torch.Tag.dynamic_output_shape in func.tags
                     or torch.Tag.data_dependent_output in func.tags)
        _CACHEABLE[func] = known
    return known


def _layout(tensor: torch.Tensor) -> Layout | None:
    """The tensor's layout, when it is a fresh meta tensor whose storage is exactly that layout's size."""
    if type(tensor) is not torch.Tensor or not tensor.is_meta or tensor.storage_offset() != 0:
        return None
    shape, stride = tuple(tensor.shape), tensor.stride()
    size = 0 if 0 in shape else 1 + sum((length - 1) * step for length, step in zip(shape, stride, strict=True))
    if tensor.untyped_storage().nbytes() != size * tensor.element_size():
        return None
    return shape, stride, tensor.dtype


def _remember(result: Any, inputs: set[int]) -> tuple[type, tuple[Layout, ...]] | None:
    """The layouts of the call's result (a tensor or a tuple of them), None when it must not be remembered."""
    tensors = [result] if isinstance(result, torch.Tensor) else result
    if not isinstance(tensors, (list, tuple)) or not tensors or \
            not all(isinstance(tensor, torch.Tensor) for tensor in tensors):
        return None
    layouts = []
    for tensor in tensors:
        layout = _layout(tensor)
        if layout is None or id(tensor.untyped_storage()) in inputs:
            return None
        layouts.append(layout)
    if len({id(tensor.untyped_storage()) for tensor in tensors}) != len(tensors):
        return None  # outputs sharing a storage
    return type(result), tuple(layouts)


def _made(layout: Layout) -> torch.Tensor:
    shape, stride, dtype = layout
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


class RepeatedOps(TorchDispatchMode):
    """While inside: functional operators on meta tensors are answered from the same call's earlier result (see
    the module). Enter it before the modes that count (it must be the last to see each call)."""

    def __init__(self) -> None:
        super().__init__()
        self.hits = self.misses = 0  # calls answered from an earlier one, calls remembered

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = None
        if ENABLED and _cacheable(func):
            try:
                key = (func, _key_of(args), _key_of(kwargs))
            except _Uncacheable:
                key = None
        if key is not None:
            found = _LAYOUTS.get(key)
            if found is not None:
                self.hits += 1
                kind, layouts = found
                return _made(layouts[0]) if kind is torch.Tensor else kind(_made(layout) for layout in layouts)
        result = func(*args, **kwargs)
        if key is not None and key not in _LAYOUTS:
            self.misses += 1
            if len(_LAYOUTS) >= LIMIT:
                _LAYOUTS.clear()
            inputs = {id(tensor.untyped_storage()) for tensor in _tensors((args, kwargs))}
            _LAYOUTS[key] = _remember(result, inputs)
        return result


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in _tensors(item)]
    return []
