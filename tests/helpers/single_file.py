"""A tiny model's transformer written as one file in its family's original layout: the inverse of diffusers'
single-file converter (diffusers/loaders/single_file_utils.py), checked by converting it back with that converter
(`write_original_layout` refuses a file that would not load back into the same state dict)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

Tensors = dict[str, torch.Tensor]
COMFYUI_PREFIX = "model.diffusion_model."


def _renamed(state: Tensors, renames: list[tuple[str, str]]) -> Tensors:
    out = {}
    for key, tensor in state.items():
        for pattern, replacement in renames:
            key = re.sub(pattern, replacement, key)
        out[key] = tensor
    return out


# diffusers name -> original name, applied in order (the converter's renames, reversed).
LTX_VIDEO = [(r"proj_in", "patchify_proj"), (r"^time_embed\.", "adaln_single."), (r"norm_q", "q_norm"),
             (r"norm_k", "k_norm")]
LTX_2 = [(r"av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
         (r"av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
         (r"av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
         (r"av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
         (r"video_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_video"),
         (r"audio_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_audio"),
         (r"norm_q", "q_norm"), (r"norm_k", "k_norm"), (r"proj_in", "patchify_proj"),
         (r"^time_embed\.", "adaln_single."), (r"^audio_time_embed\.", "audio_adaln_single.")]
WAN = [(r"condition_embedder\.time_embedder\.linear_1", "time_embedding.0"),
       (r"condition_embedder\.time_embedder\.linear_2", "time_embedding.2"),
       (r"condition_embedder\.text_embedder\.linear_1", "text_embedding.0"),
       (r"condition_embedder\.text_embedder\.linear_2", "text_embedding.2"),
       (r"condition_embedder\.time_proj", "time_projection.1"),
       (r"condition_embedder\.image_embedder\.norm1", "img_emb.proj.0"),
       (r"condition_embedder\.image_embedder\.ff\.net\.0\.proj", "img_emb.proj.1"),
       (r"condition_embedder\.image_embedder\.ff\.net\.2", "img_emb.proj.3"),
       (r"condition_embedder\.image_embedder\.norm2", "img_emb.proj.4"),
       (r"\.attn2\.", ".cross_attn."), (r"\.attn1\.", ".self_attn."), (r"\.to_out\.0\.", ".o."),
       (r"\.to_q\.", ".q."), (r"\.to_k\.", ".k."), (r"\.to_v\.", ".v."), (r"\.add_k_proj\.", ".k_img."),
       (r"\.add_v_proj\.", ".v_img."), (r"\.norm_added_k\.", ".norm_k_img."),
       (r"^scale_shift_table$", "head.modulation"), (r"\.scale_shift_table$", ".modulation"),
       (r"^proj_out\.", "head.head."), (r"ffn\.net\.0\.proj", "ffn.0"), (r"ffn\.net\.2", "ffn.2"),
       (r"\.norm2\.", ".norm3.")]

HUNYUAN_VIDEO = [
    (r"^context_embedder\.token_refiner\.refiner_blocks\.", "txt_in.individual_token_refiner.blocks."),
    (r"^context_embedder\.time_text_embed\.timestep_embedder\.linear_1", "txt_in.t_embedder.mlp.0"),
    (r"^context_embedder\.time_text_embed\.timestep_embedder\.linear_2", "txt_in.t_embedder.mlp.2"),
    (r"^context_embedder\.time_text_embed\.text_embedder", "txt_in.c_embedder"),
    (r"^context_embedder\.proj_in", "txt_in.input_embedder"),
    (r"(txt_in\.individual_token_refiner\.blocks\.\d+)\.attn\.to_out\.0", r"\1.self_attn_proj"),
    (r"(txt_in\.individual_token_refiner\.blocks\.\d+)\.ff\.net\.0\.proj", r"\1.mlp.fc1"),
    (r"(txt_in\.individual_token_refiner\.blocks\.\d+)\.ff\.net\.2", r"\1.mlp.fc2"),
    (r"(txt_in\.individual_token_refiner\.blocks\.\d+)\.norm_out\.linear", r"\1.adaLN_modulation.1"),
    (r"^x_embedder", "img_in"),
    (r"^time_text_embed\.timestep_embedder\.linear_1", "time_in.mlp.0"),
    (r"^time_text_embed\.timestep_embedder\.linear_2", "time_in.mlp.2"),
    (r"^time_text_embed\.guidance_embedder\.linear_1", "guidance_in.mlp.0"),
    (r"^time_text_embed\.guidance_embedder\.linear_2", "guidance_in.mlp.2"),
    (r"^time_text_embed\.text_embedder\.linear_1", "vector_in.in_layer"),
    (r"^time_text_embed\.text_embedder\.linear_2", "vector_in.out_layer"),
    (r"^transformer_blocks\.", "double_blocks."),
    (r"\.attn\.norm_q", ".img_attn_q_norm"), (r"\.attn\.norm_k", ".img_attn_k_norm"),
    (r"\.attn\.to_out\.0", ".img_attn_proj"), (r"\.attn\.norm_added_q", ".txt_attn_q_norm"),
    (r"\.attn\.norm_added_k", ".txt_attn_k_norm"), (r"\.attn\.to_add_out", ".txt_attn_proj"),
    (r"\.norm1_context\.linear", ".txt_mod.linear"), (r"(double_blocks\.\d+)\.norm1\.linear", r"\1.img_mod.linear"),
    (r"\.ff_context\.net\.0\.proj", ".txt_mlp.fc1"), (r"\.ff_context\.net\.2", ".txt_mlp.fc2"),
    (r"(double_blocks\.\d+)\.ff\.net\.0\.proj", r"\1.img_mlp.fc1"),
    (r"(double_blocks\.\d+)\.ff\.net\.2", r"\1.img_mlp.fc2"),
    (r"^norm_out\.linear", "final_layer.adaLN_modulation.1"), (r"^proj_out", "final_layer.linear"),
]

RENAMES: dict[str, list[tuple[str, str]]] = {"ltx-video": LTX_VIDEO, "ltx-2": LTX_2, "wan": WAN,
                                             "hunyuan-video": HUNYUAN_VIDEO}


def _fused(state: Tensors, parts: tuple[str, str, str], fused: str) -> Tensors:
    """q, k and v projections (keys ending in `parts`) concatenated into one `fused` projection, as the original
    HunyuanVideo holds them."""
    out = dict(state)
    for key in [key for key in state if parts[0] in key]:
        names = [key.replace(parts[0], part) for part in parts]
        out[key.replace(parts[0], fused)] = torch.cat([out.pop(name) for name in names])
    return out


def _hunyuan_unfused(state: Tensors) -> Tensors:
    """HunyuanVideo's original tensors that the diffusers layout splits or reorders: the fused qkv projections of
    the double blocks and the token refiner, and the final modulation's (scale, shift) halves as (shift, scale)."""
    out = _fused(state, (".attn.to_q.", ".attn.to_k.", ".attn.to_v."), ".attn.QKV.")
    out = _fused(out, (".attn.add_q_proj.", ".attn.add_k_proj.", ".attn.add_v_proj."), ".attn.ADDED_QKV.")
    for key in [key for key in out if ".attn.QKV." in key or ".attn.ADDED_QKV." in key]:
        refiner = key.startswith("context_embedder.")
        name = ".self_attn_qkv." if refiner else (".img_attn_qkv." if ".QKV." in key else ".txt_attn_qkv.")
        out[key.replace(".attn.QKV.", name).replace(".attn.ADDED_QKV.", name)] = out.pop(key)
    for key in ("norm_out.linear.weight", "norm_out.linear.bias"):
        scale, shift = out[key].chunk(2, dim=0)
        out[key] = torch.cat([shift, scale], dim=0)
    return out


