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

RENAMES: dict[str, list[tuple[str, str]]] = {"ltx-video": LTX_VIDEO, "ltx-2": LTX_2, "wan": WAN}


def original_layout(family: str, state: Tensors, prefix: str = "") -> Tensors:
    """`state` (a diffusers state dict of the family's transformer) under its original names, each with `prefix`
    (ComfyUI's files: `model.diffusion_model.`)."""
    renamed = _renamed(state, RENAMES[family])
    return {f"{prefix}{key}": tensor for key, tensor in renamed.items()}


def transformer_state(model_dir: Path, component: str = "transformer") -> Tensors:
    files = sorted((model_dir / component).glob("*.safetensors"))
    assert len(files) == 1, files
    return load_file(str(files[0]))


def write_original_layout(family: str, model_dir: Path, path: Path, prefix: str = "",
                          cast: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
                          extra: Tensors | None = None) -> Path:
    """The tiny model's transformer of `model_dir` written to `path` in the family's original layout. `cast(key,
    tensor)` -> the file's tensors for one weight (float8 copies, scales); `extra`: tensors added as they are (a
    whole-pipeline file's VAE). The file is checked to convert back to the folder's keys and shapes."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    from vidtune.models.registry import get_spec_class

    state = transformer_state(model_dir)
    original = original_layout(family, state, prefix)
    converter = SINGLE_FILE_LOADABLE_CLASSES[get_spec_class(family).denoiser_class.__name__]["checkpoint_mapping_fn"]
    back = converter(checkpoint=dict(original), config={})
    assert set(back) == set(state), sorted(set(back) ^ set(state))[:5]
    assert all(back[key].shape == state[key].shape and torch.equal(back[key], state[key]) for key in state)
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
