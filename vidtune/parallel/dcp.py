"""Sharded checkpoints on disk: torch Distributed Checkpoint (DCP) folders holding the trainable weights, the
optimizer state and the weights' average, every rank writing its shard. DCP reshards on load, so a folder written by
any number of ranks is read by any other number, one process included (`parallel.strategy: fsdp` writes them; every
strategy and `vidtune export` read them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from vidtune import parallel
from vidtune.errors import CheckpointError

Weights = dict[str, torch.Tensor]

# The two parts of a sharded checkpoint, as keys of the state DCP writes.
WEIGHTS_KEY = "weights"
OPTIMIZER_KEY = "optimizer"
EMA_KEY = "ema"  # training.ema_decay: the weights' moving average, in the format of WEIGHTS_KEY


def write_shards(folder: Path, module: nn.Module, weights: Weights, optimizer: torch.optim.Optimizer,
                 ema_weights: Weights | None = None) -> None:
    """Every rank writes its shard of `weights`, of the optimizer state and of the weights' average (`ema_weights`,
    when there is one) into the DCP folder `folder`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {WEIGHTS_KEY: weights, OPTIMIZER_KEY: get_optimizer_state_dict(module, optimizer)}
    if ema_weights is not None:
        state[EMA_KEY] = ema_weights
    dcp.save(state, checkpoint_id=str(folder), no_dist=not parallel.is_distributed())


def read_shards(folder: Path, module: nn.Module, weights: Weights, set_weights: Callable[[Weights], None],
                optimizer: torch.optim.Optimizer, ema_weights: Weights | None = None) -> Weights | None:
    """Load a DCP folder written by any number of ranks into this rank's part of the weights and optimizer state
    (`weights`: the current trainable weights, whose keys and layout say what to read). `ema_weights`: tensors
    laid out as the weights, filled with the checkpoint's average of them and returned; None when the checkpoint
    has none (or none is asked for)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {WEIGHTS_KEY: weights, OPTIMIZER_KEY: get_optimizer_state_dict(module, optimizer)}
    if ema_weights is not None and has_entry(folder, EMA_KEY):
        state[EMA_KEY] = ema_weights
    try:
        dcp.load(state, checkpoint_id=str(folder), no_dist=not parallel.is_distributed())
    except Exception as error:  # DCP wraps every rank's failure in one CheckpointException
        raise CheckpointError(f"Could not read the sharded checkpoint {folder}: {error}\nWhat to do: resume from "
                              "another checkpoint (checkpoint.resume=PATH) or check the training settings match "
                              "the run that wrote it.") from None
    set_weights(state[WEIGHTS_KEY])
    set_optimizer_state_dict(module, optimizer, state[OPTIMIZER_KEY])
    return state.get(EMA_KEY)


def has_entry(folder: Path, key: str) -> bool:
    """Whether the DCP folder holds tensors under `key` (an average, written with training.ema_decay)."""
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return any(name.startswith(f"{key}.") for name in stored)


def read_weights(folder: Path, key: str = WEIGHTS_KEY) -> Weights:
    """The trainable weights of a DCP folder (or, `key=EMA_KEY`, their average), whole, in one process (for
    `vidtune export`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"{key}."
    stored = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    weights = {
        name[len(prefix):]: torch.empty(entry.size, dtype=entry.properties.dtype)
        for name, entry in stored.items() if name.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    dcp.load({key: weights}, checkpoint_id=str(folder), no_dist=True)
    return weights
