"""Runs set up or driven the way the tests need: stopped like a user stops them (Ctrl-C) at a chosen micro-batch,
and the one-clip full fine-tune of the overfit tests."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vidtune.config import build_config
from vidtune.models.registry import tiny_family
from vidtune.training.stop import TrainingInterrupted

FRAME_RATE = 24.0


def run_stopped_at(trainer, number: int) -> None:
    """Run `trainer` with a SIGINT during its `number`-th micro-batch: the run saves a checkpoint at that step and
    stops with TrainingInterrupted."""
    original, calls = trainer.loss, [0]

    def interrupting(*args, **kwargs):
        calls[0] += 1
        if calls[0] == number:
            os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    trainer.loss = interrupting
    with pytest.raises(TrainingInterrupted):
        trainer.run()


def assert_resume_is_bitwise(config: Callable[..., Any], root: Path, stop_at: int,
                             weights: str = "pytorch_lora_weights.safetensors") -> None:
    """`config(output_dir, **checkpoint_settings)` run whole, and run stopped at micro-batch `stop_at` then resumed
    from its checkpoint: the same `weights` file, bit for bit."""
    import torch
    from safetensors.torch import load_file

    from vidtune import checkpoint
    from vidtune.trainers import build_trainer

    build_trainer(config(root / "reference")).run()
    reference = load_file(root / "reference" / weights)
    stopped = root / "stopped"
    run_stopped_at(build_trainer(config(stopped)), stop_at)
    assert checkpoint.list_checkpoints(stopped / "checkpoints")
    build_trainer(config(stopped, resume="latest")).run()
    resumed = load_file(stopped / weights)
    assert resumed.keys() == reference.keys()
    for key in reference:
        assert torch.equal(resumed[key], reference[key]), key


def overfit_config(family: str, pretrained: Path, data_root: Path, output_dir: Path, frames: int | None = None,
                   **sections: dict):
    """A full fine-tune on one clip from the cache: each step sees the clip `batch_size` times, each visit with
    its own noise level, noise and latent drawn from the cached posterior; warm-up, then cosine decay. `sections`:
    keys that replace these, by section (e.g. training={"steps": 300})."""
    tiny = tiny_family(family)
    settings = tiny.overfit
    tiny_frames, height, width = tiny.shape
    frames = frames or tiny_frames
    data = {
        "model": {"name": family, "pretrained": str(pretrained), "frame_rate": FRAME_RATE},
        "data": {"root": str(data_root), "frames": frames, "height": height, "width": width, "num_workers": 0},
        "training": {"algorithm": "full", "steps": settings.steps, "batch_size": settings.batch_size,
                     "learning_rate": settings.learning_rate, "seed": 0, "precision": "fp32", "device": "cpu",
                     "max_grad_norm": None, "sigma_sampling": "uniform", "sigma_shift": 1.0},
        "optimizer": {"weight_decay": 0.0, "lr_scheduler": "cosine", "warmup_steps": settings.steps // 10},
        "precompute": {"enabled": True, "cache_dir": str(output_dir.parent / "cache")},
        "checkpoint": {"every": 0, "keep": 1},
        "validation": {"enabled": False},
        "logging": {"progress": False, "log_every": 100},
        "output_dir": str(output_dir),
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return build_config(data)


def record_references(trainer) -> tuple[list[int], Callable]:
    """Note the frame count of each reference clip the spec's pipeline inputs are built from (validation samples of an
    image-to-video family): (the list, filled as samples are made; the spec's own `pipeline_inputs`)."""
    seen: list[int] = []
    original = trainer.spec.pipeline_inputs

    def record(reference=None):
        seen.append(reference.shape[0])
        return original(reference)

    trainer.spec.pipeline_inputs = record
    return seen, original
