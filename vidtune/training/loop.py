"""The training loop every algorithm shares: `train` -> `train_step` -> `forward_backward` -> the algorithm's loss.

Read it top to bottom. Each function reads the run's `TrainingContext` (`vidtune.training.setup`); the whole
training state (optimizer, schedule, data position, RNGs, checkpoints) lives in `vidtune.state.TrainingState`, what
the algorithm trains and saves in its part (`vidtune.algorithms`), its loss in `vidtune.algorithms.losses`.

A resumed run continues bit for bit; SIGINT / SIGTERM stop the loop after the current step with a checkpoint
(`vidtune.training.stop`); a non-finite loss or gradient is never applied.

Under torchrun (`vidtune.parallel`) every rank runs this loop on its own device and its own samples (rank r reads
stream positions r, r + world, ...); the strategy of `parallel.strategy` (`vidtune.parallel.strategy`: DDP, FSDP or
DeepSpeed) averages the gradients, so a step of `world` ranks with `batch_size` each is a step of one process with
`batch_size * world`. Rank 0 alone writes files (FSDP and ZeRO-3 gather the weights for it).
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from vidtune import checkpoint as checkpoints
from vidtune import outputs, parallel
from vidtune.compile import compile_note, compile_seconds
from vidtune.errors import TrainingError
from vidtune.metrics import plot_loss_curve
from vidtune.offload import activation_offload
from vidtune.sheets import sample_files
from vidtune.training.stop import SIGNAL_EXIT_CODES, StopSignals, TrainingInterrupted, agreed_stop, stop_votes
from vidtune.training.validation import validate_in_place, write_results

if TYPE_CHECKING:
    from vidtune.batches import Batch
    from vidtune.training.context import TrainingContext

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    output_dir: Path
    final_step: int
    losses: list[float] = field(default_factory=list)  # the logged losses of the steps this process ran
    weights_path: Path | None = None
    sample_paths: list[Path] = field(default_factory=list)  # the final validation's samples
    # Every validation sample in the run's samples folder (earlier validations, and those of the run it resumed).
    every_sample: list[Path] = field(default_factory=list)
    first_step: int = 0  # the step this process started from (> 0 after a resume)
    best_checkpoint: Path | None = None  # the checkpoint with the best held-out score (validation.eval_clips)
    held_out: str | None = None  # the closing line on the held-out score


@dataclass
class StepOutcome:
    loss: float  # mean over ranks of the step's loss
    grad_norm: float | None
    finite: bool
    stopped_by: signal.Signals | None  # the signal every rank stops on after this step, if any
    seconds: float  # without the time spent compiling (training.compile)
    compile_seconds: float = 0.0
    shapes: tuple[tuple[int, int, int], ...] = ()  # the bucket shape of each micro-batch
    # This process's samples of the step: their noise levels (and other streams') and each one's loss, by metrics key.
    noise: dict[str, list[float]] = field(default_factory=dict)
    # Named shares of the loss (mean over ranks, scaled like it): "loss/regularization", "loss/preservation".
    parts: dict[str, float] = field(default_factory=dict)


# The micro-batches of a step as the losses note them: (noise levels by metrics key, each sample's loss).
NoiseNotes = list[tuple[dict[str, torch.Tensor], torch.Tensor]]


def train(context: TrainingContext, name: str | None = None) -> TrainResult:
    """Optimizer steps until `training.steps` or a stop signal, with checkpoints, held-out scores and validation
    samples when due; then the final files (`name`: what files named after the run are called)."""
    config, state, log, held_out = context.config, context.state, context.log, context.held_out
    if held_out.enabled and state.step == 0:  # the base model's score: where the curve starts
        held_out.evaluate(context, checkpoint=False)
    with log:  # closes the trackers however the run ends
        # Handlers go in before the data loader starts, so its forked workers inherit them (and ignore Ctrl+C).
        # The stream is closed when the loop ends (its read-ahead thread joined), not whenever it is collected.
        with StopSignals() as stop, contextlib.closing(context.batches()) as stream:
            stopped_by = agreed_stop(stop)
            while state.step < config.training.steps and stopped_by is None:
                outcome = train_step(context, stream, stop)
                stopped_by = outcome.stopped_by
                if outcome.compile_seconds > 0 and parallel.is_main():
                    print(compile_note(outcome.compile_seconds, state.step, outcome.shapes), flush=True)
                if outcome.finite and due(context, config.logging.log_every, final=True):
                    log.record(state.step, outcome.loss, state.learning_rate, outcome.grad_norm, outcome.seconds,
                               context.clips_per_step * data_groups(context), outcome.compile_seconds,
                               gathered_noise(outcome.noise, context.config.parallel.context.degree), outcome.parts)
                log.advance()
                between_steps(context, stop)
                if stopped_by is None and validation_due(context):  # a signal during the samples stops the run
                    stopped_by = agreed_stop(stop)
            log.end_progress()
            # The last step's score (a stop by signal saves at once, unscored); before its checkpoint is written, so
            # the best one is kept by the pruning.
            if stopped_by is None and held_out.enabled and held_out.last_step() != state.step:
                held_out.evaluate(context, checkpoint=True)
            if state.saved_step != state.step:
                save_checkpoint(context)
            stopped_by = agreed_stop(stop)
            if stopped_by is not None:
                raise TrainingInterrupted(interrupted_message(context, stopped_by), SIGNAL_EXIT_CODES[stopped_by])
        # FSDP, ZeRO-3: every rank gathers the whole weights for rank 0 to save and sample.
        with context.strategy.gathered(context.denoiser, everything=True):
            weights, samples = parallel.on_main(lambda: write_results(context, name))
    every = sample_files(context.output_dir / outputs.SAMPLES) if parallel.is_main() else []
    result = TrainResult(context.output_dir, state.step, log.losses, weights, samples, every,
                         first_step=context.first_step)
    result.held_out, result.best_checkpoint = held_out.result(context.checkpoints_root)
    return result


def train_step(context: TrainingContext, stream: Iterator[Batch], stop: StopSignals) -> StepOutcome:
    """One optimizer step: `gradient_accumulation` micro-batches, clipping, then the update unless non-finite."""
    config, state = context.config, context.state
    accumulation = config.training.gradient_accumulation
    started, compiled_before = time.perf_counter(), compile_seconds()
    step_loss = torch.zeros((), device=context.device)
    shapes = []
    notes: NoiseNotes = []
    parts: dict[str, torch.Tensor] = {}
    for micro in range(accumulation):
        batch = next(stream)
        shapes.append(config.data.bucket_shapes()[context.clips[int(batch.indices[0])].bucket or 0])
        # Under torchrun the gradients are averaged once per step, on the last micro-batch.
        step_loss += forward_backward(context, batch, sync=micro == accumulation - 1, notes=notes, parts=parts)
    if state.step == context.first_step:
        check_every_parameter_trains(context)
    norm = clip_gradients(context)
    # The step's one host-device synchronisation: the loss, the gradient norm and the loss's parts come back together.
    names = sorted(parts)
    norms = [torch.as_tensor(norm).to(step_loss)] if norm is not None else []
    values = torch.stack([step_loss, *norms, *(parts[name].to(step_loss) for name in names)]).tolist()
    step_loss_value, grad_norm = values[0], (values[1] if norm is not None else None)
    part_values = values[1 + len(norms):]
    # Under torchrun, one collective per step: the loss summed over ranks (its mean is logged, and every rank must
    # take the same finite / non-finite decision or the replicas drift apart; the ranks of a data group computed the
    # same loss, so the mean over ranks is the mean over the groups), its parts, and whether a rank was asked to stop
    # (all ranks stop after the same step). One process: the values as they are.
    loss_sum, *rest = parallel.all_reduce_sum([step_loss_value, *part_values, *stop_votes(stop)])
    part_sums, stop_counts = rest[: len(names)], rest[len(names):]
    loss = loss_sum / parallel.world_size()
    state.step += 1
    state.samples_consumed += context.clips_per_step * data_groups(context)
    finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
    if not finite:
        skip_nonfinite_step(context, loss, grad_norm)  # raises past the limit
    state.apply_update(finite)
    compiling = compile_seconds() - compiled_before
    return StepOutcome(loss, grad_norm, finite, agreed_stop(stop, stop_counts),
                       time.perf_counter() - started - compiling, compiling, tuple(shapes), noise_row(notes),
                       {name: value / parallel.world_size() for name, value in zip(names, part_sums, strict=True)})


def forward_backward(context: TrainingContext, batch: Batch, sync: bool, notes: NoiseNotes,
                     parts: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The backward pass of one micro-batch's loss, scaled so a step's gradient is the mean over its samples;
    returns the scaled loss. A rank's share is sum / (batch_size * accumulation); DDP averages over ranks. The
    samples' losses and noise levels are added to `notes`, the loss's named parts (scaled alike) to `parts`."""
    strategy = context.strategy
    with strategy.accumulating(context.trained_denoiser, sync=sync):
        with activation_offload(context.config.memory.activation_offload, context.device):
            output = context.loss(context, batch)
            loss = output.total / context.clips_per_step
        strategy.backward(loss)  # DDP, FSDP and DeepSpeed reduce the gradients in the backward
    if output.sample_losses is not None:
        notes.append((output.levels, output.sample_losses))
    if parts is not None:
        for name, value in output.parts.items():
            parts[name] = parts.get(name, 0) + value.detach() / context.clips_per_step
    return loss.detach()


# ----- a step's parts ----------------------------------------------------------------------------------------------
def clip_gradients(context: TrainingContext) -> torch.Tensor | None:
    """Clip to `training.max_grad_norm` and return the norm before clipping (also when clipping is off, so a
    non-finite gradient is caught before the optimizer applies it), on the device: no synchronisation."""
    return context.strategy.clip_gradients(context.parameters, context.config.training.max_grad_norm)


def check_every_parameter_trains(context: TrainingContext) -> None:
    """Under torchrun, after the first step: DDP (which does not search for unused parameters, that would cost a
    graph traversal every step) needs every trainable parameter to take part in the loss."""
    if not parallel.is_distributed() or context.strategy.engine_checkpoints:  # DeepSpeed keeps gradients in shards
        return
    denoiser: nn.Module = context.denoiser
    if getattr(denoiser, "leaves_parameters_unused", False):  # DDP looks for them itself (parallel/ddp.py)
        return
    names = {id(p): name for name, p in denoiser.named_parameters()}
    unused = [names.get(id(p), "?") for p in context.parameters if p.grad is None]
    if unused:
        raise TrainingError(
            f"{len(unused)} trainable parameters take no part in the loss, e.g. {', '.join(unused[:5])}; "
            "training on several processes needs every one to. Leave them out (full.frozen_patterns, "
            "lora.target_modules)."
        )


def skip_nonfinite_step(context: TrainingContext, loss: float, grad_norm: float | None) -> None:
    """Nothing of a non-finite step is applied; the run stops unless `training.skip_nonfinite_steps` allows."""
    state, limit = context.state, context.config.training.skip_nonfinite_steps
    what = f"the loss was {loss}" if not math.isfinite(loss) else f"the gradient norm was {grad_norm}"
    if state.nonfinite_skipped >= limit:
        previous = checkpoints.latest(context.checkpoints_root)
        kept = f"The last good checkpoint is kept: {previous}." if previous else "No checkpoint was written before it."
        skipped = f" ({state.nonfinite_skipped} such steps were skipped already)" if limit else ""
        raise TrainingError(
            f"Training stopped at step {state.step}: {what}{skipped}; nothing of that step was applied. {kept}\n"
            "Try a lower training.learning_rate or training.precision=fp32 and continue with "
            "checkpoint.resume=latest, or let a few such steps be skipped with training.skip_nonfinite_steps=N."
        )
    state.nonfinite_skipped += 1
    logger.warning("Step %d skipped: %s (%d of %d allowed by training.skip_nonfinite_steps).",
                   state.step, what, state.nonfinite_skipped, limit)


def noise_row(notes: NoiseNotes) -> dict[str, list[float]]:
    """The step's noise levels by metrics key ("sigmas", or "timesteps" for DDPM; other streams' too) and each
    sample's loss ("sample_losses"), in sample order; empty for a loss that notes none (read after the step, whose
    loss already waits for them: no synchronisation of its own)."""
    row: dict[str, list[float]] = {}
    for levels_by_key, losses in notes:
        for key, levels in levels_by_key.items():
            row.setdefault(key, []).extend(levels.detach().float().cpu().tolist())
        row.setdefault("sample_losses", []).extend(losses.float().cpu().tolist())
    return row


