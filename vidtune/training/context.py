"""What a training run is once set up: `TrainingContext`, frozen, and the small objects it holds.

`vidtune.training.setup.set_up` builds it in one pass and the loop (`vidtune.training.loop`) only reads it. What
changes while the run goes on lives in the objects it points to: the weights, the training state (optimizer, step,
data position: `vidtune.state.TrainingState`), the weights' average, the held-out history, the metrics log.
Nothing in it is None: what a run may go without has an object that says so (`NoAverage` when `training.ema_decay`
is unset, `NoHeldOut` without held-out samples, `Encoders` that load when first asked when training reads the cache).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from vidtune import outputs, parallel

if TYPE_CHECKING:
    from vidtune.algorithms.losses import LossFunction
    from vidtune.algorithms.part import AlgorithmPart
    from vidtune.batches import Batch, BatchSource
    from vidtune.config import Config
    from vidtune.data.sources import Clip
    from vidtune.ema import EMA
    from vidtune.metrics import StepLog
    from vidtune.models.spec import Conditions, ModelSpec, TextComponents
    from vidtune.objectives import Objective
    from vidtune.offload import BlockSwap
    from vidtune.parallel.strategy import Strategy
    from vidtune.state import TrainingState
    from vidtune.training.held_out import HeldOut, NoHeldOut


class NoAverage:
    """`training.ema_decay` unset: no moving average; samples and results use the weights themselves."""

    enabled = False

    def applied(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @property
    def average(self) -> None:
        """What the state and the algorithm part take for "no average"."""
        return None


class Average:
    """`training.ema_decay`: the trained weights' moving average (`vidtune.ema.EMA`)."""

    enabled = True

    def __init__(self, ema: EMA) -> None:
        self.average = ema

    def applied(self) -> contextlib.AbstractContextManager[None]:
        return self.average.applied()


class Encoders:
    """The text encoders and the VAE: loaded at set-up when training encodes on the fly; when it reads the cache,
    loaded the first time something asks for them (validation samples), once, saying so."""

    def __init__(self, spec: ModelSpec, device: torch.device, load_now: bool) -> None:
        self.spec = spec
        self.device = device
        self._text: TextComponents | None = None
        self._vae: nn.Module | None = None
        if load_now:
            self.load()

    @property
    def loaded(self) -> bool:
        return self._text is not None and self._vae is not None

    def load(self, reason: str = "") -> None:
        """Load whatever is not loaded yet; `reason`: a line said first when anything loads."""
        if self.loaded:
            return
        if reason:
            print(reason, flush=True)
        if self._text is None:
            self._text = self.spec.load_text(self.device)
        if self._vae is None:
            self._vae = self.spec.load_vae(self.device)

    @property
    def text(self) -> TextComponents:
        self.load("Loading the text encoders and the VAE (training read the cache).")
        assert self._text is not None
        return self._text

    @property
    def vae(self) -> nn.Module:
        self.load("Loading the text encoders and the VAE (training read the cache).")
        assert self._vae is not None
        return self._vae


@dataclass(frozen=True)
class Inputs:
    """What checking the inputs found, before any model loads."""

    objective: Objective
    attention_backend: str  # model.attention_backend, resolved for the device
    clips: list[Clip]  # the samples training takes
    eval_clips: list[Clip]  # the held-out samples (validation.eval_clips, sources marked eval)


@dataclass(frozen=True)
class TrainingContext:
    """A run, set up: everything the loop reads."""

    config: Config
    spec: ModelSpec
    part: AlgorithmPart  # what the algorithm trains and saves (vidtune/algorithms)
    loss: LossFunction  # the algorithm's loss (vidtune/algorithms/losses.py)
    device: torch.device
    bf16: bool
    inputs: Inputs
    strategy: Strategy  # parallel.strategy: the backward, clipping, update, checkpoints, gathering
    encoders: Encoders
    source: BatchSource
    empty_caption: Conditions  # caption dropout's `empty` caption (empty when unused)
    denoiser: nn.Module
    # What the loop calls: the denoiser, or under torchrun its DistributedDataParallel wrapper (or, sharded by FSDP,
    # the denoiser itself).
    trained_denoiser: nn.Module
    parameters: list[nn.Parameter]  # those the optimizer updates
    average: Average | NoAverage
    block_swaps: tuple[BlockSwap, ...]  # memory.blocks_to_swap (none when off)
    state: TrainingState
    held_out: HeldOut | NoHeldOut
    log: StepLog
    first_step: int  # the step this process started from (> 0 after a resume)
    # The batches from the current data position (after a resume, with the saved RNGs in place); called once, by the
    # loop, after its signal handlers are in (a data loader's forked workers inherit them).
    batches: Callable[[], Iterator[Batch]]

    # ----- read often --------------------------------------------------------------------------------------
    @property
    def objective(self) -> Objective:
        return self.inputs.objective

    @property
    def clips(self) -> list[Clip]:
        return self.inputs.clips

    @property
    def eval_clips(self) -> list[Clip]:
        return self.inputs.eval_clips

    @property
    def step(self) -> int:
        """The optimizer step being taken (the losses' draws of two routed experts depend on it)."""
        return self.state.step

    @property
    def output_dir(self) -> Path:
        return Path(self.config.output_dir)

    @property
    def checkpoints_root(self) -> Path:
        return outputs.checkpoints_root(self.output_dir)

    @property
    def clips_per_step(self) -> int:
        """Samples one process takes per optimizer step."""
        return self.config.training.batch_size * self.config.training.gradient_accumulation

    @property
    def show_progress(self) -> bool:
        """Progress bars: as configured, on rank 0 only."""
        return self.config.logging.progress and parallel.is_main()

    # Convenience for what looks at a run's models (tests, benchmarks).
    @property
    def text(self) -> TextComponents:
        return self.encoders.text

    @property
    def vae(self) -> nn.Module:
        return self.encoders.vae
