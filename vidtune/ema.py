"""`training.ema_decay`: an exponential moving average (EMA) of the trained weights.

After each applied optimizer step, every trained parameter's shadow copy moves towards it:
`shadow = decay_n * shadow + (1 - decay_n) * weight`, with `decay_n = min(decay, (1 + n) / (10 + n))` at the n-th
update (the warm-up diffusers' EMAModel uses: early on the average follows the weights, so a fresh adapter's
zeros do not dominate it for thousands of steps). A skipped, non-finite step is no update.

The shadow lives beside the weights, in fp32 and on their device (a full fine-tune holds one more copy of the
trained weights). Checkpoints store it, so a resumed run continues it bit for bit; validation samples with it
(`applied`); a finished run writes it beside its weights (`pytorch_lora_weights_ema.safetensors`,
`transformer_ema/`).

Under FSDP (`parallel.strategy: fsdp`) the trained parameters are DTensors holding this rank's shard, and so is the
shadow: each rank averages its own shard (no communication per step), a sharded checkpoint stores every rank's
shard of it, and `whole` gathers it once for the final files and validation samples.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view of its storage), a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _gathered(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A DTensor's whole value on `device`, gathered from every rank (its shards may sit in CPU memory with FSDP's
    CPU offload, where NCCL cannot gather them); a plain tensor as it is."""
    if not isinstance(tensor, DTensor):
        return tensor
    if tensor.to_local().device != device:
        tensor = DTensor.from_local(tensor.to_local().to(device), tensor.device_mesh, tensor.placements,
                                    shape=tensor.shape, stride=tensor.stride())
    return tensor.full_tensor()


class EMA:
    """The moving average of `parameters` (the trained ones, by name)."""

    def __init__(self, parameters: dict[str, nn.Parameter], decay: float) -> None:
        self.parameters = parameters
        self.decay = decay
        self.updates = 0
        self.shadow = {name: p.detach().clone() for name, p in parameters.items()}

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        weight = 1.0 - self.current_decay()
        for name, parameter in self.parameters.items():
            _local(self.shadow[name]).lerp_(_local(parameter.detach()), weight)
        self.updates += 1

    @property
    def holds_shards(self) -> bool:
        """Whether the parameters are shards (FSDP): `applied` then copies the average into them, so what is read
        inside must be cloned to outlive the block."""
        return any(isinstance(p, DTensor) for p in self.parameters.values())

    def read(self, get_weights: Callable[[], dict[str, torch.Tensor]],
             own: bool = False) -> dict[str, torch.Tensor]:
        """The average in the format of `get_weights` (the trained weights' accessor), as tensors that outlive the
        call: views of the average itself (plain parameters hold its storage inside `applied`), or with `own`
        copies of it (to be written into without touching it). Shards are always copies: `applied` copies the
        average into them and their own weights back afterwards."""
        with self.applied():
            weights = get_weights()
            if self.holds_shards:
                return {key: value.clone() for key, value in weights.items()}
            return {key: value.detach().clone() for key, value in weights.items()} if own else weights

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The parameters hold the average inside the block and their own weights again after it. What is
        written into them inside (loading a checkpoint's average) lands in the average.

        Plain parameters swap their storage with the shadow's (no copy). A DTensor's storage cannot be swapped
        that way (its shard is a Python attribute FSDP gathers from), so shards are copied in and back out."""
        swapped = {name: p for name, p in self.parameters.items() if not isinstance(p, DTensor)}
        copied = {name: p for name, p in self.parameters.items() if isinstance(p, DTensor)}
        own_data = {name: p.data for name, p in swapped.items()}
        with torch.no_grad():
            own_values = {name: _local(p.detach()).clone() for name, p in copied.items()}
        try:
            for name, parameter in swapped.items():
                parameter.data = self.shadow[name]
            with torch.no_grad():
                for name, parameter in copied.items():
                    _local(parameter.detach()).copy_(_local(self.shadow[name]))
            yield
        finally:
            for name, parameter in swapped.items():
                parameter.data = own_data[name]
            with torch.no_grad():
                for name, parameter in copied.items():
                    _local(self.shadow[name]).copy_(_local(parameter.detach()))
                    _local(parameter.detach()).copy_(own_values[name])

    @contextlib.contextmanager
    def whole(self, parameters: dict[str, nn.Parameter]) -> Iterator[None]:
        """Inside the block the average is whole and follows `parameters` (the same names: the whole weights a
        sharded model gathered), so `applied` swaps it into them. Every rank must enter it: gathering a sharded
        average is a collective. What is written into the whole average inside is dropped at the end."""
        bound, shadow = self.parameters, self.shadow
        self.parameters = {name: parameters[name] for name in bound}
        self.shadow = {name: _gathered(s, self.parameters[name].device) for name, s in shadow.items()}
        try:
            yield
        finally:
            self.parameters, self.shadow = bound, shadow
