"""Writing files and folders so that a crash or a kill never leaves a half-written one under its final name.

Every output of a run (weights, checkpoints, samples, pictures, the resolved config, cache entries) is written
to a temporary name beside its target and renamed into place when complete. Temporary files are created
with a plain `open`, so what lands follows the user's umask like any other file (never mkstemp's 0600).

A folder that replaces an existing one is swapped in two renames, never deleted first: `replace_folder`.
A kill between the two leaves `.stale-NAME-PID` beside a missing `NAME`; `recover_folders` finishes the
swap (or drops the leftover), so nothing that was complete is ever lost.

A write that fails on its disk (full, read-only, no permission, the folder gone) raises a `StorageError` naming the
folder and what to do (`vidtune.storage.faults`); the temporary file is gone by then, so the final name holds the
previous complete file or nothing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from vidtune.errors import StorageError
from vidtune.storage.faults import FAULTS, storage_error, storage_faults

INCOMPLETE = ".incomplete-"
STALE = ".stale-"
TEMPORARY_SUFFIX = ".part"


def temporary_name(path: Path) -> Path:
    """A hidden name beside `path`, unique to this process and call. It does not end in `path`'s suffix, so
    nothing that lists `*.safetensors` (or `*.png`) mistakes it for a finished file: writers that pick the
    format from the name (PIL, PyAV) are told the format."""
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TEMPORARY_SUFFIX}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], durable: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write `path` to; it is renamed into place when the block succeeds and
    removed when it fails. `durable`: fsync the file before the rename (a power cut then cannot leave a
    renamed but empty file)."""
    path = Path(path)
    with storage_faults(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_name(path)
    try:
        yield temporary
        if durable:
            with temporary.open("rb") as handle:
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        # Told apart before the temporary file goes: torch.save's failure is recognised by the space left.
        fault = storage_error(error, path) if isinstance(error, Exception) else None
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # its folder may be gone with it
            temporary.unlink(missing_ok=True)
        if fault is not None:
            raise fault from error
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, durable: bool = True) -> Path:
    with atomic_path(path, durable=durable) as temporary:
        temporary.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike[str], text: str, durable: bool = False) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), durable=durable)


def process_umask() -> int:
    """This process's umask, read without changing it where the system tells it (Linux), so no other thread
    can create a file under a cleared umask meanwhile."""
    status = Path("/proc/self/status")
    lines = status.read_text().splitlines() if status.is_file() else []
    for line in lines:
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(*paths: Path) -> None:
    """Give files written by other libraries (safetensors writes 0600) the mode a plain `open` would give them."""
    mode = 0o666 & ~process_umask()
    for path in paths:
        os.chmod(path, mode)


def incomplete_folder(target: Path) -> Path:
    """Where a folder that will become `target` is written (see `replace_folder`)."""
    return target.with_name(f"{INCOMPLETE}{target.name}-{os.getpid()}")


@contextlib.contextmanager
def atomic_folder(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary folder to fill; when the block succeeds it replaces `target` (see
    `replace_folder`), when it fails it is removed and `target` is untouched."""
    target = Path(target)
    with storage_faults(target):
        target.parent.mkdir(parents=True, exist_ok=True)
    temporary = incomplete_folder(target)
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        temporary.mkdir()
        yield temporary
    except BaseException as error:
        fault = storage_error(error, target) if isinstance(error, Exception) else None
        shutil.rmtree(temporary, ignore_errors=True)
        if fault is not None:
            raise fault from error
        raise
    with storage_faults(target):
        replace_folder(temporary, target)


def append_line(path: Path, line: str) -> None:
    """Add one line to a log file (metrics.jsonl); a write the disk refuses leaves the file as it was (no row cut
    short) and raises a StorageError."""
    data = memoryview((line + "\n").encode("utf-8"))
    with storage_faults(path):
        handle = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            start = os.fstat(handle).st_size
            try:
                while data:
                    data = data[os.write(handle, data):]
            except OSError:
                os.ftruncate(handle, start)
                raise
        finally:
            os.close(handle)


def check_writable(folder: Path, setting: str) -> None:
    """Before any long work: `folder` takes a file (tried with an empty one), or, not there yet, the folder it will
    be made in may be written (nothing is made yet); else a StorageError says why, naming the `setting` that chose
    it."""
    folder = Path(folder).absolute()
    what = f"a test file ({setting})"
    probe = folder / f".vidtune-write-test-{os.getpid()}"
    above = next((path for path in folder.parents if path.exists()), None)
    if not folder.exists() and above is not None and above.is_dir():
        if not os.access(above, os.W_OK | os.X_OK):
            reason, advice = FAULTS[errno.EROFS if os.statvfs(above).f_flag & os.ST_RDONLY else errno.EACCES]
            raise StorageError(f"Could not write {what} in {folder}: {reason}.\nNothing was started.", advice,
                               folder=folder, reason=reason)
        return
    try:
        with storage_faults(probe, what=what):
            probe.write_bytes(b"")
    except StorageError as fault:
        raise fault.with_notes("Nothing was started.") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)


def replace_folder(temporary: Path, target: Path) -> None:
    """Rename the complete folder `temporary` to `target`. An existing `target` is first renamed aside and
    removed only once the new one is in place."""
    if target.exists():
        stale = target.with_name(f"{STALE}{target.name}-{os.getpid()}")
        os.replace(target, stale)
        os.replace(temporary, target)
        shutil.rmtree(stale)
    else:
        os.replace(temporary, target)
    fsync_folder(target.parent)


def recover_folders(parent: Path) -> None:
    """Tidy what a killed writer left in `parent`: drop half-written folders, finish swaps cut short.

    A `.stale-NAME-PID` folder is the complete old NAME: it goes back to NAME when NAME is missing (the kill
    came between the two renames), and is dropped when NAME is there (the kill came after). Only call it while
    no other process writes in `parent`."""
    if not parent.is_dir():
        return
    for path in parent.iterdir():
        if not path.is_dir():
            continue
        if path.name.startswith(INCOMPLETE):
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.startswith(STALE):
            target = parent / path.name[len(STALE):].rsplit("-", 1)[0]
            if target.exists():
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.replace(path, target)


def fsync_tree(folder: Path) -> None:
    """Flush every file of `folder` (not recursive) and the folder itself to disk."""
    for path in folder.iterdir():
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    fsync_folder(folder)


def fsync_folder(folder: Path) -> None:
    """Make a rename inside `folder` durable (a no-op where folders cannot be opened)."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError as error:  # some file systems refuse fsync on folders; the rename itself has happened
        if error.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(handle)


def did_you_mean(path: Path) -> str:
    """" Did you mean NAME?", naming the file beside a missing `path` whose name it most likely meant (the same
    name in another case, or a close spelling); "" when there is none."""
    folder = path.parent
    if not folder.is_dir():
        return ""
    try:
        names = [entry.name for entry in folder.iterdir()]
    except OSError:  # an unreadable folder: no suggestion, the message still names the path
        return ""
    same = [name for name in names if name.lower() == path.name.lower()]
    if same:
        return f" Did you mean {same[0]} (the same name, in other capitals)?"
    import difflib

    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.8)
    return f" Did you mean {close[0]}?" if close else ""
