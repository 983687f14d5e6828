"""The tiny Cosmos Predict 2.5 model (one checkpoint for text-, image- and video-to-world): a two-layer Qwen2.5-VL with
a chat tokenizer built in code, Wan 2.1's tiny VAE and a two-block Cosmos transformer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vidtune.models.tiny.common import OverfitSettings, TinyFamily, save_tiny
from vidtune.models.tiny.kandinsky5 import build_tiny_kandinsky_qwen_tokenizer
from vidtune.models.tiny.wan import tiny_wan_vae

SHAPE = (9, 32, 32)
# Qwen2.5-VL's chat layout for text turns (the real template also renders images and tools, which captions never use).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_cosmos_predict25(
    folder: str | Path,
    *,
    num_layers: int = 2,
    attention_head_dim: int = 16,
    num_attention_heads: int = 2,
    text_hidden: int = 16,
    text_layers: int = 2,
    latent_channels: int = 4,
    seed: int = 0,
) -> Path:
    """A tiny Cosmos Predict 2.5 with the released layout: Wan 2.1's tiny VAE (ratios 8 and 4, its latent statistics
    in the VAE config), patch (1, 2, 2), so frames are 4k+1 and sides multiples of 16; the transformer takes the
    latents and the condition-mask channel (in_channels = C + 1) and projects the concatenated hidden states of every
    Qwen layer (`crossattn_proj`, text_layers x text_hidden wide) to its cross-attention width; no learnable
    positional embedding (the released models' `extra_pos_embed_type` None). The scheduler is the converter's:
    UniPC with flow prediction, flow sigmas and Karras sigmas between 0.01 and 200 (diffusers'
    scripts/convert_cosmos_to_diffusers.py)."""
    from diffusers import Cosmos2_5_PredictBasePipeline, CosmosTransformer3DModel, UniPCMultistepScheduler
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    frames, size, _ = SHAPE
    tokenizer = build_tiny_kandinsky_qwen_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    vae = tiny_wan_vae(latent_channels, frames, size, seed, base_dim=3)
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": text_hidden, "intermediate_size": 2 * text_hidden,
            "num_hidden_layers": text_layers, "num_attention_heads": 2, "num_key_value_heads": 2,
            "rope_theta": 1000000.0, "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default",
                                                      "type": "default"},
            "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={"depth": 1, "hidden_size": 8, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": text_hidden, "patch_size": 4, "spatial_merge_size": 1,
                       "temporal_patch_size": 1, "fullatt_block_indexes": [0]},
    )).eval()
    torch.manual_seed(seed)
    width = num_attention_heads * attention_head_dim
    transformer = CosmosTransformer3DModel(
        in_channels=latent_channels + 1, out_channels=latent_channels, num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim, num_layers=num_layers, mlp_ratio=2.0, text_embed_dim=width,
        adaln_lora_dim=8, patch_size=(1, 2, 2), rope_scale=(1.0, 3.0, 3.0), concat_padding_mask=True,
        extra_pos_embed_type=None, use_crossattn_projection=True, crossattn_proj_in_channels=text_layers * text_hidden,
        encoder_hidden_states_channels=width,
    )
    scheduler = UniPCMultistepScheduler(use_karras_sigmas=True, use_flow_sigmas=True,
                                        prediction_type="flow_prediction", sigma_max=200.0, sigma_min=0.01)
    pipeline = Cosmos2_5_PredictBasePipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                                             vae=vae, scheduler=scheduler, safety_checker=_no_checker)
    return save_tiny(pipeline, folder, "cosmos-predict-2.5", seed)


def _no_checker(*args: Any, **kwargs: Any) -> None:
    """Saved as no component (the converter saves its pipelines so): the guardrail is NVIDIA's separate package."""
    return None


TINY = {
    # Sampled 0.097 away (750 steps of eight at 3e-3: 0.173).
    "cosmos-predict-2.5": TinyFamily(write_tiny_cosmos_predict25, SHAPE,
                                     OverfitSettings(steps=750, learning_rate=6e-3, batch_size=8)),
    # Sampled 0.088 away (untrained: 0.92).
    "cosmos-predict-2.5-v2w": TinyFamily(write_tiny_cosmos_predict25, SHAPE,
                                         OverfitSettings(steps=500, learning_rate=3e-3, batch_size=8)),
}
