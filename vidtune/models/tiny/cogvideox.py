"""The tiny CogVideoX models: text-to-video (CogVideoX 1.5 layout) and image-to-video (CogVideoX-5b-I2V layout)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from vidtune.models.tiny.common import (
    OverfitSettings,
    TinyFamily,
    build_tiny_t5,
    build_tiny_tokenizer,
    calm_moments_posterior,
    reference_latents,
    save_tiny,
)

SHAPE = (13, 32, 32)
I2V_SHAPE = (9, 32, 32)


def tiny_cogvideox_vae(latent_channels: int, frames: int, size: int, seed: int) -> torch.nn.Module:
    """AutoencoderKLCogVideoX as in diffusers' CogVideoX tests: spatial ratio 8, temporal ratio 4.

    Its encoder's conv_out emits [mean, log-variance] (one log-variance per latent channel), narrowed as a trained
    VAE's. CogVideoX has no latent mean/std, only `scaling_factor`: it is set to 1 / std of the raw latents so
    that scaled latents have unit scale, as for the real VAE.
    """
    from diffusers import AutoencoderKLCogVideoX

    torch.manual_seed(seed)
    vae = AutoencoderKLCogVideoX(
        in_channels=3,
        out_channels=3,
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=latent_channels,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    )
    calm_moments_posterior(vae.encoder.conv_out.conv, latent_channels)
    vae.register_to_config(scaling_factor=1.0 / float(reference_latents(vae, frames, size).std()))
    return vae


def write_tiny_cogvideox(
    folder: str | Path,
    *,
    image_to_video: bool = False,
    version_1_5: bool = False,
    num_layers: int = 2,
    attention_head_dim: int = 16,
    num_attention_heads: int = 4,
    text_hidden: int = 32,
    latent_channels: int = 4,
    max_text_seq_length: int = 16,
    seed: int = 0,
) -> Path:
    """A tiny CogVideoX model. VAE: spatial ratio 8, temporal ratio 4; patch 2 x 2.

    Text-to-video, in the CogVideoX 1.5 layout: 3D rotary embeddings, temporal patch 2 (so frames are 4k+1 with
    k+1 even and sides multiples of 16). Scheduler: CogVideoXDDIMScheduler as shipped with CogVideoX-2b
    (v-prediction, SNR shift 3, zero terminal SNR, trailing spacing).

    `image_to_video`, in the CogVideoX-5b-I2V layout: the transformer takes the noisy latents and the first-frame
    latents concatenated on channels (in_channels = 2 x latent channels), 3D rotary plus learned positional
    embeddings (so one resolution only: the tiny shape), no temporal patch. It also has the `ofs` embedding of
    CogVideoX 1.5 I2V, so that path is exercised too. Scheduler: CogVideoXDPMScheduler as shipped with
    CogVideoX-5b-I2V (v-prediction, zero terminal SNR). With `version_1_5`, in the CogVideoX 1.5 I2V layout instead:
    temporal patch 2 and rotary embeddings only (no learned positional embeddings).
    """
    from diffusers import (
        CogVideoXDDIMScheduler,
        CogVideoXDPMScheduler,
        CogVideoXImageToVideoPipeline,
        CogVideoXPipeline,
        CogVideoXTransformer3DModel,
    )

    frames, size, _ = I2V_SHAPE if image_to_video else SHAPE
    latent_size = size // 8
    torch.manual_seed(seed)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,  # a multiple of 16 for the 3D rotary embeddings
        in_channels=2 * latent_channels if image_to_video else latent_channels,
        out_channels=latent_channels,
        time_embed_dim=32,
        ofs_embed_dim=32 if image_to_video else None,
        text_embed_dim=text_hidden,
        num_layers=num_layers,
        sample_width=latent_size,
        sample_height=latent_size,
        sample_frames=frames,
        patch_size=2,
        patch_size_t=None if image_to_video and not version_1_5 else 2,
        temporal_compression_ratio=4,
        max_text_seq_length=max_text_seq_length,
        use_rotary_positional_embeddings=True,
        use_learned_positional_embeddings=image_to_video and not version_1_5,
    )
    scheduler_class = CogVideoXDPMScheduler if image_to_video else CogVideoXDDIMScheduler
    scheduler = scheduler_class(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        set_alpha_to_one=True,
        snr_shift_scale=1.0 if image_to_video else 3.0,
        timestep_spacing="trailing",
    )
    pipeline_class = CogVideoXImageToVideoPipeline if image_to_video else CogVideoXPipeline
    pipeline = pipeline_class(
        tokenizer=build_tiny_tokenizer(),
        text_encoder=build_tiny_t5(text_hidden, seed),
        vae=tiny_cogvideox_vae(latent_channels, frames, size, seed),
        transformer=transformer,
        scheduler=scheduler,
    )
    return save_tiny(pipeline, folder, "cogvideox-i2v" if image_to_video else "cogvideox", seed)


TINY = {
    "cogvideox": TinyFamily(write_tiny_cogvideox, SHAPE, OverfitSettings(steps=800, learning_rate=1e-2)),
    "cogvideox-i2v": TinyFamily(
        partial(write_tiny_cogvideox, image_to_video=True), I2V_SHAPE, OverfitSettings(steps=800, learning_rate=1e-2)
    ),
}
