"""Tiny random models of each family, saved in the diffusers layout.

They exist for tests and for `vidtune quickstart`: no download, seconds on a CPU, and they go through
exactly the same loading code as the real checkpoints. Weights are random but seeded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

# A small corpus to train the tiny tokenizer on: words the quickstart captions and tests use, so
# different captions get different token ids (byte-level pieces cover any other text).
_CORPUS = [
    "a red green blue yellow white black orange purple pink cyan circle square triangle star",
    "moving from left to right top bottom slowly quickly bouncing spinning growing shrinking",
    "on a dark light grey plain background the video of camera person dog cat car tree sky",
    "walking running dancing talking smiling water sunset city street night day forest beach",
]

TINY_VOCAB_SIZE = 384


def _save_tiny(pipeline: Any, folder: Path, family: str, seed: int) -> Path:
    """Save a tiny pipeline in the diffusers layout, with a marker naming what wrote it."""
    pipeline.save_pretrained(folder)
    (folder / "vidtune_tiny.json").write_text(json.dumps({"family": family, "seed": seed}) + "\n")
    return folder


def build_tiny_tokenizer(max_length: int = 128) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with T5's special ids (pad 0, eos 1, unk 2), trained in code."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=["<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=max_length,
    )


def build_tiny_t5(hidden: int = 32, seed: int = 0) -> T5EncoderModel:
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=TINY_VOCAB_SIZE,
        d_model=hidden,
        d_kv=8,
        d_ff=hidden * 2,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5EncoderModel(config).eval()


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


def reference_videos(frames: int = 9, size: int = 32) -> torch.Tensor:
    """A few synthetic clips [B, F, 3, H, W] in [-1, 1] to measure a tiny VAE's latent statistics on."""
    from vidtune.data.synthetic import BACKGROUNDS, COLORS, DIRECTIONS, SHAPES, ShapeClip, render_shape_frames

    clips = [
        ShapeClip(shape, color, background, direction)
        for shape, color, background, direction in zip(SHAPES, COLORS, BACKGROUNDS, DIRECTIONS, strict=False)
    ]
    videos = [torch.from_numpy(render_shape_frames(clip, frames, size, size)) for clip in clips]
    return torch.stack(videos).permute(0, 1, 4, 2, 3).float() / 127.5 - 1.0


@torch.no_grad()
def set_latent_statistics(vae: torch.nn.Module, latents: torch.Tensor) -> None:
    """Store per-channel mean / std of real latents in the VAE, as trained checkpoints do, so that
    normalised latents have unit scale (a random VAE's raw latents are far smaller)."""
    vae.latents_mean.copy_(latents.mean(dim=(0, 2, 3, 4)))
    vae.latents_std.copy_(latents.std(dim=(0, 2, 3, 4)).clamp_min(1e-4))


def write_tiny_ltx_video(
    folder: str | Path,
    *,
    num_layers: int = 2,
    attention_head_dim: int = 8,
    num_attention_heads: int = 4,
    text_hidden: int = 32,
    latent_channels: int = 8,
    seed: int = 0,
) -> Path:
    """Write a tiny LTX-Video model folder (diffusers layout) and return it.

    VAE: spatial ratio 4, temporal ratio 4 (so frames are 4k+1 and sides multiples of 4).
    """
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    folder = Path(folder)
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
    vae = AutoencoderKLLTXVideo(
        latent_channels=latent_channels,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        decoder_inject_noise=(False, False, False, False, False),
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    calm_ltx_vae_posterior(vae)
    with torch.no_grad():
        pixels = reference_videos().permute(0, 2, 1, 3, 4)  # the VAE takes [B, C, F, H, W]
        set_latent_statistics(vae, vae.encode(pixels).latent_dist.mean)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
    )
    pipeline = LTXPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=build_tiny_t5(text_hidden, seed),
        tokenizer=build_tiny_tokenizer(),
        transformer=transformer,
    )
    return _save_tiny(pipeline, folder, "ltx-video", seed)


