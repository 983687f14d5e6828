"""The tiny MiniMax H3 model: a Qwen3-VL built in code (51 text layers of width 16, as the pipeline reads
`hidden_states[50]`, with a one-block vision tower for keyframes), a byte-level tokenizer with Qwen3-VL's vision
tokens and Qwen3-VL's image processor, the video VAE (its real 16x spatial and 17-frame chunk geometry, few
channels), the mono audio VAE (40 latents per second, as the pipeline counts them, at 8 kHz), a two-block
transformer and the two schedulers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import diffusers
import torch
from diffusers import (
    AutoencoderKLMiniMaxH3,
    AutoencoderKLMiniMaxH3Audio,
    MiniMaxH3Scheduler,
    MiniMaxH3Transformer3DModel,
)
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2VLImageProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from vidtune.models.minimax_h3 import PIXEL_MEAN, PIXEL_STD
from vidtune.models.tiny.common import (
    TINY_VOCAB_SIZE,
    OverfitSettings,
    TinyFamily,
    build_tiny_tokenizer,
    calm_moments_posterior,
    latent_statistics,
    reference_videos,
)

# 22 frames (17 + 5): one VAE chunk, 7 latent frames of 2x4 and 37 audio latents per channel. Two patch columns: the
# sound's two channels sit at the width grid's two ends, and on one column they would share every rotary position.
SHAPE = (22, 32, 64)
TEXT_DIM = 16
# Qwen3-VL's vision tokens, which a keyframe's caption block is made of, appended to the byte-level vocabulary (ids
# 384 to 387) and named in the text encoder's config.
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
AUDIO_RATE = 8000  # hop 200 (2 * 4 * 5 * 5): 40 latents per second, at a rate AAC takes (mp4 sound tracks)


def build_tiny_qwen3_vl(seed: int = 0) -> Qwen3VLForConditionalGeneration:
    """Qwen3-VL with 51 narrow text layers (the pipeline reads the 50th hidden state) and a one-block vision tower."""
    torch.manual_seed(seed)
    config = Qwen3VLConfig(
        text_config={"vocab_size": TINY_VOCAB_SIZE, "hidden_size": TEXT_DIM, "intermediate_size": 32,
                     "num_hidden_layers": 51, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                     "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True},
                     "pad_token_id": 0},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                       "out_hidden_size": TEXT_DIM, "patch_size": 4, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "num_position_embeddings": 16, "deepstack_visual_indexes": []},
        vision_start_token_id=TINY_VOCAB_SIZE, image_token_id=TINY_VOCAB_SIZE + 1,
        vision_end_token_id=TINY_VOCAB_SIZE + 2, video_token_id=TINY_VOCAB_SIZE + 3,
    )
    model = Qwen3VLForConditionalGeneration(config).eval()
    # Rows for the vision tokens, added after every other weight is drawn (the text rows stay the seed's).
    model.resize_token_embeddings(TINY_VOCAB_SIZE + len(VISION_TOKENS), mean_resizing=False)
    return model


def build_tiny_keyframe_processor() -> Qwen2VLImageProcessor:
    """Qwen3-VL's image processor at the tiny vision tower's patch (4), merge (2) and temporal patch (2): a keyframe
    of the tiny canvas (32 x 64) becomes 8 x 16 patches, 32 vision tokens."""
    return Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16,
                                 max_pixels=64 * 128)


def build_tiny_qwen_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer with Qwen3-VL's vision tokens."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    return tokenizer


def tone_waveforms(seconds: float, rate: int = AUDIO_RATE) -> torch.Tensor:
    """A few stereo tones [B, 2, samples] to measure the tiny audio VAE's latent statistics on."""
    time = torch.arange(int(seconds * rate)) / rate
    tones = [torch.stack([0.5 * torch.sin(2 * math.pi * hz * time), 0.3 * torch.sin(2 * math.pi * hz * 1.5 * time)])
             for hz in (110.0, 220.0, 330.0, 440.0)]
    return torch.stack(tones)


def write_tiny_minimax_h3(folder: str | Path, *, latent_channels: int = 4, audio_channels: int = 4,
                          seed: int = 0) -> Path:
    folder = Path(folder)
    torch.manual_seed(seed)
    transformer = MiniMaxH3Transformer3DModel(
        num_attention_heads=2, attention_head_dim=32, hidden_size=64, num_layers=2, num_refiner_layers=1, ffn_dim=128,
        in_channels=latent_channels, audio_in_channels=audio_channels, patch_size=(1, 2, 2), text_dim=TEXT_DIM,
        freq_dim=32, time_embed_hidden_dim=64, time_embed_dim=32, rope_freq_dim=4)
    vae = AutoencoderKLMiniMaxH3(
        latent_channels=latent_channels, block_out_channels=(8, 8, 8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
        decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
        decoder_num_register_tokens=1, decoder_ffn_mult=2)
    calm_moments_posterior(vae.quant_conv, latent_channels)
    audio_vae = AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4, encoder_rates=(2, 4, 5, 5), latent_dim=16, latent_channels=audio_channels, num_attention_heads=2,
        decoder_dim=16, decoder_rates=(5, 5, 4, 2), decoder_kernel_sizes=(9, 9, 8, 4), resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),), sampling_rate=AUDIO_RATE)
    with torch.no_grad():  # a narrow audio posterior, as a trained one (the head predicts the log std)
        audio_vae.logs_proj.weight.zero_()
        audio_vae.logs_proj.bias.fill_(-6.0)
        pixels = ((reference_videos(SHAPE[0], SHAPE[1]) + 1.0) / 2.0 - torch.tensor(PIXEL_MEAN).view(1, 1, 3, 1, 1)) \
            / torch.tensor(PIXEL_STD).view(1, 1, 3, 1, 1)
        mean, std = latent_statistics(vae.encode(pixels.permute(0, 2, 1, 3, 4)).latent_dist.mean)
        vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
        tones = tone_waveforms(SHAPE[0] / 24.0)
        audio = audio_vae.encode(tones.reshape(-1, 1, tones.shape[-1])).latent_dist.mode()
        audio_mean, audio_std = audio.mean(dim=(0, 2)), audio.std(dim=(0, 2)).clamp_min(1e-4)
        audio_vae.register_to_config(latents_mean=audio_mean.tolist(), latents_std=audio_std.tolist())
    components = {
        "transformer": transformer, "vae": vae, "audio_vae": audio_vae, "text_encoder": build_tiny_qwen3_vl(seed),
        "tokenizer": build_tiny_qwen_tokenizer(), "processor": build_tiny_keyframe_processor(),
        "scheduler": MiniMaxH3Scheduler(shift=12.0), "audio_scheduler": MiniMaxH3Scheduler(shift=3.0),
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, component in components.items():
        component.save_pretrained(folder / name)
    # The released index names Qwen3VLProcessor, whose video half needs torchvision; the tiny folder holds its image
    # processor only, which the keyframe caption reads from `processor/`.
    write_modular_index(folder, {name: value for name, value in components.items() if name != "processor"})
    (folder / "vidtune_tiny.json").write_text(json.dumps({"family": "minimax-h3", "seed": seed}) + "\n")
    return folder


def write_modular_index(folder: Path, components: dict[str, object]) -> None:
    """`modular_model_index.json`, as the released repository holds it: the modular pipeline's class and, per
    component, where `ModularPipeline.from_pretrained(...).load_components()` reads it (this folder's subfolder)."""
    index: dict[str, object] = {"_class_name": "MiniMaxH3ModularPipeline", "_blocks_class_name": "MiniMaxH3Blocks",
                                "_diffusers_version": diffusers.__version__}
    for name, component in components.items():
        library = type(component).__module__.split(".")[0]
        hint = [library, type(component).__name__]
        index[name] = [*hint, {"pretrained_model_name_or_path": str(folder.absolute()), "revision": None,
                               "subfolder": name, "type_hint": hint, "variant": None}]
    (folder / "modular_model_index.json").write_text(json.dumps(index, indent=2) + "\n")


TINY = {
    "minimax-h3": TinyFamily(write_tiny_minimax_h3, SHAPE,
                             OverfitSettings(steps=600, learning_rate=1e-2, audio_bound=0.15)),
}
