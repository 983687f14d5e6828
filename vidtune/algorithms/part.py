"""What an algorithm trains and saves, as an object of its own: `AlgorithmPart`.

A part is built from (config, spec) by `vidtune.algorithms.build.build_part` and bound to one denoiser by
`configure`: from then on it reads and writes that denoiser's trained weights (`state_dict`, `load_state_dict`),
writes the run's final files (`save_final`), and gives the frozen model a distillation learns from (`teacher`).
`export` turns a checkpoint's weights into the same final files, loading the base model only where the result
needs it. Training, `vidtune export`, `vidtune plan` and the memory measurement all use the same part; none of
them needs a trainer.

Parts compose: the student's kind (`LoRAPart`, `FullPart`) is wrapped by what an algorithm adds on top
(`ControlPart`, the distillation parts), which hands everything it does not change to the part inside (`Wrapping`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vidtune.algorithms import AlgorithmTraits, traits_of
from vidtune.ema import EMA

if TYPE_CHECKING:
    from vidtune.batches import BatchSource
    from vidtune.config import Config
    from vidtune.data.sources import Clip
    from vidtune.models.spec import ModelSpec
    from vidtune.objectives import Objective
    from vidtune.parallel.strategy import Strategy

CPU = torch.device("cpu")


class AlgorithmPart:
    """The trained weights of one algorithm; subclasses decide what trains and what is written."""

    # Config keys whose change a checkpoint of this algorithm cannot follow (beyond model and algorithm).
    resume_fixed_keys: tuple[str, ...] = ()

    def __init__(self, config: Config, spec: ModelSpec) -> None:
        self.config = config
        self.spec = spec
        self.traits: AlgorithmTraits = traits_of(config)
        self._denoiser: nn.Module | None = None

    @property
    def denoiser(self) -> nn.Module:
        """The denoiser `configure` set up."""
        if self._denoiser is None:
            raise RuntimeError("the algorithm part has no denoiser yet: call configure(denoiser) first")
        return self._denoiser

    # ----- before anything loads ------------------------------------------------------------------------------
    def check(self, clips: Sequence[Clip], objective: Objective, resuming: bool) -> None:
        """The algorithm's own settings against the family and the samples (`clips`: training's and the held-out
        ones), before any model loads; `resuming`: the run continues a checkpoint."""

    def prepare_inputs(self, source: BatchSource) -> None:
        """Read what the loss needs beside the batches from the batch source (a teacher's negative prompt)."""

    # ----- what trains --------------------------------------------------------------------------------------
    def configure(self, denoiser: nn.Module, resuming: bool = False) -> list[nn.Parameter]:
        """Freeze / wrap `denoiser` and return the parameters the optimizer updates; the part is bound to it."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint stores (those that change)."""
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def trained_parameters(self, parameters: list[nn.Parameter]) -> dict[str, nn.Parameter]:
        """`parameters` by their names in the denoiser (what the moving average keeps)."""
        trained = {id(p) for p in parameters}
        return {name: p for name, p in self.denoiser.named_parameters() if id(p) in trained}

    # ----- what a run writes --------------------------------------------------------------------------------
    def save_final(self, folder: Path, ema: EMA | None, name: str | None = None) -> Path:
        """Write the run's result into `folder` in the family's diffusers format (with `ema`, the moving average
        beside it); `name`: the run's name for files named after it (default: the output folder's). Returns the
        main file or folder."""
        raise NotImplementedError

    def export(self, weights: dict[str, torch.Tensor], output: Path, ema: dict[str, torch.Tensor] | None = None,
               name: str | None = None) -> Path:
        """Write a checkpoint's weights (and their moving average, `ema`) as a finished run's result into `output`
        (`vidtune export`). By default the denoiser is loaded on the CPU and set up as for training, given the
        weights and saved with `save_final`; a part whose result needs no base model (LoRA) overrides this."""
        denoiser = self.spec.load_denoiser(CPU)
        parameters = self.configure(denoiser)
        average = EMA(self.trained_parameters(parameters), 0.0) if ema is not None else None
        self.load_state_dict(weights)
        if average is not None and ema is not None:
            with average.applied():  # loading writes into the average
                self.load_state_dict(ema)
        return self.save_final(output, average, name)

    def run_name(self, name: str | None) -> str:
        """What files named after the run are called: `name`, or the output folder's name."""
        return name or Path(self.config.output_dir).resolve().name

    # ----- distillation ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def teacher(self) -> Iterator[nn.Module]:
        """The frozen base model, without gradients (what a distilled student learns from)."""
        raise NotImplementedError(f"{self.traits.name} has no teacher")
        yield  # pragma: no cover

    def prepare_frozen(self, strategy: Strategy) -> None:
        """Let the strategy place frozen copies the part holds (FSDP shards a full student's teacher)."""

    # ----- control ------------------------------------------------------------------------------------------
    def control_given(self, latents: torch.Tensor) -> contextlib.AbstractContextManager[None]:
        """Within: the widened input layer is handed these control latents (control algorithms only)."""
        raise NotImplementedError(f"{self.traits.name} takes no control input")

    # ----- validation samples -------------------------------------------------------------------------------
    def sampling_spec(self, spec: ModelSpec) -> ModelSpec:
        """The spec validation samples are taken with (a student may be told another embedded guidance)."""
        return spec

    @contextlib.contextmanager
    def sampling(self, pipeline: Any, vae: nn.Module, clips: Sequence[Clip]) -> Iterator[Any]:
        """Within: the pipeline validation samples with (a student's scheduler, a control clip given)."""
        yield pipeline


class Wrapping(AlgorithmPart):
    """A part that adds to another (`inner`, the student's kind): everything it does not change is the inner
    part's."""

    def __init__(self, inner: AlgorithmPart) -> None:
        super().__init__(inner.config, inner.spec)
        self.inner = inner
        self.resume_fixed_keys = inner.resume_fixed_keys + self.own_fixed_keys

    own_fixed_keys: tuple[str, ...] = ()

    @property
    def denoiser(self) -> nn.Module:
        return self.inner.denoiser

    def check(self, clips: Sequence[Clip], objective: Objective, resuming: bool) -> None:
        self.inner.check(clips, objective, resuming)

    def prepare_inputs(self, source: BatchSource) -> None:
        self.inner.prepare_inputs(source)

    def configure(self, denoiser: nn.Module, resuming: bool = False) -> list[nn.Parameter]:
        return self.inner.configure(denoiser, resuming)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.inner.load_state_dict(state)

    def save_final(self, folder: Path, ema: EMA | None, name: str | None = None) -> Path:
        return self.inner.save_final(folder, ema, name)

    def export(self, weights: dict[str, torch.Tensor], output: Path, ema: dict[str, torch.Tensor] | None = None,
               name: str | None = None) -> Path:
        return self.inner.export(weights, output, ema, name)

    def teacher(self) -> contextlib.AbstractContextManager[nn.Module]:
        return self.inner.teacher()

    def prepare_frozen(self, strategy: Strategy) -> None:
        self.inner.prepare_frozen(strategy)

    def control_given(self, latents: torch.Tensor) -> contextlib.AbstractContextManager[None]:
        return self.inner.control_given(latents)

    def sampling_spec(self, spec: ModelSpec) -> ModelSpec:
        return self.inner.sampling_spec(spec)

    def sampling(self, pipeline: Any, vae: nn.Module, clips: Sequence[Clip]) -> contextlib.AbstractContextManager:
        return self.inner.sampling(pipeline, vae, clips)
