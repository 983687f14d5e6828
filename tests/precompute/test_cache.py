"""The cache store: keys, atomic checked writes, detection of damaged entries, memoised fingerprints."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from vidtune.files import temporary_name
from vidtune.precompute import cache as cache_module
from vidtune.precompute.cache import CacheStore, CorruptEntryError, Fingerprints, entry_key


def _tensors():
    return {
        "prompt_embeds": torch.randn(7, 5, dtype=torch.bfloat16),
        "prompt_attention_mask": torch.tensor([True, True, False]),
        "latents_mean": torch.randn(2, 3, 4),
    }


def test_round_trip_is_a_safetensors_file_with_a_checksum(tmp_path):
    store = CacheStore(tmp_path)
    tensors = _tensors()
    path = store.write("conditions", "ab" * 32, tensors, {"caption": "a red circle"})
    assert path == tmp_path / "conditions" / "ab" / f"{'ab' * 32}.safetensors"
    loaded = store.read("conditions", "ab" * 32)
    assert loaded.keys() == tensors.keys()
    for key, value in tensors.items():
        assert loaded[key].dtype == value.dtype  # stored in the dtype it was computed in
        assert torch.equal(loaded[key], value)
    with safe_open(str(path), "pt") as handle:  # plain safetensors: any tool can read it, nothing is unpickled
        metadata = handle.metadata()
    assert len(metadata["sha256"]) == 64 and metadata["key"] == "ab" * 32
    assert json.loads(metadata["info"]) == {"caption": "a red circle"}
    assert store.info("conditions", "ab" * 32) == {"caption": "a red circle"}
    assert [entry.key for entry in store.entries()] == ["ab" * 32]


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "rename"])
def test_damaged_entries_are_detected_on_read(tmp_path, damage):
    store = CacheStore(tmp_path)
    path = store.write("latents", "cd" * 32, _tensors())
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(bytes(data[: len(data) - 10]))
    elif damage == "flip":  # same size, one bit of tensor data changed: only the checksum can tell
        data[-3] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # a valid entry under another entry's name
        target = store.path("latents", "ef" * 32)
        target.parent.mkdir(parents=True)
        os.replace(path, target)
        path = target
    key = path.name.removesuffix(".safetensors")
    with pytest.raises(CorruptEntryError):
        store.read("latents", key)


def test_a_failed_write_leaves_neither_an_entry_nor_a_temporary_file(tmp_path, monkeypatch):
    store = CacheStore(tmp_path)

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(cache_module.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        store.write("latents", "12" * 32, _tensors())
    assert not store.exists("latents", "12" * 32)
    assert not store.temporary_files()


def test_temporary_files_of_killed_writers_are_ignored_and_cleaned(tmp_path):
    store = CacheStore(tmp_path)
    store.write("latents", "34" * 32, _tensors())
    entry = store.path("latents", "34" * 32)
    # One left by this version's writer, one by an earlier version's.
    leftovers = sorted([temporary_name(entry), entry.with_name(".x.safetensors.123.abcd.tmp")])
    for leftover in leftovers:
        leftover.write_bytes(b"half an entry")
    assert [entry.key for entry in store.entries()] == ["34" * 32]
    assert store.temporary_files() == leftovers
    assert store.remove_stale_temporary_files(older_than_s=3600) == 0  # it may belong to a live writer
    for leftover in leftovers:
        os.utime(leftover, (0, 0))
    assert store.remove_stale_temporary_files(older_than_s=3600) == 2
    assert not any(leftover.exists() for leftover in leftovers)


def test_keys_cover_every_part_and_the_format_version(monkeypatch):
    parts = {"spec": "ltx-video", "dtype": "float32", "caption": "a cat"}
    key = entry_key("conditions", parts)
    assert key == entry_key("conditions", dict(reversed(parts.items())))  # order does not matter
    assert key != entry_key("latents", parts)
    for name, value in (("spec", "other"), ("dtype", "bfloat16"), ("caption", "a cat ")):
        assert key != entry_key("conditions", {**parts, name: value})
    monkeypatch.setattr(cache_module, "FORMAT_VERSION", cache_module.FORMAT_VERSION + 1)
    assert key != entry_key("conditions", parts)


def test_fingerprints_hash_contents_once_and_notice_changes(tmp_path, monkeypatch):
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"first version")
    reads = []
    real = cache_module.file_sha256
    monkeypatch.setattr(cache_module, "file_sha256", lambda path: reads.append(path) or real(path))

    first = Fingerprints(tmp_path / "memo").file(clip)
    assert Fingerprints(tmp_path / "memo").file(clip) == first  # a new process: read from the memo folder
    assert len(reads) == 1

    clip.write_bytes(b"other version")  # same name, new content
    assert Fingerprints(tmp_path / "memo").file(clip) != first
    other = tmp_path / "copy.mp4"
    other.write_bytes(b"first version")  # same content, other name: same identity
    assert Fingerprints(tmp_path / "memo").file(other) == first
