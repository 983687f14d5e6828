"""How the processes of a run share the training work: the one interface the trainer and the training state use.

`choose_strategy(config, device)` (vidtune/parallel/choose.py) reads `parallel.strategy`:
- one process (no torchrun, `auto`): `Strategy` itself, which changes nothing;
- `ddp` (and `auto` with several processes): every rank holds the whole model, DistributedDataParallel averages
  the gradients (`vidtune.parallel.ddp`);
- `fsdp`: torch's FSDP2 shards weights, gradients and optimizer state (`vidtune.parallel.fsdp`).

The trainer calls, in this order: `load_denoiser` (how each rank gets the weights), `prepare` (before the optimizer
exists: a strategy that replaces the parameters, as FSDP does, returns the new ones), `wrap` (the module to call
for forward), then every step `accumulating` / `backward` / `clip_gradients` / `optimizer_step` / `zero_grad`; a
frozen model beside the trained one (a distillation teacher) goes through `prepare_frozen`. Checkpoints: a strategy with
`sharded_checkpoints` writes its trainable weights and optimizer state with `save_state` (every rank its shard)
and reads them with `load_state`; the others keep the single-file format of `vidtune.checkpoint`. `gathered`
makes the whole trained model usable on rank 0 (final weights, validation samples).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from vidtune import parallel
from vidtune.config import Config
from vidtune.ema import EMA
from vidtune.models.spec import ModelSpec
from vidtune.parallel.dcp import Weights, read_shards

if TYPE_CHECKING:
    from vidtune.algorithms.part import AlgorithmPart


class Strategy:
    """One process: the module as it is, gradients as backward leaves them."""

    name = "none"
    # Whether `save_state` / `load_state` write / read the checkpoint's weights and optimizer state (every rank
    # taking part) instead of the single-file format rank 0 writes.
    sharded_checkpoints = False
    # Whether the training engine keeps checkpoint files of its own beside the single-file format (DeepSpeed's
    # `zero/`: `save_engine_state` / `load_engine_state`).
    engine_checkpoints = False
    # Whether `wrap` comes before a checkpoint is restored (an engine that restores into itself).
    wraps_before_restore = False
    # Whether a forward gathers weights from every rank (sharded weights): all ranks must then run the same number
    # of forwards, also of a frozen teacher, or their collectives no longer pair up.
    forwards_gather_weights = False

    def __init__(self, config: Config, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.module: nn.Module | None = None  # the denoiser, once `prepare` has seen it
        self.ema: EMA | None = None  # training.ema_decay: the weights' average, which `gathered` gathers with them

    def check(self) -> None:
        """Refuse settings this strategy cannot run, before any model is loaded."""

    def load_denoiser(self, spec: ModelSpec, load_on: torch.device) -> nn.Module:
        """The denoiser as this rank starts from it, placed on `load_on` (see `ModelSpec.load_denoiser`)."""
        return spec.load_denoiser(self.device, load_on)

    def prepare_frozen(self, module: nn.Module) -> nn.Module:
        """A frozen model used for forwards only (the teacher of a fully trained student), after `prepare`."""
        return module

    def prepare(self, module: nn.Module, parameters: list[nn.Parameter]) -> list[nn.Parameter]:
        """Before the optimizer is built: the parameters it is to update (the same ones unless replaced)."""
        self.module = module
        return parameters

    def wrap(self, module: nn.Module, parameters: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> nn.Module:
        """The module the trainer calls for forward."""
        return module

    def accumulating(self, module: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Forward and backward of a micro-batch; gradients are synchronised over ranks only when `sync`."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_gradients(self, parameters: list[nn.Parameter],
                       max_norm: float | None) -> torch.Tensor | float | None:
        """Clip to `max_norm` (None: do not clip) and return the global norm before clipping, as a tensor on the
        device where it is one (the trainer reads it with the loss, in the step's one synchronisation)."""
        if max_norm is None:
            grads = [p.grad for p in parameters if p.grad is not None]
            return _whole(torch.nn.utils.get_total_norm(grads)) if grads else None
        return _whole(torch.nn.utils.clip_grad_norm_(parameters, max_norm))

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def zero_grad(self, optimizer: torch.optim.Optimizer, applied: bool = True) -> None:
        """After each step (`applied`: whether the update was, or the step was skipped as non-finite)."""
        optimizer.zero_grad(set_to_none=True)

    def save_state(self, folder: Path, weights: Weights, optimizer: torch.optim.Optimizer,
                   ema_weights: Weights | None = None) -> None:
        """`sharded_checkpoints` only: write `weights`, the optimizer state and the weights' average (`ema_weights`)
        into `folder` (every rank)."""
        raise NotImplementedError(f"parallel.strategy={self.name} writes single-file checkpoints")

    def load_state(self, folder: Path, weights: Weights, set_weights: Callable[[Weights], None],
                   optimizer: torch.optim.Optimizer, ema_weights: Weights | None = None) -> Weights | None:
        """Read the weights and optimizer state of a sharded checkpoint, written by any number of ranks, into the
        model and the optimizer (`weights`: the current trainable weights, whose keys say what to read). Every
        strategy reads them: a run sharded over many GPUs continues in one process too. `ema_weights`: tensors
        laid out as `weights`, filled with the checkpoint's average and returned (None: it has none)."""
        return read_shards(folder, self.module, weights, set_weights, optimizer, ema_weights)

    @contextlib.contextmanager
    def gathered(self, module: nn.Module, everything: bool = False) -> Iterator[None]:
        """Within the block, `module` holds its whole trained weights on every rank (rank 0 saves / samples them;
        `everything`: the frozen ones too, for the final files)."""
        yield

    @contextlib.contextmanager
    def sampling(self, part: AlgorithmPart, fresh: Callable[[], AlgorithmPart]) -> Iterator[AlgorithmPart]:
        """Rank 0, inside `gathered`: the algorithm part (and its denoiser) validation samples with; here the
        trained one as it is (`fresh`: a new part of the same algorithm, for a strategy that needs a copy)."""
        yield part

    def full_trainable_state_dict(self, module: nn.Module, get_weights: Callable[[], Weights]) -> Weights:
        """The trained weights, whole, as CPU tensors on rank 0 (every rank must call it; others get {})."""
        with self.gathered(module):
            if not parallel.is_main():
                return {}
            return {key: value.detach().cpu().clone() for key, value in get_weights().items()}


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """A norm as a plain tensor; a DTensor norm (sharded gradients) is whole already (replicated) on every rank."""
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm
