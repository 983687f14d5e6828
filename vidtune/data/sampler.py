"""The order in which a run visits its samples.

The order is one endless stream: epoch 0's permutation, then epoch 1's, and so on, each drawn from
the run's seed. A position in that stream identifies a sample visit uniquely across epochs and ranks,
which the trainer uses to seed per-sample randomness (noise, timesteps, dropout). Because of that:
    - batch 2 x accumulation 1 and batch 1 x accumulation 2 see the same samples with the same noise;
    - data-parallel ranks never share samples or noise (rank r takes positions r, r + world, ...);
    - resuming only needs the number of positions already consumed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def stream_index(num_samples: int, seed: int, position: int) -> int:
    """The dataset index at a position of the stream."""
    epoch, offset = divmod(position, num_samples)
    return epoch_permutation(num_samples, seed, epoch)[offset]


class StreamSampler(Sampler[tuple[int, int]]):
    """Yields (position, dataset index) forever, starting at `start`, for one rank of `world`."""

    def __init__(self, num_samples: int, seed: int, start: int = 0, rank: int = 0, world: int = 1) -> None:
        if num_samples <= 0:
            raise ValueError("the dataset is empty")
        self.num_samples = num_samples
        self.seed = seed
        self.start = start
        self.rank = rank
        self.world = world

    def __iter__(self) -> Iterator[tuple[int, int]]:
        position = self.start + self.rank
        epoch = -1
        order: list[int] = []
        while True:
            current_epoch, offset = divmod(position, self.num_samples)
            if current_epoch != epoch:
                epoch = current_epoch
                order = epoch_permutation(self.num_samples, self.seed, epoch)
            yield position, order[offset]
            position += self.world
