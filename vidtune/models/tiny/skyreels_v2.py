"""The tiny SkyReels V2 models: text-to-video and image-to-video, built from the tiny Wan 2.1 parts."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from vidtune.models.tiny.common import OverfitSettings, TinyFamily, build_tiny_tokenizer, save_tiny
from vidtune.models.tiny.wan import SHAPE, tiny_umt5, tiny_wan_scheduler, tiny_wan_transformer, tiny_wan_vae

# The published sampling shifts (SkyReels-V2's README: `--shift 8.0` for text-to-video, 5.0 for image-to-video).
FLOW_SHIFT = {"skyreels-v2": 8.0, "skyreels-v2-i2v": 5.0, "skyreels-v2-df": 8.0}


def write_tiny_skyreels_v2(
    folder: str | Path,
    *,
    image_to_video: bool = False,
    diffusion_forcing: bool = False,
    sample_info: bool = False,
    num_layers: int = 2,
    attention_head_dim: int = 12,
    num_attention_heads: int = 2,
    text_hidden: int = 32,
    latent_channels: int = 4,
    image_hidden: int = 8,
    seed: int = 0,
) -> Path:
    """A tiny SkyReels V2 model: the tiny Wan 2.1 VAE, UMT5 and (image-to-video) CLIP vision encoder, a
    SkyReelsV2Transformer3DModel of the tiny Wan transformer's sizes, and the published UniPC flow scheduler's shift.
    The image encoder is a CLIPVisionModelWithProjection, the class SkyReelsV2ImageToVideoPipeline declares (its
    penultimate hidden states are the image tokens, as with Wan's CLIPVisionModel).

    `diffusion_forcing`: the folder is a SkyReelsV2DiffusionForcingPipeline's (its transformer as the DF-14B models');
    `sample_info`: its transformer embeds the frame-rate class (`inject_sample_info`, as SkyReels-V2-DF-1.3B)."""
    from diffusers import (
        SkyReelsV2DiffusionForcingPipeline,
        SkyReelsV2ImageToVideoPipeline,
        SkyReelsV2Pipeline,
        SkyReelsV2Transformer3DModel,
    )
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    name = "skyreels-v2-i2v" if image_to_video else "skyreels-v2-df" if diffusion_forcing else "skyreels-v2"
    frames, size, _ = SHAPE
    vae = tiny_wan_vae(latent_channels, frames, size, seed, base_dim=3)
    text_encoder = tiny_umt5(text_hidden, seed)
    torch.manual_seed(seed)
    transformer = tiny_wan_transformer(
        in_channels=2 * latent_channels + 4 if image_to_video else latent_channels, latent_channels=latent_channels,
        text_hidden=text_hidden, num_layers=num_layers, num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim, model_class=SkyReelsV2Transformer3DModel,
        image_dim=image_hidden if image_to_video else None,
        added_kv_proj_dim=num_attention_heads * attention_head_dim if image_to_video else None,
        **({"inject_sample_info": True} if sample_info else {}),
    )
    parts = {"tokenizer": build_tiny_tokenizer(max_length=512), "text_encoder": text_encoder, "vae": vae,
             "scheduler": tiny_wan_scheduler(flow_shift=FLOW_SHIFT[name]), "transformer": transformer}
    if diffusion_forcing:
        return save_tiny(SkyReelsV2DiffusionForcingPipeline(**parts), folder, name, seed)
    if not image_to_video:
        return save_tiny(SkyReelsV2Pipeline(**parts), folder, name, seed)
    torch.manual_seed(seed)
    image_encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=image_hidden, projection_dim=image_hidden, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, intermediate_size=16, patch_size=4,
    )).eval()
    pipeline = SkyReelsV2ImageToVideoPipeline(
        image_encoder=image_encoder, image_processor=CLIPImageProcessor(crop_size=32, size=32), **parts
    )
    return save_tiny(pipeline, folder, name, seed)


TINY = {
    "skyreels-v2": TinyFamily(write_tiny_skyreels_v2, SHAPE, OverfitSettings(steps=1500, learning_rate=3e-3)),
    # Sampled 0.061 away.
    "skyreels-v2-i2v": TinyFamily(partial(write_tiny_skyreels_v2, image_to_video=True), SHAPE,
                                  OverfitSettings(steps=500, learning_rate=6e-3, batch_size=8)),
    "skyreels-v2-df": TinyFamily(
        partial(write_tiny_skyreels_v2, diffusion_forcing=True), SHAPE, OverfitSettings(steps=1500, learning_rate=3e-3)
    ),
}
