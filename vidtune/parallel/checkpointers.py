"""Checkpointers: how a run's trained weights, optimizer state and weights' average go into a checkpoint folder and
come back out, one kind per way of sharing the training over processes. Each strategy provides its own
(`Strategy.checkpointer`); the training state (`vidtune.state`) hands it those parts and the rest of the checkpoint
(step, data position, RNG states, config: a `Record`), and never asks which kind it holds.

- `Checkpointer` (one process, DDP): rank 0 writes the whole weights, their average and the optimizer state as
  files of the folder (`vidtune.checkpoint.save`);
- `ShardedCheckpointer` (FSDP): every rank writes its shard of them into the folder's DCP `shards/`
  (`vidtune.parallel.dcp`), then rank 0 completes the folder;
- `DeepSpeedCheckpointer` (vidtune/parallel/deepspeed.py): DeepSpeed's own shards (`zero/`) beside the gathered
  weights.

Every checkpointer reads a sharded checkpoint (DCP reshards on load), so a run sharded over many GPUs continues on
fewer, or in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vidtune import checkpoint as checkpoints
from vidtune import parallel
from vidtune.checkpoint import SavedState
from vidtune.config import Config
from vidtune.ema import EMA
from vidtune.errors import CheckpointError
from vidtune.parallel.dcp import Weights, read_shards, write_shards

if TYPE_CHECKING:
    from vidtune.parallel.strategy import Strategy


@dataclass(frozen=True)
class Record:
    """What a checkpoint holds beside the weights, optimizer state and average (see `vidtune.checkpoint.save`)."""

    step: int
    extra: dict[str, Any]  # the data position, algorithm, skip count, number of processes...
    config: Config
    keep: int  # checkpoints kept (the newest), besides those of `protect`'s steps
    protect: Collection[int]
    rng: dict[int, Any]  # every rank's RNG states, by rank


@dataclass(frozen=True)
class TrainedParts:
    """The parts of the training state a checkpointer writes and restores."""

    get_weights: Callable[[], Weights]  # the trained weights, through the algorithm's accessor
    set_weights: Callable[[Weights], None]
    optimizer: torch.optim.Optimizer
    ema: EMA | None  # training.ema_decay: the weights' average

    def ema_weights(self) -> Weights | None:
        """The average in the format of `get_weights` (what a checkpoint stores), or None."""
        return None if self.ema is None else self.ema.read(self.get_weights)


class Checkpointer:
    """One process and DDP: rank 0 writes the whole weights, their average and the optimizer state as files."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def save(self, root: Path, record: Record, parts: TrainedParts) -> Path:
        """Every rank calls it: write the checkpoint of `record.step` under `root`; returns its folder. A failed write
        raises (OSError, RuntimeError...) on every rank, with the checkpoints already there left whole."""
        return parallel.on_main(lambda: self.write_files(root, record, parts.get_weights(),
                                                         parts.optimizer.state_dict(), parts.ema_weights()))

    def restore(self, saved: SavedState, parts: TrainedParts, device: torch.device) -> Weights | None:
        """The weights and optimizer state of `saved` into `parts`; returns its weights' average (None: it has none),
        which the training state puts into its own."""
        if saved.sharded:
            return self.read_shards(saved, parts)
        parts.set_weights({key: value.to(device) for key, value in saved.weights.items()})
        parts.optimizer.load_state_dict(saved.state["optimizer"])
        return saved.ema_weights

    def write_files(self, root: Path, record: Record, weights: Weights, optimizer: dict[str, Any],
                    ema_weights: Weights | None, shards: Path | None = None) -> Path:
        """Rank 0: the checkpoint folder with the weights and average as safetensors files and `optimizer` in the
        training state (`shards`: a folder of the engine's own files to move in)."""
        return checkpoints.save(root, step=record.step, weights=weights, optimizer=optimizer, extra=record.extra,
                                config=record.config, keep=record.keep, protect=record.protect, rng=record.rng,
                                ema_weights=ema_weights, shards=shards)

    def read_shards(self, saved: SavedState, parts: TrainedParts) -> Weights | None:
        """A sharded checkpoint, written by any number of ranks, into this rank's weights and optimizer state; its
        average is read into tensors laid out as this run's."""
        template = None if parts.ema is None else parts.ema.read(parts.get_weights, own=True)
        return read_shards(saved.folder / checkpoints.SHARDS, self.strategy.module, parts.get_weights(),
                           parts.set_weights, parts.optimizer, template)


class ShardedCheckpointer(Checkpointer):
    """FSDP: every rank writes its shard of the weights, optimizer state and average into one DCP folder, at once;
    rank 0 then adds the rest of the state and renames the folder into place."""

    def save(self, root: Path, record: Record, parts: TrainedParts) -> Path:
        # A failure on any rank stops every rank, with the checkpoints already written intact.
        temporary = parallel.on_main(lambda: checkpoints.begin_sharded(root, record.step))
        write_shards(temporary / checkpoints.SHARDS, self.strategy.module, parts.get_weights(), parts.optimizer,
                     parts.ema_weights())
        return parallel.on_main(lambda: checkpoints.finish_sharded(
            root, temporary, step=record.step, extra=record.extra, config=record.config, keep=record.keep,
            rng=record.rng, protect=record.protect))

    def restore(self, saved: SavedState, parts: TrainedParts, device: torch.device) -> Weights | None:
        if not saved.sharded and parallel.is_distributed():
            raise CheckpointError(f"{saved.folder} was written with parallel.strategy=ddp (or by one process); "
                                  f"parallel.strategy={self.strategy.name} resumes only its own sharded "
                                  "checkpoints on several processes. What to do: resume it with "
                                  "parallel.strategy=ddp (or in one process), or start anew.")
        return super().restore(saved, parts, device)
