"""Training from the cache: each clip's conditions and VAE posterior, read instead of computed.

Reads verify each entry (see `CacheStore.read`). An entry that is damaged or gone is reported with a warning
and computed again, loading the one component it needs just for that and releasing it afterwards. Entries read
once stay in host memory while `data.encoded_store_mib` allows, so later epochs read nothing from disk.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from vidtune.config import Config
from vidtune.data.buckets import visit_window
from vidtune.data.captions import preservation_caption, variant_of_visit
from vidtune.data.encoded_store import EncodedStore
from vidtune.data.sources import Clip
from vidtune.errors import StorageError
from vidtune.models.spec import CONTROL_LATENTS, ModelSpec
from vidtune.precompute.cache import CorruptEntryError
from vidtune.precompute.encode import Tensors, as_posterior, recompute_entry, stack_items
from vidtune.precompute.plan import CachePlan

logger = logging.getLogger(__name__)


class CachedClips(Dataset):
    """At a (position, sample index, bucket) key of the batch schedule, yields {"conditions": {...}, "latents":
    {...}, "caption": str, "index": int, "position": int}, tensors without batch dim. A clip offering several
    windows (`data.frame_sampling=random`, `precompute.windows_per_clip`) gives the one the visit draws."""

    def __init__(self, config: Config, spec: ModelSpec, plan: CachePlan, clips: Sequence[Clip]) -> None:
        self.config = config
        self.spec = spec
        self.plan = plan
        self.clips = list(clips)
        self._lock = threading.Lock()
        self.kept = EncodedStore(config.data.encoded_store_mib * 2**20)

    def __len__(self) -> int:
        return len(self.clips)

    def read(self, kind: str, key: str) -> Tensors:
        return self.kept.items([(kind, key)], lambda _: [self.read_entry(kind, key)])[0]

    def read_entry(self, kind: str, key: str) -> Tensors:
        try:
            return self.plan.cache.read(kind, key)
        except CorruptEntryError as error:
            logger.warning("%s; computing it again.", error)
        except FileNotFoundError as error:
            root = self.plan.cache.root
            if not root.is_dir():  # not one entry lost: the whole folder, as with a drive unmounted
                raise StorageError(
                    f"precompute.cache_dir: the cache folder {root} is gone (a drive unmounted, or the folder "
                    "removed) while the run reads from it.", "mount the drive again", folder=root) from None
            logger.warning("The cache entry %s is gone; computing it again.", error.filename)
        with self._lock:
            return recompute_entry(self.config, self.spec, self.plan, kind, key)

    def conditions(self, key: str) -> Tensors:
        return self.read("conditions", key)

    def prompt_conditions(self, prompt: str) -> Tensors:
        """The cached conditions of a prompt the run reads beside its captions (`plan.extra_prompts`: the empty
        prompt of caption dropout, the teacher's negative prompt), batch of one."""
        key = self.plan.prompt_keys.get(prompt)
        if key is None:  # `build_plan` adds every prompt a trainer asks for: a trainer that asks for another one
            raise RuntimeError(f"the precompute plan has no entry for the prompt {prompt!r}; add it to "
                               "vidtune.precompute.plan.extra_prompts")
        return stack_items([self.conditions(key)])

    def empty_conditions(self) -> Tensors:
        """The cached empty-prompt conditions, batch of one."""
        return self.prompt_conditions("")

    def __getitem__(self, key: tuple[int, int, int] | int) -> dict[str, Any]:
        position, item, _ = key if isinstance(key, tuple) else (-1, key, 0)
        clip = self.clips[item]
        windows = self.plan.latent_windows[item]
        window = visit_window(len(windows), self.config.data.frame_sampling, self.config.training.seed, position)
        latents = as_posterior(self.read("latents", windows[window]))
        controls = self.plan.control_windows[item] if self.plan.control_windows else []
        if controls:  # control training: the same window of the control clip, its posterior mean
            control = as_posterior(self.read("latents", controls[window]))["latents_mean"]
            latents = {**latents, CONTROL_LATENTS: control}
        inputs = self.plan.input_windows[item] if self.plan.input_windows else {}
        if inputs:  # per-clip inputs: the same window's entry of each kind
            latents = {**latents, **{name: value for keys in inputs.values()
                                     for name, value in self.read("inputs", keys[window]).items()}}
        variants = self.plan.condition_variants[item]
        variant = variant_of_visit(len(variants), self.config.training.seed, position)
        if self.plan.clip_condition_windows:  # the caption encoded with this window's pictures, beside the latents
            key = self.plan.clip_condition_windows[item][window][variant]
            latents = {**latents, **self.read("clip_conditions", key)}
        found = {
            "conditions": self.conditions(variants[variant]),
            "latents": latents,
            "caption": clip.caption,
            "index": clip.index,
            "position": position,
        }
        preserve = self.config.training.preserve_base
        if preserve is not None:  # the visit's preservation caption, as `EncodedBatches.preservation` makes it
            seed = self.config.training.seed
            untriggered = self.plan.caption_variants[item][variant]
            caption = preservation_caption(untriggered, clip.style, preserve.prompts, preserve.class_word, seed,
                                           position)
            found["preserve"] = self.conditions(self.plan.preserve_keys[caption])
        return found


def collate_cached(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack conditions and latents to batches; captions stay a list; indices become a LongTensor."""
    if not items:
        raise ValueError("cannot collate an empty batch")
    return {
        "conditions": stack_items([item["conditions"] for item in items]),
        "latents": stack_items([item["latents"] for item in items]),
        **({"preserve": stack_items([item["preserve"] for item in items])} if "preserve" in items[0] else {}),
        "caption": [item["caption"] for item in items],
        "index": torch.tensor([item["index"] for item in items], dtype=torch.long),
        "position": torch.tensor([item.get("position", -1) for item in items], dtype=torch.long),
    }
