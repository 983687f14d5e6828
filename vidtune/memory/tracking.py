"""The live tensor memory of a piece of code, counted at torch's dispatcher.

`LiveMemory` sees every tensor an operator returns and keeps a weak reference to its storage; when the storage is
freed, its bytes leave the count. It runs equally over real tensors and over `meta` tensors, which have shapes and
dtypes but no data: the planner runs a real-size training step on the meta device, where nothing is allocated and
no arithmetic is done, and reads the peak it would have had.

Storages that existed before (the weights) are registered with `known` and never counted: the planner adds the
weights' bytes itself, since how they are stored (fp8, int8, nf4, swapped to the CPU) is its own decision.
`offloaded` storages (activations saved for the backward pass under `memory.activation_offload`) leave the count
while saved and come back when the backward pass reads them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class _Record:
    __slots__ = ("counted", "known")

    def __init__(self, counted: int, known: bool = False) -> None:
        self.counted = counted  # the bytes this storage adds to the live count now
        self.known = known  # existed before: never counted


class LiveMemory(TorchDispatchMode):
    """Counts the bytes of tensor storages created inside it that are alive; `peak` is the largest count seen."""

    def __init__(self) -> None:
        super().__init__()
        self._records: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._finalizers: list[weakref.ref] = []
        self.current = 0
        self.peak = 0

    def known(self, tensors: Iterable[torch.Tensor]) -> None:
        """Storages that are never counted (they existed before, e.g. the model's weights)."""
        for tensor in tensors:
            self._records.setdefault(tensor.untyped_storage(), _Record(0, known=True))

    def reset_peak(self) -> None:
        self.peak = self.current

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage in self._records:
            return
        record = _Record(storage.nbytes())
        self._records[storage] = record
        self.current += record.counted
        # The storage's Python object lives as long as the storage: its end is where the bytes are freed.
        self._finalizers.append(weakref.ref(storage, lambda _, record=record: self._free(record)))

    def _free(self, record: _Record) -> None:
        self.current -= record.counted
        record.counted = 0

    def offload(self, tensor: torch.Tensor) -> None:
        """`tensor` was moved off the device (a saved activation): its bytes leave the count until `reload`."""
        record = self._records.get(tensor.untyped_storage())
        if record is not None and record.counted:
            self.current -= record.counted
            record.counted = 0

    def reload(self, tensor: torch.Tensor) -> None:
        """`tensor` is on the device again (the backward pass reads it)."""
        storage = tensor.untyped_storage()
        record = self._records.get(storage)
        if record is not None and not record.known and record.counted == 0:
            record.counted = storage.nbytes()
            self.current += record.counted
            self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(result):
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
        self.peak = max(self.peak, self.current)
        return result


@contextlib.contextmanager
def fused_attention(device_type: str) -> Iterator[None]:
    """`scaled_dot_product_attention` as the planned device runs it. On meta tensors torch picks its reference
    implementation, which stores the whole attention matrix; the fused kernels the CPU and CUDA pick never do
    (flash attention; on CUDA with a mask, memory-efficient attention). Their meta versions give the same shapes
    and the same saved tensors (output, log-sum-exp) as on the device. The function is replaced where models look
    it up, so gradient checkpointing's recomputation in the backward pass sees the same one."""
    original = F.scaled_dot_product_attention

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        if enable_gqa:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=True)
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # as torch converts it for the fused kernels:
            # one `where` over two scalars (no temporary the size of the mask)
            attn_mask = torch.where(attn_mask, torch.zeros((), dtype=query.dtype, device=query.device),
                                    torch.full((), float("-inf"), dtype=query.dtype, device=query.device))
        if device_type != "cuda":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        if attn_mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, scale=scale)[0]
        bias = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, dropout_p, is_causal, scale=scale)[0]

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