MOCHI = [(r"^patch_embed\.proj", "x_embedder.proj"),
         (r"^time_embed\.timestep_embedder\.linear_1", "t_embedder.mlp.0"),
         (r"^time_embed\.timestep_embedder\.linear_2", "t_embedder.mlp.2"),
         (r"^time_embed\.pooler\.", "t5_y_embedder."), (r"^time_embed\.caption_proj", "t5_yproj"),
         (r"^transformer_blocks\.", "blocks."), (r"\.norm1\.linear\.", ".mod_x."),
         (r"\.norm1_context\.linear(_1)?\.", ".mod_y."), (r"\.attn1\.norm_q\.", ".attn.q_norm_x."),
         (r"\.attn1\.norm_k\.", ".attn.k_norm_x."), (r"\.attn1\.to_out\.0\.", ".attn.proj_x."),
         (r"\.attn1\.norm_added_q\.", ".attn.q_norm_y."), (r"\.attn1\.norm_added_k\.", ".attn.k_norm_y."),
         (r"\.attn1\.to_add_out\.", ".attn.proj_y."), (r"\.ff\.net\.0\.proj\.", ".mlp_x.w1."),
         (r"\.ff\.net\.2\.", ".mlp_x.w2."), (r"\.ff_context\.net\.0\.proj\.", ".mlp_y.w1."),
         (r"\.ff_context\.net\.2\.", ".mlp_y.w2."), (r"^norm_out\.linear", "final_layer.mod"),
         (r"^proj_out", "final_layer.linear")]
