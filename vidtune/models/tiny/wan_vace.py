"""The tiny Wan VACE models, built from the tiny Wan 2.1 parts: Wan 2.1 VACE-like (one transformer) and Wan 2.2
VACE-Fun A14B-like (two experts)."""

from __future__ import annotations

from pathlib import Path

import torch

from vidtune.models.tiny.common import OverfitSettings, TinyFamily, build_tiny_tokenizer, save_tiny
from vidtune.models.tiny.wan import SHAPE, tiny_umt5, tiny_wan_scheduler, tiny_wan_transformer, tiny_wan_vae


def write_tiny_wan_vace(
    folder: str | Path,
    *,
    num_layers: int = 2,
    vace_layers: tuple[int, ...] = (0, 1),
    attention_head_dim: int = 12,
    num_attention_heads: int = 2,
    text_hidden: int = 32,
    latent_channels: int = 4,
    two_experts: bool = False,
    boundary_ratio: float = 0.875,
    seed: int = 0,
) -> Path:
    """A tiny Wan VACE model: the tiny Wan 2.1 VAE (spatial ratio 8), UMT5 and scheduler, and a
    WanVACETransformer3DModel of the tiny Wan transformer's sizes with a VACE block beside each of `vace_layers`
    (the first must be 0, as in the published models). Its control context has 2 x `latent_channels` (inactive and
    reactive latents) + 8 x 8 (the mask folded from each latent position's pixels) channels. `two_experts`: Wan 2.2
    VACE-Fun A14B's layout, `transformer` (high noise) and `transformer_2` (low noise) seeded differently, with
    `boundary_ratio` (the released model's 0.875 by default; tests use 0.5: both sides alike)."""
    from diffusers import WanVACEPipeline, WanVACETransformer3DModel

    frames, size, _ = SHAPE
    vae = tiny_wan_vae(latent_channels, frames, size, seed, base_dim=3)
    text_encoder = tiny_umt5(text_hidden, seed)

    def transformer(offset: int) -> WanVACETransformer3DModel:
        torch.manual_seed(seed + offset)
        model = tiny_wan_transformer(
            in_channels=latent_channels, latent_channels=latent_channels, text_hidden=text_hidden,
            num_layers=num_layers, num_attention_heads=num_attention_heads, attention_head_dim=attention_head_dim,
            model_class=WanVACETransformer3DModel, vace_layers=list(vace_layers),
            vace_in_channels=2 * latent_channels + 8 * 8,
        )
        # The VACE branch starts as VACE's own training starts it (ali-vilab/VACE zero-initialises each VACE block's
        # `before_proj` and `after_proj`): the untrained hints add nothing, so what the branch learns is the
        # control's.
        with torch.no_grad():
            for block in model.vace_blocks:
                for projection in (block.proj_in, block.proj_out):
                    if projection is not None:
                        projection.weight.zero_()
                        projection.bias.zero_()
        return model

    experts = {"transformer_2": transformer(1), "boundary_ratio": boundary_ratio} if two_experts else {}
    pipeline = WanVACEPipeline(tokenizer=build_tiny_tokenizer(max_length=512), text_encoder=text_encoder, vae=vae,
                               scheduler=tiny_wan_scheduler(flow_shift=3.0), transformer=transformer(0), **experts)
    return save_tiny(pipeline, folder, "wan-vace", seed)


TINY = {
    # Sampled 0.067 away (750 steps of eight at 3e-3: 0.111).
    "wan-vace": TinyFamily(write_tiny_wan_vace, SHAPE, OverfitSettings(steps=750, learning_rate=6e-3, batch_size=8)),
}
