"""The tiny HunyuanVideo 1.5 models (text- and image-to-video), with a Qwen-style chat tokenizer built in code."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from vidtune.models.hunyuan_video15 import CROP_START, SYSTEM_MESSAGE
from vidtune.models.tiny.common import (
    CORPUS,
    OverfitSettings,
    TinyFamily,
    calm_moments_posterior,
    reference_latents,
    save_tiny,
)

# 32 x 32 is the tiny transformer's `target_size` bucket for square images, so image-to-video samples at it.
SHAPE = (9, 32, 32)

_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's chat template for plain-text messages: what HunyuanVideo15Pipeline's `apply_chat_template` call renders.
_QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_qwen_tokenizer(vocab_size: int = 768) -> PreTrainedTokenizerFast:
    """A Qwen2-style byte-level BPE with its chat template, `<|endoftext|>` padding on the right (the pipeline crops
    the template from the left and reads the mask as a prefix). Trained on the pipeline's system message too, so the
    template before the caption is exactly the `crop_start` (108) tokens the pipeline crops, as with Qwen2.5-VL's
    tokenizer: the kept tokens start at the caption."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_QWEN_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([SYSTEM_MESSAGE] * 8 + CORPUS * 4, trainer=trainer)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   padding_side="right", chat_template=_QWEN_CHAT_TEMPLATE, model_max_length=32768)
    messages = [{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": "{}"}]
    prefix = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=False).split("{}")[0]
    if len(fast(prefix).input_ids) != CROP_START:
        raise RuntimeError("the tiny Qwen tokenizer does not split the HunyuanVideo 1.5 template like Qwen2.5-VL")
    return fast


def write_tiny_hunyuan_video15(
    folder: str | Path,
    *,
    image_to_video: bool = False,
    num_layers: int = 2,
    attention_head_dim: int = 12,
    num_attention_heads: int = 2,
    latent_channels: int = 4,
    image_hidden: int = 8,
    seed: int = 0,
) -> Path:
    """A tiny HunyuanVideo 1.5 in the spirit of diffusers' HunyuanVideo 1.5 tests, but with the real compression:
    VAE ratios 16 (space, four downsampling blocks) and 4 (time), patch 1, so frames are 4k+1 and sides multiples
    of 16. A 3-layer Qwen2.5-VL text model (the pipeline keeps hidden_states[-3]), a T5 encoder over ByT5's bytes,
    the scheduler shift (5) and guider (6) of the published 480p checkpoints. `image_to_video` adds a SigLIP vision
    encoder (patch 4 on 32 x 32 images) and its processor. The VAE's `scaling_factor` makes latents unit scale."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15ImageToVideoPipeline,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        SiglipImageProcessor,
        SiglipVisionConfig,
        SiglipVisionModel,
        T5Config,
        T5EncoderModel,
    )

    frames, size, _ = SHAPE
    tokenizer, tokenizer_2 = build_tiny_qwen_tokenizer(), ByT5Tokenizer()
    torch.manual_seed(seed)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * latent_channels + 1,
        out_channels=latent_channels,
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        num_layers=num_layers,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=16,
        text_embed_2_dim=32,
        image_embed_dim=image_hidden,
        rope_axes_dim=(4, 4, 4),
        target_size=size,
        task_type="i2v" if image_to_video else "t2v",
    )
    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8, 8, 8, 8),
        layers_per_block=1, spatial_compression_ratio=16, temporal_compression_ratio=4,
        downsample_match_channel=False, upsample_match_channel=False,
    )
    calm_moments_posterior(vae.encoder.conv_out.conv, latent_channels)
    vae.enable_slicing()  # diffusers 0.42's VAE attention takes one clip at a time (see HunyuanVideo15Spec.load_vae)
    vae.register_to_config(scaling_factor=1.0 / float(reference_latents(vae, frames, size).std()))
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, rope_theta=1000000.0,
        rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )).eval()
    torch.manual_seed(seed)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=tokenizer_2.pad_token_id, eos_token_id=tokenizer_2.eos_token_id,
    )).eval()
    parts = {
        "text_encoder": text_encoder, "tokenizer": tokenizer, "transformer": transformer, "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0), "text_encoder_2": text_encoder_2,
        "tokenizer_2": tokenizer_2, "guider": ClassifierFreeGuidance(guidance_scale=6.0),
    }
    if not image_to_video:
        return save_tiny(HunyuanVideo15Pipeline(**parts), folder, "hunyuan-video-1.5", seed)
    torch.manual_seed(seed)
    image_encoder = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=image_hidden, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        patch_size=4,
    )).eval()
    feature_extractor = SiglipImageProcessor(size={"height": 32, "width": 32})
    pipeline = HunyuanVideo15ImageToVideoPipeline(image_encoder=image_encoder, feature_extractor=feature_extractor,
                                                  **parts)
    return save_tiny(pipeline, folder, "hunyuan-video-1.5-i2v", seed)


TINY = {
    # Sampled 0.095 away (250 steps of four: 0.157).
    "hunyuan-video-1.5": TinyFamily(write_tiny_hunyuan_video15, SHAPE,
                                    OverfitSettings(steps=250, learning_rate=4e-3, batch_size=8)),
    "hunyuan-video-1.5-i2v": TinyFamily(partial(write_tiny_hunyuan_video15, image_to_video=True), SHAPE,
                                        OverfitSettings(steps=400, learning_rate=5e-3)),
}