RENAMES["mochi"] = MOCHI
# Image-to-video and newer models of a family share its denoiser class and converter.
RENAMES.update({"ltx-video-i2v": LTX_VIDEO, "ltx-2-i2v": LTX_2, "wan-i2v": WAN, "wan2.2": WAN, "wan2.2-i2v": WAN})
# Wan VACE: Wan's names, and the VACE blocks' input / output projections as the original checkpoint names them.
RENAMES["wan-vace"] = [(r"^(vace_blocks\.\d+)\.proj_in\.", r"\1.before_proj."),
                       (r"^(vace_blocks\.\d+)\.proj_out\.", r"\1.after_proj."), *WAN]
# SkyReels V2 keeps Wan 2.1's original names: diffusers reads its files with the Wan converter.
RENAMES.update({"skyreels-v2": WAN, "skyreels-v2-i2v": WAN, "skyreels-v2-df": WAN})


def _swapped_halves(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def _mochi_unfused(state: Tensors) -> Tensors:
    """Mochi's original tensors that the diffusers layout splits or reorders: fused qkv projections, the feed
    forwards' (gate, projection) halves and the final modulation's (shift, scale) halves."""
    out = _fused(state, (".attn1.to_q.", ".attn1.to_k.", ".attn1.to_v."), ".attn.qkv_x.")
    out = _fused(out, (".attn1.add_q_proj.", ".attn1.add_k_proj.", ".attn1.add_v_proj."), ".attn.qkv_y.")
    for key in [key for key in out if ".net.0.proj." in key or key.startswith("norm_out.linear.")]:
        out[key] = _swapped_halves(out[key])
    return out


# MiniMax H3: MiniMax's names, which ComfyUI's files keep (the converter's renames, reversed).
MINIMAX_H3 = [(r"^transformer_blocks\.", "blocks."), (r"^token_refiner\.refiner_blocks\.", "token_refiner.blocks."),
              (r"^time_embedder\.linear_1\.", "time_embedder.proj_in."),
              (r"^time_embedder\.linear_2\.", "time_embedder.proj_out."), (r"^proj_in\.", "video_patch_proj."),
              (r"^audio_proj_in\.", "audio_patch_proj."), (r"^context_embedder\.", "condition_proj."),
              (r"^norm_out\.norm\.", "final_layer.norm."), (r"^norm_out\.linear\.", "final_layer.adaln_proj.linear."),
              (r"^proj_out\.", "final_layer.video_out."), (r"^audio_proj_out\.", "final_layer.audio_out."),
              (r"\.attn\.norm_q\.", ".attn.q_norm."), (r"\.attn\.norm_k\.", ".attn.k_norm."),
              (r"\.attn\.to_out\.0\.", ".attn.out_proj."), (r"\.ff\.net\.0\.proj\.", ".mlp.fc1."),
              (r"\.ff\.net\.2\.", ".mlp.fc2.")]
RENAMES["minimax-h3"] = MINIMAX_H3


def _minimax_h3_unfused(state: Tensors) -> Tensors:
    """MiniMax H3's original tensors that the diffusers layout splits or reorders: q, k and v stacked in one
    `qkv_proj` (`[q; k; v]`, the published single files' order) and the SwiGLU input's halves as `[gate; value]`."""
    out = _fused(state, (".attn.to_q.", ".attn.to_k.", ".attn.to_v."), ".attn.qkv_proj.")
    for key in [key for key in out if ".ff.net.0.proj." in key]:
        out[key] = _swapped_halves(out[key])
    return out


def original_layout(family: str, state: Tensors, prefix: str = "") -> Tensors:
    """`state` (a diffusers state dict of the family's transformer) under its original names, each with `prefix`
    (ComfyUI's files: `model.diffusion_model.`)."""
    if family == "hunyuan-video":
        state = _hunyuan_unfused(state)
    if family == "mochi":
        state = _mochi_unfused(state)
    if family == "minimax-h3":
        state = _minimax_h3_unfused(state)
    renamed = _renamed(state, RENAMES[family])
    return {f"{prefix}{key}": tensor for key, tensor in renamed.items()}


def transformer_state(model_dir: Path, component: str = "transformer") -> Tensors:
    files = sorted((model_dir / component).glob("*.safetensors"))
    assert len(files) == 1, files
    return load_file(str(files[0]))


def write_original_layout(family: str, model_dir: Path, path: Path, prefix: str = "",
                          cast: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
                          extra: Tensors | None = None, component: str = "transformer") -> Path:
    """The tiny model's transformer of `model_dir` written to `path` in the family's original layout. `cast(key,
    tensor)` -> the file's tensors for one weight (float8 copies, scales); `extra`: tensors added as they are (a
    whole-pipeline file's VAE); `component`: the folder's transformer to write (`transformer_2`: Wan 2.2 A14B's
    low-noise expert). The file is checked to convert back to the folder's keys and shapes."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    from vidtune.models.registry import get_spec_class

    state = transformer_state(model_dir, component)
    converter = SINGLE_FILE_LOADABLE_CLASSES[get_spec_class(family).denoiser_class.__name__]["checkpoint_mapping_fn"]
    back = converter(checkpoint=original_layout(family, state), config={})
    assert set(back) == set(state), sorted(set(back) ^ set(state))[:5]
    assert all(back[key].shape == state[key].shape and torch.equal(back[key], state[key]) for key in state)
    original = original_layout(family, state, prefix)
    written: Tensors = {}
    for key, tensor in original.items():
        written.update(cast(key, tensor) if cast else {key: tensor})
    written.update(extra or {})
    save_file({key: tensor.contiguous() for key, tensor in written.items()}, str(path))
    return path


def float8_weights(dtype: torch.dtype = torch.float8_e4m3fn) -> Callable[[str, torch.Tensor], Tensors]:
    """Every 2-D weight in float8 (as the fp8 releases hold their linear layers), the rest as it is."""

    def cast(key: str, tensor: torch.Tensor) -> Tensors:
        return {key: tensor.to(dtype) if key.endswith(".weight") and tensor.dim() == 2 else tensor}

    return cast


def scaled_float8_weights(scale: float = 0.03, scale_input: bool = False) -> Callable[[str, torch.Tensor], Tensors]:
    """ComfyUI's scaled fp8: each 2-D weight divided by its `scale_weight` and stored in e4m3fn beside it."""

    def cast(key: str, tensor: torch.Tensor) -> Tensors:
        if not (key.endswith(".weight") and tensor.dim() == 2):
            return {key: tensor}
        layer = key.removesuffix(".weight")
        found = {key: (tensor / scale).to(torch.float8_e4m3fn),
                 f"{layer}.scale_weight": torch.tensor(scale, dtype=torch.float32)}
        if scale_input:
            found[f"{layer}.scale_input"] = torch.tensor(1.0, dtype=torch.float32)
        return found

    return cast


def dequantised_folder(model_dir: Path, out: Path, values: Callable[[str, torch.Tensor], torch.Tensor]) -> Path:
    """A copy of the model folder whose transformer holds `values(key, tensor)` (e.g. the float8 file's values
    upcast), the reference a single file is compared with."""
    import shutil

    shutil.copytree(model_dir, out)
    files = sorted((out / "transformer").glob("*.safetensors"))
    state = load_file(str(files[0]))
    save_file({key: values(key, tensor).contiguous() for key, tensor in state.items()}, str(files[0]))
    return out
