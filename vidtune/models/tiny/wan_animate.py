"""The tiny Wan Animate model: Wan 2.1's tiny image-to-video parts with Wan Animate's pose, motion and face paths."""

from __future__ import annotations

from pathlib import Path

import torch

from vidtune.models.tiny.common import OverfitSettings, TinyFamily, build_tiny_tokenizer, save_tiny
from vidtune.models.tiny.wan import SHAPE, tiny_umt5, tiny_wan_scheduler, tiny_wan_vae

MOTION_SIZE = 16  # face frames are resized to this square (the released model's: 512)


def write_tiny_wan_animate(
    folder: str | Path,
    *,
    num_layers: int = 2,
    attention_head_dim: int = 12,
    num_attention_heads: int = 2,
    text_hidden: int = 32,
    latent_channels: int = 4,
    image_hidden: int = 8,
    seed: int = 0,
) -> Path:
    """A tiny Wan Animate model in the diffusers layout, every conditioning encoder built small.

    The VAE, UMT5, CLIP vision encoder and scheduler are the tiny Wan 2.1 image-to-video model's. The transformer
    is a WanAnimateTransformer3DModel: 2 x 4 + 4 input channels (noisy latents, then the reference and segment
    condition's mask channels and latents), a pose patch embedding, the motion encoder (a StyleGAN-like
    convolution stack on 16 x 16 face frames, 8 channels at each of its three resolutions, then its linear
    motion network and orthogonal motion basis), the causal face encoder and one face adapter (cross-attention
    to the face tokens) after every block."""
    from diffusers import WanAnimatePipeline, WanAnimateTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    frames, size, _ = SHAPE
    vae = tiny_wan_vae(latent_channels, frames, size, seed, base_dim=3)
    text_encoder = tiny_umt5(text_hidden, seed)
    torch.manual_seed(seed)
    inner = num_attention_heads * attention_head_dim
    transformer = WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=num_attention_heads, attention_head_dim=attention_head_dim,
        in_channels=2 * latent_channels + 4, latent_channels=latent_channels, out_channels=latent_channels,
        text_dim=text_hidden, freq_dim=256, ffn_dim=32, num_layers=num_layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", image_dim=image_hidden, added_kv_proj_dim=inner, rope_max_seq_len=32,
        motion_encoder_channel_sizes={str(MOTION_SIZE): 8, str(MOTION_SIZE // 2): 8, str(MOTION_SIZE // 4): 8},
        motion_encoder_size=MOTION_SIZE, motion_style_dim=8, motion_dim=4, motion_encoder_dim=8,
        face_encoder_hidden_dim=8, face_encoder_num_heads=2, inject_face_latents_blocks=1, motion_encoder_batch_size=8,
    )
    torch.manual_seed(seed)
    image_encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=image_hidden, projection_dim=image_hidden, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, intermediate_size=16, patch_size=4,
    )).eval()
    pipeline = WanAnimatePipeline(
        tokenizer=build_tiny_tokenizer(max_length=512), text_encoder=text_encoder, vae=vae,
        scheduler=tiny_wan_scheduler(flow_shift=5.0), image_processor=CLIPImageProcessor(crop_size=32, size=32),
        image_encoder=image_encoder, transformer=transformer,
    )
    return save_tiny(pipeline, folder, "wan-animate", seed)


TINY = {
    "wan-animate": TinyFamily(write_tiny_wan_animate, SHAPE, OverfitSettings(steps=1000, learning_rate=3e-3)),
}
