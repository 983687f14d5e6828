"""The content-addressed cache of precomputed conditions and latents.

Layout of a cache folder (default `<data.root>/.vidtune-cache`):

    conditions/ab/abcdef....safetensors   one caption's text-encoder outputs
    clip_conditions/cd/cdef....safetensors  one caption encoded with one clip window's first frame (a family whose
                                          captions read their clip: `ModelSpec.reads_clip_in_conditions`)
    latents/12/123456....safetensors      one clip's VAE posterior (or one sampled latent)
    fingerprints/<stat-hash>              memoised content hashes of clips and weight files

An entry's file name is the SHA-256 of everything that determines it (see `entry_key`): what the spec
declares its conditions or latents depend on (`ModelSpec.condition_identity` / `latent_identity`), the
identity of the component that computed it (hub id + commit, or a hash of the local weight files), its
dtype, the preprocessing, the clip's content hash or the caption text, and `FORMAT_VERSION`. So an entry is
never stale: when anything it depends on changes, its key changes and it is computed again; the old file
just stops being used.

Entries are safetensors files (no pickles) written atomically (temporary file + rename), with a SHA-256 of
their tensor bytes in the metadata. A read checks the format, the key and the checksum, so a truncated or
damaged file is detected (`CorruptEntryError`) instead of being trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from vidtune.errors import CacheError, StorageError
from vidtune.files import TEMPORARY_SUFFIX, atomic_write_bytes
from vidtune.storage.digests import data_section, file_sha256

# Bump when what an entry holds, or how it is computed, changes in a way its key does not capture.
FORMAT_VERSION = 1
KINDS = ("conditions", "latents", "inputs", "clip_conditions")
SUFFIX = ".safetensors"


class CorruptEntryError(CacheError):
    """A cache entry exists but cannot be trusted (truncated, damaged, or not what its name says)."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"The cache entry {path} is damaged ({reason})")


class CacheWriteError(CacheError, OSError):
    """An entry could not be written (a full disk, lost permissions). Still an OSError for callers that expect one."""

    def __init__(self, path: Path, error: OSError) -> None:
        self.path = path
        super().__init__(f"precompute.cache_dir: could not write the cache entry {path} ({error.strerror or error}); "
                         "free some space or point precompute.cache_dir elsewhere, then run again: entries already "
                         "written are reused")


def entry_key(kind: str, parts: dict[str, Any]) -> str:
    """The SHA-256 of an entry's kind, everything that determines it, and the format version."""
    description = {"format": FORMAT_VERSION, "kind": kind, **parts}
    text = json.dumps(description, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Fingerprints:
    """Content hashes of files, each computed once and memoised by (path, size, mtime, ctime, inode).

    The memo lives in the cache folder, so a second run (or another process) does not read the files again;
    any change to a file changes its stat and so its memo key, and the file is hashed again.
    """

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self._memory: dict[str, str] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _stat_key(path: Path) -> str:
        info = path.stat()
        text = f"{path.resolve()}|{info.st_size}|{info.st_mtime_ns}|{info.st_ctime_ns}|{info.st_ino}"
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:40]

    def file(self, path: str | os.PathLike[str]) -> str:
        """SHA-256 of a file's content."""
        path = Path(path)
        stat_key = self._stat_key(path)
        with self._lock:
            if stat_key in self._memory:
                return self._memory[stat_key]
        memo = self.folder / stat_key if self.folder is not None else None
        digest = None
        if memo is not None and memo.is_file():
            text = memo.read_text(encoding="ascii").strip()
            digest = text if len(text) == 64 else None
        if digest is None:
            digest = file_sha256(path)
            if memo is not None:  # a memo lost in a power cut is only hashed again: no fsync needed
                atomic_write_bytes(memo, (digest + "\n").encode("ascii"), durable=False)
        with self._lock:
            self._memory[stat_key] = digest
        return digest

    def tree(self, folder: str | os.PathLike[str]) -> str:
        """One hash over every file below a folder (relative names and contents)."""
        folder = Path(folder)
        digest = hashlib.sha256()
        for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
            digest.update(f"{path.relative_to(folder).as_posix()}\0{self.file(path)}\n".encode())
        return digest.hexdigest()


@dataclass(frozen=True)
class EntryFile:
    kind: str
    key: str
    path: Path
    size: int