def calm_cogvideox_vae_posterior(vae: torch.nn.Module, log_variance: float = -12.0) -> None:
    """`calm_ltx_vae_posterior` for AutoencoderKLCogVideoX: the encoder's conv_out emits [mean, log-variance]
    (one log-variance per latent channel, the second half), so those output channels get a constant bias."""
    conv = vae.encoder.conv_out.conv
    channels = vae.config.latent_channels
    with torch.no_grad():
        conv.weight[channels:].zero_()
        conv.bias[channels:] = log_variance


def calm_mochi_vae_posterior(vae: torch.nn.Module, log_variance: float = -12.0) -> None:
    """`calm_ltx_vae_posterior` for AutoencoderKLMochi, whose last layer (proj_out) has no bias.

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


def _raw_latents(vae: torch.nn.Module, frames: int, size: int) -> torch.Tensor:
    """Posterior means of a tiny VAE on `reference_videos` ([B, C, F, H, W])."""
    with torch.no_grad():
        pixels = reference_videos(frames, size).permute(0, 2, 1, 3, 4)  # the VAE takes [B, C, F, H, W]
        return vae.encode(pixels).latent_dist.mean


def _tiny_cogvideox_vae(latent_channels: int, frames: int, size: int, seed: int) -> torch.nn.Module:
    """AutoencoderKLCogVideoX as in diffusers' CogVideoX tests: spatial ratio 8, temporal ratio 4.

    CogVideoX has no latent mean/std, only `scaling_factor`: it is set to 1 / std of the raw latents so
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
    calm_cogvideox_vae_posterior(vae)
    std = float(_raw_latents(vae, frames, size).std())
    vae.register_to_config(scaling_factor=1.0 / std)
    return vae


def write_tiny_cogvideox(
    folder: str | Path,
    *,
    num_layers: int = 2,
    attention_head_dim: int = 16,
    num_attention_heads: int = 4,
    text_hidden: int = 32,
    latent_channels: int = 4,
    max_text_seq_length: int = 16,
    seed: int = 0,
) -> Path:
    """A tiny CogVideoX text-to-video model in the CogVideoX 1.5 layout (3D rotary embeddings, temporal patch 2).

    VAE: spatial ratio 8, temporal ratio 4; patch 2 x 2 x 2, so frames are 4k+1 with k+1 even and sides
    multiples of 16. Scheduler: CogVideoXDDIMScheduler as shipped with CogVideoX-2b (v-prediction, SNR shift 3,
    zero terminal SNR, trailing spacing).
    """
    from diffusers import CogVideoXDDIMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel

    folder = Path(folder)
    frames, size, _ = TINY_SHAPES["cogvideox"]
    latent_size = size // 8
    torch.manual_seed(seed)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,  # a multiple of 16 for the 3D rotary embeddings
        in_channels=latent_channels,
        out_channels=latent_channels,
        time_embed_dim=32,
        text_embed_dim=text_hidden,
        num_layers=num_layers,
        sample_width=latent_size,
        sample_height=latent_size,
        sample_frames=frames,
        patch_size=2,
        patch_size_t=2,
        temporal_compression_ratio=4,
        max_text_seq_length=max_text_seq_length,
        use_rotary_positional_embeddings=True,
        use_learned_positional_embeddings=False,
    )
    scheduler = CogVideoXDDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        set_alpha_to_one=True,
        snr_shift_scale=3.0,
        timestep_spacing="trailing",
    )
    pipeline = CogVideoXPipeline(
        tokenizer=build_tiny_tokenizer(),
        text_encoder=build_tiny_t5(text_hidden, seed),
        vae=_tiny_cogvideox_vae(latent_channels, frames, size, seed),
        transformer=transformer,
        scheduler=scheduler,
    )
    return _save_tiny(pipeline, folder, "cogvideox", seed)


