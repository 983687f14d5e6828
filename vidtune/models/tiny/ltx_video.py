"""The tiny LTX-Video model."""

from __future__ import annotations

from pathlib import Path

import torch

from vidtune.models.tiny.common import (
    OverfitSettings,
    TinyFamily,
    build_tiny_t5,
    build_tiny_tokenizer,
    latent_statistics,
    reference_latents,
    save_tiny,
)

SHAPE = (9, 32, 32)


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


def write_tiny_ltx_video(
    folder: str | Path,
    *,
    num_layers: int = 2,
    attention_head_dim: int = 8,
    num_attention_heads: int = 4,
    text_hidden: int = 32,
    latent_channels: int = 8,
    seed: int = 0,
    version_095: bool = False,
) -> Path:
    """Write a tiny LTX-Video model folder (diffusers layout) and return it; `version_095`: in the layout of the 0.9.5+
    checkpoints (their VAE and scheduler configs), which image-to-video samples with LTXConditionPipeline.

    VAE: spatial ratio 4, temporal ratio 4 (so frames are 4k+1 and sides multiples of 4). Its per-channel latent
    statistics go where LTX-Video keeps them, the `latents_mean` / `latents_std` buffers.
    """
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXConditionPipeline,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    frames, size, _ = SHAPE
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
    # The 0.9.5+ layout names each encoder block's downsampling and conditions the decoder on a timestep; the
    # 0.9.0 / 0.9.1 one halves space and time together in every scaling block.
    layout: dict[str, object] = {"spatio_temporal_scaling": (True, True, False, False)}
    if version_095:
        layout = {
            "spatio_temporal_scaling": (True, True, True, False),
            "down_block_types": ("LTXVideo095DownBlock3D",) * 4,
            "downsample_type": ("spatial", "temporal", "spatiotemporal", "conv"),
            "timestep_conditioning": True,
            "spatial_compression_ratio": 4,
            "temporal_compression_ratio": 4,
        }
    vae = AutoencoderKLLTXVideo(
        latent_channels=latent_channels,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        decoder_inject_noise=(False, False, False, False, False),
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
        **layout,
    )
    calm_ltx_vae_posterior(vae)
    mean, std = latent_statistics(reference_latents(vae, frames, size))
    with torch.no_grad():
        vae.latents_mean.copy_(mean)
        vae.latents_std.copy_(std)
    # 0.9.5+ ship a fixed shift (LTXConditionPipeline sets its own timesteps); 0.9.0 / 0.9.1 shift by resolution.
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=not version_095,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
    )
    pipeline_class = LTXConditionPipeline if version_095 else LTXPipeline
    pipeline = pipeline_class(
        scheduler=scheduler,
        vae=vae,
        text_encoder=build_tiny_t5(text_hidden, seed),
        tokenizer=build_tiny_tokenizer(),
        transformer=transformer,
    )
    return save_tiny(pipeline, folder, "ltx-video-i2v" if version_095 else "ltx-video", seed)


def write_tiny_ltx_video_i2v(folder: str | Path, **overrides: object) -> Path:
    """The tiny LTX-Video in the 0.9.5+ layout, which `ltx-video-i2v` samples with LTXConditionPipeline."""
    return write_tiny_ltx_video(folder, **{"version_095": True, **overrides})


TINY = {
    "ltx-video": TinyFamily(write_tiny_ltx_video, SHAPE, OverfitSettings(steps=1000, learning_rate=1e-2)),
    "ltx-video-i2v": TinyFamily(write_tiny_ltx_video_i2v, SHAPE, OverfitSettings(steps=500, learning_rate=1e-2)),
}
