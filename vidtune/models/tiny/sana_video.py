"""The tiny Sana Video models: text-to-video and image-to-video (one transformer, two pipelines)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

from vidtune.models.tiny.common import TINY_VOCAB_SIZE, OverfitSettings, TinyFamily, build_tiny_tokenizer, save_tiny
from vidtune.models.tiny.wan import tiny_wan_vae

SHAPE = (9, 32, 32)
# The published scheduler's shift (diffusers' scripts/convert_sana_video_to_diffusers.py: flow_shift 8.0).
FLOW_SHIFT = 8.0


def write_tiny_sana_video(
    folder: str | Path,
    *,
    image_to_video: bool = False,
    num_layers: int = 2,
    attention_head_dim: int = 12,
    num_attention_heads: int = 2,
    text_hidden: int = 32,
    latent_channels: int = 4,
    seed: int = 0,
) -> Path:
    """A tiny Sana Video model: Wan 2.1's tiny VAE (ratios 8 and 4, 4 latent channels, its latent statistics in the
    VAE config), a two-layer Gemma 2 text encoder and a two-block transformer with patch (1, 2, 2), so frames are
    4k+1 and sides multiples of 32 (the pipelines' rule). `sample_size` 30 is the published 480p model's (the
    pipelines' resolution binning reads it). Text-to-video ships the converter's DPMSolverMultistepScheduler with
    flow sigmas, image-to-video its FlowMatchEulerDiscreteScheduler, both shifted by 8."""
    from diffusers import (
        DPMSolverMultistepScheduler,
        FlowMatchEulerDiscreteScheduler,
        SanaImageToVideoPipeline,
        SanaVideoPipeline,
    )

    frames, size, _ = SHAPE
    vae = tiny_wan_vae(latent_channels, frames, size, seed, base_dim=3)
    text_encoder = tiny_gemma2(text_hidden, seed)
    torch.manual_seed(seed)
    transformer = tiny_sana_video_transformer(latent_channels=latent_channels, text_hidden=text_hidden,
                                              num_layers=num_layers, num_attention_heads=num_attention_heads,
                                              attention_head_dim=attention_head_dim)
    if image_to_video:
        scheduler: Any = FlowMatchEulerDiscreteScheduler(shift=FLOW_SHIFT)
    else:
        scheduler = DPMSolverMultistepScheduler(flow_shift=FLOW_SHIFT, use_flow_sigmas=True,
                                                prediction_type="flow_prediction")
    pipeline_class = SanaImageToVideoPipeline if image_to_video else SanaVideoPipeline
    pipeline = pipeline_class(tokenizer=build_tiny_tokenizer(max_length=4096), text_encoder=text_encoder, vae=vae,
                              transformer=transformer, scheduler=scheduler)
    return save_tiny(pipeline, folder, "sana-video-i2v" if image_to_video else "sana-video", seed)


def tiny_gemma2(hidden: int, seed: int) -> Any:
    """A tiny Gemma 2 text model (the published pipelines' text encoder is Gemma 2 2B's decoder, `Gemma2Model`).
    Positions reach past the pipelines' instruction + caption tokens under the tiny tokenizer."""
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(seed)
    return Gemma2Model(Gemma2Config(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
        sliding_window=4096, pad_token_id=0, eos_token_id=1, bos_token_id=2, attn_implementation="eager",
    )).eval()


def tiny_sana_video_transformer(*, latent_channels: int, text_hidden: int, num_layers: int,
                                num_attention_heads: int, attention_head_dim: int) -> Any:
    """A tiny SanaVideoTransformer3DModel, patch (1, 2, 2); seed first. The cross-attention is as wide as the
    blocks, as in the published model."""
    from diffusers import SanaVideoTransformer3DModel

    width = num_attention_heads * attention_head_dim
    return SanaVideoTransformer3DModel(
        in_channels=latent_channels, out_channels=latent_channels, num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim, num_layers=num_layers, num_cross_attention_heads=num_attention_heads,
        cross_attention_head_dim=attention_head_dim, cross_attention_dim=width, caption_channels=text_hidden,
        mlp_ratio=2.5, sample_size=30, patch_size=(1, 2, 2), qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )


TINY = {
    # Sampled 0.075 away.
    "sana-video": TinyFamily(write_tiny_sana_video, SHAPE,
                             OverfitSettings(steps=750, learning_rate=6e-3, batch_size=8)),
    "sana-video-i2v": TinyFamily(partial(write_tiny_sana_video, image_to_video=True), SHAPE,
                                 OverfitSettings(steps=1000, learning_rate=3e-3)),
}
