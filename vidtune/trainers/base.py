"""The training loop every algorithm shares: `run` -> `train` -> `train_step` -> `forward_backward` -> `compute_loss`.

Read it top to bottom. `train` checks everything the user gave, loads the model, opens the batch source
(`vidtune.batches`: the cache or on-the-fly encoding) and loops over optimizer steps; the whole training
state (optimizer, schedule, data position, RNGs, checkpoints) lives in `vidtune.state.TrainingState`.

An algorithm (LoRA, full fine-tune, ...) subclasses `Trainer` and decides what is trainable
(`configure_trainable`), what a checkpoint stores (`trainable_state_dict`) and what a finished run writes
(`save_final`); one that needs another loss overrides `compute_loss` (distillation) or `clip_losses` (control), which
the held-out score (`vidtune.evaluation`) calls too.

A resumed run (`checkpoint.resume`) continues bit for bit; SIGINT / SIGTERM stop the loop after the current
step with a checkpoint (`vidtune.trainers.stop`); a non-finite loss or gradient is never applied.

Under torchrun (`vidtune.parallel`) every rank runs this loop on its own device and its own samples (rank r reads
stream positions r, r + world, ...); the strategy of `parallel.strategy` (`vidtune.parallel.strategy`: DDP, or FSDP
sharding the model) averages the gradients, so a step of `world` ranks with `batch_size` each is a step of one
process with `batch_size * world`. Rank 0 alone writes files (FSDP gathers the weights for it).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from vidtune import checkpoint as checkpoints
from vidtune import outputs, parallel
from vidtune.algorithms.build import build_part, build_spec
from vidtune.algorithms.distillation import validation_config
from vidtune.algorithms.losses import (
    LossFunction,
    NoisyInputs,
    apply_caption_dropout,
    clip_losses,
    loss_function,
    noisy_inputs,
)
from vidtune.algorithms.part import AlgorithmPart
from vidtune.attention import resolve_attention_backend, set_attention_backend
from vidtune.batches import Batch, BatchSource, CachedBatches, EncodedBatches
from vidtune.compile import compile_blocks, compile_note, compile_seconds, eager
from vidtune.config import Config, write_resolved_config
from vidtune.data.audio import has_sound, sound_line
from vidtune.data.buckets import check_bucket_shapes, visit_generator
from vidtune.data.overview import write_dataset_overview
from vidtune.data.sources import Clip, load_dataset
from vidtune.data.video import VideoInfo
from vidtune.ema import EMA
from vidtune.errors import ConfigError, TrainingError
from vidtune.evaluation import (
    EvalHistory,
    HeldOutSet,
    append_row,
    best_line,
    check_evaluation,
    encode_held_out,
    held_out_line,
    hold_out,
    plot_eval_curve,
    score_line,
    tracker_values,
)
from vidtune.memory import check_base_weights
from vidtune.metrics import StepLog, plot_loss_curve, truncate_metrics
from vidtune.models.spec import Conditions, ModelSpec, TextComponents
from vidtune.objectives import Objective
from vidtune.offload import (
    BlockSwap,
    activation_offload,
    apply_block_swap,
    check_activation_offload,
    check_block_count,
    check_block_swap,
    loading_device,
)
from vidtune.optim import check_optimizer
from vidtune.parallel.choose import choose_strategy
from vidtune.parallel.deepspeed import check_deepspeed
from vidtune.parallel.deepspeed import process_group as deepspeed_process_group
from vidtune.parallel.strategy import Strategy
from vidtune.precompute import CachedClips, precompute
from vidtune.resume import resolve_resume
from vidtune.sampling import (
    SampleSettings,
    SamplingStopped,
    describe_samples,
    reference_clip,
    render_samples,
    validation_shape,
)
from vidtune.sheets import sample_files, write_samples_by_step
from vidtune.state import SavedState, TrainingState, read_checkpoint, restore_rng, resume_stream
from vidtune.trackers import check_trackers, open_trackers
from vidtune.trainers.stop import SIGNAL_EXIT_CODES, StopSignals, TrainingInterrupted, agreed_stop, stop_votes

logger = logging.getLogger(__name__)

__all__ = ["TrainResult", "Trainer", "TrainingError", "visit_generator"]


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


def gathered_noise(noise: dict[str, list[float]]) -> dict[str, list[float]]:
    """A step's noise levels and sample losses of every rank, in rank order (one collective under torchrun: every
    rank logs the same steps)."""
    if not parallel.is_distributed():
        return noise
    merged: dict[str, list[float]] = {}
    for rows in parallel.gather_objects(noise):
        for key, values in rows.items():
            merged.setdefault(key, []).extend(values)
    return merged


def say(line: str) -> None:
    """A line on stdout that leaves a progress bar intact, written at once (also into a log file)."""
    tqdm.write(line)
    sys.stdout.flush()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """The shared loop; what an algorithm trains and saves is its part (`vidtune.algorithms`), its loss a function
    of `vidtune.algorithms.losses`."""

    def __init__(self, config: Config) -> None:
        self.config = config = validation_config(config)
        self.output_dir = Path(config.output_dir)
        self.device = parallel.resolve_device(config.training.device)
        self.spec: ModelSpec = build_spec(config)
        self.part: AlgorithmPart = build_part(config, self.spec)
        self.loss: LossFunction = loss_function(self.part.traits)
        # The name of files named after the run (a LoRA's ComfyUI file): the run folder's, unless an export names it.
        self.export_name: str | None = None
        self.clips: list[Clip] = []
        self.clip_infos: list[VideoInfo] = []
        # Text encoders and VAE: loaded for on-the-fly training, or (training from the cache) only for validation.
        self.text: TextComponents | None = None
        self.vae: nn.Module | None = None
        self.denoiser: nn.Module | None = None
        # What the loop calls: the denoiser, or under torchrun its DistributedDataParallel wrapper (or, sharded by
        # FSDP, the denoiser itself); `strategy` (parallel.strategy) does the backward, clipping, update, checkpoints.
        self._trained_denoiser: nn.Module | None = None
        self.strategy: Strategy | None = None
        self.objective: Objective | None = None
        self.source: BatchSource | None = None
        self.empty_caption: Conditions | None = None
        self.state: TrainingState | None = None
        self.first_step = 0  # the step this process started from
        self.log: StepLog | None = None
        self.resuming_from: SavedState | None = None  # the checkpoint this run continues, if any
        self.ema: EMA | None = None  # the trained weights' moving average (training.ema_decay)
        self.block_swap: BlockSwap | None = None  # memory.blocks_to_swap
        self.attention_backend = "native"  # model.attention_backend, resolved for the device by check_inputs
        self.eval_clips: list[Clip] = []  # the held-out samples (validation.eval_clips, sources marked eval)
        self.held_out: HeldOutSet | None = None  # their encoded inputs, once set up
        self.eval_history = EvalHistory()
        # The current step's micro-batches: (their noise levels by metrics key, each sample's loss), for metrics.jsonl.
        self.step_noise: list[tuple[dict[str, torch.Tensor], torch.Tensor]] = []
        self.stop: StopSignals | None = None  # what SIGINT / SIGTERM asked, while they are caught
        self.sampling_part: AlgorithmPart = self.part  # what validation samples with (a copy's, under ZeRO-3)

    # ----- what the algorithm's part decides ---------------------------------------------------------------
    @property
    def algorithm(self) -> str:
        return self.part.traits.name

    @property
    def resume_fixed_keys(self) -> tuple[str, ...]:
        return self.part.resume_fixed_keys

    @property
    def trained_denoiser(self) -> nn.Module:
        """What the loop calls: the denoiser, or under torchrun its data-parallel wrapper (once wrapped)."""
        return self.denoiser if self._trained_denoiser is None else self._trained_denoiser

    @property
    def bf16(self) -> bool:
        return self.use_bf16

    @property
    def step(self) -> int:
        return self.state.step if self.state is not None else 0

    def configure_trainable(self, denoiser: nn.Module) -> list[nn.Parameter]:
        """Freeze / wrap the denoiser and return the parameters the optimizer updates."""
        return self.part.configure(denoiser, resuming=self.resuming_from is not None)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint stores (those that change)."""
        return self.part.state_dict()

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.part.load_state_dict(state)

    def save_final(self, folder: Path) -> Path:
        """Write the run's result (adapter or full weights) in the family's diffusers format."""
        return self.part.save_final(folder, self.ema, self.export_name)

    # ----- the run ---------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        # Under torchrun: this run's process group (or the one already set up), taken down at the end.
        deepspeed = self.config.parallel.strategy == "deepspeed"
        with deepspeed_process_group(self.device) if deepspeed else parallel.process_group(self.device):
            return self.train()

    def train(self) -> TrainResult:
        """Check the inputs, set up, then take optimizer steps until `training.steps` or a stop signal."""
        saved = self.resuming_from = self.find_checkpoint()
        self.check_inputs()
        self.strategy = choose_strategy(self.config, self.device)
        parallel.on_main(self.prepare_output_dir)
        # Trackers start before the long work, so a refusal (no login, no package) comes at once.
        trackers = open_trackers(self.config, self.output_dir, saved.step if saved else 0) if parallel.is_main() else []
        parameters = self.set_up(saved)
        self.set_up_held_out()
        state = self.state
        log = self.log = StepLog(self.output_dir / outputs.METRICS, self.config.training.steps, state.step,
                                 self.show_progress, trackers)
        parallel.on_main(lambda: truncate_metrics(log.path, state.step))
        self.denoiser.train()
        if self.held_out is not None:
            self.eval_history = parallel.on_main(lambda: EvalHistory.read(log.path))
            if state.step == 0:  # the base model's score: where the curve starts
                self.evaluate(checkpoint=False)
        with log:  # closes the trackers however the run ends
            # Handlers go in before the data loader starts, so its forked workers inherit them (and ignore Ctrl+C).
            with StopSignals() as stop:
                self.stop = stop
                stream = self.batch_stream(saved)
                stopped_by = agreed_stop(stop)
                while state.step < self.config.training.steps and stopped_by is None:
                    outcome = self.train_step(stream, parameters, stop)
                    stopped_by = outcome.stopped_by
                    if outcome.compile_seconds > 0 and parallel.is_main():
                        print(compile_note(outcome.compile_seconds, state.step, outcome.shapes), flush=True)
                    if outcome.finite and self.due(self.config.logging.log_every, final=True):
                        log.record(state.step, outcome.loss, state.learning_rate, outcome.grad_norm, outcome.seconds,
                                   self.clips_per_step * parallel.world_size(), outcome.compile_seconds,
                                   gathered_noise(outcome.noise))
                    log.advance()
                    self.between_steps()
                    if stopped_by is None and self.validation_due():  # a signal during the samples stops the run
                        stopped_by = agreed_stop(stop)
                log.end_progress()
                # The last step's score (a stop by signal saves at once, unscored); before its checkpoint is written,
                # so the best one is kept by the pruning.
                if stopped_by is None and self.held_out is not None and self.eval_history.last_step != state.step:
                    self.evaluate(checkpoint=True)
                if state.saved_step != state.step:
                    self.save_checkpoint()
                stopped_by = agreed_stop(stop)
                self.stop = None
                if stopped_by is not None:
                    raise TrainingInterrupted(self.interrupted_message(stopped_by), SIGNAL_EXIT_CODES[stopped_by])
            # FSDP, ZeRO-3: every rank gathers the whole weights for rank 0 to save and sample.
            with self.strategy.gathered(self.denoiser, everything=True):
                weights, samples = parallel.on_main(self.write_results)
        every = sample_files(self.output_dir / outputs.SAMPLES) if parallel.is_main() else []
        result = TrainResult(self.output_dir, state.step, log.losses, weights, samples, every,
                             first_step=self.first_step)
        if self.held_out is not None:
            result.held_out, result.best_checkpoint = best_line(self.eval_history, self.checkpoints_root)
        return result

    def set_up(self, saved: SavedState | None) -> list[nn.Parameter]:
        """Models, the training state (restored from `saved` when resuming) and the strategy's wrapper; returns the
        parameters to train."""
        # Rank 0 draws what one process draws; other ranks draw their own (e.g. LoRA dropout masks).
        seed_everything(self.config.training.seed + parallel.rank())
        if self.strategy is None:
            self.strategy = choose_strategy(self.config, self.device)
        # FSDP shards the denoiser here, replacing its parameters, so the optimizer is built after.
        parameters = self.load_models()
        parameters = self.strategy.prepare(self.denoiser, parameters)
        self.ema = self.strategy.ema = self.make_ema(parameters)
        self.state = TrainingState(self.config, self.algorithm, parameters, len(self.clips),
                                   self.trainable_state_dict, self.load_trainable_state_dict, self.ema, self.strategy)
        if self.strategy.wraps_before_restore:  # DeepSpeed: each rank restores its own shards into the engine
            self._trained_denoiser = self.strategy.wrap(self.denoiser, parameters, self.state.optimizer)
        if saved is not None:
            self.state.restore(saved, self.device)
        self.first_step = self.state.step
        if not self.strategy.wraps_before_restore:
            # Under torchrun, DDP starts every rank from rank 0's weights and averages the gradients over ranks.
            self._trained_denoiser = self.strategy.wrap(self.denoiser, parameters, self.state.optimizer)
        # After the wrapper, which checks and broadcasts the weights on the training device.
        self.block_swap = apply_block_swap(self.denoiser, self.spec.block_lists, self.config.memory.blocks_to_swap,
                                           self.device)
        self.part.prepare_frozen(self.strategy)  # FSDP shards a full student's teacher like the student
        return parameters

    def train_step(self, stream: Iterator[Batch], parameters: list[nn.Parameter], stop: StopSignals) -> StepOutcome:
        """One optimizer step: `gradient_accumulation` micro-batches, clipping, then the update unless non-finite."""
        state, accumulation = self.state, self.config.training.gradient_accumulation
        started, compiled_before = time.perf_counter(), compile_seconds()
        step_loss = torch.zeros((), device=self.device)
        shapes = []
        self.step_noise = []
        for micro in range(accumulation):
            batch = next(stream)
            shapes.append(self.config.data.bucket_shapes()[self.clips[int(batch.indices[0])].bucket or 0])
            # Under torchrun the gradients are averaged once per step, on the last micro-batch.
            step_loss += self.forward_backward(batch, sync=micro == accumulation - 1)
        if state.step == self.first_step:
            self.check_every_parameter_trains(parameters)
        norm = self.clip_gradients(parameters)
        # The step's one host-device synchronisation: the loss and the gradient norm come back together.
        step_loss_value, grad_norm = (torch.stack([step_loss, torch.as_tensor(norm).to(step_loss)]).tolist()
                                      if norm is not None else (step_loss.item(), None))
        # Under torchrun, one collective per step: the loss summed over ranks (its mean is logged, and every rank
        # must take the same finite / non-finite decision or the replicas drift apart) and whether a rank was
        # asked to stop (all ranks stop after the same step). One process: the values as they are.
        loss_sum, *stop_counts = parallel.all_reduce_sum([step_loss_value, *stop_votes(stop)])
        loss = loss_sum / parallel.world_size()
        state.step += 1
        state.samples_consumed += self.clips_per_step * parallel.world_size()
        finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
        if not finite:
            self.skip_nonfinite_step(loss, grad_norm)  # raises past the limit
        state.apply_update(finite)
        compiling = compile_seconds() - compiled_before
        return StepOutcome(loss, grad_norm, finite, agreed_stop(stop, stop_counts),
                           time.perf_counter() - started - compiling, compiling, tuple(shapes), self.noise_row())

    def forward_backward(self, batch: Batch, sync: bool) -> torch.Tensor:
        """The backward pass of one micro-batch's loss, scaled so a step's gradient is the mean over its samples;
        returns the scaled loss. A rank's share is sum / (batch_size * accumulation); DDP averages over ranks."""
        with self.strategy.accumulating(self.trained_denoiser, sync=sync):
            with activation_offload(self.config.memory.activation_offload, self.device):
                loss = self.compute_loss(batch) / self.clips_per_step
            self.strategy.backward(loss)  # DDP, FSDP and DeepSpeed reduce the gradients in the backward
        return loss.detach()

    def compute_loss(self, batch: Batch) -> torch.Tensor:
        """The algorithm's loss of one micro-batch (summed over its samples); its samples' losses and noise levels
        are kept for the step's row in metrics.jsonl."""
        output = self.loss(self, batch)
        if output.sample_losses is not None:
            self.step_noise.append((output.levels, output.sample_losses))
        return output.total

    def clip_losses(self, inputs: NoisyInputs, denoiser: nn.Module | None = None) -> torch.Tensor:
        """Each clip's weighted error [B] for these inputs (`vidtune.algorithms.losses.clip_losses`)."""
        return clip_losses(self, inputs, denoiser)

    def noise_row(self) -> dict[str, list[float]]:
        """The step's noise levels by metrics key ("sigmas", or "timesteps" for DDPM; other streams' too) and each
        sample's loss ("sample_losses"), in sample order; empty for an algorithm that notes none."""
        row: dict[str, list[float]] = {}
        for levels_by_key, losses in self.step_noise:
            for key, levels in levels_by_key.items():
                row.setdefault(key, []).extend(levels.detach().float().cpu().tolist())
            row.setdefault("sample_losses", []).extend(losses.float().cpu().tolist())
        self.step_noise = []
        return row

    def noisy_inputs(self, batch: Batch) -> NoisyInputs:
        return noisy_inputs(self, batch)

    def apply_caption_dropout(self, conditions: Conditions, drop: torch.Tensor) -> Conditions:
        return apply_caption_dropout(self, conditions, drop)

    def between_steps(self) -> None:
        """Checkpoints, the held-out score and validation samples every N steps (the last step's come after the
        loop)."""
        checkpoint_due = self.due(self.config.checkpoint.every)
        if self.held_out is not None and (checkpoint_due or self.due(self.config.validation.every)):
            self.evaluate(checkpoint=checkpoint_due)  # before the checkpoint, so the pruning keeps the best one
        if checkpoint_due:
            self.save_checkpoint()
        if self.validation_due():
            stopping = (f"stopping the validation samples, then saving a checkpoint of step {self.state.step}. "
                        "Send {key} again to quit at once without saving.")
            # FSDP, ZeRO-3: every rank gathers the trained weights for rank 0's samples.
            announced = self.stop.meanwhile(stopping) if self.stop is not None else contextlib.nullcontext()
            with self.strategy.gathered(self.denoiser), announced:
                parallel.on_main(self.validate_in_place)

    def validation_due(self) -> bool:
        """Whether validation samples are due after this step, within the loop."""
        return self.config.validation.enabled and self.due(self.config.validation.every)

    def save_checkpoint(self) -> None:
        """A checkpoint of the current step, and loss.png as of it (rank 0), to look at while the run goes on."""
        self.state.save(self.checkpoints_root)
        if parallel.is_main():
            plot_loss_curve(self.output_dir / outputs.METRICS, self.output_dir / outputs.LOSS_PLOT)

    def due(self, every: int | None, final: bool = False) -> bool:
        """Whether something done every `every` steps is due now (`final`: also after the last step)."""
        step, last = self.state.step, self.config.training.steps
        return (bool(every) and step % every == 0 and step < last) or (final and step == last)

    # ----- setting up ------------------------------------------------------------------------------------
    @property
    def show_progress(self) -> bool:
        """Progress bars: as configured, on rank 0 only."""
        return self.config.logging.progress and parallel.is_main()

    @property
    def use_bf16(self) -> bool:
        precision = self.config.training.precision
        return precision == "bf16" or (precision == "auto" and self.device.type == "cuda")

    @property
    def clips_per_step(self) -> int:
        """Samples one process takes per optimizer step."""
        return self.config.training.batch_size * self.config.training.gradient_accumulation

    @property
    def checkpoints_root(self) -> Path:
        return outputs.checkpoints_root(self.output_dir)

    def find_checkpoint(self) -> SavedState | None:
        """The checkpoint this run continues from, checked against the config. A used output_dir is refused before
        anything is read or written. Rank 0 decides (it also tidies what a killed run left) and every rank
        follows, or raises the same error."""
        folder = parallel.on_main(lambda: resolve_resume(self.config))
        if folder is None:
            return None
        return read_checkpoint(folder, self.config, self.algorithm, self.resume_fixed_keys)

    def check_inputs(self) -> None:
        """Model folder, bucket shapes, scheduler, every source and every sample, before any long work."""
        data = self.config.data
        self.spec.check_source()
        check_bucket_shapes(self.spec, data.bucket_shapes(), single=not data.buckets)
        self.spec.check_training(self.config)
        self.objective = self.spec.objective(self.config.training)  # an unknown scheduler fails here, not later
        check_trackers(self.config)
        check_optimizer(self.config, self.device)
        if self.config.parallel.strategy == "deepspeed":
            check_deepspeed(self.config, self.device.type, self.resuming_from)
        check_base_weights(self.config.memory.base_weights)
        check_base_weights(self.config.memory.text_encoder_weights, "memory.text_encoder_weights")
        memory, training = self.config.memory, self.config.training
        check_block_swap(memory.blocks_to_swap, self.part.traits, training.gradient_checkpointing,
                         memory.activation_offload, self.config.parallel.strategy, training.compile)
        if memory.blocks_to_swap:
            check_block_count(memory.blocks_to_swap, self.spec.block_lists,
                              self.spec.load_config(self.spec.denoiser_class, "transformer"))
        check_activation_offload(memory.activation_offload, self.device)
        self.attention_backend = resolve_attention_backend(self.config.model.attention_backend, self.device)
        check_evaluation(self.config)
        clips = self.leave_out_silent(load_dataset(data, progress=self.show_progress))
        self.spec.check_frame_settings(self.config, clips)
        self.clips, self.eval_clips = hold_out(clips, self.config)
        self.clip_infos = [clip.info for clip in self.clips]
        self.part.check([*self.clips, *self.eval_clips], self.objective, resuming=self.resuming_from is not None)

    def leave_out_silent(self, clips: list[Clip]) -> list[Clip]:
        """The clips a run trains on: for a family that trains on sound with `model.clips_without_sound: leave-out`,
        those with an audio track, with one line saying how many were left out; else all of them."""
        if self.spec.audio_format() is None or self.config.model.clips_without_sound != "leave-out":
            return clips
        kept = [clip for clip in clips if has_sound(clip)]
        if not kept:
            raise ConfigError(f"model.clips_without_sound: leave-out leaves none of the {len(clips)} samples: none "
                                "has an audio track.\nWhat to do: add clips with sound, or set "
                                "model.clips_without_sound=video-only to train their video.")
        if len(kept) < len(clips) and parallel.is_main():
            print(f"{self.spec.name}: {len(clips) - len(kept)} of {len(clips)} samples have no audio track and are "
                  "left out (model.clips_without_sound: leave-out).", flush=True)
        return kept

    def prepare_output_dir(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_resolved_config(self.config, self.output_dir)
        # What the run trains on, to look at: each sample's frames at its bucket's size, and its caption (and
        # whether it has sound, for a family that trains on it).
        write_dataset_overview(self.clips, self.config.data, self.output_dir / outputs.DATASET_OVERVIEW,
                               sound=self.spec.audio_format() is not None)

    def load_models(self) -> list[nn.Parameter]:
        """The batch source and the denoiser; returns the parameters to train."""
        self.source = self.open_batch_source()
        if self.config.data.caption_dropout > 0 and self.config.data.caption_dropout_technique == "empty":
            self.empty_caption = self.source.empty_caption()
        # Quantized base weights for a GPU are quantized in host memory first: the GPU never holds the whole
        # unquantized model (vidtune/offload.py).
        load_on = loading_device(self.config.memory.base_weights, self.device)
        if self.strategy is None:
            self.strategy = choose_strategy(self.config, self.device)
        self.denoiser = self.strategy.load_denoiser(self.spec, load_on)  # FSDP: perhaps rank 0 only
        if self.config.training.gradient_checkpointing:
            self.denoiser.enable_gradient_checkpointing()
        parameters = self.configure_trainable(self.denoiser)
        # The kernel before compiling, so the compiled blocks call it; both after the adapter and base weights.
        set_attention_backend(self.denoiser, self.attention_backend, self.spec.name)
        if self.config.training.compile:
            compile_blocks(self.denoiser, len(self.config.data.bucket_shapes()))
        if load_on != self.device:
            self.denoiser.to(self.device)
        self.part.prepare_inputs(self.source)  # e.g. the teacher's negative prompt
        return parameters

    def make_ema(self, parameters: list[nn.Parameter]) -> EMA | None:
        """The moving average of the trained parameters (`training.ema_decay`), or None."""
        decay = self.config.training.ema_decay
        if decay is None:
            return None
        trained = {id(p) for p in parameters}
        return EMA({name: p for name, p in self.denoiser.named_parameters() if id(p) in trained}, decay)

    def open_batch_source(self) -> BatchSource:
        """From the cache (`precompute.enabled`: missing entries are computed first, with the encoders loaded and
        released by that stage, so training never holds them), or encoded on the fly (the encoders loaded here)."""
        if self.spec.audio_format() is not None and parallel.is_main():
            print(sound_line(self.spec.name, self.clips), flush=True)
        if not self.config.precompute.enabled:
            self.load_encoders()
            return EncodedBatches(self.config, self.clips, self.device, self.spec, self.text, self.vae)
        # The held-out samples' entries too: their encoders load once, with training's (vidtune/evaluation.py).
        summary = precompute(self.config, [*self.clips, *self.eval_clips], progress=self.show_progress)
        if summary.rank == 0:
            print(summary.line(), flush=True)
        cached = CachedClips(self.config, self.spec, summary.plan, self.clips)
        return CachedBatches(self.config, self.clips, self.device, cached)

    def load_encoders(self) -> None:
        """The text encoders and the VAE, unless loaded already."""
        if self.text is None:
            self.text = self.spec.load_text(self.device)
        if self.vae is None:
            self.vae = self.spec.load_vae(self.device)

    def batch_stream(self, saved: SavedState | None) -> Iterator[Batch]:
        """The batches from the current data position; after a resume, with the saved RNGs in place."""
        stream = self.source.batches(self.state.samples_consumed)
        if saved is None:
            return stream
        if self.state.step < self.config.training.steps:
            return resume_stream(stream, saved)
        restore_rng(saved)
        return stream

    # ----- guards ----------------------------------------------------------------------------------------
    def check_every_parameter_trains(self, parameters: list[nn.Parameter]) -> None:
        """Under torchrun, after the first step: DDP (which does not search for unused parameters, that would cost
        a graph traversal every step) needs every trainable parameter to take part in the loss."""
        if not parallel.is_distributed() or self.strategy.engine_checkpoints:  # DeepSpeed keeps gradients in its shards
            return
        if getattr(self.denoiser, "leaves_parameters_unused", False):  # DDP looks for them itself (parallel/ddp.py)
            return
        names = {id(p): name for name, p in self.denoiser.named_parameters()}
        unused = [names.get(id(p), "?") for p in parameters if p.grad is None]
        if unused:
            raise TrainingError(
                f"{len(unused)} trainable parameters take no part in the loss, e.g. {', '.join(unused[:5])}; "
                "training on several processes needs every one to. Leave them out (full.frozen_patterns, "
                "lora.target_modules)."
            )

    def clip_gradients(self, parameters: list[nn.Parameter]) -> torch.Tensor | None:
        """Clip to `training.max_grad_norm` and return the norm before clipping (also when clipping is off,
        so a non-finite gradient is caught before the optimizer applies it), on the device: no synchronisation."""
        return self.strategy.clip_gradients(parameters, self.config.training.max_grad_norm)

    def skip_nonfinite_step(self, loss: float, grad_norm: float | None) -> None:
        """Nothing of a non-finite step is applied; the run stops unless `training.skip_nonfinite_steps` allows."""
        state, limit = self.state, self.config.training.skip_nonfinite_steps
        what = f"the loss was {loss}" if not math.isfinite(loss) else f"the gradient norm was {grad_norm}"
        if state.nonfinite_skipped >= limit:
            previous = checkpoints.latest(self.checkpoints_root)
            kept = (f"The last good checkpoint is kept: {previous}." if previous
                    else "No checkpoint was written before it.")
            skipped = f" ({state.nonfinite_skipped} such steps were skipped already)" if limit else ""
            raise TrainingError(
                f"Training stopped at step {state.step}: {what}{skipped}; nothing of that step was applied. {kept}\n"
                "Try a lower training.learning_rate or training.precision=fp32 and continue with "
                "checkpoint.resume=latest, or let a few such steps be skipped with training.skip_nonfinite_steps=N."
            )
        state.nonfinite_skipped += 1
        logger.warning("Step %d skipped: %s (%d of %d allowed by training.skip_nonfinite_steps).",
                       state.step, what, state.nonfinite_skipped, limit)

    def interrupted_message(self, received: signal.Signals) -> str:
        where = checkpoints.latest(self.checkpoints_root)
        return (
            f"{received.name} received: stopped after step {self.state.step} of {self.config.training.steps} and "
            f"saved the checkpoint {where}.\n"
            "To continue exactly where it stopped, run the same command again with checkpoint.resume=latest.\n"
            f"To look at what it learned so far: vidtune sample {where} --prompt \"...\"; to use the weights "
            f"elsewhere: vidtune export {where} --output FOLDER (vidtune sample FOLDER samples them too)"
        )

    # ----- the held-out score (vidtune/evaluation.py) ------------------------------------------------------
    def set_up_held_out(self) -> None:
        """The held-out samples' inputs, encoded once on every rank (from the cache or with the run's encoders),
        without drawing from the training RNGs."""
        if not self.eval_clips:
            return
        if parallel.is_main():
            print(held_out_line(self.eval_clips, self.clips, self.config), flush=True)
        with self.own_rng():
            items = encode_held_out(self.config, self.spec, self.eval_clips, self.device, self.text, self.vae,
                                    progress=self.show_progress)
        self.held_out = HeldOutSet.from_config(self.config, self.eval_clips, items)

    @contextlib.contextmanager
    def own_rng(self) -> Iterator[None]:
        """Inside, torch's RNGs (CPU, and this rank's GPU) may be used; afterwards they are as they were."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            yield

    def evaluate(self, checkpoint: bool) -> None:
        """The held-out score of the weights as they are now (their moving average with `training.ema_decay`, as
        validation samples use), on every rank: written to metrics.jsonl, the trackers and the console by rank 0,
        eval_loss.png redrawn; `checkpoint`: this step's weights are a checkpoint, which may become the best one
        (kept by the pruning)."""
        compiled = eager() if self.config.training.compile else contextlib.nullcontext()
        average = self.ema.applied() if self.ema is not None else contextlib.nullcontext()
        training = self.denoiser.training
        self.denoiser.eval()  # no dropout: the same weights always give the same score
        try:
            with torch.no_grad(), self.own_rng(), compiled, average:
                score = self.held_out.score(self.objective, self.held_out_losses, self.device,
                                            every_rank=self.strategy.forwards_gather_weights,
                                            progress=self.show_progress)
        finally:
            self.denoiser.train(training)
        step = self.state.step
        row = self.eval_history.add(step, score, checkpoint)
        best = self.eval_history.best()
        self.state.keep_steps = {best["step"]} if best is not None else set()
        if parallel.is_main():
            append_row(self.log.path, row)
            for tracker in self.log.trackers:
                tracker.log_metrics(step, tracker_values(score), section="eval")
            tqdm.write(score_line(step, score, best))
            plot_eval_curve(self.log.path, self.output_dir / outputs.EVAL_PLOT)

    def held_out_losses(self, conditions: Conditions, noisy: torch.Tensor, timesteps: torch.Tensor,
                        target: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """`clip_losses` of the plain denoiser (not the data-parallel wrapper: no rank waits for another)."""
        return self.clip_losses(NoisyInputs(conditions, noisy, timesteps, target, levels), denoiser=self.denoiser)

    # ----- results ---------------------------------------------------------------------------------------
    def validate(self) -> list[Path]:
        """Sample the validation prompts with the weights as they are now, or their moving average when
        `training.ema_decay` is set (rank 0), saying at which shape, with a bar per sample; a stop signal ends the
        samples within a denoising step. A run trained from the cache loads the text encoders and the VAE for it,
        once, and says so. Also draws every validation so far side by side (samples_by_step.png)."""
        if self.text is None or self.vae is None:
            print("Loading the text encoders and the VAE for validation samples (training read the cache).",
                  flush=True)
            self.load_encoders()
        part = self.sampling_part
        spec = part.sampling_spec(self.spec)  # e.g. a student's embedded guidance scale
        settings = SampleSettings.from_config(self.config, spec, default_prompt=self.clips[0].caption)
        step = self.state.step
        say(f"Validation at step {step}: {describe_samples(settings, validation_shape(self.config)[1])}.")
        compiled = eager() if self.config.training.compile else contextlib.nullcontext()
        folder = self.output_dir / outputs.SAMPLES
        stop = self.stop
        try:
            with compiled, self.ema.applied() if self.ema is not None else contextlib.nullcontext(), \
                    part.sampling(spec.pipeline(self.text, self.vae, part.denoiser), self.vae, self.clips) as pipeline:
                videos = render_samples(spec, pipeline, settings, folder, f"step-{step:08d}",
                                        reference=reference_clip(spec, self.clips, settings, self.config.data.fps),
                                        bf16=self.use_bf16, progress=self.show_progress, step=step,
                                        stop=(lambda: stop.received is not None) if stop is not None else None)
        except SamplingStopped as stopped:
            say(f"Validation at step {step} stopped: {len(stopped.written)} of {len(settings.prompts)} "
                       "samples written.")
            return stopped.written
        by_step = write_samples_by_step(folder, self.output_dir / outputs.SAMPLES_BY_STEP)
        say(f"Validation samples of step {step} in {folder}" + (f"; every validation side by side: {by_step}"
                                                                      if by_step else ""))
        self.log.samples(step, videos, settings.frame_rate)
        return videos

    def validate_in_place(self) -> list[Path]:
        """`validate`; under ZeRO-3 with a plain copy of the denoiser (`DeepSpeedStrategy.sampling`)."""
        with self.strategy.sampling(self.part, lambda: build_part(self.config, self.spec)) as part:
            self.sampling_part = part
            try:
                return self.validate()
            finally:
                self.sampling_part = self.part

    def sampling_pipeline(self) -> Any:
        """The family's pipeline over the models being trained, as validation samples with it."""
        return self.spec.pipeline(self.text, self.vae, self.denoiser)

    def write_results(self) -> tuple[Path, list[Path]]:
        """What a finished run leaves: the weights, the loss curve, the validation samples (rank 0 only)."""
        weights = self.save_final(self.output_dir)
        plot_loss_curve(self.output_dir / outputs.METRICS, self.output_dir / outputs.LOSS_PLOT)
        if not self.config.validation.enabled:
            return weights, []
        with StopSignals("stopping the validation samples (the trained weights are saved). Send {key} again to "
                         "quit at once.") as stop:
            self.stop = stop
            try:
                samples = self.validate_in_place()
            finally:
                self.stop = None
        if stop.received is not None:
            raise TrainingInterrupted(
                f"{stop.received.name} received: stopped the validation samples after the last step "
                f"({self.state.step}); the trained weights are saved: {weights}.\nTo sample them: vidtune sample "
                f"{self.output_dir} --prompt \"...\"", SIGNAL_EXIT_CODES[stop.received])
        return weights, samples

    def export_weights(self, weights: dict[str, torch.Tensor], output: Path,
                       ema: dict[str, torch.Tensor] | None = None) -> Path:
        """Write a checkpoint's weights (and their moving average, `ema`) as the run's final result into `output`
        (see `vidtune export`)."""
        return self.part.export(weights, output, ema, self.export_name)
