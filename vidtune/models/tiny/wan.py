"""The tiny Wan 2.1 models: text-to-video and image-to-video."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

from vidtune.models.tiny.common import (
    TINY_VOCAB_SIZE,
    OverfitSettings,
    TinyFamily,
    build_tiny_tokenizer,
    calm_moments_posterior,
    latent_statistics,
    reference_latents,
    save_tiny,
)

SHAPE = (9, 32, 32)


def write_tiny_wan(
    folder: str | Path,
    *,
    image_to_video: bool = False,
    num_layers: int = 2,
    attention_head_dim: int = 12,
    num_attention_heads: int = 2,
    text_hidden: int = 32,
    latent_channels: int = 4,
    image_hidden: int = 8,
    seed: int = 0,
) -> Path:
    """A tiny Wan 2.1 model as in diffusers' Wan tests: VAE ratios 8 and 4, patch (1, 2, 2), so frames are 4k+1 and
    sides multiples of 16. 4 latent channels (not the tests' 16): a patch then has 16 features, fewer than the
    transformer's width, so the tiny model can represent its input and learn. Latent statistics go where Wan keeps
    them, `latents_mean` / `latents_std` in the VAE config. The scheduler is Wan 2.1's: UniPCMultistepScheduler
    with flow_prediction, flow sigmas and flow_shift 3.

    `image_to_video`, as in diffusers' Wan I2V tests: the transformer takes noisy latents, 4 mask channels and the
    first-frame latents (2 x 4 + 4 channels) and cross-attends to CLIP image tokens (`image_hidden` wide) through
    added key/value projections; a CLIP vision encoder (patch 4 on 32 x 32 images) and its processor.
    """
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    frames, size, _ = SHAPE
    vae = tiny_wan_vae(latent_channels, frames, size, seed, base_dim=3)
    text_encoder = tiny_umt5(text_hidden, seed)
    scheduler = tiny_wan_scheduler(flow_shift=3.0)
    torch.manual_seed(seed)
    transformer = tiny_wan_transformer(
        in_channels=2 * latent_channels + 4 if image_to_video else latent_channels, latent_channels=latent_channels,
        text_hidden=text_hidden, num_layers=num_layers, num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim, image_dim=image_hidden if image_to_video else None,
        added_kv_proj_dim=num_attention_heads * attention_head_dim if image_to_video else None,
    )
    parts = {"tokenizer": build_tiny_tokenizer(max_length=512), "text_encoder": text_encoder, "vae": vae,
             "scheduler": scheduler, "transformer": transformer}
    if not image_to_video:
        return save_tiny(WanPipeline(**parts), folder, "wan", seed)
    torch.manual_seed(seed)
    image_encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=image_hidden, projection_dim=image_hidden, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, intermediate_size=16, patch_size=4,
    )).eval()
    pipeline = WanImageToVideoPipeline(
        image_encoder=image_encoder, image_processor=CLIPImageProcessor(crop_size=32, size=32), **parts
    )
    return save_tiny(pipeline, folder, "wan-i2v", seed)


def tiny_wan_vae(latent_channels: int, frames: int, size: int, seed: int, **structure: Any) -> Any:
    """A tiny AutoencoderKLWan (`structure`: its size and, for Wan 2.2's, its patching) whose posterior is calm, with
    its latent statistics where Wan keeps them, `latents_mean` / `latents_std` in the VAE config."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(z_dim=latent_channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], **structure)
    calm_moments_posterior(vae.quant_conv, latent_channels)
    mean, std = latent_statistics(reference_latents(vae, frames, size))
    vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    return vae


def tiny_umt5(text_hidden: int, seed: int) -> Any:
    """A tiny UMT5 text encoder, as Wan's."""
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    return UMT5EncoderModel(UMT5Config(
        vocab_size=TINY_VOCAB_SIZE, d_model=text_hidden, d_kv=8, d_ff=text_hidden * 2, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )).eval()


def tiny_wan_scheduler(flow_shift: float) -> Any:
    """Wan's scheduler: UniPCMultistepScheduler with flow prediction and flow sigmas (2.1 shifts by 3, 2.2 by 5)."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift, num_train_timesteps=1000,
        solver_order=2, solver_type="bh2", final_sigmas_type="zero", timestep_spacing="linspace",
    )


def tiny_wan_transformer(*, in_channels: int, latent_channels: int, text_hidden: int, num_layers: int,
                         num_attention_heads: int, attention_head_dim: int, model_class: Any = None,
                         **image: Any) -> Any:
    """A tiny WanTransformer3DModel, patch (1, 2, 2) (`image`: an image-to-video model's image inputs; `model_class`:
    a transformer class of Wan's arguments, such as SkyReels V2's); seed first."""
    from diffusers import WanTransformer3DModel

    return (model_class or WanTransformer3DModel)(
        patch_size=(1, 2, 2), num_attention_heads=num_attention_heads, attention_head_dim=attention_head_dim,
        in_channels=in_channels, out_channels=latent_channels, text_dim=text_hidden, freq_dim=256, ffn_dim=32,
        num_layers=num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **image,
    )


TINY = {
    # Sampled 0.083 away (750 steps of eight at 3e-3: 0.107).
    "wan": TinyFamily(write_tiny_wan, SHAPE, OverfitSettings(steps=750, learning_rate=6e-3, batch_size=8)),
    "wan-i2v": TinyFamily(
        partial(write_tiny_wan, image_to_video=True), SHAPE, OverfitSettings(steps=1000, learning_rate=3e-3)
    ),
}
