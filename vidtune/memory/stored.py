"""Traces kept between runs of `vidtune plan`: the same question is asked many times while settings are chosen.

What a trace gives is a handful of numbers (bytes) and the shapes of the encoders' outputs; they are stored as one
small JSON file per trace under `VIDTUNE_PLAN_CACHE` (default `~/.cache/vidtune/plan`). A file's name is a digest of
everything the trace depends on: the settings it was traced with, the contents of the model's config.json files,
vidtune's own source files and the versions of torch, diffusers, transformers and peft, so a changed model, a new
vidtune or another library version traces again. Files are written whole (a temporary file renamed into place); one
that cannot be read as a trace is traced again and overwritten.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

FORMAT = 1
VIDTUNE_SOURCES = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    configured = os.environ.get("VIDTUNE_PLAN_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vidtune" / "plan"


@functools.cache
def _code_and_libraries() -> str:
    digest = hashlib.sha256(f"format {FORMAT}".encode())
    for package in ("torch", "diffusers", "transformers", "peft"):
        try:
            digest.update(f"{package} {version(package)}".encode())
        except PackageNotFoundError:
            digest.update(f"{package} missing".encode())
    for source in sorted(VIDTUNE_SOURCES.rglob("*.py")):
        digest.update(str(source.relative_to(VIDTUNE_SOURCES)).encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()


@functools.cache
def folder_digest(folder: str) -> str:
    """The contents of a model folder's settings files (config.json and the like), not its weights."""
    digest = hashlib.sha256()
    root = Path(folder)
    for path in sorted(root.rglob("*.json")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def trace_digest(kind: str, parts: tuple) -> str:
    return hashlib.sha256(json.dumps([kind, _code_and_libraries(), *parts], default=str).encode()).hexdigest()


def load(digest: str) -> dict | None:
    """The stored trace, or None when there is none (or it cannot be read: it is traced again)."""
    path = cache_dir() / f"{digest}.json"
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # a damaged file: traced again and replaced
        return None
    return stored if isinstance(stored, dict) and stored.get("format") == FORMAT else None


def store(digest: str, payload: dict) -> None:
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(handle, "w") as file:
        json.dump({"format": FORMAT, **payload}, file)
    os.replace(temporary, folder / f"{digest}.json")


def tensors_to_json(tensors: dict) -> dict | None:
    """Meta tensors as shapes and dtypes (None when a value is not a tensor: such a trace is not stored)."""
    if not all(isinstance(value, torch.Tensor) for value in tensors.values()):
        return None
    return {key: [list(value.shape), str(value.dtype).removeprefix("torch.")] for key, value in tensors.items()}


def tensors_from_json(stored: dict) -> dict:
    return {key: torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for key, (shape, dtype) in
            stored.items()}
