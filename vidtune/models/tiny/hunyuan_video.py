"""The tiny HunyuanVideo model, with Llama-3-style and CLIP-style tokenizers built in code."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from vidtune.models.tiny.common import (
    CORPUS,
    OverfitSettings,
    TinyFamily,
    calm_moments_posterior,
    reference_latents,
    save_tiny,
)

SHAPE = (9, 32, 32)

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
    tokenizer.train_from_iterator(template * 8 + CORPUS * 4, trainer=trainer)
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
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
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

    frames, size, _ = SHAPE
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
    vae.register_to_config(scaling_factor=1.0 / float(reference_latents(vae, frames, size).std()))
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
    return save_tiny(pipeline, folder, "hunyuan-video", seed)


# Sampled 0.075 away (800 steps of four visits: 0.054).
TINY = {"hunyuan-video": TinyFamily(write_tiny_hunyuan_video, SHAPE,
                                    OverfitSettings(steps=400, learning_rate=5e-3, batch_size=8))}
