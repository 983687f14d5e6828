"""SHA-256 digests of files, and of a safetensors file's tensor bytes kept in that file's own metadata.

A safetensors file is an 8-byte header length, a JSON header (tensor names, dtypes, shapes, offsets and a free-form
`__metadata__` of strings) and the tensor bytes. The digest of the tensor bytes can live in the header: changing
the header moves no tensor, so `stamp_digest` rewrites only the header of a written file, and `file_digest_problem`
checks a file at disk speed without loading a tensor. The weights a run exports (the diffusers LoRA, the ComfyUI
file, a full fine-tune's shards) carry it under `TENSORS_DIGEST`; the precompute cache's entries under `sha256`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

TENSORS_DIGEST = "vidtune.tensors_sha256"
CHUNK = 1 << 22
HEADER_ALIGNMENT = 8  # safetensors pads its header with spaces so the tensor bytes start 8-byte aligned


def file_sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def data_section(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, tensor bytes) of a serialised safetensors file; ValueError when it is cut off."""
    if len(blob) < 8:
        raise ValueError(f"{len(blob)} bytes, shorter than a header")
    length = int.from_bytes(blob[:8], "little")
    if 8 + length > len(blob):
        raise ValueError("the header runs past the end of the file")
    header = json.loads(blob[8 : 8 + length])
    data = blob[8 + length :]
    if len(data) != data_length(header):
        raise ValueError(f"{len(data)} bytes of tensor data, the header says {data_length(header)}")
    return header, data


def data_length(header: dict[str, Any]) -> int:
    return max((info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"), default=0)


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header, offset of the tensor bytes) of a safetensors file; ValueError when it is not one or cut off."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{size} bytes, shorter than a header")
        length = int.from_bytes(prefix, "little")
        if 8 + length > size:
            raise ValueError("the header runs past the end of the file")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"its header is not JSON ({error})") from None
    if size - 8 - length != data_length(header):
        raise ValueError(f"{size - 8 - length} bytes of tensor data, the header says {data_length(header)} "
                         "(cut short?)")
    return header, 8 + length


def _data_sha256(path: Path, offset: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        handle.seek(offset)
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def stamp_digest(path: Path) -> str:
    """Put the SHA-256 of `path`'s tensor bytes into its metadata (`TENSORS_DIGEST`), rewriting the header in place
    of the file. Call it on a file not yet under its final name (it is rewritten through a second file)."""
    header, offset = read_header(path)
    digest = _data_sha256(path, offset)
    header["__metadata__"] = {**(header.get("__metadata__") or {}), TENSORS_DIGEST: digest}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % HEADER_ALIGNMENT)
    rewritten = path.with_name(path.name + ".stamped")
    try:
        with path.open("rb") as source, rewritten.open("wb") as target:
            target.write(len(text).to_bytes(8, "little"))
            target.write(text)
            source.seek(offset)
            shutil.copyfileobj(source, target, CHUNK)
        shutil.copymode(path, rewritten)
        os.replace(rewritten, path)
    except BaseException:
        rewritten.unlink(missing_ok=True)
        raise
    return digest


def file_digest_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file that carries `TENSORS_DIGEST` (cut short, changed since it was
    written), or None when it is whole. A file without the digest raises LookupError (it cannot be checked)."""
    try:
        header, offset = read_header(path)
    except ValueError as error:
        return f"it is not a whole safetensors file: {error}"
    expected = (header.get("__metadata__") or {}).get(TENSORS_DIGEST)
    if expected is None:
        raise LookupError(f"{path} carries no digest")
    if _data_sha256(path, offset) != expected:
        return "its tensor bytes do not match the digest written with them (changed or damaged since)"
    return None
