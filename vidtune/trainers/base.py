"""The training loop every algorithm shares.

Read it top to bottom: `run` validates everything the user gave, loads the model, builds the data
stream, then loops over optimizer steps. An algorithm (LoRA, full fine-tune, ...) subclasses `Trainer`
and decides only what is trainable (`configure_trainable`) and what is saved (`trainable_state_dict`,
`save_final`).

Checkpoints hold the whole training state, so a resumed run (`checkpoint.resume`) continues bit for bit
where the saved one stopped: trainable weights, optimizer, LR schedule, the number of samples consumed
(the data stream is seeded by position, see `vidtune.data.sampler`) and the RNGs. SIGINT / SIGTERM stop
the loop after the current step with a checkpoint; a non-finite loss or gradient is never applied.

Under torchrun (`vidtune.parallel`) every rank runs this loop on its own device and its own samples (rank r reads
stream positions r, r + world, ...); DistributedDataParallel averages the gradients, so a step of `world` ranks
with `batch_size` each is a step of one process with `batch_size * world`. Rank 0 alone writes files.
"""

from __future__ import annotations

import json
import logging
import math
import random
import signal
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from vidtune import checkpoint as checkpoints
from vidtune import parallel
from vidtune.config import Config, write_resolved_config
from vidtune.data.dataset import VideoCaptionDataset, collate_samples
from vidtune.data.overview import write_dataset_overview
from vidtune.data.sampler import StreamSampler
from vidtune.data.sources import Sample, load_text_pair_dataset, validate_clips
from vidtune.data.video import VideoInfo
from vidtune.errors import ConfigError, VidtuneError
from vidtune.models.registry import get_spec_class
from vidtune.models.spec import POSTERIOR_KEYS, Conditions, ModelSpec, TextComponents, sample_latents
from vidtune.objectives import Objective
from vidtune.optim import build_lr_scheduler, build_optimizer
from vidtune.precompute import CachedSamples, collate_cached, encode_captions, encode_videos, precompute, stack_items
from vidtune.resume import (
    FIXED_KEYS,
    SIGNAL_EXIT_CODES,
    CheckpointError,
    StopSignals,
    TrainingInterrupted,
    compare_configs,
    resolve_resume,
    saved_config,
    truncate_metrics,
)
from vidtune.validation import plot_loss_curve, render_validation_samples

logger = logging.getLogger(__name__)


class TrainingError(VidtuneError):
    """Training cannot go on (e.g. the loss became NaN); the message says where and what to try."""


@dataclass
class TrainResult:
    output_dir: Path
    final_step: int
    losses: list[float] = field(default_factory=list)
    weights_path: Path | None = None
    sample_paths: list[Path] = field(default_factory=list)
    first_step: int = 0  # the step this process started from (a resumed run's checkpoint step)


def resolve_device(name: str) -> torch.device:
    """`training.device` -> this process's device (under torchrun: the GPU of its LOCAL_RANK)."""
    return parallel.resolve_device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def sample_generator(seed: int, position: int) -> torch.Generator:
    """Randomness of one visit of one sample: independent of batch size, accumulation and rank."""
    return torch.Generator().manual_seed((seed * 1_000_003 + position * 7_919 + 17) % 2**63)


class _StreamDataset(Dataset):
    """Adapts a map-style dataset to the (position, index) pairs of StreamSampler."""

    def __init__(self, dataset: VideoCaptionDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        position, index = key
        item = dict(self.dataset[index])
        item["position"] = position
        return item


def _collate_with_positions(items: list[dict[str, Any]]) -> dict[str, Any]:
    batch = collate_samples(items)
    batch["position"] = torch.tensor([item["position"] for item in items], dtype=torch.long)
    return batch


def _collate_cached_with_positions(items: list[dict[str, Any]]) -> dict[str, Any]:
    batch = collate_cached(items)
    batch["position"] = torch.tensor([item["position"] for item in items], dtype=torch.long)
    return batch


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_votes(stop: StopSignals) -> list[float]:
    """This process's vote on stopping, one entry per signal in STOP_SIGNALS (summed over ranks)."""
    return [float(stop.received == number) for number in STOP_SIGNALS]


def agreed_stop(stop: StopSignals, votes: list[float] | None = None) -> signal.Signals | None:
    """The signal the run stops on. One process: the one it received. Under torchrun every rank must stop after the
    same step, and a signal reaches the ranks at different moments: one rank's is enough (`votes`, summed over
    ranks; gathered here when not given)."""
    if not parallel.is_distributed():
        return stop.received
    votes = parallel.all_reduce_sum(stop_votes(stop)) if votes is None else votes
    return next((number for number, count in zip(STOP_SIGNALS, votes, strict=True) if count > 0), None)


def _to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device, non_blocking=True) for key, value in tensors.items()}


