"""Decoded frame windows kept for later epochs (`data.frame_store_mib`), so on-the-fly training decodes each window
once.

Decoding a window with PyAV costs milliseconds to tens of milliseconds per clip, often more than a step of a small
model, and two decode workers on a small CPU do not hide it. A window decoded once is kept as uint8 [F, H, W, 3]
(resized: a quarter of the float32 batch it becomes) in a folder that the DataLoader's worker processes share:
under /dev/shm (memory) when it has room, else the system's temp folder, where the page cache keeps recent files
in memory. A later visit of the same window (same file, start, shape, fps and resize) reads it back in a fraction of
a millisecond. A family that trains on the clips' sound (LTX-2) keeps each window's sound beside its frames, under
its own key, so a later visit reads the same samples back. Files are written whole and renamed into place, so a
reader never sees half of one.

The store is bounded: each process may add up to its share of `data.frame_store_mib` (the whole of it without
worker processes); past that, windows are decoded every visit as before. The folder is removed when the batch
source is done with it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

AUTO_MAX_MIB = 2048  # the default bound; at most half the free space of the folder's file system
SHARED_MEMORY = Path("/dev/shm")


def store_root() -> Path:
    """Where stores live: shared memory when this system has it, else the temp folder."""
    if SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK):
        return SHARED_MEMORY
    return Path(tempfile.gettempdir())


def auto_size_mib(root: Path) -> int:
    """`data.frame_store_mib: null`: up to AUTO_MAX_MIB, at most half the free space under `root`."""
    free_mib = shutil.disk_usage(root).free // 2**20
    return int(min(AUTO_MAX_MIB, free_mib // 2))


class FrameStore:
    """Windows by key, shared by the processes that receive a copy of this object (DataLoader workers)."""

    def __init__(self, folder: Path, budget_bytes: int) -> None:
        self.folder = folder
        self.budget_bytes = budget_bytes  # what this process may still add (each worker gets its copy)
        self.stored_bytes = 0
        self.hits = 0
        self.misses = 0

    @classmethod
    def create(cls, size_mib: int | None, num_workers: int) -> FrameStore | None:
        """A fresh store of `size_mib` (None: automatic), split between `num_workers` worker processes; None when
        it is off (0) or has no room."""
        root = store_root()
        size = auto_size_mib(root) if size_mib is None else size_mib
        if size <= 0:
            return None
        folder = Path(tempfile.mkdtemp(prefix="vidtune-frames-", dir=root))
        store = cls(folder, size * 2**20 // max(1, num_workers))
        # Removed with the object, by the process that made it (forked workers hold copies and leave it alone).
        weakref.finalize(store, _remove_folder, folder, os.getpid())
        logger.info("Decoded windows kept in %s (up to %d MiB).", folder, size)
        return store

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "budget_bytes": self.budget_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["folder"], state["budget_bytes"])

    def frames(self, key: tuple, decode: Callable[[], np.ndarray]) -> np.ndarray:
        """The window at `key`: read back when stored, else `decode()`d (and stored while there is room)."""
        file = self.folder / f"{hashlib.sha1(repr(key).encode()).hexdigest()}.npy"
        if file.exists():
            self.hits += 1
            return np.load(file)
        self.misses += 1
        frames = decode()
        if self.stored_bytes + frames.nbytes <= self.budget_bytes:
            self._write(file, frames)
        return frames

    def _write(self, file: Path, frames: np.ndarray) -> None:
        partial = file.with_name(f".{file.stem}.{os.getpid()}.tmp.npy")
        try:
            np.save(partial, frames)
            os.replace(partial, file)
        except OSError as error:
            # A full file system (shared memory is often small in containers) ends storing, not training.
            partial.unlink(missing_ok=True)
            logger.warning("Decoded windows are no longer kept in %s (%s); each is decoded every visit from now.",
                           self.folder, error)
            self.budget_bytes = self.stored_bytes
            return
        self.stored_bytes += frames.nbytes


def _remove_folder(folder: Path, owner_pid: int) -> None:
    if os.getpid() == owner_pid:
        shutil.rmtree(folder, ignore_errors=True)
