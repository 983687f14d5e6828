"""The tiny Wan 2.2 models: TI2V-5B-like (text- and image-to-video in one model) and A14B-like (two experts)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

from vidtune.models.tiny.common import OverfitSettings, TinyFamily, build_tiny_tokenizer, save_tiny
from vidtune.models.tiny.wan import tiny_umt5, tiny_wan_scheduler, tiny_wan_transformer, tiny_wan_vae

SHAPE = (9, 64, 64)  # TI2V-5B: sides multiples of 32 (VAE 16x, patch 2)
TWO_EXPERT_SHAPE = (9, 32, 32)  # A14B: Wan 2.1's VAE, sides multiples of 16
BOUNDARY_RATIO = 0.875  # Wan2.2 T2V-A14B's; I2V-A14B's is 0.9


def write_tiny_wan22(
    folder: str | Path,
    *,
    image_to_video: bool = False,
    two_experts: bool = False,
    boundary_ratio: float = BOUNDARY_RATIO,
    num_layers: int = 2,
    attention_head_dim: int = 12,
    num_attention_heads: int = 2,
    text_hidden: int = 32,
    latent_channels: int = 4,
    seed: int = 0,
) -> Path:
    """A tiny Wan 2.2 model in the diffusers layout.

    TI2V-5B-like (default): the Wan 2.2 VAE's structure (residual blocks, 2x2 pixel patch into 12 channels, 16x
    spatial and 4x temporal compression) with 4 latent channels, one transformer, and `expand_timesteps` in
    model_index.json, so the pipelines give every latent token its own timestep; image-to-video is the same model
    sampled by WanImageToVideoPipeline (the image's latent as the first frame).

    `two_experts`, A14B-like: Wan 2.1's VAE and transformer shape twice over, `transformer` (high noise) and
    `transformer_2` (low noise), seeded differently, with `boundary_ratio` (tests use 0.5: both sides alike);
    image-to-video experts take the 2.1 mask + first-frame channels (2 x 4 + 4) and no CLIP image tokens, as
    I2V-A14B.
    The scheduler is Wan 2.2's: UniPC with flow prediction and flow sigmas, shift 5 (TI2V-5B's and I2V-A14B's
    published sampling shift; T2V-A14B uses 12)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    frames, size, _ = TWO_EXPERT_SHAPE if two_experts else SHAPE
    if two_experts:  # Wan 2.1's VAE
        vae = tiny_wan_vae(latent_channels, frames, size, seed, base_dim=3)
    else:
        vae = tiny_wan_vae(latent_channels, frames, size, seed, base_dim=4, is_residual=True, in_channels=12,
                           out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4)
    text_encoder = tiny_umt5(text_hidden, seed)
    scheduler = tiny_wan_scheduler(flow_shift=5.0)
    # Only the A14B image-to-video experts take the condition channels; TI2V puts the image in the first frame.
    condition_channels = latent_channels + 4 if image_to_video and two_experts else 0

    def transformer(offset: int) -> Any:
        torch.manual_seed(seed + offset)
        return tiny_wan_transformer(
            in_channels=latent_channels + condition_channels, latent_channels=latent_channels, text_hidden=text_hidden,
            num_layers=num_layers, num_attention_heads=num_attention_heads, attention_head_dim=attention_head_dim,
        )

    parts = {"tokenizer": build_tiny_tokenizer(max_length=512), "text_encoder": text_encoder, "vae": vae,
             "scheduler": scheduler, "transformer": transformer(0)}
    if two_experts:
        parts.update(transformer_2=transformer(1), boundary_ratio=boundary_ratio)
    else:
        parts.update(expand_timesteps=True)
    family = "wan2.2-i2v" if image_to_video else "wan2.2"
    if image_to_video:
        return save_tiny(WanImageToVideoPipeline(image_encoder=None, image_processor=None, **parts), folder, family,
                         seed)
    return save_tiny(WanPipeline(**parts), folder, family, seed)


TINY = {
    "wan2.2": TinyFamily(write_tiny_wan22, SHAPE, OverfitSettings(steps=800, learning_rate=5e-3)),
    "wan2.2-i2v": TinyFamily(
        partial(write_tiny_wan22, image_to_video=True), SHAPE, OverfitSettings(steps=600, learning_rate=5e-3)
    ),
}
