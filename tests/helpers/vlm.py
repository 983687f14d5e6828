"""A tiny random Qwen2.5-VL saved as a model folder (weights, tokenizer with its chat template, preprocessor
config), built in code for the captioning tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from vidtune.models.tiny.common import CORPUS

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
# The shape of Qwen2.5-VL's own template: a user turn holding the media's placeholder and the text.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_tiny_qwen25_vl(folder: Path, seed: int = 0) -> Path:
    """Save a seeded tiny Qwen2.5-VL (two layers each side, 14-pixel patches) with its tokenizer and preprocessor
    config in `folder`, as a hub download holds them."""
    tokenizer = tiny_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
                     "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
                     "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": 32,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                       "fullatt_block_indexes": [1]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    preprocessor = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "temporal_patch_size": 2,
                    "merge_size": 2, "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64,
                    "image_mean": [0.48145466, 0.4578275, 0.40821073],
                    "image_std": [0.26862954, 0.26130258, 0.27577711]}
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    return folder


def write_tiny_qwen3_vl(folder: Path, seed: int = 0) -> Path:
    """Save a seeded tiny Qwen3-VL (16-pixel patches, timestamps in the prompt) as `write_tiny_qwen25_vl` does."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = tiny_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = Qwen3VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                     "max_position_embeddings": 2048,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                         "mrope_interleaved": True},
                     "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": 32,
                       "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "num_position_embeddings": 64, "deepstack_visual_indexes": [1]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    Qwen3VLForConditionalGeneration(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    preprocessor = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "size": {"shortest_edge": 64 * 64,
                    "longest_edge": 32 * 32 * 64}, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    (folder / "video_preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    return folder
