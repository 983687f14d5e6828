"""Encoder outputs of on-the-fly training kept for later visits (`data.encoded_store_mib`).

What the text encoders make of a caption, and the VAE posterior of a window (one clip, bucket and start frame),
are the same at every visit: the randomness of a step (the latent drawn from the posterior, noise, caption dropout)
comes after them. So on-the-fly training encodes each caption and each window once and keeps the results, in host
memory, for the epochs that follow, as the precompute cache keeps them on disk. This is what brings an on-the-fly
step close to a step from the cache when the encoders fit beside the denoiser.

Bounded: entries are added until `data.encoded_store_mib` is used; later ones are encoded every visit (no eviction:
epochs revisit samples in a cycle, which would make a least-recently-used store miss every time).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

Tensors = dict[str, torch.Tensor]


class EncodedStore:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.stored_bytes = 0
        self.entries: dict[Hashable, Tensors] = {}
        self.hits = 0
        self.misses = 0

    def items(self, keys: Sequence[Hashable], encode: Callable[[list[int]], list[Tensors]]) -> list[Tensors]:
        """The entry of each key; the missing ones computed by `encode(positions in keys)` (entries on the CPU),
        and kept while there is room."""
        missing = [i for i, key in enumerate(keys) if key not in self.entries]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        # One at a time: encoders give slightly different values for an item in another batch, and which items
        # miss together depends on the run's history; encoded alone, an entry is the same in a run resumed from a
        # checkpoint (with an empty store) as in the run left alone, bit for bit.
        computed = {i: encode([i])[0] for i in missing}
        for i, entry in computed.items():
            size = sum(t.numel() * t.element_size() for t in entry.values())
            if self.stored_bytes + size <= self.budget_bytes:
                # Copies: an entry is a view into its batch, which it would otherwise keep alive whole.
                self.entries[keys[i]] = {name: tensor.clone() for name, tensor in entry.items()}
                self.stored_bytes += size
        return [computed[i] if i in computed else self.entries[key] for i, key in enumerate(keys)]
