"""A folder's digest manifest: every file's size and SHA-256, written last, so damage is found before it is used.

Each checkpoint carries one (`manifest.json`, written when every other file is in the folder, fsynced, and before
the folder is renamed into place). `verify_folder` compares the folder with it: a file missing, cut short, or
changed since (one flipped byte) is named. A folder without a manifest was written by vidtune before checkpoints
carried one: it is reported as unverified, not as damaged.

Hashing runs at disk speed (SHA-256 is faster than most disks on current CPUs), over several files at once
(hashlib releases the GIL); a progress bar shows for folders above `PROGRESS_FROM`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from vidtune.files import atomic_write_text
from vidtune.storage.digests import file_sha256
from vidtune.storage.space import human_size

MANIFEST = "manifest.json"
FORMAT = 1
PROGRESS_FROM = 1 << 30
THREADS = 4


def manifest_files(folder: Path) -> list[Path]:
    """The files a manifest of `folder` lists: all of them, in sub-folders too, but the manifest."""
    return sorted(path for path in folder.rglob("*") if path.is_file() and path != folder / MANIFEST)


def _digests(files: list[Path], progress: bool, description: str) -> list[str]:
    total = sum(path.stat().st_size for path in files)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=description,
              disable=not progress or total < PROGRESS_FROM) as bar:
        def one(path: Path) -> str:
            digest = file_sha256(path)
            bar.update(path.stat().st_size)
            return digest

        with ThreadPoolExecutor(min(THREADS, max(1, len(files)))) as pool:
            return list(pool.map(one, files))


def write_manifest(folder: Path, progress: bool = False) -> Path:
    """Hash every file of `folder` and write its manifest, durably; call it once every other file is written."""
    files = manifest_files(folder)
    digests = _digests(files, progress, f"digests of {folder.name}")
    entries = {path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": digest}
               for path, digest in zip(files, digests, strict=True)}
    text = json.dumps({"format": FORMAT, "files": entries}, indent=1) + "\n"
    return atomic_write_text(folder / MANIFEST, text, durable=True)


@dataclass(frozen=True)
class Verdict:
    """What `verify_folder` found."""

    folder: Path
    problems: tuple[str, ...] = ()  # each names a file and what is wrong with it
    verified: bool = True  # False: the folder has no manifest, so its contents could not be checked
    size: int = 0

    @property
    def intact(self) -> bool:
        return not self.problems

    def reason(self) -> str:
        return "; ".join(self.problems)


def verify_folder(folder: Path, digests: bool = True, progress: bool = False,
                  required: Iterable[str] = ()) -> Verdict:
    """Compare `folder` with its manifest: every listed file there, of its size and (`digests`) its SHA-256; the
    files in `required` must be listed too. Without a manifest only `required` is checked."""
    required = list(required)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return Verdict(folder, tuple(f"{name} is missing" for name in required if not (folder / name).exists()),
                       verified=False)
    try:
        listed = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        sizes = {name: int(entry["size"]) for name, entry in listed.items()}
        expected = {name: str(entry["sha256"]) for name, entry in listed.items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        return Verdict(folder, (f"{MANIFEST} is damaged ({type(error).__name__}: {error})",))
    problems = [f"{name} is not in its {MANIFEST}" for name in required
                if name not in listed and not any(key.startswith(f"{name}/") for key in listed)]
    present = []
    for name, size in sizes.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif (actual := path.stat().st_size) != size:
            problems.append(f"{name} is {human_size(actual)} ({actual} bytes), {size} when it was written "
                            "(cut short, or a copy not finished)")
        else:
            present.append(name)
    if digests and present:
        found = _digests([folder / name for name in present], progress, f"checking {folder.name}")
        problems += [f"{name} does not match its digest (its content changed after it was written: a damaged disk "
                     "or copy)" for name, digest in zip(present, found, strict=True) if digest != expected[name]]
    return Verdict(folder, tuple(problems), size=sum(sizes.values()))