def write_tiny_cogvideox_i2v(
    folder: str | Path,
    *,
    num_layers: int = 2,
    attention_head_dim: int = 16,
    num_attention_heads: int = 4,
    text_hidden: int = 32,
    latent_channels: int = 4,
    max_text_seq_length: int = 16,
    seed: int = 0,
) -> Path:
    """A tiny CogVideoX image-to-video model in the CogVideoX-5b-I2V layout: the transformer takes the noisy
    latents and the first-frame latents concatenated on channels (in_channels = 2 x latent channels), 3D
    rotary plus learned positional embeddings (so one resolution only: the tiny shape), no temporal patch.
    It also has the `ofs` embedding of CogVideoX 1.5 I2V, so that path is exercised too.
    Scheduler: CogVideoXDPMScheduler as shipped with CogVideoX-5b-I2V (v-prediction, zero terminal SNR).
    """
    from diffusers import CogVideoXDPMScheduler, CogVideoXImageToVideoPipeline, CogVideoXTransformer3DModel

    folder = Path(folder)
    frames, size, _ = TINY_SHAPES["cogvideox-i2v"]
    latent_size = size // 8
    torch.manual_seed(seed)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        in_channels=2 * latent_channels,
        out_channels=latent_channels,
        time_embed_dim=32,
        ofs_embed_dim=32,
        text_embed_dim=text_hidden,
        num_layers=num_layers,
        sample_width=latent_size,
        sample_height=latent_size,
        sample_frames=frames,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=max_text_seq_length,
        use_rotary_positional_embeddings=True,
        use_learned_positional_embeddings=True,
    )
    scheduler = CogVideoXDPMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        set_alpha_to_one=True,
        snr_shift_scale=1.0,
        timestep_spacing="trailing",
    )
    pipeline = CogVideoXImageToVideoPipeline(
        tokenizer=build_tiny_tokenizer(),
        text_encoder=build_tiny_t5(text_hidden, seed),
        vae=_tiny_cogvideox_vae(latent_channels, frames, size, seed),
        transformer=transformer,
        scheduler=scheduler,
    )
    return _save_tiny(pipeline, folder, "cogvideox-i2v", seed)


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

    folder = Path(folder)
    frames, size, _ = TINY_SHAPES["mochi"]
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
    latents = _raw_latents(vae, frames, size)
    vae.register_to_config(
        latents_mean=latents.mean(dim=(0, 2, 3, 4)).tolist(),
        latents_std=latents.std(dim=(0, 2, 3, 4)).clamp_min(1e-4).tolist(),
        scaling_factor=1.0,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(invert_sigmas=True)
    pipeline = MochiPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=build_tiny_t5(text_hidden, seed),
        tokenizer=build_tiny_tokenizer(),
        transformer=transformer,
    )
    return _save_tiny(pipeline, folder, "mochi", seed)


# ----- HunyuanVideo and Wan -----------------------------------------------------------------------------
# Llama 3's pre-tokenizer split: with every piece of the HunyuanVideo prompt template in the vocabulary, the
# template's system part is exactly the 95 tokens the pipeline crops (`crop_start`), as with the real tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_LLAMA3_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<pad>",
]
_CLIP_SPLIT = r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"


def build_tiny_llama_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """A Llama-3-style byte-level BPE (HunyuanVideo's text encoder): bos prepended, no eos, right padding
    with `<pad>` (the pipeline crops the template from the left and the transformer reads the mask as a
    prefix), the template's header tokens as special tokens."""
    import regex
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from tokenizers import Regex

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_LLAMA3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    specials = "|".join(regex.escape(token) for token in _LLAMA3_SPECIALS)
    template = regex.split(specials, DEFAULT_PROMPT_TEMPLATE["template"].replace("{}", " "))
    tokenizer.train_from_iterator(template * 8 + _CORPUS * 4, trainer=trainer)
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<pad>",
        padding_side="right",
        model_max_length=1024,
    )
    prefix = DEFAULT_PROMPT_TEMPLATE["template"].split("{}")[0]
    if len(fast(prefix).input_ids) != DEFAULT_PROMPT_TEMPLATE["crop_start"]:
        raise RuntimeError("the tiny Llama tokenizer does not split the HunyuanVideo template like Llama 3")
    return fast


