"""Precomputation of conditions and latents: a functional API, the precompute stage, and its cache.

    from vidtune.precompute import encode_captions, encode_videos, precompute

See `encode.py` (the API and the stage), `plan.py` (what each entry's key covers) and `cache.py` (the
content-addressed, crash-safe store).
"""

from vidtune.precompute.cache import FORMAT_VERSION, CacheStore, CorruptEntryError, entry_key
from vidtune.precompute.dataset import CachedClips, collate_cached
from vidtune.precompute.encode import (
    PrecomputeSummary,
    WorkerReport,
    as_posterior,
    encode_captions,
    encode_clip_captions,
    encode_clip_inputs,
    encode_videos,
    precompute,
    read_clips,
    shard,
    split_items,
    stack_items,
)
from vidtune.precompute.plan import CachePlan, Preprocess, build_plan, cache_root, component_identity

__all__ = [
    "FORMAT_VERSION",
    "CachePlan",
    "CacheStore",
    "CachedClips",
    "CorruptEntryError",
    "PrecomputeSummary",
    "Preprocess",
    "WorkerReport",
    "as_posterior",
    "build_plan",
    "cache_root",
    "collate_cached",
    "component_identity",
    "encode_captions",
    "encode_clip_captions",
    "encode_clip_inputs",
    "encode_videos",
    "entry_key",
    "precompute",
    "read_clips",
    "shard",
    "split_items",
    "stack_items",
]
