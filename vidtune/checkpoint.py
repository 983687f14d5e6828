"""Checkpoints of the whole training state, written so that a crash never leaves a broken one.

A checkpoint is a folder `step-XXXXXXXX/` holding the trainable weights (safetensors), the optimizer and RNG
states (one entry per rank; the LR schedule is a function of the step, see `vidtune.state`), the data
position, and the resolved config. It is written under a temporary name and renamed into place only when
complete (`vidtune.files.atomic_folder`), so a folder named `step-*` is always whole; a write that fails
(a full disk) removes its temporary folder and leaves the checkpoints already there untouched.

Its last file is a digest manifest (`manifest.json`: every file's size and SHA-256, `vidtune.storage.manifest`), so
a checkpoint damaged on disk afterwards (a flipped bit, a truncated copy, a file lost) is found before it is resumed
or exported: `verify` names the file, `newest_intact` skips it for the newest checkpoint that is whole.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from vidtune.config import Config, write_resolved_config
from vidtune.files import atomic_folder, follow_umask, fsync_tree, incomplete_folder, recover_folders, replace_folder
from vidtune.parallel.dcp import EMA_KEY, has_entry, read_weights
from vidtune.storage.manifest import Verdict, verify_folder, write_manifest

WEIGHTS = "weights.safetensors"
EMA_WEIGHTS = "ema_weights.safetensors"  # with training.ema_decay: the moving average, in the format of WEIGHTS
STATE = "training_state.pt"
# A sharded checkpoint (parallel.strategy=fsdp) holds the weights and optimizer state in this torch Distributed
# Checkpoint folder instead (each rank's shard in its own file) and the rest of the state in STATE.
SHARDS = "shards"
CONFIG = "config.yaml"
PREFIX = "step-"
FORMAT = 1
ZERO_SHARDS = "zero"  # parallel.strategy=deepspeed: DeepSpeed's own files, each rank's shards


@dataclass
class SavedState:
    """A checkpoint as read from disk (`vidtune.state.read_checkpoint`): its folder, trainable weights and the rest
    of the state."""

    folder: Path
    weights: dict[str, torch.Tensor] | None  # None: a sharded checkpoint, whose weights are read into the model
    state: dict[str, Any]
    ema_weights: dict[str, torch.Tensor] | None = None

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def sharded(self) -> bool:
        """Whether the weights, optimizer state and average are DCP shards (`SHARDS`), read into the model."""
        return self.weights is None


def rng_state() -> dict[str, Any]:
    # Plain tuples and tensors only, so checkpoints load with torch.load(weights_only=True).
    name, keys, position, has_gauss, cached = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any], rank: int = 0) -> None:
    """Restore the RNGs saved by `save` for `rank` (older checkpoints hold one unkeyed state)."""
    if "python" not in state:
        if rank not in state:
            raise KeyError(f"the checkpoint holds no RNG state for rank {rank} (it has ranks {sorted(state)})")
        state = state[rank]
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(
    root: Path,
    *,
    step: int,
    weights: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    extra: dict[str, Any],
    config: Config,
    keep: int,
    protect: Collection[int] = (),
    rank: int = 0,
    rng: dict[int, Any] | None = None,
    ema_weights: dict[str, torch.Tensor] | None = None,
    shards: Path | None = None,
) -> Path:
    """Write checkpoint `step` atomically under `root`, then keep only the newest `keep` (and those of the steps in
    `protect`).

    `rng`: the RNG states by rank (under torchrun, every rank's); default: this process's, as `rank`.
    `shards`: a folder every rank wrote its part of the state into (DeepSpeed), moved in as `zero/`.

    Any error while writing (OSError for a full disk, ...) removes the temporary folder and is raised
    again; the checkpoints already under `root` are untouched then.
    """
    final = root / f"{PREFIX}{step:08d}"
    with atomic_folder(final) as temporary:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, temporary / WEIGHTS)
        follow_umask(temporary / WEIGHTS)
        if ema_weights is not None:
            save_file({k: v.detach().contiguous().cpu() for k, v in ema_weights.items()}, temporary / EMA_WEIGHTS)
            follow_umask(temporary / EMA_WEIGHTS)
        torch.save(
            {"format": FORMAT, "step": step, "optimizer": optimizer,
             "rng": {rank: rng_state()} if rng is None else rng, **extra},
            temporary / STATE,
        )
        write_resolved_config(config, temporary)
        if shards is not None:
            shutil.move(shards, temporary / ZERO_SHARDS)
        write_manifest(temporary)  # last: it describes every other file
        fsync_tree(temporary)
    prune(root, keep, protect)
    return final


def begin_sharded(root: Path, step: int) -> Path:
    """An empty temporary folder for the sharded checkpoint `step` (rank 0 makes it, every rank writes into its
    SHARDS folder, then `finish_sharded` renames it into place)."""
    temporary = incomplete_folder(root / f"{PREFIX}{step:08d}")
    shutil.rmtree(temporary, ignore_errors=True)
    (temporary / SHARDS).mkdir(parents=True)
    return temporary


def finish_sharded(root: Path, temporary: Path, *, step: int, extra: dict[str, Any], config: Config, keep: int,
                   rng: dict[int, Any], protect: Collection[int] = ()) -> Path:
    """Complete a sharded checkpoint whose shards every rank has written: the training state and config beside
    them, then the rename that makes it whole at once; then keep only the newest `keep`. On any error the
    temporary folder is removed and the error raised again."""
    final = root / f"{PREFIX}{step:08d}"
    try:
        torch.save({"format": FORMAT, "step": step, "sharded": True, "rng": rng, **extra}, temporary / STATE)
        write_resolved_config(config, temporary)
        follow_umask(*(path for path in temporary.rglob("*") if path.is_file()))
        write_manifest(temporary)  # last: it describes every other file, every rank's shards included
        fsync_tree(temporary)
        replace_folder(temporary, final)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    prune(root, keep, protect)
    return final


def is_sharded(folder: Path) -> bool:
    """Whether a checkpoint folder holds its weights and optimizer state as DCP shards."""
    return (folder / SHARDS / ".metadata").is_file()


def _has_files(folder: Path) -> bool:
    return (folder.is_dir() and all((folder / name).is_file() for name in (STATE, CONFIG))
            and ((folder / WEIGHTS).is_file() or is_sharded(folder)))


def is_complete(folder: Path) -> bool:
    """A checkpoint folder renamed into place with every file; nothing else is ever listed or loaded."""
    return folder.name.startswith(PREFIX) and folder.name[len(PREFIX):].isdigit() and _has_files(folder)


def is_step_folder(path: Path) -> bool:
    """A folder named as a checkpoint (renamed into place), whole or not."""
    return path.is_dir() and path.name.startswith(PREFIX) and path.name[len(PREFIX):].isdigit()


def verify(folder: Path, digests: bool = True, progress: bool = False) -> Verdict:
    """Whether a checkpoint folder is whole: its files against its manifest (`digests`: their SHA-256 too, else
    their sizes), and the files every checkpoint has. A checkpoint written before checkpoints carried a manifest
    is unverified (`Verdict.verified` False), not damaged."""
    weights = SHARDS if (folder / SHARDS).is_dir() else WEIGHTS
    return verify_folder(folder, digests, progress, required=(STATE, CONFIG, weights))


def step_folders(root: Path) -> list[Path]:
    """The folders under `root` named as checkpoints, whole or not, oldest first."""
    return sorted((path for path in root.iterdir() if is_step_folder(path)), key=step_of) if root.is_dir() else []


def newest_intact(root: Path, progress: bool = False, digests: bool = True) -> tuple[Verdict | None, list[Verdict]]:
    """The verdict on the newest checkpoint under `root` that is whole, and those on the newer ones skipped
    (damaged); `digests`: check the files' SHA-256 (else only that each is there, of its size)."""
    skipped = []
    for folder in reversed(step_folders(root)):
        verdict = verify(folder, digests, progress)
        if verdict.intact:
            return verdict, skipped
        skipped.append(verdict)
    return None, skipped


def step_of(folder: Path) -> int:
    return int(folder.name[len(PREFIX):])


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_complete(p)), key=step_of)


