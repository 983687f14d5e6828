"""Storage faults in plain words: an error raised while writing a file, told apart from a bug.

A full disk reaches vidtune in several shapes: `OSError(ENOSPC)` from Python's own writes, PIL and PyAV; a
`SafetensorError` whose text ends in "(os error 28)"; and from torch.save's zip writer a RuntimeError that says only
that its position is off ("unexpected pos"), recognised by the folder having (almost) no space left. `fault_of`
reads all of them; `storage_error` turns one into a `StorageError` naming the folder and what was being written.
"""

from __future__ import annotations

import contextlib
import errno
import re
from collections.abc import Iterator
from pathlib import Path

from vidtune.errors import StorageError, VidtuneError
from vidtune.storage.space import free_bytes, human_size

# What an errno means for the folder written to, and what to do about it.
FAULTS: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("the disk is full", "free some space on that disk, or choose a folder on another disk"),
    errno.EDQUOT: ("the disk quota is used up", "free some space within your quota, or choose another folder"),
    errno.EROFS: ("the file system is read-only (a drive mounted read-only, or write-protected)",
                  "choose a folder on a writable disk (or mount the drive read-write)"),
    errno.EACCES: ("permission denied", "choose a folder you can write to, or give yourself write permission on it "
                   "(chmod u+w FOLDER)"),
    errno.EPERM: ("the operation is not permitted there", "choose a folder you can write to"),
    errno.EIO: ("the disk reported an input/output error", "check the disk, and copy what is there to a healthy one"),
}
FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
GONE = ("the folder no longer exists (a drive unmounted, or the folder removed)",
        "mount the drive again, or choose another folder")
# safetensors writes the OS error into its message; torch.save's zip writer only says its position is off.
OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)|\[Errno (\d+)\]")  # also an OSError quoted in another error
ZIP_WRITER_FAILURES = ("unexpected pos", "file write failed", "PytorchStreamWriter failed")
# Below this much free space, a zip writer that failed is taken to have filled the disk.
NEARLY_FULL = 64 << 20


def error_number(error: BaseException) -> int | None:
    """The OS error number `error` carries, in its attribute or (safetensors) its text."""
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno
    found = OS_ERROR_IN_TEXT.search(str(error))
    return int(found[1] or found[2]) if found else None


def fault_of(error: BaseException, folder: Path) -> tuple[str, str, bool] | None:
    """(what went wrong with `folder`'s disk, what to do, whether it is full) for an error raised while writing in
    `folder`; None when `error` is not a storage fault (a bug keeps its traceback)."""
    if isinstance(error, VidtuneError):
        return None
    number = error_number(error)
    if number in FAULTS:
        return (*FAULTS[number], number in FULL)
    if number == errno.ENOENT and not folder.is_dir():
        return (*GONE, False)
    if isinstance(error, RuntimeError) and any(text in str(error) for text in ZIP_WRITER_FAILURES):
        free = free_bytes(folder)
        if free is not None and free < NEARLY_FULL:
            return (*FAULTS[errno.ENOSPC], True)
    return None


def storage_error(error: BaseException, target: Path, what: str | None = None) -> StorageError | None:
    """`error`, raised while writing `target`, as a StorageError (None: not a storage fault). `what`: how to name
    what was written (default: the file's name)."""
    folder = target.parent
    found = fault_of(error, folder)
    if found is None:
        return None
    reason, advice, full = found
    free = free_bytes(folder) if full else None
    room = f" ({human_size(free)} free there)" if free is not None else ""
    return StorageError(f"Could not write {what or target.name} in {folder}: {reason}{room}.", advice,
                        folder=folder, full=full, reason=reason + room)


@contextlib.contextmanager
def storage_faults(target: Path, what: str | None = None) -> Iterator[None]:
    """Around writing `target`: a storage fault becomes a StorageError (see `storage_error`), anything else passes."""
    try:
        yield
    except Exception as error:
        fault = storage_error(error, Path(target), what)
        if fault is None:
            raise
        raise fault from error
