"""DistributedDataParallel: every rank holds the whole model, gradients are averaged after each backward."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from vidtune.parallel import is_distributed
from vidtune.parallel.strategy import Strategy


class DataParallel(DistributedDataParallel):
    """DistributedDataParallel that also answers for the module it wraps.

    The families' `spec.forward(denoiser, ...)` read `denoiser.config` / `denoiser.dtype`, and they must call the
    wrapper (not `.module`) for DDP to average the gradients. Delegating unknown attributes to `.module` lets
    every spec take the wrapper unchanged, instead of each spec learning to unwrap."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)


def wrap(module: nn.Module, device: torch.device) -> nn.Module:
    """`module` ready for data-parallel training (one process: `module` itself)."""
    if not is_distributed():
        return module
    device_ids = [device.index] if device.type == "cuda" else None
    # Frozen weights are not broadcast from rank 0: every rank read them from the same files and stored them the
    # same way, and quantized ones (memory.base_weights int8 / nf4) are tensor subclasses DDP cannot broadcast.
    frozen = [name for name, parameter in module.named_parameters() if not parameter.requires_grad]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, frozen)
    # A module whose forward routes samples to parts of it (two experts split by noise level) declares
    # `leaves_parameters_unused`: a rank's micro-batch may skip a part that another rank's used. DDP then marks the
    # skipped parameters ready with a zero gradient, so the average over ranks is the gradient of the mean loss
    # over all ranks' samples, as one process with the whole batch computes it; a part no rank used keeps no
    # gradient, as in one process. The price is one walk over the autograd graph per backward.
    # Such a module also keeps its idle part's buffers in CPU memory (vidtune/models/experts.py), where a broadcast
    # from rank 0 cannot reach them; they are not broadcast: every rank built them the same way from one config.
    routed = bool(getattr(module, "leaves_parameters_unused", False))
    # Gradients are views into DDP's communication buckets: no second copy of them in memory.
    return DataParallel(module, device_ids=device_ids, gradient_as_bucket_view=True,
                        find_unused_parameters=routed, broadcast_buffers=not routed)


def accumulating(module: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Forward and backward of a micro-batch: gradients are averaged over ranks only when `sync` (the last
    micro-batch of an accumulation), not on the ones before it."""
    if sync or not isinstance(module, DistributedDataParallel):
        return contextlib.nullcontext()
    return module.no_sync()


class DataParallelStrategy(Strategy):
    """DistributedDataParallel: today's behaviour and checkpoint format."""

    name = "ddp"

    def wrap(self, module: nn.Module, parameters: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> nn.Module:
        return wrap(module, self.device)

    def accumulating(self, module: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        return accumulating(module, sync)
