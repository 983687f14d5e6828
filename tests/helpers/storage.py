"""A disk that fills up at a chosen write, without a real small disk: the rename that completes a file (every
atomic writer's last step) or an append to it raises OSError(ENOSPC), as the kernel would."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class FullDisk:
    name: str  # the file name whose write fails
    after: int  # that many writes of it succeed first
    seen: int = 0
    failed: bool = False

    def hits(self, path: str | os.PathLike[str] | bytes) -> bool:
        if self.failed or Path(os.fsdecode(path)).name != self.name:
            return False
        self.seen += 1
        self.failed = self.seen > self.after
        return self.failed


def full_disk_at(monkeypatch: pytest.MonkeyPatch, name: str, after: int = 0) -> FullDisk:
    """From the `after + 1`-th write of a file named `name` on (once), the disk is full."""
    disk = FullDisk(name, after)
    real_replace, real_write = os.replace, os.write

    def replace(source, target, *args, **kwargs):
        if disk.hits(target):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(source, target, *args, **kwargs)

    def write(handle, data):
        if disk.hits(os.readlink(f"/proc/self/fd/{handle}")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(handle, data)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "write", write)
    return disk


def leftovers(folder: Path) -> list[Path]:
    """Temporary files and folders a writer would leave under a final name's neighbours if it did not clean up."""
    return [path for path in folder.rglob("*")
            if path.name.endswith(".part") or path.name.startswith((".incomplete-", ".stale-", ".zero-"))]
