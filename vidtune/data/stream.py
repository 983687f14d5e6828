"""The seeded, resumable stream of training batches: one interface, from the cache or encoded on the fly.

A `Batch` holds what the loss needs: the conditions (text encoders' outputs), the latents (the VAE posterior
and any video-derived conditions) of samples of one bucket, and the stream positions of its samples, which seed
each visit's randomness (see `vidtune.data.buckets`). Two sources give the same batches for the same config
(with `data.frame_sampling` `start` or `middle`; `random` draws any start on the fly, one of the cached windows
from the cache):

- `CachedBatches` reads precomputed entries (`vidtune.precompute`); the encoders are never loaded.
- `EncodedBatches` decodes clips in DataLoader workers and encodes them in this process with the functional
  API the precompute stage uses (`encode_captions`, `encode_videos`).

Both also give the conditions of the empty caption, for caption dropout with the `empty` technique.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from vidtune import parallel
from vidtune.config import Config
from vidtune.data.buckets import BatchSchedule, ScheduleSampler
from vidtune.data.dataset import VideoCaptionDataset, collate_samples
from vidtune.data.sources import Clip
from vidtune.models.spec import CONTROL_LATENTS, Conditions, Latents, ModelSpec, TextComponents
from vidtune.precompute import CachedClips, collate_cached, encode_captions, encode_videos, stack_items
from vidtune.processors import configured_processor


@dataclass
class Batch:
    conditions: Conditions
    latents: Latents
    positions: torch.Tensor  # [B] long: each clip's position in the stream
    indices: torch.Tensor  # [B] long: each clip's index in the dataset


class BatchSource(ABC):
    """Batches of `training.batch_size` samples of one bucket, for this rank, from any position of the stream, on
    `device`. The samples come from `load_dataset` (each with its bucket)."""

    def __init__(self, config: Config, clips: Sequence[Clip], device: torch.device) -> None:
        self.config = config
        self.clips = list(clips)
        self.device = device
        self.schedule = BatchSchedule([clip.bucket or 0 for clip in self.clips], [clip.repeats for clip in self.clips],
                                      config.training.batch_size, config.training.seed)

    def batches(self, start_position: int) -> Iterator[Batch]:
        """The endless stream from `start_position` (samples consumed so far by all ranks)."""
        sampler = ScheduleSampler(self.schedule, start_position, rank=parallel.rank(), world=parallel.world_size())
        for raw in self.loader(sampler):
            conditions, latents = self.encode(raw)
            yield Batch(to_device(conditions, self.device), to_device(latents, self.device), raw["position"],
                        raw["index"])

    @abstractmethod
    def loader(self, sampler: ScheduleSampler) -> DataLoader:
        """Batches of items at `sampler`'s keys, each with its "position"."""

    @abstractmethod
    def encode(self, raw: dict[str, Any]) -> tuple[Conditions, Latents]:
        """(conditions, latents) of one loaded batch."""

    @abstractmethod
    def empty_caption(self) -> Conditions:
        """The conditions of the empty caption, a batch of one, on `device`."""


class CachedBatches(BatchSource):
    """Batches read from the precompute cache (an entry that is damaged or gone is computed again)."""

    def __init__(self, config: Config, clips: Sequence[Clip], device: torch.device, cached: CachedClips) -> None:
        super().__init__(config, clips, device)
        self.cached = cached

    def loader(self, sampler: ScheduleSampler) -> DataLoader:
        # Reading an entry is far cheaper than a step: no worker processes (nor their memory) needed.
        return DataLoader(self.cached, batch_sampler=sampler, num_workers=0, collate_fn=collate_cached)

    def encode(self, raw: dict[str, Any]) -> tuple[Conditions, Latents]:
        return raw["conditions"], raw["latents"]

    def empty_caption(self) -> Conditions:
        return to_device(self.cached.empty_conditions(), self.device)


class EncodedBatches(BatchSource):
    """Clips decoded by `data.num_workers` worker processes and encoded here, batch by batch."""

    def __init__(self, config: Config, clips: Sequence[Clip], device: torch.device, spec: ModelSpec,
                 text: TextComponents, vae: nn.Module) -> None:
        super().__init__(config, clips, device)
        self.spec = spec
        self.text = text
        self.vae = vae

    def loader(self, sampler: ScheduleSampler) -> DataLoader:
        data = self.config.data
        dataset = VideoCaptionDataset(self.clips, data.bucket_shapes(), data.fps, data.resize, data.frame_sampling,
                                      self.config.training.seed, configured_processor(self.config))
        return DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=data.num_workers,
            collate_fn=collate_samples,
            persistent_workers=data.num_workers > 0,
            prefetch_factor=2 if data.num_workers > 0 else None,
        )

    def encode(self, raw: dict[str, Any]) -> tuple[Conditions, Latents]:
        count = len(raw["caption"])
        conditions = stack_items(encode_captions(self.spec, self.text, raw["caption"], batch_size=count))
        latents = stack_items(encode_videos(self.spec, self.vae, raw["video"], batch_size=count))
        if "control" in raw:  # control training: the control clips' latents, from the same VAE
            controls = stack_items(encode_videos(self.spec, self.vae, raw["control"], batch_size=count))
            latents[CONTROL_LATENTS] = controls["latents_mean"]
        return conditions, latents

    def empty_caption(self) -> Conditions:
        return to_device(stack_items(encode_captions(self.spec, self.text, [""], batch_size=1)), self.device)


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device, non_blocking=True) for key, value in tensors.items()}