def build_tiny_clip_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A CLIP-style BPE (lower case, `<|startoftext|> ... <|endoftext|>`, padded on the right with `<|endoftext|>`
    like openai/clip-vit-large-patch14, so the pooled token is the first eos). No `</w>` word ends: the
    trainer orders those tokens differently from run to run, and tiny models must be reproducible."""
    from tokenizers import Regex

    tokenizer = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tokenizer.normalizer = normalizers.Sequence([
        normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase(),
    ])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_CLIP_SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|startoftext|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>",
        special_tokens=[(token, tokenizer.token_to_id(token)) for token in ("<|startoftext|>", "<|endoftext|>")],
    )
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        padding_side="right",
        model_max_length=77,
    )


def calm_moments_posterior(quant_conv: torch.nn.Module, latent_channels: int, log_variance: float = -12.0) -> None:
    """`calm_ltx_vae_posterior` for VAEs whose last encoder layer is a 1x1 `quant_conv` emitting
    [mean, log-variance] (HunyuanVideo, Wan): the log-variance half gets zero weights and a negative bias."""
    with torch.no_grad():
        quant_conv.weight[latent_channels:].zero_()
        quant_conv.bias[latent_channels:] = log_variance


@torch.no_grad()
def _reference_latents(vae: torch.nn.Module, frames: int, size: int) -> torch.Tensor:
    """Raw posterior means [B, C, F, H, W] of `reference_videos` under a tiny VAE."""
    return vae.encode(reference_videos(frames, size).permute(0, 2, 1, 3, 4)).latent_dist.mean


def write_tiny_hunyuan_video(
    folder: str | Path,
    *,
    num_layers: int = 1,
    num_single_layers: int = 1,
    attention_head_dim: int = 10,
    num_attention_heads: int = 2,
    latent_channels: int = 4,
    seed: int = 0,
) -> Path:
    """A tiny HunyuanVideo as in diffusers' HunyuanVideo tests: VAE ratios 8 (space) and 4 (time), patch 1,
    guidance embedding on; a 3-layer Llama (so the pipeline's hidden_states[-3] is a real layer) and a CLIP
    text model. The VAE's `scaling_factor` makes its latents unit scale, as the real one (0.476986) does."""
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    folder = Path(folder)
    frames, size, _ = TINY_SHAPES["hunyuan-video"]
    tokenizer, tokenizer_2 = build_tiny_llama_tokenizer(), build_tiny_clip_tokenizer()
    torch.manual_seed(seed)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        num_refiner_layers=1,
        patch_size=1,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 4, 4),
    )
    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        act_fn="silu",
        norm_num_groups=4,
        scaling_factor=0.476986,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        mid_block_add_attention=True,
    )
    calm_moments_posterior(vae.quant_conv, latent_channels)
    vae.register_to_config(scaling_factor=1.0 / float(_reference_latents(vae, frames, size).std()))
    torch.manual_seed(seed)
    text_encoder = LlamaModel(LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=3,
        hidden_act="gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )).eval()
    torch.manual_seed(seed)
    text_encoder_2 = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer_2),
        hidden_size=8,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        hidden_act="gelu",
        projection_dim=32,
        bos_token_id=tokenizer_2.bos_token_id,
        eos_token_id=tokenizer_2.eos_token_id,
        pad_token_id=tokenizer_2.pad_token_id,
    )).eval()
    pipeline = HunyuanVideoPipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),  # as shipped with HunyuanVideo
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
    )
    return _save_tiny(pipeline, folder, "hunyuan-video", seed)


