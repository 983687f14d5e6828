"""The tiny LTX-2 model: a Gemma 3 built in code, the text connectors, video and audio VAEs, vocoder, transformer."""

from __future__ import annotations

from pathlib import Path

import torch

from vidtune.models.tiny.common import (
    TINY_VOCAB_SIZE,
    OverfitSettings,
    TinyFamily,
    build_tiny_tokenizer,
    latent_statistics,
    reference_latents,
    save_tiny,
)

SHAPE = (9, 32, 32)


def build_tiny_gemma3(seed: int = 0) -> torch.nn.Module:
    """Gemma 3 (text and a vision tower, as LTX-2's pipelines load it) at toy sizes."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.configuration_gemma3 import Gemma3TextConfig
    from transformers.models.siglip.configuration_siglip import SiglipVisionConfig

    text = Gemma3TextConfig(vocab_size=TINY_VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
                            sliding_window=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    torch.manual_seed(seed)
    return Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision,
                                                       mm_tokens_per_image=4)).eval()


def build_tiny_gemma4(seed: int = 0) -> torch.nn.Module:
    """Gemma 4 (text only), the other text encoder LTX2Pipeline takes, of the tiny Gemma 3's hidden size and depth
    (so the tiny connectors fit either)."""
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration
    from transformers.models.gemma4_unified.configuration_gemma4_unified import Gemma4UnifiedTextConfig

    text = Gemma4UnifiedTextConfig(vocab_size=TINY_VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   max_position_embeddings=1024, layer_types=["sliding_attention", "full_attention"],
                                   pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(seed)
    return Gemma4UnifiedForConditionalGeneration(Gemma4UnifiedConfig(text_config=text)).eval()


def calm_ltx2_vae_posterior(vae: torch.nn.Module, log_variance: float = -12.0) -> None:
    """A narrow posterior like a trained VAE's: the LTX-2 encoder's last output channel is the shared log-variance."""
    conv = vae.encoder.conv_out.conv
    with torch.no_grad():
        conv.weight[-1].zero_()
        conv.bias[-1] = log_variance


def build_tiny_bwe_vocoder(in_channels: int, seed: int = 0) -> torch.nn.Module:
    """LTX-2.3's vocoder with bandwidth extension at toy sizes: a first stage rendering one mel frame (a hop of 160
    samples at 16 kHz) into 160 samples at 16 kHz, then a causal log-mel of that (hop 80) from which the extension
    renders the 48 kHz residual, 240 samples a frame, as the published one does."""
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

    torch.manual_seed(seed)
    vocoder = LTX2VocoderWithBWE(
        in_channels=in_channels, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[16, 40],
        upsample_factors=[8, 20], resnet_kernel_sizes=[3], resnet_dilations=[[1]],
        bwe_in_channels=2 * 8, bwe_hidden_channels=16, bwe_out_channels=2, bwe_upsample_kernel_sizes=[24, 40],
        bwe_upsample_factors=[12, 20], bwe_resnet_kernel_sizes=[3], bwe_resnet_dilations=[[1]],
        filter_length=128, hop_length=80, window_length=128, num_mel_channels=8,
        input_sampling_rate=16000, output_sampling_rate=48000,
    )
    # The STFT and mel bases are checkpoint buffers (zeros until loaded): a Hann-windowed DFT and a random
    # non-negative filterbank, so that the extension hears the first stage's sound.
    stft, mel_basis = vocoder.mel_stft.stft_fn, vocoder.mel_stft.mel_basis
    length = stft.forward_basis.shape[-1]
    frequencies = torch.arange(length // 2 + 1, dtype=torch.float64)[:, None]
    angles = 2 * torch.pi * frequencies * torch.arange(length, dtype=torch.float64) / length
    window = torch.hann_window(length, periodic=True, dtype=torch.float64)
    basis = torch.cat([torch.cos(angles), -torch.sin(angles)]) * window
    with torch.no_grad():
        stft.forward_basis.copy_(basis[:, None].float())
        stft.inverse_basis.copy_(basis[:, None].float())
        mel_basis.copy_(torch.rand(mel_basis.shape) / length)
    return vocoder.eval()


def write_tiny_ltx_2(folder: str | Path, *, latent_channels: int = 8, seed: int = 0,
                     bandwidth_extension: bool = False) -> Path:
    """Write a tiny LTX-2 model folder (diffusers layout) and return it. VAE: spatial and temporal ratio 4.
    `bandwidth_extension`: its vocoder is LTX2VocoderWithBWE (48 kHz, as LTX-2.3's), else LTX2Vocoder (16 kHz)."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    frames, size, _ = SHAPE
    text_encoder = build_tiny_gemma3(seed)
    text_config = text_encoder.config.text_config
    torch.manual_seed(seed)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=latent_channels, out_channels=latent_channels, patch_size=1, patch_size_t=1,
        num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
        audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
        caption_channels=text_config.hidden_size, rope_double_precision=False, rope_type="split",
    )
    torch.manual_seed(seed)
    connectors = LTX2TextConnectors(
        caption_channels=text_config.hidden_size, text_proj_in_factor=text_config.num_hidden_layers + 1,
        video_connector_num_attention_heads=4, video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split",
    )
    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Video(
        latent_channels=latent_channels, block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
        layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, True), decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False, False, False), downsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_residual=(False, False), upsample_factor=(1, 1), timestep_conditioning=False,
        patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False,
    )
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    calm_ltx2_vae_posterior(vae)
    mean, std = latent_statistics(reference_latents(vae, frames, size))
    with torch.no_grad():
        vae.latents_mean.copy_(mean)
        vae.latents_std.copy_(std)
    torch.manual_seed(seed)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=8, output_channels=2, ch_mult=(1, 1, 1), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=4, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
    )
    torch.manual_seed(seed)
    # One mel frame (a hop of 160 samples at 16 kHz) becomes 160 samples at 16 kHz, so the sound it renders lasts as
    # long as the clip, as the published vocoder's 240 samples at 24 kHz do.
    mel_channels = audio_vae.config.output_channels * audio_vae.config.mel_bins
    vocoder = build_tiny_bwe_vocoder(mel_channels, seed) if bandwidth_extension else LTX2Vocoder(
        in_channels=mel_channels, hidden_channels=32, out_channels=2,
        upsample_kernel_sizes=[16, 40], upsample_factors=[8, 20], resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1, output_sampling_rate=16000,
    )
    # Captions of 32 tokens (LTX2Pipeline's 1024 is the default only where the tokenizer allows it): cheap tests.
    tokenizer = build_tiny_tokenizer(max_length=32)
    tokenizer.padding_side = "left"
    pipeline = LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                  base_image_seq_len=1024, max_image_seq_len=4096),
        vae=vae, audio_vae=audio_vae, text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors,
        transformer=transformer, vocoder=vocoder,
    )
    return save_tiny(pipeline, folder, "ltx-2", seed)


TINY = {
    "ltx-2": TinyFamily(write_tiny_ltx_2, SHAPE, OverfitSettings(steps=1000, learning_rate=1e-2)),
    # The same model: image-to-video is how it is trained and sampled (LTX2ImageToVideoPipeline).
    "ltx-2-i2v": TinyFamily(write_tiny_ltx_2, SHAPE, OverfitSettings(steps=1000, learning_rate=1e-2)),
}
