"""The tiny Mochi model."""

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

SHAPE = (7, 32, 32)


def calm_mochi_vae_posterior(vae: torch.nn.Module, log_variance: float = -12.0) -> None:
    """Narrow the posterior of AutoencoderKLMochi, whose last layer (proj_out) has no bias.

    One feature of the encoder's last norm is made constant (affine weight 0, bias 4), and the log-variance
    rows of proj_out read only that feature.
    """
    norm = vae.encoder.norm_out.norm_layer
    proj = vae.encoder.proj_out
    channels = vae.config.latent_channels
    constant = 4.0
    with torch.no_grad():
        norm.weight[-1] = 0.0
        norm.bias[-1] = constant
        feature = torch.nn.functional.silu(torch.tensor(constant)).item()
        proj.weight[:, -1] = 0.0
        proj.weight[channels:] = 0.0
        proj.weight[channels:, -1] = log_variance / feature


def write_tiny_mochi(
    folder: str | Path,
    *,
    num_layers: int = 2,
    attention_head_dim: int = 16,
    num_attention_heads: int = 4,
    text_hidden: int = 32,
    max_sequence_length: int = 16,
    seed: int = 0,
) -> Path:
    """A tiny Mochi model as in diffusers' Mochi tests. The pipeline fixes 12 latent channels, VAE ratios
    8 (space) and 6 (time) and patch 2, so frames are 6k+1 and sides multiples of 16.

    Latent statistics go where Mochi keeps them, `latents_mean` / `latents_std` in the VAE config.
    The scheduler is Mochi's: FlowMatchEulerDiscreteScheduler with `invert_sigmas`.
    """
    from diffusers import AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiPipeline, MochiTransformer3DModel

    frames, size, _ = SHAPE
    torch.manual_seed(seed)
    transformer = MochiTransformer3DModel(
        patch_size=2,
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        num_layers=num_layers,
        pooled_projection_dim=16,
        in_channels=12,
        out_channels=None,
        qk_norm="rms_norm",
        text_embed_dim=text_hidden,
        time_embed_dim=16,
        activation_fn="swiglu",
        max_sequence_length=max_sequence_length,
    )
    with torch.no_grad():  # learned rotary frequencies start at 0 (no rotation); give them trained-like values
        transformer.pos_frequencies.copy_(torch.rand(transformer.pos_frequencies.shape) * 0.5)
    torch.manual_seed(seed)
    vae = AutoencoderKLMochi(
        latent_channels=12,
        out_channels=3,
        encoder_block_out_channels=(32, 32, 32, 32),
        decoder_block_out_channels=(32, 32, 32, 32),
        layers_per_block=(1, 1, 1, 1, 1),
    )
    calm_mochi_vae_posterior(vae)
    mean, std = latent_statistics(reference_latents(vae, frames, size))
    vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist(), scaling_factor=1.0)
    pipeline = MochiPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(invert_sigmas=True),
        vae=vae,
        text_encoder=build_tiny_t5(text_hidden, seed),
        tokenizer=build_tiny_tokenizer(),
        transformer=transformer,
    )
    return save_tiny(pipeline, folder, "mochi", seed)


TINY = {"mochi": TinyFamily(write_tiny_mochi, SHAPE, OverfitSettings(steps=700, learning_rate=5e-3))}
