"""The held-out score during training (the score itself: `vidtune.evaluation`): `HeldOut` scores the weights as
they are and records it; `NoHeldOut` stands for a run without held-out samples."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from vidtune import outputs, parallel
from vidtune.algorithms.losses import NoisyInputs, clip_losses, with_loss_mask
from vidtune.compile import eager
from vidtune.evaluation import (
    EvalHistory,
    HeldOutSet,
    LossFunction,
    append_row,
    best_line,
    plot_eval_curve,
    score_line,
    tracker_values,
)

if TYPE_CHECKING:
    from vidtune.models.spec import Conditions
    from vidtune.training.context import TrainingContext


@contextlib.contextmanager
def own_rng(device: torch.device) -> Iterator[None]:
    """Inside, torch's RNGs (CPU, and this rank's GPU) may be used; afterwards they are as they were."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield


def held_out_losses(context: TrainingContext) -> LossFunction:
    """Training's per-clip loss (`clip_losses`) of the plain denoiser (not the data-parallel wrapper: no rank waits
    for another), as the held-out score calls it."""

    def losses(conditions: Conditions, noisy: torch.Tensor, timesteps: torch.Tensor, target: torch.Tensor,
               levels: torch.Tensor) -> torch.Tensor:
        given = with_loss_mask(context.config, conditions)  # a masked run is scored on its masks, as it trains
        return clip_losses(context, NoisyInputs(given, noisy, timesteps, target, levels), context.denoiser)

    return losses


class NoHeldOut:
    """No held-out samples: nothing is scored."""

    enabled = False

    def evaluate(self, context: TrainingContext, checkpoint: bool) -> None:
        """Nothing to score."""

    def last_step(self) -> int | None:
        return None

    def result(self, checkpoints_root: Path) -> tuple[str | None, Path | None]:
        return None, None


@dataclass
class HeldOut:
    """The held-out samples' inputs (encoded once) and the run's scores so far."""

    set: HeldOutSet
    history: EvalHistory = field(default_factory=EvalHistory)
    enabled = True

    def evaluate(self, context: TrainingContext, checkpoint: bool) -> None:
        """The held-out score of the weights as they are now (their moving average with `training.ema_decay`, as
        validation samples use), on every rank: written to metrics.jsonl, the trackers and the console by rank 0,
        eval_loss.png redrawn; `checkpoint`: this step's weights are a checkpoint, which may become the best one
        (kept by the pruning)."""
        compiled = eager() if context.config.training.compile else contextlib.nullcontext()
        denoiser = context.denoiser
        training = denoiser.training
        denoiser.eval()  # no dropout: the same weights always give the same score
        try:
            with torch.no_grad(), own_rng(context.device), compiled, context.average.applied():
                score = self.set.score(context.objective, held_out_losses(context), context.device,
                                       every_rank=context.strategy.forwards_gather_weights,
                                       progress=context.show_progress)
        finally:
            denoiser.train(training)
        step = context.state.step
        row = self.history.add(step, score, checkpoint)
        best = self.history.best()
        context.state.keep_steps = {best["step"]} if best is not None else set()
        if parallel.is_main():
            log = context.log
            append_row(log.path, row)
            for tracker in log.trackers:
                tracker.log_metrics(step, tracker_values(score), section="eval")
            tqdm.write(score_line(step, score, best))
            plot_eval_curve(log.path, context.output_dir / outputs.EVAL_PLOT)

    def last_step(self) -> int | None:
        return self.history.last_step

    def result(self, checkpoints_root: Path) -> tuple[str | None, Path | None]:
        """(the closing line on the held-out score, the checkpoint with the best score)."""
        return best_line(self.history, checkpoints_root)
