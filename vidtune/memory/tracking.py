"""The live tensor memory of a piece of code, counted at torch's dispatcher.

`LiveMemory` sees every tensor an operator returns and keeps a weak reference to its storage; when the storage is
freed, its bytes leave the count. It runs equally over real tensors and over `meta` tensors, which have shapes and
dtypes but no data: the planner runs a real-size training step on the meta device, where nothing is allocated and
no arithmetic is done, and reads the peak it would have had.

Storages that existed before (the weights) are registered with `known` and never counted: the planner adds the
weights' bytes itself, since how they are stored (fp8, int8, nf4, swapped to the CPU) is its own decision.
Activations saved for the backward pass are counted a second way at the same time: as `memory.activation_offload`
would hold them (in host memory while saved, back on the device when the backward pass reads them), so one run
gives the peak with and without it.
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


def pinned_size(nbytes: int) -> int:
    """The pinned host memory a tensor of `nbytes` takes: torch's caching host allocator (what `pin_memory` and
    `save_on_cpu(pin_memory=True)` use) rounds each block up to a power of two."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


class _Record:
    __slots__ = ("counted", "known", "offloaded")

    def __init__(self, counted: int, known: bool = False) -> None:
        self.counted = counted  # the bytes this storage adds to the live count now
        self.known = known  # existed before: never counted
        self.offloaded = False  # saved for the backward pass and held in pinned host memory (activation offload)


class LiveMemory(TorchDispatchMode):
    """Counts the bytes of tensor storages created inside it that are alive; `peak` is the largest count seen.

    One run counts two ways at once: `current` / `peak` with every tensor on the device, `offload_current` /
    `offload_peak` with the tensors saved for the backward pass in host memory while saved (`offload`, `reload`:
    `memory.activation_offload`); `host_peak` is the most pinned host memory they take at once."""

    def __init__(self) -> None:
        super().__init__()
        self._records: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._finalizers: list[weakref.ref] = []
        self.current = self.peak = 0
        self.offload_current = self.offload_peak = 0
        self.host_current = self.host_peak = 0

    def known(self, tensors: Iterable[torch.Tensor]) -> None:
        """Storages that are never counted (they existed before, e.g. the model's weights)."""
        for tensor in tensors:
            self._records.setdefault(tensor.untyped_storage(), _Record(0, known=True))

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage in self._records:
            return
        record = _Record(storage.nbytes())
        self._records[storage] = record
        self.current += record.counted
        self.offload_current += record.counted
        # The storage's Python object lives as long as the storage: its end is where the bytes are freed.
        self._finalizers.append(weakref.ref(storage, lambda _, record=record: self._free(record)))

    def _free(self, record: _Record) -> None:
        self.current -= record.counted
        if record.offloaded:
            self.host_current -= pinned_size(record.counted)
        else:
            self.offload_current -= record.counted
        record.counted = 0

    def offload(self, tensor: torch.Tensor) -> None:
        """`tensor` was saved for the backward pass: under activation offload its bytes leave the device for host
        memory until `reload`."""
        record = self._records.get(tensor.untyped_storage())
        if record is not None and record.counted and not record.offloaded:
            record.offloaded = True
            self.offload_current -= record.counted
            self.host_current += pinned_size(record.counted)
            self.host_peak = max(self.host_peak, self.host_current)

    def reload(self, tensor: torch.Tensor) -> None:
        """`tensor` is on the device again (the backward pass reads it)."""
        record = self._records.get(tensor.untyped_storage())
        if record is not None and record.offloaded:
            record.offloaded = False
            self.offload_current += record.counted
            self.host_current -= pinned_size(record.counted)
            self.offload_peak = max(self.offload_peak, self.offload_current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(result):
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
        self.peak = max(self.peak, self.current)
        self.offload_peak = max(self.offload_peak, self.offload_current)
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