def data_groups(context: TrainingContext) -> int:
    """The processes that read different samples: all of them, or the data groups of `parallel.context`."""
    return parallel.data_world(context.config.parallel.context.degree)


def gathered_noise(noise: dict[str, list[float]], context_degree: int = 1) -> dict[str, list[float]]:
    """A step's noise levels and sample losses of every data group, in rank order (one collective under torchrun:
    every rank logs the same steps); the ranks of a group noted the same samples, its first one stands for it."""
    if not parallel.is_distributed():
        return noise
    merged: dict[str, list[float]] = {}
    for rows in parallel.gather_objects(noise)[::parallel.context_degree(context_degree)]:
        for key, values in rows.items():
            merged.setdefault(key, []).extend(values)
    return merged


# ----- between steps -----------------------------------------------------------------------------------------------
def between_steps(context: TrainingContext, stop: StopSignals) -> None:
    """Checkpoints, the held-out score and validation samples every N steps (the last step's come after the loop)."""
    config = context.config
    checkpoint_due = due(context, config.checkpoint.every)
    if context.held_out.enabled and (checkpoint_due or due(context, config.validation.every)):
        context.held_out.evaluate(context, checkpoint=checkpoint_due)  # before the checkpoint: the pruning keeps it
    if checkpoint_due:
        save_checkpoint(context)
    if validation_due(context):
        stopping = (f"stopping the validation samples, then saving a checkpoint of step {context.state.step}. "
                    "Send {key} again to quit at once without saving.")
        # FSDP, ZeRO-3: every rank gathers the trained weights for rank 0's samples.
        with context.strategy.gathered(context.denoiser), stop.meanwhile(stopping):
            parallel.on_main(lambda: validate_in_place(context, stop))


def validation_due(context: TrainingContext) -> bool:
    """Whether validation samples are due after this step, within the loop."""
    return context.config.validation.enabled and due(context, context.config.validation.every)


def save_checkpoint(context: TrainingContext) -> None:
    """A checkpoint of the current step, and loss.png as of it (rank 0), to look at while the run goes on."""
    context.state.save(context.checkpoints_root)
    # On rank 0; a failure (a full disk) stops every rank, not rank 0 alone.
    parallel.on_main(lambda: plot_loss_curve(context.output_dir / outputs.METRICS,
                                             context.output_dir / outputs.LOSS_PLOT))


def due(context: TrainingContext, every: int | None, final: bool = False) -> bool:
    """Whether something done every `every` steps is due now (`final`: also after the last step)."""
    step, last = context.state.step, context.config.training.steps
    return (bool(every) and step % every == 0 and step < last) or (final and step == last)


def interrupted_message(context: TrainingContext, received: signal.Signals) -> str:
    where = checkpoints.latest(context.checkpoints_root)
    return (
        f"{received.name} received: stopped after step {context.state.step} of {context.config.training.steps} and "
        f"saved the checkpoint {where}.\n"
        "To continue exactly where it stopped, run the same command again with checkpoint.resume=latest.\n"
        f"To look at what it learned so far: vidtune sample {where} --prompt \"...\"; to use the weights "
        f"elsewhere: vidtune export {where} --output FOLDER (vidtune sample FOLDER samples them too)"
    )
