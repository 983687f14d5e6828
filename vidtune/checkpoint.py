"""Checkpoints of the whole training state, written so that a crash never leaves a broken one.

A checkpoint is a folder `step-XXXXXXXX/` holding the trainable weights (safetensors), the optimizer,
LR scheduler and RNG states, and the resolved config. It is written under a temporary name and
renamed into place only when complete, so a folder named `step-*` is always whole.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from vidtune.config import Config, write_resolved_config

WEIGHTS = "weights.safetensors"
STATE = "training_state.pt"
PREFIX = "step-"


def rng_state() -> dict[str, Any]:
    # Plain tuples and tensors only, so checkpoints load with torch.load(weights_only=True).
    name, keys, position, has_gauss, cached = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        with path.open("rb") as handle:
            os.fsync(handle.fileno())


def save(
    root: Path,
    *,
    step: int,
    weights: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    lr_scheduler: dict[str, Any],
    extra: dict[str, Any],
    config: Config,
    keep: int,
) -> Path:
    """Write checkpoint `step` atomically under `root`, then keep only the newest `keep`."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    temporary = root / f".incomplete-{PREFIX}{step:08d}-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, temporary / WEIGHTS)
    torch.save(
        {"step": step, "optimizer": optimizer, "lr_scheduler": lr_scheduler, "rng": rng_state(), **extra},
        temporary / STATE,
    )
    write_resolved_config(config, temporary)
    _fsync_tree(temporary)
    if final.exists():
        # Same step saved twice (e.g. at an interval and at the end): swap, never delete first.
        stale = root / f".stale-{final.name}-{os.getpid()}"
        os.replace(final, stale)
        os.replace(temporary, final)
        shutil.rmtree(stale)
    else:
        os.replace(temporary, final)
    prune(root, keep)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def prune(root: Path, keep: int) -> None:
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old)


def load(folder: Path, map_location: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    weights = load_file(folder / WEIGHTS, device=str(map_location))
    state = torch.load(folder / STATE, map_location=map_location, weights_only=True)
    return weights, state