def _tiny_wan_parts(family: str, text_hidden: int, latent_channels: int, seed: int) -> dict[str, object]:
    """Tokenizer, UMT5 encoder, VAE (as in diffusers' Wan tests: ratios 8 and 4) and scheduler of tiny Wan models.

    Latent statistics go where Wan keeps them, `latents_mean` / `latents_std` in the VAE config. The
    scheduler is Wan 2.1's: UniPCMultistepScheduler with flow_prediction, flow sigmas and flow_shift 3.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    frames, size, _ = TINY_SHAPES[family]
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=latent_channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )
    calm_moments_posterior(vae.quant_conv, latent_channels)
    latents = _reference_latents(vae, frames, size)
    vae.register_to_config(
        latents_mean=latents.mean(dim=(0, 2, 3, 4)).tolist(),
        latents_std=latents.std(dim=(0, 2, 3, 4)).clamp_min(1e-4).tolist(),
    )
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=TINY_VOCAB_SIZE, d_model=text_hidden, d_kv=8, d_ff=text_hidden * 2, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )).eval()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000,
        solver_order=2, solver_type="bh2", final_sigmas_type="zero", timestep_spacing="linspace",
    )
    return {"tokenizer": build_tiny_tokenizer(max_length=512), "text_encoder": text_encoder, "vae": vae,
            "scheduler": scheduler}


def _tiny_wan_transformer(seed: int, in_channels: int, out_channels: int, text_hidden: int, num_layers: int,
                          num_attention_heads: int, attention_head_dim: int, image_dim: int | None = None):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        in_channels=in_channels,
        out_channels=out_channels,
        text_dim=text_hidden,
        freq_dim=256,
        ffn_dim=32,
        num_layers=num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        image_dim=image_dim,
        added_kv_proj_dim=None if image_dim is None else num_attention_heads * attention_head_dim,
    )


def write_tiny_wan(
    folder: str | Path,
    *,
    num_layers: int = 2,
    attention_head_dim: int = 12,
    num_attention_heads: int = 2,
    text_hidden: int = 32,
    latent_channels: int = 4,
    seed: int = 0,
) -> Path:
    """A tiny Wan 2.1 text-to-video model as in diffusers' Wan tests: patch (1, 2, 2), so frames are 4k+1 and
    sides multiples of 16. 4 latent channels (not the tests' 16): a patch then has 16 features, fewer than the
    transformer's width, so the tiny model can represent its input and learn."""
    from diffusers import WanPipeline

    folder = Path(folder)
    parts = _tiny_wan_parts("wan", text_hidden, latent_channels, seed)
    transformer = _tiny_wan_transformer(seed, latent_channels, latent_channels, text_hidden, num_layers,
                                        num_attention_heads, attention_head_dim)
    return _save_tiny(WanPipeline(transformer=transformer, **parts), folder, "wan", seed)


def write_tiny_wan_i2v(
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
    """A tiny Wan 2.1 image-to-video model as in diffusers' Wan I2V tests: the transformer takes noisy latents,
    4 mask channels and the first-frame latents (2 x 4 + 4 channels) and cross-attends to CLIP image tokens
    through added key/value projections; a CLIP vision encoder (patch 4 on 32 x 32 images) and its processor."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    folder = Path(folder)
    parts = _tiny_wan_parts("wan-i2v", text_hidden, latent_channels, seed)
    transformer = _tiny_wan_transformer(seed, 2 * latent_channels + 4, latent_channels, text_hidden, num_layers,
                                        num_attention_heads, attention_head_dim, image_dim=image_hidden)
    torch.manual_seed(seed)
    image_encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=image_hidden, projection_dim=image_hidden, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, intermediate_size=16, patch_size=4,
    )).eval()
    image_processor = CLIPImageProcessor(crop_size=32, size=32)
    pipeline = WanImageToVideoPipeline(
        transformer=transformer, image_encoder=image_encoder, image_processor=image_processor, **parts
    )
    return _save_tiny(pipeline, folder, "wan-i2v", seed)


TINY_WRITERS = {
    "ltx-video": write_tiny_ltx_video,
    "cogvideox": write_tiny_cogvideox,
    "cogvideox-i2v": write_tiny_cogvideox_i2v,
    "mochi": write_tiny_mochi,
    "hunyuan-video": write_tiny_hunyuan_video,
    "wan": write_tiny_wan,
    "wan-i2v": write_tiny_wan_i2v,
}

# A clip shape (frames, height, width) that each tiny model accepts; tests and the quickstart use it.
TINY_SHAPES: dict[str, tuple[int, int, int]] = {
    "ltx-video": (9, 32, 32),
    "cogvideox": (13, 32, 32),
    "cogvideox-i2v": (9, 32, 32),
    "mochi": (7, 32, 32),
    "hunyuan-video": (9, 32, 32),
    "wan": (9, 32, 32),
    "wan-i2v": (9, 32, 32),
}


def write_tiny_model(family: str, folder: str | Path, **kwargs: object) -> Path:
    """Write the tiny model of a family (see TINY_WRITERS) into `folder`."""
    if family not in TINY_WRITERS:
        raise KeyError(f"no tiny model for '{family}'; available: {', '.join(sorted(TINY_WRITERS))}")
    return TINY_WRITERS[family](folder, **kwargs)