def latest(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def recover(root: Path) -> None:
    """Tidy what a killed process left under `root` (see `vidtune.files.recover_folders`)."""
    recover_folders(root)


def prune(root: Path, keep: int, protect: Collection[int] = ()) -> None:
    """Remove all but the newest `keep` checkpoints, and those of the steps in `protect` (the best held-out score)."""
    for old in list_checkpoints(root)[:-keep]:
        if step_of(old) not in protect:
            shutil.rmtree(old)


def load(folder: Path, map_location: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(trainable weights, training state) of a complete checkpoint folder; a sharded one's weights are read
    whole, in this process."""
    if not is_complete(folder):
        raise FileNotFoundError(f"{folder} is not a complete checkpoint (a step-XXXXXXXX folder with {WEIGHTS} or "
                                f"{SHARDS}/, {STATE} and {CONFIG})")
    state = torch.load(folder / STATE, map_location=map_location, weights_only=True)
    if is_sharded(folder):
        return {key: value.to(map_location) for key, value in read_weights(folder / SHARDS).items()}, state
    return load_file(folder / WEIGHTS, device=str(map_location)), state


def load_ema(folder: Path, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor] | None:
    """The moving average of the trained weights a checkpoint holds (a run with training.ema_decay), or None; a
    sharded one's is read whole, in this process."""
    if is_sharded(folder):
        if not has_entry(folder / SHARDS, EMA_KEY):
            return None
        return {key: value.to(map_location) for key, value in read_weights(folder / SHARDS, EMA_KEY).items()}
    path = folder / EMA_WEIGHTS
    return load_file(path, device=str(map_location)) if path.is_file() else None
