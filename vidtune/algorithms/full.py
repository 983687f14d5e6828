"""Full fine-tuning: the denoiser's own weights train (all of them, or those `full.*` patterns select).

The result is the whole denoiser in the family's diffusers format under `output_dir/transformer/`: load it
with the family's transformer class `from_pretrained`, or point `model.subfolders.transformer` at it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from vidtune.algorithms.part import AlgorithmPart
from vidtune.ema import EMA
from vidtune.errors import ConfigError
from vidtune.files import atomic_folder, follow_umask
from vidtune.outputs import TRANSFORMER_EMA_FOLDER, TRANSFORMER_FOLDER
from vidtune.storage.digests import stamp_digest

if TYPE_CHECKING:
    from vidtune.config import Config
    from vidtune.models.spec import ModelSpec
    from vidtune.parallel.strategy import Strategy


def select_trainable(names: list[str], trainable: list[str], frozen: list[str]) -> set[str]:
    """Names matching a `trainable` pattern and no `frozen` one (fnmatch, case-sensitive; `*` matches dots).

    Raises ConfigError for a pattern that matches no parameter (a typo would otherwise train the wrong set)
    and when nothing is left to train."""
    unused = [
        f"full.{key}: '{pattern}'"
        for key, patterns in (("trainable_patterns", trainable), ("frozen_patterns", frozen))
        for pattern in patterns
        if not any(fnmatchcase(name, pattern) for name in names)
    ]
    if unused:
        examples = ", ".join(names[:3] + names[-2:])
        raise ConfigError(
            "These patterns match no parameter of the denoiser:\n" + "\n".join(f"  - {u}" for u in unused)
            + f"\nPatterns are fnmatch patterns over parameter names such as: {examples}"
        )
    selected = {
        name for name in names
        if any(fnmatchcase(name, p) for p in trainable) and not any(fnmatchcase(name, p) for p in frozen)
    }
    if not selected:
        raise ConfigError("full.trainable_patterns / full.frozen_patterns leave no parameter to train.")
    return selected


class FullPart(AlgorithmPart):
    """The denoiser's own weights train (`full.*` patterns); a distilled student keeps a frozen copy as teacher."""

    resume_fixed_keys = ("full.trainable_patterns", "full.frozen_patterns")

    def __init__(self, config: Config, spec: ModelSpec) -> None:
        super().__init__(config, spec)
        # The dtype the denoiser was loaded in: trainable weights train in fp32 and are saved back in it.
        self.base_dtype: torch.dtype = torch.float32
        self.frozen_teacher: nn.Module | None = None  # a distilled student's teacher, copied before training

    def configure(self, denoiser: nn.Module, resuming: bool = False) -> list[nn.Parameter]:
        self._denoiser = denoiser
        if self.traits.distils:
            # Copied before the trained weights change (and before they become fp32).
            self.frozen_teacher = copy.deepcopy(denoiser).requires_grad_(False).eval()
        options = self.config.full
        named = dict(denoiser.named_parameters())
        selected = select_trainable(list(named), options.trainable_patterns, options.frozen_patterns)
        self.base_dtype = next(iter(named.values())).dtype
        denoiser.requires_grad_(False)
        for name, parameter in named.items():
            if name in selected:
                parameter.requires_grad_(True)
                if parameter.dtype != torch.float32:
                    # fp32 master weights (bf16 + Adam loses small updates); compute stays under autocast.
                    parameter.data = parameter.data.float()
        return [parameter for name, parameter in named.items() if name in selected]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.denoiser.named_parameters() if p.requires_grad}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        named = {name: p for name, p in self.denoiser.named_parameters() if p.requires_grad}
        missing, unexpected = sorted(named.keys() - state.keys()), sorted(state.keys() - named.keys())
        if missing or unexpected:
            raise ValueError(f"checkpoint weights do not match the trainable parameters (missing: {missing[:5]}, "
                             f"unexpected: {unexpected[:5]})")
        with torch.no_grad():
            for name, parameter in named.items():
                if state[name].shape != parameter.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(state[name].shape)}, model "
                                     f"{tuple(parameter.shape)}")
                parameter.copy_(state[name])

    def save_final(self, folder: Path, ema: EMA | None, name: str | None = None) -> Path:
        """`folder/transformer/`, and with `training.ema_decay` the moving average as `folder/transformer_ema/`; a
        model of several denoisers (Wan 2.2's two experts) writes one such folder per denoiser, as the spec names
        them (`transformer_2/`, `transformer_2_ema/`). Returns the first."""
        parts = self.spec.denoiser_folders(self.denoiser)
        written = [self.save_transformer(Path(folder) / part, module) for part, module in parts.items()]
        if ema is not None:
            with ema.applied():
                for part, module in parts.items():
                    ema_folder = TRANSFORMER_EMA_FOLDER if part == TRANSFORMER_FOLDER else f"{part}_ema"
                    self.save_transformer(Path(folder) / ema_folder, module)
        return written[0]

    def save_transformer(self, target: Path, module: nn.Module) -> Path:
        """A denoiser via `save_pretrained`, in the dtype it was loaded in; written beside and renamed into
        place, so an existing result is replaced only by a complete one."""
        cast = [p for p in module.parameters() if p.dtype != self.base_dtype]
        originals = [p.data for p in cast]
        try:
            for parameter in cast:
                parameter.data = parameter.data.to(self.base_dtype)
            with atomic_folder(target) as temporary:
                module.save_pretrained(temporary, safe_serialization=True)
                for shard in temporary.glob("*.safetensors"):  # each shard carries the digest of its tensors
                    stamp_digest(shard)
                follow_umask(*(path for path in temporary.rglob("*") if path.is_file()))
        finally:
            for parameter, data in zip(cast, originals, strict=True):
                parameter.data = data
        return target

    @contextlib.contextmanager
    def teacher(self) -> Iterator[nn.Module]:
        """The frozen copy of the denoiser made before training (twice the denoiser's memory), without gradients."""
        if self.frozen_teacher is None:
            raise RuntimeError("a full fine-tune has a teacher only when it distils")
        with torch.no_grad():
            yield self.frozen_teacher

    def prepare_frozen(self, strategy: Strategy) -> None:
        # FSDP shards the teacher like the student (see FullyShardedStrategy.prepare_frozen).
        if self.frozen_teacher is not None:
            self.frozen_teacher = strategy.prepare_frozen(self.frozen_teacher)
