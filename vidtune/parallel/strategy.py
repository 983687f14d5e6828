"""How the processes of a run share the training work: the one interface the trainer and the training state use.

`choose_strategy(config, device)` (vidtune/parallel/choose.py) reads `parallel.strategy`:
- one process (no torchrun, `auto`): `Strategy` itself, which changes nothing;
- `ddp` (and `auto` with several processes): every rank holds the whole model, DistributedDataParallel averages
  the gradients (`vidtune.parallel.ddp`);
- `fsdp`: torch's FSDP2 shards weights, gradients and optimizer state (`vidtune.parallel.fsdp`).

The trainer calls, in this order: `load_denoiser` (how each rank gets the weights), `prepare` (before the optimizer
exists: a strategy that replaces the parameters, as FSDP does, returns the new ones), `wrap` (the module to call
for forward), then every step `accumulating` / `backward` / `clip_gradients` / `optimizer_step` / `zero_grad`; a
frozen model beside the trained one (a distillation teacher) goes through `prepare_frozen`. Checkpoints: `checkpointer`
gives the object that writes and reads the trained weights, optimizer state and weights' average in this strategy's
format (vidtune/parallel/checkpointers.py). `gathered` makes the whole trained model usable on rank 0 (final weights,
validation samples).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from vidtune.config import Config
from vidtune.ema import EMA
from vidtune.models.spec import ModelSpec
from vidtune.parallel.checkpointers import Checkpointer

if TYPE_CHECKING:
    from vidtune.algorithms.part import AlgorithmPart


class Strategy:
    """One process: the module as it is, gradients as backward leaves them."""

    name = "none"
    # Whether a training engine keeps the optimizer state and gradients to itself (DeepSpeed): its checkpointer
    # writes the engine's own files, and the trainer cannot look at gradients on the parameters.
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
        self.spec: ModelSpec | None = None  # its family, once `load_denoiser` has loaded it
        self.ema: EMA | None = None  # training.ema_decay: the weights' average, which `gathered` gathers with them

    def check(self) -> None:
        """Refuse settings this strategy cannot run, before any model is loaded."""

    def load_denoiser(self, spec: ModelSpec, load_on: torch.device) -> nn.Module:
        """The denoiser as this rank starts from it, placed on `load_on` (see `ModelSpec.load_denoiser`). The
        strategy keeps `spec`: how it treats the denoiser afterwards (`prepare`, `prepare_frozen`) is the family's
        to say (vidtune/models/spec/hooks.py)."""
        self.spec = spec
        return spec.load_denoiser(self.device, load_on)

    @property
    def family(self) -> ModelSpec:
        """The spec `load_denoiser` was given."""
        if self.spec is None:
            raise RuntimeError(f"parallel.strategy={self.name}: the denoiser is prepared before `load_denoiser` "
                               "loaded it, so its family is unknown.")
        return self.spec

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

    def checkpointer(self) -> Checkpointer:
        """What writes and reads this strategy's checkpoints: rank 0 the whole weights and optimizer state as files."""
        return Checkpointer(self)

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


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """A norm as a plain tensor; a DTensor norm (sharded gradients) is whole already (replicated) on every rank."""
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm
