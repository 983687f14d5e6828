"""`vidtune cache info`: what a cache folder holds, and what a config would reuse from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from vidtune.config import Config
from vidtune.errors import CacheError
from vidtune.precompute.cache import KINDS, CacheStore, CorruptEntryError
from vidtune.precompute.encode import build_spec, load_clips
from vidtune.precompute.plan import build_plan, cache_root
from vidtune.storage.space import human_size


@dataclass
class CacheReport:
    root: Path
    entries: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    temporary_files: int = 0
    needed: dict[str, int] = field(default_factory=dict)  # unique entries the config needs, by kind
    cached: dict[str, int] = field(default_factory=dict)  # of those, present (and valid with verify)
    damaged: dict[str, int] = field(default_factory=dict)

    def kinds(self) -> list[str]:
        """The kinds to list: per-clip inputs and captions read with their clip only where there are some (on disk
        or needed)."""
        optional = ("inputs", "clip_conditions")
        return [kind for kind in KINDS if kind not in optional or self.entries.get(kind) or self.needed.get(kind)]

    def lines(self) -> list[str]:
        total = sum(self.sizes.values())
        out = [f"Cache: {self.root}"]
        for kind in self.kinds():
            out.append(f"  {kind}: {self.entries.get(kind, 0)} entries, {human_size(self.sizes.get(kind, 0))}")
        out.append(f"  on disk: {sum(self.entries.values())} entries, {human_size(total)}")
        if self.temporary_files:
            out.append(f"  {self.temporary_files} temporary file(s) of interrupted writes (ignored; safe to delete)")
        if self.needed:
            parts = []
            for kind in self.kinds():
                damaged = f", {self.damaged[kind]} damaged" if self.damaged.get(kind) else ""
                parts.append(f"{kind}: {self.cached[kind]} of {self.needed[kind]} cached{damaged}")
            reuse = sum(self.cached.values())
            compute = sum(self.needed.values()) - reuse
            out.append(f"This config would reuse {reuse} entries and compute {compute} ({'; '.join(parts)})")
        return out


def cache_report(config: Config | None = None, root: str | Path | None = None, verify: bool = False,
                 progress: bool = False) -> CacheReport:
    """Entries and size of a cache; with a config, how many of the entries it needs are there already."""
    cache = CacheStore(root or cache_root(config))
    # Without a config the folder is all there is to report on: a missing one is most likely a typo.
    if (cache.root.exists() and not cache.root.is_dir()) or (config is None and not cache.root.exists()):
        state = "is not a folder" if cache.root.exists() else "does not exist"
        raise CacheError(f"The cache folder {cache.root} {state}; check --cache-dir (or precompute.cache_dir)")
    report = CacheReport(cache.root, {k: 0 for k in KINDS}, {k: 0 for k in KINDS})
    for entry in cache.entries():
        report.entries[entry.kind] += 1
        report.sizes[entry.kind] += entry.size
    report.temporary_files = len(cache.temporary_files())
    if config is None:
        return report
    spec = build_spec(config)
    plan = build_plan(config, spec, load_clips(config, spec, progress=progress), cache)
    for kind, keys in (("conditions", list(plan.conditions)), ("latents", list(plan.latents)),
                       ("inputs", list(plan.inputs)), ("clip_conditions", list(plan.clip_conditions))):
        report.needed[kind] = len(keys)
        report.cached[kind] = report.damaged[kind] = 0
        for key in keys:
            if not cache.exists(kind, key):
                continue
            if verify:
                try:
                    cache.read(kind, key)
                except CorruptEntryError:
                    report.damaged[kind] += 1
                    continue
            report.cached[kind] += 1
    return report
