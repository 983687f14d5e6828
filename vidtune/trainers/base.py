"""The training loop every algorithm shares.

Read it top to bottom: `run` validates everything the user gave, loads the model, builds the data
stream, then loops over optimizer steps. An algorithm (LoRA, full fine-tune, ...) subclasses `Trainer`
and decides only what is trainable (`configure_trainable`) and what is saved (`trainable_state_dict`,
`save_final`).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from vidtune import checkpoint as checkpoints
from vidtune.config import Config, write_resolved_config
from vidtune.data.dataset import VideoCaptionDataset, collate_samples
from vidtune.data.sampler import StreamSampler
from vidtune.data.sources import Sample, load_text_pair_dataset, validate_clips
from vidtune.errors import VidtuneError
from vidtune.models.registry import get_spec_class
from vidtune.models.spec import POSTERIOR_KEYS, Conditions, ModelSpec, TextComponents, sample_latents
from vidtune.objectives import Objective
from vidtune.optim import build_lr_scheduler, build_optimizer

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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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


class Trainer(ABC):
    """The shared loop. Subclasses implement what differs per algorithm."""

    algorithm: str

    def __init__(self, config: Config) -> None:
        self.config = config
        self.output_dir = Path(config.output_dir)
        self.device = resolve_device(config.training.device)
        self.spec: ModelSpec = get_spec_class(config.model.name)(config.model, frame_rate=config.frame_rate)
        self.samples: list[Sample] = []
        self.text: TextComponents | None = None
        self.vae: nn.Module | None = None
        self.denoiser: nn.Module | None = None
        self.objective: Objective | None = None
        self.empty_conditions: Conditions | None = None

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
        validate_clips(self.samples, data.frames, data.fps, progress=self.config.logging.progress)

    # ----- 2. model ----------------------------------------------------------------------------------
    def load_models(self) -> list[nn.Parameter]:
        training = self.config.training
        self.text = self.spec.load_text_components(self.device)
        self.vae = self.spec.load_vae(self.device)
        self.denoiser = self.spec.load_denoiser(self.device)
        if training.gradient_checkpointing:
            self.denoiser.enable_gradient_checkpointing()
        self.objective = self.spec.objective(training)
        if self.config.data.caption_dropout > 0 and self.config.data.caption_dropout_technique == "empty":
            self.empty_conditions = self.spec.prepare_conditions(self.text, [""])
        return self.configure_trainable(self.denoiser)

    # ----- 3. data -------------------------------------------------------------------------------------
    def batches(self, start_position: int) -> Iterator[dict[str, Any]]:
        data = self.config.data
        dataset = VideoCaptionDataset(self.samples, data.frames, data.height, data.width, data.fps)
        sampler = StreamSampler(len(dataset), self.config.training.seed, start=start_position)
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
        """Conditions and the VAE posterior of a batch (on the fly; precomputed runs skip this)."""
        conditions = self.spec.prepare_conditions(self.text, batch["caption"])
        latents = self.spec.prepare_latents(self.vae, batch["video"])
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
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_bf16):
            prediction = self.spec.forward(
                self.denoiser, conditions, noisy.to(self.denoiser.dtype), timesteps
            )
        per_sample = (prediction.float() - target).pow(2).flatten(1).mean(dim=1)
        return (per_sample * self.objective.loss_weights(levels).to(per_sample.device)).sum()

    @property
    def use_bf16(self) -> bool:
        precision = self.config.training.precision
        return precision == "bf16" or (precision == "auto" and self.device.type == "cuda")

    # ----- 5. the loop ---------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        config, training = self.config, self.config.training
        self.check_inputs()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_resolved_config(config, self.output_dir)
        seed_everything(training.seed)

        parameters = self.load_models()
        optimizer = build_optimizer(parameters, config)
        lr_scheduler = build_lr_scheduler(optimizer, config)
        step = 0
        samples_per_step = training.batch_size * training.gradient_accumulation
        metrics = MetricsLog(self.output_dir / "metrics.jsonl")
        stream = self.batches(start_position=step * samples_per_step)

        progress = tqdm(total=training.steps, initial=step, desc="training", unit="step",
                        disable=not config.logging.progress, dynamic_ncols=True)
        self.denoiser.train()
        losses: list[float] = []
        while step < training.steps:
            started = time.perf_counter()
            step_loss = torch.zeros((), device=self.device)
            for _ in range(training.gradient_accumulation):
                batch = next(stream)
                conditions, latents = self.encode_batch(batch)
                loss = self.compute_loss(conditions, latents, batch["position"]) / samples_per_step
                loss.backward()
                step_loss += loss.detach()
            grad_norm = self.clip_gradients(parameters)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % config.logging.log_every == 0 or step == training.steps:
                loss_value = float(step_loss)
                if not math.isfinite(loss_value):
                    raise TrainingError(
                        f"The loss became {loss_value} at step {step}. Try a lower training.learning_rate "
                        "or training.precision=fp32; checkpoints written so far are kept."
                    )
                seconds = time.perf_counter() - started
                metrics.write(step=step, loss=loss_value, lr=lr_scheduler.get_last_lr()[0],
                              grad_norm=grad_norm, seconds_per_step=seconds)
                losses.append(loss_value)
                progress.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr_scheduler.get_last_lr()[0]:.2e}")
            progress.update(1)

            if config.checkpoint.every and step % config.checkpoint.every == 0 and step < training.steps:
                self.save_checkpoint(step, optimizer, lr_scheduler)
        progress.close()

        self.save_checkpoint(step, optimizer, lr_scheduler)
        weights = self.save_final(self.output_dir)
        from vidtune.validation import plot_loss_curve, render_validation_samples

        plot_loss_curve(self.output_dir / "metrics.jsonl", self.output_dir / "loss.png")
        samples = render_validation_samples(self, step) if config.validation.enabled else []
        return TrainResult(self.output_dir, step, losses, weights, samples)

    def clip_gradients(self, parameters: list[nn.Parameter]) -> float | None:
        max_norm = self.config.training.max_grad_norm
        if max_norm is None:
            return None
        return float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))

    def save_checkpoint(self, step: int, optimizer: torch.optim.Optimizer, lr_scheduler: Any) -> Path:
        samples_per_step = self.config.training.batch_size * self.config.training.gradient_accumulation
        return checkpoints.save(
            self.output_dir / "checkpoints",
            step=step,
            weights=self.trainable_state_dict(),
            optimizer=optimizer.state_dict(),
            lr_scheduler=lr_scheduler.state_dict(),
            extra={"samples_consumed": step * samples_per_step, "algorithm": self.algorithm},
            config=self.config,
            keep=self.config.checkpoint.keep,
        )


class MetricsLog:
    """metrics.jsonl: one JSON object per logged step, flushed as it is written."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, **values: Any) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(values) + "\n")
