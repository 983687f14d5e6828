"""The ComfyUI LoRA rules HunyuanVideo 1.0 and 1.5 share: ComfyUI runs both with one model class, so their
diffusers modules map to the same names (see vidtune/export/comfyui_models.py, `hunyuan_video`).

Targets are the names ComfyUI's HunyuanVideo key map reads: the original checkpoint's where ComfyUI translates them
(fused `img_attn_qkv`, `img_mlp.fc1`, `img_mod.linear`), ComfyUI's own for the MLP embedders, which it does not
translate (`time_in.in_layer`, not the checkpoint's `time_in.mlp.0`).
"""

from __future__ import annotations

from vidtune.export.comfyui import Rule, fused

DOUBLE = r"transformer_blocks\.(\d+)"
REFINER = r"context_embedder\.token_refiner\.refiner_blocks\.(\d+)"
REFINED = r"txt_in.individual_token_refiner.blocks.\1"


def embedder(source: str, target: str) -> list[Rule]:
    """A diffusers two-layer embedder (`linear_1`, `linear_2`) as ComfyUI's MLPEmbedder (`in_layer`, `out_layer`)."""
    return [Rule(rf"{source}\.linear_1", f"{target}.in_layer"), Rule(rf"{source}\.linear_2", f"{target}.out_layer")]


def shared_rules(hidden: int, timestep_embedder: str) -> list[Rule]:
    """The double blocks (q, k, v fused per stream), the text refiner `txt_in`, the timestep embedding `time_in`
    (diffusers' `timestep_embedder`, which 1.0 and 1.5 place differently) and the final layer; `hidden` is the
    transformer's width (heads x head size)."""
    return [
        *fused([rf"{DOUBLE}\.attn\.to_{x}" for x in "qkv"], r"double_blocks.\1.img_attn_qkv", [hidden] * 3),
        *fused([rf"{DOUBLE}\.attn\.add_{x}_proj" for x in "qkv"], r"double_blocks.\1.txt_attn_qkv", [hidden] * 3),
        Rule(rf"{DOUBLE}\.attn\.to_out\.0", r"double_blocks.\1.img_attn_proj"),
        Rule(rf"{DOUBLE}\.attn\.to_add_out", r"double_blocks.\1.txt_attn_proj"),
        Rule(rf"{DOUBLE}\.ff\.net\.0\.proj", r"double_blocks.\1.img_mlp.fc1"),
        Rule(rf"{DOUBLE}\.ff\.net\.2", r"double_blocks.\1.img_mlp.fc2"),
        Rule(rf"{DOUBLE}\.ff_context\.net\.0\.proj", r"double_blocks.\1.txt_mlp.fc1"),
        Rule(rf"{DOUBLE}\.ff_context\.net\.2", r"double_blocks.\1.txt_mlp.fc2"),
        Rule(rf"{DOUBLE}\.norm1\.linear", r"double_blocks.\1.img_mod.linear"),
        Rule(rf"{DOUBLE}\.norm1_context\.linear", r"double_blocks.\1.txt_mod.linear"),
        *fused([rf"{REFINER}\.attn\.to_{x}" for x in "qkv"], rf"{REFINED}.self_attn_qkv", [hidden] * 3),
        Rule(rf"{REFINER}\.attn\.to_out\.0", rf"{REFINED}.self_attn_proj"),
        Rule(rf"{REFINER}\.ff\.net\.0\.proj", rf"{REFINED}.mlp.fc1"),
        Rule(rf"{REFINER}\.ff\.net\.2", rf"{REFINED}.mlp.fc2"),
        Rule(rf"{REFINER}\.norm_out\.linear", rf"{REFINED}.adaLN_modulation.1"),
        Rule(r"context_embedder\.proj_in", "txt_in.input_embedder"),
        *embedder(r"context_embedder\.time_text_embed\.timestep_embedder", "txt_in.t_embedder"),
        *embedder(r"context_embedder\.time_text_embed\.text_embedder", "txt_in.c_embedder"),
        *embedder(timestep_embedder, "time_in"),
        Rule(r"proj_out", "final_layer.linear"),
        # The original modulation gives (shift, scale), diffusers' AdaLayerNormContinuous (scale, shift).
        Rule(r"norm_out\.linear", "final_layer.adaLN_modulation.1", swap_halves=True),
    ]
