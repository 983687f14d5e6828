"""The tiny Kandinsky 5 models (text- and image-to-video): a Qwen2.5-VL with a chat tokenizer built in code, a CLIP
text model, the HunyuanVideo VAE and a two-block Kandinsky 5 transformer."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import regex
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from vidtune.models.kandinsky5 import PROMPT_TEMPLATE
from vidtune.models.tiny.common import (
    CORPUS,
    OverfitSettings,
    TinyFamily,
    calm_moments_posterior,
    reference_latents,
    save_tiny,
)
from vidtune.models.tiny.hunyuan_video import build_tiny_clip_tokenizer

SHAPE = (9, 32, 32)
# Image-to-video: the pipeline evens out its first four latent frames against the next ones after sampling, so the
# clip needs more than four latent frames.
I2V_SHAPE = (17, 32, 32)

_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tiny_kandinsky_qwen_tokenizer(vocab_size: int = 768) -> PreTrainedTokenizerFast:
    """A Qwen2-style byte-level BPE trained on the pipeline's prompt template, so each of its words is one token as
    with Qwen2.5-VL's tokenizer: the template before the caption is then 131 tokens, of which the pipeline crops the
    first 128 (`prompt_template_encode_start_idx`) and keeps the user turn's opening with the caption. Padded on the
    right with `<|endoftext|>`. The pipeline calls its tokenizer with text only, which a plain tokenizer takes as
    Qwen2VLProcessor does (the processor needs torchvision for its video half)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_QWEN_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    pieces = regex.split("|".join(regex.escape(token) for token in _QWEN_SPECIALS),
                         PROMPT_TEMPLATE.replace("{}", " "))
    tokenizer.train_from_iterator(pieces * 8 + CORPUS * 4, trainer=trainer)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   padding_side="right", model_max_length=32768)


def wake_modulations(transformer: torch.nn.Module, std: float = 0.1) -> None:
    """Random modulations: diffusers initialises them to zero (every block's gate closed, so nothing inside a block
    gets a gradient), where a trained model's are not."""
    with torch.no_grad():
        for name, module in transformer.named_modules():
            if name.endswith("modulation") and isinstance(getattr(module, "out_layer", None), torch.nn.Linear):
                module.out_layer.weight.normal_(0.0, std)
                module.out_layer.bias.normal_(0.0, std)


def write_tiny_kandinsky5(
    folder: str | Path,
    *,
    image_to_video: bool = False,
    num_visual_blocks: int = 2,
    num_text_blocks: int = 1,
    model_dim: int = 24,
    axes_dims: tuple[int, int, int] = (4, 4, 4),
    latent_channels: int = 4,
    text_hidden: int = 16,
    clip_hidden: int = 8,
    seed: int = 0,
) -> Path:
    """A tiny Kandinsky 5 with the real compression: the HunyuanVideo VAE (8x space, 4x time) and patch (1, 2, 2), so
    frames are 4k+1 and sides multiples of 16. Heads of sum(axes_dims) = 12 channels, two of them. A 2-layer
    Qwen2.5-VL (the pipeline keeps its last hidden state; its vision tower is one block, which captions never reach)
    and a CLIP text model (the pipeline keeps its pooled output). The VAE's `scaling_factor` makes its latents unit
    scale, as the real one (0.476986) does. The scheduler is flow-matching Euler with the Lite checkpoints' shift 5.
    The transformer takes [latents, condition latents, mask] (2C + 1 channels, `visual_cond`), as every released
    Kandinsky 5 video transformer does; `image_to_video` writes the image-to-video pipeline."""
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        Kandinsky5I2VPipeline,
        Kandinsky5T2VPipeline,
        Kandinsky5Transformer3DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    frames, size, _ = I2V_SHAPE if image_to_video else SHAPE
    tokenizer, tokenizer_2 = build_tiny_kandinsky_qwen_tokenizer(), build_tiny_clip_tokenizer()
    torch.manual_seed(seed)
    transformer = Kandinsky5Transformer3DModel(
        in_visual_dim=latent_channels, out_visual_dim=latent_channels, in_text_dim=text_hidden,
        in_text_dim2=clip_hidden, time_dim=16, patch_size=(1, 2, 2), model_dim=model_dim, ff_dim=2 * model_dim,
        num_text_blocks=num_text_blocks, num_visual_blocks=num_visual_blocks, axes_dims=axes_dims,
        visual_cond=True,
    )
    wake_modulations(transformer)
    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4, up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8), layers_per_block=1, act_fn="silu", norm_num_groups=4,
        scaling_factor=0.476986, spatial_compression_ratio=8, temporal_compression_ratio=4,
        mid_block_add_attention=True,
    )
    calm_moments_posterior(vae.quant_conv, latent_channels)
    vae.register_to_config(scaling_factor=1.0 / float(reference_latents(vae, frames, size).std()))
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": text_hidden, "intermediate_size": 2 * text_hidden,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "rope_theta": 1000000.0,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={"depth": 1, "hidden_size": 8, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": text_hidden, "patch_size": 4, "spatial_merge_size": 1,
                       "temporal_patch_size": 1, "fullatt_block_indexes": [0]},
    )).eval()
    torch.manual_seed(seed)
    text_encoder_2 = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer_2), hidden_size=clip_hidden, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, hidden_act="gelu", projection_dim=32, bos_token_id=tokenizer_2.bos_token_id,
        eos_token_id=tokenizer_2.eos_token_id, pad_token_id=tokenizer_2.pad_token_id,
    )).eval()
    parts = {
        "transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
        "text_encoder_2": text_encoder_2, "tokenizer_2": tokenizer_2,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0),
    }
    if image_to_video:
        return save_tiny(Kandinsky5I2VPipeline(**parts), folder, "kandinsky-5-i2v", seed)
    return save_tiny(Kandinsky5T2VPipeline(**parts), folder, "kandinsky-5", seed)


TINY = {
    # Sampled 0.081 away (750 steps of eight at 3e-3: 0.245).
    "kandinsky-5": TinyFamily(write_tiny_kandinsky5, SHAPE,
                              OverfitSettings(steps=750, learning_rate=6e-3, batch_size=8)),
    "kandinsky-5-i2v": TinyFamily(partial(write_tiny_kandinsky5, image_to_video=True), I2V_SHAPE,
                                  OverfitSettings(steps=2000, learning_rate=3e-3)),
}