class CacheStore:
    """Reads and writes entries of one cache folder. Safe to use from several threads and processes."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self.fingerprints = Fingerprints(self.root / "fingerprints")

    def prepare(self) -> None:
        """Create the cache folder, or say plainly why it cannot be used, before any long work."""
        if self.root.exists() and not self.root.is_dir():
            raise CacheError(f"precompute.cache_dir: {self.root} is a file, not a folder; set precompute.cache_dir "
                             "to a folder (it is created if missing)")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # a file in the way, no permission, a read-only file system
            raise CacheError(
                f"precompute.cache_dir: cannot create the cache folder {self.root} ({error.strerror or error}); "
                "set precompute.cache_dir to a folder you can write to"
            ) from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise CacheError(f"precompute.cache_dir: the cache folder {self.root} is not writable; set "
                             "precompute.cache_dir to a folder you can write to")

    def path(self, kind: str, key: str) -> Path:
        if kind not in KINDS:
            raise ValueError(f"unknown cache kind {kind!r}")
        return self.root / kind / key[:2] / f"{key}{SUFFIX}"

    def exists(self, kind: str, key: str) -> bool:
        return self.path(kind, key).is_file()

    def write(self, kind: str, key: str, tensors: dict[str, torch.Tensor], info: dict[str, Any] | None = None) -> Path:
        """Store one entry atomically, with the SHA-256 of its tensor bytes in the metadata."""
        tensors = {name: value.detach().to("cpu").contiguous().clone() for name, value in tensors.items()}
        _, data = data_section(save_tensors(tensors))
        metadata = {
            "format": str(FORMAT_VERSION),
            "kind": kind,
            "key": key,
            "sha256": hashlib.sha256(data).hexdigest(),
            "info": json.dumps(info or {}, sort_keys=True, ensure_ascii=False),
            "written": f"{time.time():.3f}",
        }
        blob = save_tensors(tensors, metadata=metadata)
        if data_section(blob)[1] != data:  # the checksum must describe exactly the bytes written
            raise RuntimeError("safetensors laid out the same tensors differently twice")
        path = self.path(kind, key)
        try:
            atomic_write_bytes(path, blob)
        except StorageError as fault:  # a full disk, lost permissions: nothing is left behind
            restated = fault.restated(f"the cache entry {path.name}", path.parent)
            raise restated.with_notes(
                "The cache entries already written are whole and are reused when it runs again.",
                advice=f"{fault.advice} (precompute.cache_dir chooses the cache's folder)") from fault
        except OSError as error:
            raise CacheWriteError(path, error) from error
        return path

    def read(self, kind: str, key: str) -> dict[str, torch.Tensor]:
        """An entry's tensors (CPU); FileNotFoundError when absent, CorruptEntryError when damaged."""
        path = self.path(kind, key)
        blob = path.read_bytes()
        try:
            header, data = data_section(blob)
        except (ValueError, UnicodeDecodeError) as error:
            raise CorruptEntryError(path, f"truncated or not a safetensors file: {error}") from None
        metadata = header.get("__metadata__") or {}
        if metadata.get("format") != str(FORMAT_VERSION) or metadata.get("kind") != kind or metadata.get("key") != key:
            raise CorruptEntryError(path, "its metadata does not match its name")
        if hashlib.sha256(data).hexdigest() != metadata.get("sha256"):
            raise CorruptEntryError(path, "checksum mismatch")
        try:
            return load_tensors(blob)
        except Exception as error:  # safetensors raises its own error types
            raise CorruptEntryError(path, f"safetensors could not load it: {error}") from None

    def info(self, kind: str, key: str) -> dict[str, Any]:
        """The description stored with an entry (what its key was made of)."""
        path = self.path(kind, key)
        with path.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
        return json.loads((header.get("__metadata__") or {}).get("info", "{}"))

    def remove(self, kind: str, key: str) -> None:
        self.path(kind, key).unlink(missing_ok=True)

    def entries(self) -> Iterator[EntryFile]:
        for kind in KINDS:
            folder = self.root / kind
            if not folder.is_dir():
                continue
            for path in sorted(folder.glob(f"*/*{SUFFIX}")):
                if not path.name.startswith("."):
                    yield EntryFile(kind, path.name[: -len(SUFFIX)], path, path.stat().st_size)

    def temporary_files(self) -> list[Path]:
        """Leftovers of writes that were interrupted (never read; safe to delete). Caches written by earlier
        versions named them `.*.tmp`."""
        return sorted(p for kind in KINDS for pattern in (f".*{TEMPORARY_SUFFIX}", ".*.tmp")
                      for p in (self.root / kind).glob(f"*/{pattern}"))

    def remove_stale_temporary_files(self, older_than_s: float = 3600.0) -> int:
        """Delete temporary files old enough that no live writer can still own them."""
        removed = 0
        now = time.time()
        for path in self.temporary_files():
            try:
                if now - path.stat().st_mtime > older_than_s:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed
