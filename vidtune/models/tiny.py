"""Tiny random models of each family, saved in the diffusers layout.

They exist for tests and for `vidtune quickstart`: no download, seconds on a CPU, and they go through
exactly the same loading code as the real checkpoints. Weights are random but seeded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

# A small corpus to train the tiny tokenizer on: words the quickstart captions and tests use, so
# different captions get different token ids (byte-level pieces cover any other text).
_CORPUS = [
    "a red green blue yellow white black orange purple pink cyan circle square triangle star",
    "moving from left to right top bottom slowly quickly bouncing spinning growing shrinking",
    "on a dark light grey plain background the video of camera person dog cat car tree sky",
    "walking running dancing talking smiling water sunset city street night day forest beach",
]

TINY_VOCAB_SIZE = 384


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
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
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


def calm_ltx_vae_posterior(vae: torch.nn.Module, log_variance: float = -12.0) -> None:
    """Make a random VAE's posterior narrow like a trained one's.

    A random encoder emits log-variance near 0 (std ~ 1), which turns one clip into a cloud of
    latents; trained VAEs have std near 0. The LTX encoder's last output channel is the shared
    log-variance, so biasing it strongly negative gives a realistic posterior.
    """
    conv = vae.encoder.conv_out.conv
    with torch.no_grad():
        conv.weight[-1].zero_()
        conv.bias[-1] = log_variance


def reference_videos(frames: int = 9, size: int = 32) -> torch.Tensor:
    """A few synthetic clips [B, F, 3, H, W] in [-1, 1] to measure a tiny VAE's latent statistics on."""
    from vidtune.data.synthetic import BACKGROUNDS, COLORS, DIRECTIONS, SHAPES, ShapeClip, render_shape_frames

    clips = [
        ShapeClip(shape, color, background, direction)
        for shape, color, background, direction in zip(SHAPES, COLORS, BACKGROUNDS, DIRECTIONS, strict=False)
    ]
    videos = [torch.from_numpy(render_shape_frames(clip, frames, size, size)) for clip in clips]
    return torch.stack(videos).permute(0, 1, 4, 2, 3).float() / 127.5 - 1.0


@torch.no_grad()
def set_latent_statistics(vae: torch.nn.Module, latents: torch.Tensor) -> None:
    """Store per-channel mean / std of real latents in the VAE, as trained checkpoints do, so that
    normalised latents have unit scale (a random VAE's raw latents are far smaller)."""
    vae.latents_mean.copy_(latents.mean(dim=(0, 2, 3, 4)))
    vae.latents_std.copy_(latents.std(dim=(0, 2, 3, 4)).clamp_min(1e-4))


def write_tiny_ltx_video(
    folder: str | Path,
    *,
    num_layers: int = 2,
    attention_head_dim: int = 8,
    num_attention_heads: int = 4,
    text_hidden: int = 32,
    latent_channels: int = 8,
    seed: int = 0,
) -> Path:
    """Write a tiny LTX-Video model folder (diffusers layout) and return it.

    VAE: spatial ratio 4, temporal ratio 4 (so frames are 4k+1 and sides multiples of 4).
    """
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    folder = Path(folder)
    torch.manual_seed(seed)
    transformer = LTXVideoTransformer3DModel(
        in_channels=latent_channels,
        out_channels=latent_channels,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        cross_attention_dim=num_attention_heads * attention_head_dim,
        num_layers=num_layers,
        caption_channels=text_hidden,
    )
    torch.manual_seed(seed)
    vae = AutoencoderKLLTXVideo(
        latent_channels=latent_channels,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        decoder_inject_noise=(False, False, False, False, False),
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    calm_ltx_vae_posterior(vae)
    with torch.no_grad():
        pixels = reference_videos().permute(0, 2, 1, 3, 4)  # the VAE takes [B, C, F, H, W]
        set_latent_statistics(vae, vae.encode(pixels).latent_dist.mean)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
    )
    pipeline = LTXPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=build_tiny_t5(text_hidden, seed),
        tokenizer=build_tiny_tokenizer(),
        transformer=transformer,
    )
    pipeline.save_pretrained(folder)
    (folder / "vidtune_tiny.json").write_text(json.dumps({"family": "ltx-video", "seed": seed}) + "\n")
    return folder


TINY_WRITERS = {"ltx-video": write_tiny_ltx_video}

# A clip shape (frames, height, width) that each tiny model accepts; tests and the quickstart use it.
TINY_SHAPES: dict[str, tuple[int, int, int]] = {"ltx-video": (9, 32, 32)}


def write_tiny_model(family: str, folder: str | Path, **kwargs: object) -> Path:
    """Write the tiny model of a family (see TINY_WRITERS) into `folder`."""
    if family not in TINY_WRITERS:
        raise KeyError(f"no tiny model for '{family}'; available: {', '.join(sorted(TINY_WRITERS))}")
    return TINY_WRITERS[family](folder, **kwargs)
