"""What the tiny models of every family share: the record a family declares, tokenizers and a T5 built in code,
reference clips, latent statistics, saving.

A random VAE is unlike a trained one in two ways that matter for training: its posterior is wide (std ~ 1) and
its latents are tiny. The family modules make it narrow (a strongly negative log-variance bias in the layer that
emits the moments) and store the latent statistics of `reference_videos` where the pipeline reads them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

from vidtune.data.synthetic import BACKGROUNDS, COLORS, DIRECTIONS, SHAPES, ShapeClip, render_shape_frames


@dataclass(frozen=True)
class OverfitSettings:
    """How `tests/models/test_overfit.py` overfits one clip of a family with the trainer (full fine-tune from the
    cache): optimizer steps, peak learning rate (linear warm-up over a tenth of the steps, then cosine decay),
    clips per step (the one clip, visited `batch_size` times with its own noise), and the bound on the relative
    error of the latents the family's pipeline samples afterwards. Never raise the bound to pass: a failure means
    training and the pipeline disagree (target, timestep direction, packing, normalisation, rotary embeddings).
    `audio_bound`: for a family that trains sound with the picture, the bound on the sampled audio latents' relative
    error (None: the sound stream is tested elsewhere).

    On the tiny models much of a step's cost is its fixed overhead, so where a family declares `batch_size=8` eight
    visits a step with half the steps (and, from 3e-3, twice the peak rate) reach the bound with margin in less
    time than four visits a step did."""

    steps: int
    learning_rate: float
    batch_size: int = 4
    bound: float = 0.15
    audio_bound: float | None = None


@dataclass(frozen=True)
class TinyFamily:
    """A family's tiny model, declared beside its writer in `vidtune/models/tiny/<module>.py`.

    `write(folder, **overrides)` saves seeded random components in the diffusers layout and returns `folder`;
    `shape` is a clip shape (frames, height, width) the tiny model accepts, used by the tests and the quickstart;
    `overfit` is how the overfit test trains it."""

    write: Callable[..., Path]
    shape: tuple[int, int, int]
    overfit: OverfitSettings


# A small corpus to train the tiny tokenizers on: words the quickstart captions and tests use, so
# different captions get different token ids (byte-level pieces cover any other text).
CORPUS = [
    "a red green blue yellow white black orange purple pink cyan circle square triangle star",
    "moving from left to right top bottom slowly quickly bouncing spinning growing shrinking",
    "on a dark light grey plain background the video of camera person dog cat car tree sky",
    "walking running dancing talking smiling water sunset city street night day forest beach",
]

TINY_VOCAB_SIZE = 384


def save_tiny(pipeline: Any, folder: str | Path, family: str, seed: int) -> Path:
    """Save a tiny pipeline in the diffusers layout, with a marker naming what wrote it."""
    folder = Path(folder)
    pipeline.save_pretrained(folder)
    (folder / "vidtune_tiny.json").write_text(json.dumps({"family": family, "seed": seed}) + "\n")
    return folder


def build_tiny_tokenizer(max_length: int = 128) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with T5's special ids (pad 0, eos 1, unk 2), trained in code."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=["<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=max_length,
    )


def build_tiny_t5(hidden: int = 32, seed: int = 0) -> T5EncoderModel:
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=TINY_VOCAB_SIZE,
        d_model=hidden,
        d_kv=8,
        d_ff=hidden * 2,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5EncoderModel(config).eval()


def reference_videos(frames: int = 9, size: int = 32) -> torch.Tensor:
    """A few synthetic clips [B, F, 3, H, W] in [-1, 1] to measure a tiny VAE's latent statistics on."""
    clips = [
        ShapeClip(shape, color, background, direction)
        for shape, color, background, direction in zip(SHAPES, COLORS, BACKGROUNDS, DIRECTIONS, strict=False)
    ]
    videos = [torch.from_numpy(render_shape_frames(clip, frames, size, size)) for clip in clips]
    return torch.stack(videos).permute(0, 1, 4, 2, 3).float() / 127.5 - 1.0


@torch.no_grad()
def reference_latents(vae: torch.nn.Module, frames: int, size: int) -> torch.Tensor:
    """Raw posterior means [B, C, F, H, W] of `reference_videos` under a tiny VAE."""
    return vae.encode(reference_videos(frames, size).permute(0, 2, 1, 3, 4)).latent_dist.mean


def latent_statistics(latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std of latents [B, C, F, H, W], as trained checkpoints store them (a random VAE's raw
    latents are far smaller than unit scale)."""
    return latents.mean(dim=(0, 2, 3, 4)), latents.std(dim=(0, 2, 3, 4)).clamp_min(1e-4)


def calm_moments_posterior(layer: torch.nn.Module, latent_channels: int, log_variance: float = -12.0) -> None:
    """Narrow the posterior of a VAE whose encoder ends in a layer emitting [mean, log-variance] per latent channel
    (CogVideoX's conv_out, HunyuanVideo's and Wan's 1x1 quant_conv): the log-variance half gets zero weights and a
    strongly negative bias, so one clip gives one latent, as with a trained VAE."""
    with torch.no_grad():
        layer.weight[latent_channels:].zero_()
        layer.bias[latent_channels:] = log_variance