class Trainer(ABC):
    """The shared loop. Subclasses implement what differs per algorithm."""

    algorithm: str

    def __init__(self, config: Config) -> None:
        self.config = config
        self.output_dir = Path(config.output_dir)
        self.device = resolve_device(config.training.device)
        self.spec: ModelSpec = get_spec_class(config.model.name)(config.model, frame_rate=config.frame_rate)
        self.samples: list[Sample] = []
        self.clip_infos: list[VideoInfo] = []
        self.text: TextComponents | None = None
        self.vae: nn.Module | None = None
        self.denoiser: nn.Module | None = None
        self.objective: Objective | None = None
        self.empty_conditions: Conditions | None = None
        # Progress of the run: positions of the data stream consumed, non-finite steps skipped.
        self.samples_consumed = 0
        self.nonfinite_skipped = 0
        # What the loop calls: the denoiser, or under torchrun its DistributedDataParallel wrapper (`self.denoiser`
        # stays the plain module, for state dicts, saving and sampling).
        self.trained_denoiser: nn.Module | None = None

    # ----- what an algorithm decides ------------------------------------------------------------------
    @abstractmethod
    def configure_trainable(self, denoiser: nn.Module) -> list[nn.Parameter]:
        """Freeze / wrap the denoiser and return the parameters the optimizer updates."""

    @abstractmethod
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint stores (those that change)."""

    @abstractmethod
    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def save_final(self, folder: Path) -> Path:
        """Write the run's result (adapter or full weights) in the family's diffusers format."""

    # ----- 1. check everything before any long work ----------------------------------------------------
    def check_inputs(self) -> None:
        data = self.config.data
        self.spec.check_source()
        self.spec.check_video_shape(data.frames, data.height, data.width)
        self.samples = load_text_pair_dataset(Path(data.root), data.videos, data.prompts)
        self.clip_infos = validate_clips(self.samples, data.frames, data.fps, progress=self.progress)

    @property
    def progress(self) -> bool:
        """Progress bars: as configured, on rank 0 only."""
        return self.config.logging.progress and parallel.is_main()

    # ----- 2. model ----------------------------------------------------------------------------------
    def load_models(self) -> list[nn.Parameter]:
        training = self.config.training
        empty_prompt = self.config.data.caption_dropout > 0 and self.config.data.caption_dropout_technique == "empty"
        if self.config.precompute.enabled:
            # The precompute stage loads the text encoders and the VAE only for entries that are missing, and
            # releases them before it returns: training from the cache never holds them.
            summary = precompute(self.config, self.samples, progress=self.progress)
            if summary.rank == 0:
                print(summary.line(), flush=True)
            self.cached = CachedSamples(self.config, self.spec, summary.plan, self.samples)
            self._encoders_on_demand = True
            if empty_prompt:
                self.empty_conditions = _to_device(self.cached.empty_conditions(), self.device)
        else:
            self.text = self.spec.load_text_components(self.device)
            self.vae = self.spec.load_vae(self.device)
            if empty_prompt:
                self.empty_conditions = stack_items(encode_captions(self.spec, self.text, [""], batch_size=1))
        self.denoiser = self.spec.load_denoiser(self.device)
        if training.gradient_checkpointing:
            self.denoiser.enable_gradient_checkpointing()
        self.objective = self.spec.objective(training)
        return self.configure_trainable(self.denoiser)

    # Text encoders and VAE. A run trained from the cache never loads them for training; only the validation
    # sampler (after training) needs them, so there they are loaded lazily, on first use, at that point.
    cached: CachedSamples | None = None
    _encoders_on_demand = False
    _text: TextComponents | None = None
    _vae: nn.Module | None = None

    @property
    def text(self) -> TextComponents | None:
        if self._text is None and self._encoders_on_demand:
            logger.info("Loading the text encoders for validation (training used the cache).")
            self._text = self.spec.load_text_components(self.device)
        return self._text

    @text.setter
    def text(self, value: TextComponents | None) -> None:
        self._text = value

    @property
    def vae(self) -> nn.Module | None:
        if self._vae is None and self._encoders_on_demand:
            logger.info("Loading the VAE for validation (training used the cache).")
            self._vae = self.spec.load_vae(self.device)
        return self._vae

    @vae.setter
    def vae(self, value: nn.Module | None) -> None:
        self._vae = value

    # ----- 3. data -------------------------------------------------------------------------------------
    def batches(self, start_position: int) -> Iterator[dict[str, Any]]:
        data = self.config.data
        sampler = StreamSampler(len(self.samples), self.config.training.seed, start=start_position,
                                rank=parallel.rank(), world=parallel.world_size())
        if self.cached is not None:
            # Reading an entry is far cheaper than a step: no worker processes (nor their memory) needed.
            yield from DataLoader(_StreamDataset(self.cached), batch_size=self.config.training.batch_size,
                                  sampler=sampler, num_workers=0, collate_fn=_collate_cached_with_positions)
            return
        dataset = VideoCaptionDataset(self.samples, data.frames, data.height, data.width, data.fps)
        loader = DataLoader(
            _StreamDataset(dataset),
            batch_size=self.config.training.batch_size,
            sampler=sampler,
            num_workers=data.num_workers,
            collate_fn=_collate_with_positions,
            persistent_workers=data.num_workers > 0,
            prefetch_factor=2 if data.num_workers > 0 else None,
        )
        yield from loader

    def encode_batch(self, batch: dict[str, Any]) -> tuple[Conditions, dict[str, torch.Tensor]]:
        """Conditions and the VAE posterior of a batch: read from the cache, or computed on the fly with the
        functional API the precompute stage uses (`vidtune.precompute.encode`), so both give the same batch."""
        if "conditions" in batch:
            return _to_device(batch["conditions"], self.device), _to_device(batch["latents"], self.device)
        count = len(batch["caption"])
        conditions = stack_items(encode_captions(self.spec, self.text, batch["caption"], batch_size=count))
        latents = stack_items(encode_videos(self.spec, self.vae, batch["video"], batch_size=count))
        return conditions, latents

    def apply_caption_dropout(self, conditions: Conditions, drop: torch.Tensor) -> Conditions:
        if not bool(drop.any()):
            return conditions
        if self.config.data.caption_dropout_technique == "zero":
            replacement = self.spec.empty_conditions(conditions)
        else:
            replacement = {k: v.expand_as(conditions[k]) for k, v in self.empty_conditions.items()}
        mask = drop.to(conditions[next(iter(conditions))].device)
        return {
            key: torch.where(mask.view(-1, *([1] * (value.ndim - 1))), replacement[key].to(value), value)
            for key, value in conditions.items()
        }

    # ----- 4. one micro-batch -------------------------------------------------------------------------
    def compute_loss(self, conditions: Conditions, latents: dict[str, torch.Tensor],
                     positions: torch.Tensor) -> torch.Tensor:
        """Sum over the micro-batch of each sample's mean squared error."""
        seed = self.config.training.seed
        generators = [sample_generator(seed, int(position)) for position in positions]
        levels = torch.cat([self.objective.sample_noise_levels(1, g) for g in generators])
        x0 = torch.cat([
            sample_latents({k: latents[k][i : i + 1] for k in POSTERIOR_KEYS}, g) for i, g in enumerate(generators)
        ]).float()
        noise = torch.cat([
            torch.randn(x0.shape[1:], generator=g).unsqueeze(0) for g in generators
        ]).to(x0.device)
        if self.config.data.caption_dropout > 0:
            drop = torch.tensor([
                float(torch.rand(1, generator=g)) < self.config.data.caption_dropout for g in generators
            ])
            conditions = self.apply_caption_dropout(conditions, drop)
        # Video-derived conditions (e.g. first-frame latents) never take part in caption dropout.
        conditions = {**conditions, **{k: v for k, v in latents.items() if k not in POSTERIOR_KEYS}}
        noisy = self.objective.noisy(x0, noise, levels)
        target = self.objective.target(x0, noise, levels)
        timesteps = self.objective.timesteps(levels).to(x0.device)
        denoiser = self.denoiser if self.trained_denoiser is None else self.trained_denoiser
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_bf16):
            prediction = self.spec.forward(denoiser, conditions, noisy.to(self.denoiser.dtype), timesteps)
        per_sample = (prediction.float() - target).pow(2).flatten(1).mean(dim=1)
        return (per_sample * self.objective.loss_weights(levels).to(per_sample.device)).sum()

    @property
    def use_bf16(self) -> bool:
        precision = self.config.training.precision
        return precision == "bf16" or (precision == "auto" and self.device.type == "cuda")

    # ----- 5. the loop ---------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        # Under torchrun: this run's process group (or the one already set up), taken down at the end.
        with parallel.process_group(self.device):
            return self._run()

    def _run(self) -> TrainResult:
        config, training = self.config, self.config.training
        # Refuses a used output_dir before anything is read or written. Rank 0 decides (it also tidies what a killed
        # run left among the checkpoints) and every rank follows, or raises the same error.
        resume_from = parallel.on_main(lambda: resolve_resume(config))
        resumed = self.read_checkpoint(resume_from) if resume_from is not None else None
        self.check_inputs()
        parallel.on_main(self.prepare_output_dir)
        # Rank 0 draws what one process draws; other ranks draw their own (e.g. LoRA dropout masks).
        seed_everything(training.seed + parallel.rank())

        parameters = self.load_models()
        optimizer = build_optimizer(parameters, config)
        lr_scheduler = build_lr_scheduler(optimizer, config)
        step, self.samples_consumed, self.nonfinite_skipped = 0, 0, 0
        if resumed is not None:
            step = self.restore_training_state(resumed, optimizer, lr_scheduler)
        # Under torchrun, DDP starts every rank from rank 0's weights and averages the gradients over ranks.
        self.trained_denoiser = parallel.wrap(self.denoiser, self.device)
        world = parallel.world_size()
        # A rank's loss is the sum over its samples / (batch_size * accumulation); DDP averages the gradients over
        # the ranks, so they are those of one process with batch_size * world: sum / (batch_size * accum * world).
        samples_per_step = training.batch_size * training.gradient_accumulation
        metrics = MetricsLog(self.output_dir / "metrics.jsonl")
        parallel.on_main(lambda: truncate_metrics(metrics.path, step))
        saved_step = step if resumed is not None else None
        first_step = step

        progress = tqdm(total=training.steps, initial=step, desc="training", unit="step",
                        disable=not self.progress, dynamic_ncols=True)
        self.denoiser.train()
        losses: list[float] = []
        # Handlers go in before the data loader starts, so its forked workers inherit them (and ignore Ctrl+C).
        with StopSignals() as stop:
            stream = self.batches(start_position=self.samples_consumed)
            if resumed is not None and step < training.steps:
                stream = self._continue_stream(stream, resumed.state["rng"])
            elif resumed is not None:
                self.restore_rng(resumed.state["rng"])
            stopped_by = agreed_stop(stop)
            while step < training.steps and stopped_by is None:
                started = time.perf_counter()
                step_loss = torch.zeros((), device=self.device)
                for micro in range(training.gradient_accumulation):
                    batch = next(stream)
                    # Under torchrun the gradients are averaged once per step, on the last micro-batch.
                    with parallel.accumulating(self.trained_denoiser, sync=micro == training.gradient_accumulation - 1):
                        conditions, latents = self.encode_batch(batch)
                        loss = self.compute_loss(conditions, latents, batch["position"]) / samples_per_step
                        loss.backward()
                    step_loss += loss.detach()
                if step == first_step:
                    self.check_every_parameter_trains(parameters)
                grad_norm = self.clip_gradients(parameters)
                # Under torchrun, one collective per step: the loss summed over ranks (its mean is logged, and every
                # rank must take the same finite / non-finite decision or the replicas drift apart) and whether a
                # rank was asked to stop (all ranks stop after the same step). One process: the values as they are.
                votes = parallel.all_reduce_sum([float(step_loss), *stop_votes(stop)])
                loss_value = votes[0] / world
                step += 1
                self.samples_consumed += samples_per_step * world
                finite = math.isfinite(loss_value) and (grad_norm is None or math.isfinite(grad_norm))
                if finite:
                    optimizer.step()
                    lr_scheduler.step()
                else:
                    self.skip_nonfinite_step(step, loss_value, grad_norm)  # raises past the limit
                    with warnings.catch_warnings():  # the schedule follows the step count, skipped or not
                        warnings.simplefilter("ignore", UserWarning)
                        lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)

                if finite and (step % config.logging.log_every == 0 or step == training.steps):
                    seconds = time.perf_counter() - started
                    if parallel.is_main():
                        metrics.write(step=step, loss=loss_value, lr=lr_scheduler.get_last_lr()[0],
                                      grad_norm=grad_norm, seconds_per_step=seconds)
                    losses.append(loss_value)
                    progress.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr_scheduler.get_last_lr()[0]:.2e}")
                progress.update(1)

                if config.checkpoint.every and step % config.checkpoint.every == 0 and step < training.steps:
                    self.save_checkpoint(step, optimizer, lr_scheduler)
                    saved_step = step
                if config.validation.enabled and config.validation.every and step % config.validation.every == 0 \
                        and step < training.steps:
                    parallel.on_main(lambda step=step: render_validation_samples(self, step))
                stopped_by = agreed_stop(stop, votes[1:])
            progress.close()
            if saved_step != step:
                self.save_checkpoint(step, optimizer, lr_scheduler)
            stopped_by = agreed_stop(stop)
            if stopped_by is not None:
                raise TrainingInterrupted(self.interrupted_message(stopped_by, step), SIGNAL_EXIT_CODES[stopped_by])

        weights, samples = parallel.on_main(lambda: self.write_results(step))
        return TrainResult(self.output_dir, step, losses, weights, samples, first_step=first_step)

    def prepare_output_dir(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_resolved_config(self.config, self.output_dir)
        # What the run trains on, to look at: first / middle / last frame and caption of each clip.
        write_dataset_overview(self.samples, self.clip_infos, self.output_dir / "dataset_overview.png")

    def write_results(self, step: int) -> tuple[Path, list[Path]]:
        """What a finished run leaves: the weights, the loss curve, the validation samples (rank 0 only)."""
        weights = self.save_final(self.output_dir)
        plot_loss_curve(self.output_dir / "metrics.jsonl", self.output_dir / "loss.png")
        samples = render_validation_samples(self, step) if self.config.validation.enabled else []
        return weights, samples

    def check_every_parameter_trains(self, parameters: list[nn.Parameter]) -> None:
        """Under torchrun, after the first step: DDP (which does not search for unused parameters, that would cost
        a graph traversal every step) needs every trainable parameter to take part in the loss."""
        if not parallel.is_distributed():
            return
        names = {id(p): name for name, p in self.denoiser.named_parameters()}
        unused = [names.get(id(p), "?") for p in parameters if p.grad is None]
        if unused:
            raise TrainingError(
                f"{len(unused)} trainable parameters take no part in the loss, e.g. {', '.join(unused[:5])}; "
                "training on several processes needs every one to. Leave them out (full.frozen_patterns, "
                "lora.target_modules)."
            )

    def clip_gradients(self, parameters: list[nn.Parameter]) -> float | None:
        """Clip to `training.max_grad_norm` and return the norm before clipping (also when clipping is off,
        so a non-finite gradient is caught before the optimizer applies it)."""
        max_norm = self.config.training.max_grad_norm
        if max_norm is None:
            grads = [p.grad for p in parameters if p.grad is not None]
            return float(torch.nn.utils.get_total_norm(grads)) if grads else None
        return float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))

    # ----- 6. checkpoints, resume, faults ----------------------------------------------------------------
    # Config keys whose change a checkpoint of this algorithm cannot follow (beyond model and algorithm).
    resume_fixed_keys: tuple[str, ...] = ()

    @property
    def checkpoints_root(self) -> Path:
        return self.output_dir / "checkpoints"

    def save_checkpoint(self, step: int, optimizer: torch.optim.Optimizer, lr_scheduler: Any) -> Path:
        """Everything a resumed run needs: weights, optimizer, schedule, data position, RNGs, config.

        A failed write (full disk, ...) stops the run; the checkpoints already written stay whole. Under torchrun
        every rank calls it: each one's RNG states are gathered (a resumed rank restores its own), rank 0 writes."""
        rng = dict(enumerate(parallel.gather_objects(checkpoints.rng_state())))
        consumed = self.samples_consumed
        return parallel.on_main(lambda: self._write_checkpoint(step, optimizer, lr_scheduler, consumed, rng))

    def _write_checkpoint(self, step: int, optimizer: torch.optim.Optimizer, lr_scheduler: Any, consumed: int,
                          rng: dict[int, Any]) -> Path:
        try:
            return checkpoints.save(
                self.checkpoints_root,
                step=step,
                weights=self.trainable_state_dict(),
                optimizer=optimizer.state_dict(),
                lr_scheduler=lr_scheduler.state_dict(),
                extra={
                    "samples_consumed": consumed,
                    "algorithm": self.algorithm,
                    "num_samples": len(self.samples),
                    "nonfinite_skipped": self.nonfinite_skipped,
                    "world_size": len(rng),
                },
                config=self.config,
                keep=self.config.checkpoint.keep,
                rng=rng,
            )
        except (OSError, RuntimeError, SafetensorError) as error:
            # A full disk reaches here as OSError (config), SafetensorError (weights) or RuntimeError (torch.save).
            previous = checkpoints.latest(self.checkpoints_root)
            kept = (f"The previous checkpoint {previous} is intact; free some space (or fix the folder) and "
                    "continue from it with checkpoint.resume=latest." if previous
                    else "No earlier checkpoint exists.")
            raise TrainingError(f"Could not write the checkpoint of step {step} under {self.checkpoints_root}: "
                                f"{error}\nIs the disk full? {kept}") from error

    def read_checkpoint(self, folder: Path) -> ResumedState:
        """Check `folder` fits this config (refusing changes it cannot follow, stating the others) and load it."""
        changes = compare_configs(saved_config(folder), self.config, FIXED_KEYS + self.resume_fixed_keys, folder)
        try:
            weights, state = checkpoints.load(folder)
        except (OSError, RuntimeError, ValueError) as error:
            raise CheckpointError(f"Could not read the checkpoint {folder}: {error}") from None
        if state.get("algorithm", self.algorithm) != self.algorithm:
            raise ConfigError(f"Cannot resume from {folder}: it was written by training.algorithm="
                              f"{state['algorithm']}, this run uses {self.algorithm}.")
        if parallel.is_main():
            print(f"Resuming from {folder} (step {state['step']} of {self.config.training.steps}).", flush=True)
            if changes:
                print("Changed since that checkpoint:\n" + "\n".join(f"  - {line}" for line in changes), flush=True)
        return ResumedState(folder, weights, state)

    def restore_training_state(self, resumed: ResumedState, optimizer: torch.optim.Optimizer,
                               lr_scheduler: Any) -> int:
        """Load a checkpoint's weights, optimizer and schedule; return its step. The RNGs follow later."""
        state = resumed.state
        saved_samples = state.get("num_samples", len(self.samples))
        if saved_samples != len(self.samples) and parallel.is_main():
            print(f"The dataset changed since that checkpoint: {saved_samples} clips -> {len(self.samples)} (the "
                  "data order from here on differs from an uninterrupted run).", flush=True)
        saved_world, world = int(state.get("world_size", 1)), parallel.world_size()
        if saved_world != world and parallel.is_main():
            per_step = self.config.training.batch_size * self.config.training.gradient_accumulation * world
            print(f"The number of processes changed since that checkpoint: {saved_world} -> {world} (a step now "
                  f"takes {per_step} samples; the data each process reads and its random draws differ from an "
                  "uninterrupted run).", flush=True)
        try:
            self.load_trainable_state_dict({k: v.to(self.device) for k, v in resumed.weights.items()})
            optimizer.load_state_dict(state["optimizer"])
        except (KeyError, ValueError, RuntimeError) as error:
            raise CheckpointError(f"The checkpoint {resumed.folder} does not fit this model: {error}") from None
        lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.apply_optimizer_config(optimizer, lr_scheduler)
        self.samples_consumed = int(state["samples_consumed"])
        self.nonfinite_skipped = int(state.get("nonfinite_skipped", 0))
        return int(state["step"])

    def apply_optimizer_config(self, optimizer: torch.optim.Optimizer, lr_scheduler: Any) -> None:
        """After loading a checkpoint the config's learning rate, schedule and AdamW settings apply: the loaded
        state dicts would otherwise bring back the values they were saved with. Unchanged values give the
        same numbers bit for bit (LambdaLR's own formula)."""
        options, learning_rate = self.config.optimizer, self.config.training.learning_rate
        for group in optimizer.param_groups:
            group.update(initial_lr=learning_rate, betas=(options.beta1, options.beta2), eps=options.eps,
                         weight_decay=options.weight_decay)
        if isinstance(lr_scheduler, LambdaLR):
            lr_scheduler.base_lrs = [learning_rate for _ in optimizer.param_groups]
            values = [base * fn(lr_scheduler.last_epoch)
                      for fn, base in zip(lr_scheduler.lr_lambdas, lr_scheduler.base_lrs, strict=True)]
            for group, value in zip(optimizer.param_groups, values, strict=True):
                group["lr"] = value
            lr_scheduler._last_lr = list(values)

    def _continue_stream(self, stream: Iterator[dict[str, Any]], rng: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The data stream of a resumed run, with the RNGs restored at the exact point they were saved.

        Starting a DataLoader draws its base seed from the global RNG, as it did when the run began: take
        the first batch, then restore the saved RNGs, so the steps that follow draw what they would have."""
        first = next(stream)
        self.restore_rng(rng)
        yield first
        yield from stream

    def restore_rng(self, saved: dict[Any, Any]) -> None:
        """This rank's RNG states from a checkpoint. A rank it has none for (the run now has more processes than
        when it was saved) keeps its freshly seeded ones."""
        rank = parallel.rank()
        if "python" in saved or rank in saved:
            checkpoints.restore_rng_state(saved, rank)

    def skip_nonfinite_step(self, step: int, loss: float, grad_norm: float | None) -> None:
        """Nothing of a non-finite step is applied; the run stops unless `training.skip_nonfinite_steps` allows."""
        what = f"the loss was {loss}" if not math.isfinite(loss) else f"the gradient norm was {grad_norm}"
        limit = self.config.training.skip_nonfinite_steps
        if self.nonfinite_skipped >= limit:
            previous = checkpoints.latest(self.checkpoints_root)
            kept = (f"The last good checkpoint is kept: {previous}." if previous
                    else "No checkpoint was written before it.")
            skipped = f" ({self.nonfinite_skipped} such steps were skipped already)" if limit else ""
            raise TrainingError(
                f"Training stopped at step {step}: {what}{skipped}; nothing of that step was applied. {kept}\n"
                "Try a lower training.learning_rate or training.precision=fp32 and continue with "
                "checkpoint.resume=latest, or let a few such steps be skipped with training.skip_nonfinite_steps=N."
            )
        self.nonfinite_skipped += 1
        logger.warning("Step %d skipped: %s (%d of %d allowed by training.skip_nonfinite_steps).",
                       step, what, self.nonfinite_skipped, limit)

    def interrupted_message(self, received: signal.Signals, step: int) -> str:
        where = checkpoints.latest(self.checkpoints_root)
        return (
            f"{received.name} received: stopped after step {step} of {self.config.training.steps} and saved the "
            f"checkpoint {where}.\n"
            "To continue exactly where it stopped, run the same command again with checkpoint.resume=latest.\n"
            f"To use what it learned so far: vidtune export {where} --output FOLDER"
        )

    def export_weights(self, weights: dict[str, torch.Tensor], output: Path) -> Path:
        """Write a checkpoint's weights as the run's final result into `output` (see `vidtune export`).

        By default the denoiser is loaded and set up as for training, given the weights and saved with
        `save_final`; an algorithm whose result needs no base model (LoRA) overrides this."""
        self.denoiser = self.spec.load_denoiser(torch.device("cpu"))
        self.configure_trainable(self.denoiser)
        self.load_trainable_state_dict(weights)
        return self.save_final(output)


@dataclass
class ResumedState:
    folder: Path
    weights: dict[str, torch.Tensor]
    state: dict[str, Any]


class MetricsLog:
    """metrics.jsonl: one JSON object per logged step, flushed as it is written."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, **values: Any) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(values) + "\n")
