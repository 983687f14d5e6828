"""Free space, sizes in words, and the space a run's checkpoints and final files take on disk.

`CheckpointSpace` is what a run knows before its first checkpoint (estimated from the trained weights and the
optimizer's state per weight) and after it (measured): with `checkpoint.keep`, what the output folder must hold.
`check_space` says so at the start of a run, a warning when the folder holds less than the whole run needs, a
refusal when it cannot hold even one checkpoint.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from vidtune.errors import StorageError

# The optimizer's state per trained weight, in multiples of the weight's own size (AdamW keeps two moments like the
# weight, prodigy four) or, for the quantized optimizers, in bytes (`STATE_BYTES`).
STATE_MULTIPLES = {"adamw": 2.0, "prodigy": 4.0, "came": 2.0, "adafactor": 0.1}
STATE_BYTES = {"adamw8bit": 2.0, "paged_adamw8bit": 2.0, "adamw8bit_ao": 2.0, "adamw4bit_ao": 1.0,
               "adamw_fp8_ao": 2.0}
# The training state beside the weights (RNG states, config, data position) and the pictures and samples a run
# writes besides its weights: small, but counted.
STATE_OVERHEAD = 64 << 10
PICTURES_AND_SAMPLES = 4 << 20


def human_size(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError


def free_bytes(folder: Path) -> int | None:
    """Free space on the disk holding `folder` (or the nearest existing folder above it); None if unknown."""
    for candidate in (folder, *folder.parents):
        if candidate.is_dir():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def optimizer_state_bytes(name: str, elements: int, element_size: int) -> int:
    """About how many bytes `name`'s state takes for `elements` trained weights of `element_size` bytes each."""
    if name in STATE_BYTES:
        return int(STATE_BYTES[name] * elements)
    return int(STATE_MULTIPLES.get(name, 2.0) * elements * element_size)


def folder_size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


@dataclass(frozen=True)
class CheckpointSpace:
    """The disk space a run's checkpoints and final files take in its output folder."""

    checkpoint: int  # bytes of one checkpoint
    final: int  # the final weights (each format, their average) and the pictures and samples
    keep: int  # checkpoint.keep
    measured: bool = False  # `checkpoint` is the size of a checkpoint this run wrote (else an estimate)

    @classmethod
    def estimate(cls, weight_bytes: int, state_bytes: int, averaged: bool, keep: int,
                 final_formats: int) -> CheckpointSpace:
        """`weight_bytes`: the trained weights as a checkpoint stores them; `state_bytes`: the optimizer's state;
        `averaged`: a moving average is stored too; `final_formats`: how many files hold the final weights (the
        diffusers file, the ComfyUI file)."""
        copies = 2 if averaged else 1
        return cls(checkpoint=weight_bytes * copies + state_bytes + STATE_OVERHEAD,
                   final=weight_bytes * copies * final_formats + PICTURES_AND_SAMPLES, keep=keep)

    def new_checkpoints(self, existing: int, to_write: int) -> int:
        """How many more checkpoints are on disk at once at most, beyond the `existing` ones, while `to_write`
        more are written: the newest is written before the oldest beyond `keep` goes."""
        return max(1, min(self.keep + 1, existing + to_write) - existing) if to_write else 0

    def needed(self, existing: int, to_write: int) -> int:
        """Bytes still to be written: the new checkpoints on disk at once, and the final files."""
        return self.new_checkpoints(existing, to_write) * self.checkpoint + self.final

    def measure(self, folder: Path) -> CheckpointSpace:
        """The same with the size of a checkpoint this run wrote."""
        return replace(self, checkpoint=folder_size(folder), measured=True)

    def describe(self, existing: int, to_write: int) -> str:
        """'about 1.2 GiB: 3 more checkpoints of 400 MiB each (estimated) ...'."""
        count = self.new_checkpoints(existing, to_write)
        how = "measured" if self.measured else "estimated"
        return (f"about {human_size(self.needed(existing, to_write))} more: {count} more checkpoint"
                f"{'s' if count != 1 else ''} of {human_size(self.checkpoint)} ({how}; checkpoint.keep={self.keep} "
                f"are kept, and the newest while it is written), and the final weights, pictures and samples, "
                f"about {human_size(self.final)}")


def check_space(output_dir: Path, space: CheckpointSpace, existing: int, to_write: int) -> str | None:
    """Before the first step: a refusal (StorageError) when `output_dir`'s disk cannot hold even one checkpoint; a
    warning (returned, to print) when it holds less than the rest of the run needs; None when it fits."""
    free = free_bytes(output_dir)
    if free is None or free >= space.needed(existing, to_write):
        return None
    if free < space.checkpoint:
        raise StorageError(
            f"output_dir {output_dir}: its disk has {human_size(free)} free, less than one checkpoint of this run "
            f"({human_size(space.checkpoint)}); this run needs {space.describe(existing, to_write)}. Nothing was "
            "trained.", "free some space on that disk, or choose an output_dir on another disk", folder=output_dir,
            full=True)
    return (f"output_dir {output_dir}: its disk has {human_size(free)} free, and this run needs "
            f"{space.describe(existing, to_write)}. It starts, but stops with a message when the disk fills (what was "
            "written stays whole, and the run continues with checkpoint.resume=latest). To avoid that: free some "
            "space, lower checkpoint.keep, or choose an output_dir on another disk.")
