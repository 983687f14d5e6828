"""The ComfyUI LoRA file: its maths, its key rules per family, the names ComfyUI's models read, and diffusers' own
converters reading it back.

Every family's file, for the default preset and for `all-linear`, must be read whole by the ComfyUI model of its
family: its key names are built here from ComfyUI's published state-dict layouts and key map (no ComfyUI needed).
diffusers ships converters for non-diffusers LoRAs (`diffusion_model.` keys with the original checkpoint's module
names) for LTX-Video, Wan, HunyuanVideo and MiniMax H3: each family's `load_lora_weights` applies them, and the
pipeline with the ComfyUI file must then produce what it produces with the diffusers file. Mochi and HunyuanVideo
1.5 have no such converter: their files are checked against the module names and shapes of ComfyUI's model.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from diffusers.loaders import lora_conversion_utils
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file

from vidtune.algorithms.build import build_part, build_spec
from vidtune.algorithms.lora import linear_module_names
from vidtune.data.video import ClipWindow, read_clip
from vidtune.export.comfyui import ComfyUIExportError, Rule, comfyui_lora, fuse, fused, save_comfyui_lora
from vidtune.export.comfyui_workflow import workflow_file
from vidtune.models.registry import available_models, get_spec_class
from vidtune.models.spec import ModelSpec
from vidtune.models.tiny import TINY_SHAPES
from vidtune.outputs import LORA_WEIGHTS, comfyui_lora_weights
from vidtune.trainers import build_trainer

RUN = "run"  # make_config's output_dir: the ComfyUI file is named after it
COMFYUI_LORA_WEIGHTS = comfyui_lora_weights(RUN)

CPU = torch.device("cpu")


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----- the maths --------------------------------------------------------------------------------------------
def test_a_fused_adapter_applies_the_split_adapters_row_by_row():
    """A stacked, B block-diagonal: B @ A is each part's B_i @ A_i in its rows, zeros for a part without one."""
    sizes = (6, 6, 6, 10)
    parts = {0: (_random(3, 5, seed=0), _random(6, 3, seed=1)),
             1: (_random(2, 5, seed=2), _random(6, 2, seed=3)),  # ranks may differ
             3: (_random(3, 5, seed=4), _random(10, 3, seed=5))}  # part 2 has no adapter
    down, up = fuse(parts, sizes)
    assert down.shape == (8, 5) and up.shape == (28, 8)
    expected = torch.cat([parts[0][1] @ parts[0][0], parts[1][1] @ parts[1][0], torch.zeros(6, 5),
                          parts[3][1] @ parts[3][0]])
    torch.testing.assert_close(up @ down, expected)


def test_the_scale_is_folded_into_b_and_halves_swap_where_the_original_orders_them_the_other_way():
    rules = [Rule(r"block\.(\d+)\.ff", r"blocks.\1.w1", swap_halves=True), Rule(r"block\.(\d+)\.out", r"blocks.\1.o"),
             *fused([r"block\.(\d+)\.q", r"block\.(\d+)\.k"], r"blocks.\1.qk", [4, 4])]
    state = {f"block.0.{name}.lora_{ab}.weight": _random(*shape, seed=i)
             for i, (name, ab, shape) in enumerate([("ff", "A", (2, 3)), ("ff", "B", (4, 2)), ("out", "A", (2, 3)),
                                                    ("out", "B", (3, 2)), ("q", "A", (2, 3)), ("q", "B", (4, 2))])}
    result = comfyui_lora(state, rules, alpha=8.0)  # rank 2: scale 4
    assert set(result) == {f"diffusion_model.blocks.0.{m}.lora_{ab}.weight" for m in ("w1", "o", "qk") for ab in "AB"}

    def delta(prefix: str, module: str) -> torch.Tensor:
        return state[f"{prefix}.{module}.lora_B.weight"] @ state[f"{prefix}.{module}.lora_A.weight"] * 4.0

    def comfy(module: str) -> torch.Tensor:
        return (result[f"diffusion_model.blocks.0.{module}.lora_B.weight"]
                @ result[f"diffusion_model.blocks.0.{module}.lora_A.weight"])

    torch.testing.assert_close(comfy("o"), delta("block.0", "out"))
    torch.testing.assert_close(comfy("w1"), torch.cat([delta("block.0", "ff")[2:], delta("block.0", "ff")[:2]]))
    torch.testing.assert_close(comfy("qk"), torch.cat([delta("block.0", "q"), torch.zeros(4, 3)]))
    assert not any(key.endswith(".alpha") for key in result)


def test_a_module_without_an_original_name_is_named():
    state = {"block.0.norm.lora_A.weight": torch.zeros(2, 3), "block.0.norm.lora_B.weight": torch.zeros(3, 2)}
    with pytest.raises(ComfyUIExportError, match=r"block\.0\.norm.*\nWhat to do: leave them out of lora.target"):
        comfyui_lora(state, [Rule("block\\.(\\d+)\\.out", "o")], alpha=1.0, family="wan")
    state["block.0.norm.lora_magnitude_vector"] = torch.ones(3)
    # A DoRA file's `dora_scale` is computed from the base weights: without them, the layer is named.
    with pytest.raises(ComfyUIExportError, match=r"DoRA adapter of block\.0\.norm needs .* base weight"):
        comfyui_lora(state, [Rule("block\\.(\\d+)\\.norm", "n")], alpha=1.0)
    state["block.0.norm.lokr_w1"] = torch.ones(2, 2)
    with pytest.raises(ComfyUIExportError, match=r"not those of one LoRA, LoKr or LoHa adapter"):
        comfyui_lora(state, [Rule("block\\.(\\d+)\\.norm", "n")], alpha=1.0)


# ----- diffusers' converters read the file back -------------------------------------------------------------
@contextlib.contextmanager
def hunyuan_hidden_size(hidden: int) -> Iterator[None]:
    """diffusers' HunyuanVideo converter splits a single block's `linear1` at the real model's hidden size (3072,
    a constant in it); for the tiny model it must split at the tiny one. Everything else is the converter's own."""
    real_split = torch.split

    def split(tensor: torch.Tensor, sizes, dim: int = 0):
        if isinstance(sizes, tuple) and sizes[:3] == (3072, 3072, 3072):
            sizes = (hidden, hidden, hidden, tensor.shape[dim] - 3 * hidden)
        return real_split(tensor, sizes, dim)

    patched = types.SimpleNamespace(**{name: getattr(torch, name) for name in dir(torch) if not name.startswith("__")})
    patched.split = split
    original = lora_conversion_utils.torch
    lora_conversion_utils.torch = patched
    try:
        yield
    finally:
        lora_conversion_utils.torch = original


# Targets per family: beyond the default attention projections, the layers each converter maps (feed-forward,
# cross-attention image projections, fused parts), so the round trip covers them. HunyuanVideo: not the token
# refiner, whose fused `self_attn_qkv` diffusers' converter splits as if it were a plain weight (its A too), nor the
# MLP embedders, which the file names as ComfyUI reads them (`guidance_in.in_layer`) and diffusers' converter as the
# original checkpoint does (`guidance_in.mlp.0`).
ROUND_TRIP_TARGETS = {
    "ltx-video": ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"],
    "ltx-video-i2v": ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"],
    "ltx-2": ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "audio_ff.net.2", "proj_in", "audio_proj_in",
              "time_embed.linear", "av_cross_attn_video_a2v_gate.linear",
              "av_cross_attn_audio_scale_shift.emb.timestep_embedder.linear_1"],
    "wan": ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2", "proj_out",
            "condition_embedder.time_proj", "condition_embedder.text_embedder.linear_1"],
    "wan-i2v": ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "ffn.net.0.proj",
                "condition_embedder.image_embedder.ff.net.0.proj"],
    "wan2.2": ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2", "proj_out"],
    "wan2.2-i2v": ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.2", "condition_embedder.time_proj"],
    "skyreels-v2": ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2", "proj_out",
                    "condition_embedder.time_proj"],
    "skyreels-v2-i2v": ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "ffn.net.2",
                        "condition_embedder.image_embedder.ff.net.0.proj"],
    "skyreels-v2-df": ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"],
    # Wan VACE: the main blocks' layers by their full names (diffusers' Wan converter reads no VACE block; those
    # are covered by the layout of ComfyUI's model below).
    "wan-vace": ["blocks.0.attn1.to_q", "blocks.0.attn2.to_v", "blocks.1.attn1.to_out.0", "blocks.1.ffn.net.0.proj",
                 "blocks.1.ffn.net.2", "condition_embedder.time_proj"],
    # MiniMax H3: every layer diffusers' converter maps (fused q, k, v; SwiGLU halves swapped; the final layer).
    "minimax-h3": ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "adaln_proj.linear", "proj_in",
                   "audio_proj_in", "context_embedder", "time_embedder.linear_1", "norm_out.linear", "proj_out",
                   "audio_proj_out"],
    "hunyuan-video": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                      "transformer_blocks.0.attn.to_v", "transformer_blocks.0.attn.to_out.0", "add_q_proj",
                      "add_k_proj", "add_v_proj", "to_add_out", "transformer_blocks.0.ff.net.0.proj",
                      "ff_context.net.2", "single_transformer_blocks.0.attn.to_q",
                      "single_transformer_blocks.0.attn.to_k", "single_transformer_blocks.0.attn.to_v",
                      "single_transformer_blocks.0.proj_out"],
}


@pytest.mark.parametrize("family", sorted(ROUND_TRIP_TARGETS))
def test_the_comfyui_file_loads_through_diffusers_converter_and_samples_like_the_diffusers_file(make_config, family):
    config = make_config(family, training={"steps": 2, "learning_rate": 5e-2},
                         lora={"rank": 4, "alpha": 8, "target_modules": ROUND_TRIP_TARGETS[family]})
    trainer = build_trainer(config)
    trainer.run()
    output_dir = Path(config.output_dir)
    comfy = load_file(output_dir / COMFYUI_LORA_WEIGHTS)
    assert (output_dir / LORA_WEIGHTS).is_file()
    assert comfy and all(key.startswith("diffusion_model.") and key.endswith((".lora_A.weight", ".lora_B.weight"))
                         for key in comfy)

    spec = trainer.spec
    text, vae = spec.load_text_components(CPU), spec.load_vae(CPU)
    frames, height, width = TINY_SHAPES[family]
    reference = read_clip(trainer.context.clips[0].video, ClipWindow(1, height, width)) if spec.image_to_video else None

    def sample(weight_name: str | None) -> torch.Tensor:
        pipeline = spec.pipeline(text, vae, spec.load_denoiser(CPU))
        pipeline.set_progress_bar_config(disable=True)
        if weight_name is not None:
            pipeline.load_lora_weights(output_dir, weight_name=weight_name)
        return spec.sample(pipeline, "a red circle", frames=frames, height=height, width=width, num_inference_steps=2,
                           generator=torch.Generator().manual_seed(0), reference=reference).frames

    plain = sample(None)
    with_diffusers_file = sample(LORA_WEIGHTS)
    hidden = spec.load_denoiser(CPU).config.attention_head_dim * spec.load_denoiser(CPU).config.num_attention_heads
    with hunyuan_hidden_size(hidden) if family == "hunyuan-video" else contextlib.nullcontext():
        with_comfyui_file = sample(COMFYUI_LORA_WEIGHTS)
    assert (with_diffusers_file - plain).abs().max() > 1e-3, "the adapter changes nothing: the test would prove nothing"
    difference = (with_comfyui_file - with_diffusers_file).abs().max().item()
    print(f"{family}: max |comfyui - diffusers| = {difference:.2e}, adapter effect "
          f"{(with_diffusers_file - plain).abs().max().item():.2e}")
    assert difference < 5e-5


# ----- ComfyUI's models read every key -----------------------------------------------------------------------
def hunyuan_video_layout(config: dict) -> dict[str, tuple[int, int]]:
    """ComfyUI's HunyuanVideo model (1.0 and 1.5: `comfy/ldm/hunyuan_video/model.py`, Flux's blocks from
    `comfy/ldm/flux/layers.py`) under the names its LoRA key map gives the original checkpoint's layers: double
    blocks with fused `img_attn_qkv` / `txt_attn_qkv` (3 x width), `img_mod` / `txt_mod.linear` (6 x width),
    `img_mlp` / `txt_mlp.fc1/fc2`; 1.0's single blocks (`linear1`: q, k, v and the MLP input; `linear2`,
    `modulation.linear`, 3 x width); the text refiner `txt_in` (fused `self_attn_qkv`, 4 x width MLP, MLP embedders
    `t_embedder` / `c_embedder` with `in_layer` / `out_layer`, which the key map keeps as they are); `time_in`, 1.0's
    `vector_in` and `guidance_in`, 1.5's glyph projection `byt5_in` (2048 wide) and image projection
    `vision_in.proj.1/3`; `final_layer`. Weight shapes (out, in)."""
    x, text = config["num_attention_heads"] * config["attention_head_dim"], config["text_embed_dim"]
    mlp = int(x * config["mlp_ratio"])
    out = config["patch_size"] ** 2 * config["patch_size_t"] * config["out_channels"]
    embedders = {"time_in": 256, "txt_in.t_embedder": 256, "txt_in.c_embedder": text}
    if "num_single_layers" in config:  # 1.0
        embedders |= {"vector_in": config["pooled_projection_dim"]}
        embedders |= {"guidance_in": 256} if config["guidance_embeds"] else {}
    layout = {f"{name}.{layer}": shape for name, width in embedders.items()
              for layer, shape in (("in_layer", (x, width)), ("out_layer", (x, x)))}
    layout |= {"txt_in.input_embedder": (x, text), "final_layer.linear": (out, x),
               "final_layer.adaLN_modulation.1": (2 * x, x)}
    if "text_embed_2_dim" in config:  # 1.5
        glyph, image = config["text_embed_2_dim"], config["image_embed_dim"]
        layout |= {"byt5_in.fc1": (2048, glyph), "byt5_in.fc2": (2048, 2048), "byt5_in.fc3": (x, 2048),
                   "vision_in.proj.1": (image, image), "vision_in.proj.3": (x, image)}
    for n in range(config["num_refiner_layers"]):
        block = f"txt_in.individual_token_refiner.blocks.{n}"
        layout |= {f"{block}.self_attn_qkv": (3 * x, x), f"{block}.self_attn_proj": (x, x),
                   f"{block}.mlp.fc1": (4 * x, x), f"{block}.mlp.fc2": (x, 4 * x),
                   f"{block}.adaLN_modulation.1": (2 * x, x)}
    for n in range(config["num_layers"]):
        for stream in ("img", "txt"):
            block = f"double_blocks.{n}.{stream}"
            layout |= {f"{block}_mod.linear": (6 * x, x), f"{block}_attn_qkv": (3 * x, x),
                       f"{block}_attn_proj": (x, x), f"{block}_mlp.fc1": (mlp, x), f"{block}_mlp.fc2": (x, mlp)}
    for n in range(config.get("num_single_layers", 0)):
        block = f"single_blocks.{n}"
        layout |= {f"{block}.linear1": (3 * x + mlp, x), f"{block}.linear2": (x, x + mlp),
                   f"{block}.modulation.linear": (3 * x, x)}
    return layout


def mochi_layout(config: dict) -> dict[str, tuple[int, int]]:
    """Genmo's Mochi 1 checkpoint (`asymm_models_joint.py`; ComfyUI's Mochi model keeps its names): visual width
    x, text width y; per block fused `attn.qkv_x` / `attn.qkv_y`, `attn.proj_x` / `proj_y`, SwiGLU `mlp_x` /
    `mlp_y` (`w1` holds both halves), modulations `mod_x` / `mod_y`; the last block updates no text stream (no
    `proj_y`, `mlp_y`; `mod_y` gives only a scale). Weight shapes (out, in)."""
    x, y = config["num_attention_heads"] * config["attention_head_dim"], config["pooled_projection_dim"]
    t5, frequencies = config["text_embed_dim"], config["time_embed_dim"]
    hidden_x, hidden_y = 4 * x * 2 // 3, 4 * y * 2 // 3
    out = config["patch_size"] ** 2 * (config["out_channels"] or config["in_channels"])
    layout = {"t_embedder.mlp.0": (x, frequencies), "t_embedder.mlp.2": (x, x), "t5_y_embedder.to_kv": (2 * t5, t5),
              "t5_y_embedder.to_q": (t5, t5), "t5_y_embedder.to_out": (x, t5), "t5_yproj": (y, t5),
              "final_layer.mod": (2 * x, x), "final_layer.linear": (out, x)}
    for n in range(config["num_layers"]):
        block, last = f"blocks.{n}", n == config["num_layers"] - 1
        layout |= {f"{block}.attn.qkv_x": (3 * x, x), f"{block}.attn.qkv_y": (3 * x, y), f"{block}.attn.proj_x": (x, x),
                   f"{block}.mlp_x.w1": (2 * hidden_x, x), f"{block}.mlp_x.w2": (x, hidden_x),
                   f"{block}.mod_x": (4 * x, x), f"{block}.mod_y": (y if last else 4 * y, x)}
        if not last:
            layout |= {f"{block}.attn.proj_y": (y, x), f"{block}.mlp_y.w1": (2 * hidden_y, y),
                       f"{block}.mlp_y.w2": (y, hidden_y)}
    return layout

def kandinsky5_layout(config: dict) -> dict[str, tuple[int, int]]:
    """ComfyUI's Kandinsky 5 (`comfy/ldm/kandinsky5/model.py`, Kandinsky Lab's names): width d, time width t; the
    visual embedding reads a (1, 2, 2) patch of the latents (with the condition latents and mask of image-to-video
    models); text blocks' modulation gives 6 x d, visual blocks' 9 x d, the output layer's 2 x d. Shapes (out, in)."""
    d, t, ff = config["model_dim"], config["time_dim"], config["ff_dim"]
    patch = config["patch_size"][0] * config["patch_size"][1] * config["patch_size"][2]
    visual = 2 * config["in_visual_dim"] + 1 if config["visual_cond"] else config["in_visual_dim"]
    layout = {"time_embeddings.in_layer": (t, d), "time_embeddings.out_layer": (t, t),
              "text_embeddings.in_layer": (d, config["in_text_dim"]),
              "pooled_text_embeddings.in_layer": (t, config["in_text_dim2"]),
              "visual_embeddings.in_layer": (d, patch * visual), "out_layer.modulation.out_layer": (2 * d, t),
              "out_layer.out_layer": (patch * config["out_visual_dim"], d)}
    attention = {f"{part}": (d, d) for part in ("to_query", "to_key", "to_value", "out_layer")}
    feed_forward = {"feed_forward.in_layer": (ff, d), "feed_forward.out_layer": (d, ff)}
    for n in range(config["num_text_blocks"]):
        block = f"text_transformer_blocks.{n}"
        layout |= {f"{block}.text_modulation.out_layer": (6 * d, t),
                   **{f"{block}.self_attention.{part}": shape for part, shape in attention.items()},
                   **{f"{block}.{name}": shape for name, shape in feed_forward.items()}}
    for n in range(config["num_visual_blocks"]):
        block = f"visual_transformer_blocks.{n}"
        layout |= {f"{block}.visual_modulation.out_layer": (9 * d, t),
                   **{f"{block}.{name}.{part}": shape for name in ("self_attention", "cross_attention")
                      for part, shape in attention.items()},
                   **{f"{block}.{name}": shape for name, shape in feed_forward.items()}}
    return layout


def wan_vace_layout(config: dict) -> dict[str, tuple[int, int]]:
    """ComfyUI's Wan VACE (`WAN21_Vace`: `VaceWanModel` in `comfy/ldm/wan/model.py`, Wan-Video's names): Wan 2.1's
    text and time embeddings (`text_embedding.0/2`, `time_embedding.0/2`, `time_projection.1`: 6 x width), blocks
    with `self_attn` / `cross_attn` `q k v o` and `ffn.0/2`, and `head.head`; the VACE blocks `vace_blocks.N`, Wan
    blocks (text cross-attention) with `after_proj`, the first with `before_proj` too. Shapes (out, in)."""
    x, ffn = config["num_attention_heads"] * config["attention_head_dim"], config["ffn_dim"]
    out = config["patch_size"][0] * config["patch_size"][1] * config["patch_size"][2] * config["out_channels"]
    block = {**{f"{name}.{part}": (x, x) for name in ("self_attn", "cross_attn") for part in "qkvo"},
             "ffn.0": (ffn, x), "ffn.2": (x, ffn)}
    layout = {"text_embedding.0": (x, config["text_dim"]), "text_embedding.2": (x, x),
              "time_embedding.0": (x, config["freq_dim"]), "time_embedding.2": (x, x),
              "time_projection.1": (6 * x, x), "head.head": (out, x), "vace_blocks.0.before_proj": (x, x)}
    for n in range(config["num_layers"]):
        layout |= {f"blocks.{n}.{name}": shape for name, shape in block.items()}
    for n in range(len(config["vace_layers"])):
        layout |= {f"vace_blocks.{n}.{name}": shape for name, shape in {**block, "after_proj": (x, x)}.items()}
    return layout


def wan_animate_layout(config: dict) -> dict[str, tuple[int, int]]:
    """ComfyUI's Wan Animate model (`AnimateWanModel`, comfy/ldm/wan/model_animate.py, on `WanModel` of
    comfy/ldm/wan/model.py): Wan 2.1 image-to-video's blocks (`self_attn` / `cross_attn` q, k, v, o, the image
    keys and values `k_img` / `v_img`, `ffn.0` / `ffn.2`), embedders (`text_embedding`, `time_embedding`,
    `time_projection.1`, `img_emb.proj.1/3`) and `head.head`; a face adapter block `face_adapter.fuser_blocks.N`
    (`linear1_q`, `linear1_kv` fusing key and value, `linear2`) after every `inject_face_latents_blocks` blocks;
    the face encoder's `out_proj`. Weight shapes (out, in)."""
    x, ffn, image = config["num_attention_heads"] * config["attention_head_dim"], config["ffn_dim"], config["image_dim"]
    out = config["out_channels"] * config["patch_size"][0] * config["patch_size"][1] * config["patch_size"][2]
    layout = {"text_embedding.0": (x, config["text_dim"]), "text_embedding.2": (x, x),
              "time_embedding.0": (x, config["freq_dim"]), "time_embedding.2": (x, x), "time_projection.1": (6 * x, x),
              "img_emb.proj.1": (image, image), "img_emb.proj.3": (x, image), "head.head": (out, x),
              "face_encoder.out_proj": (x, config["face_encoder_hidden_dim"])}
    for n in range(config["num_layers"]):
        block = f"blocks.{n}"
        layout |= {f"{block}.{attention}.{part}": (x, x) for attention in ("self_attn", "cross_attn")
                   for part in "qkvo"}
        layout |= {f"{block}.cross_attn.k_img": (x, x), f"{block}.cross_attn.v_img": (x, x),
                   f"{block}.ffn.0": (ffn, x), f"{block}.ffn.2": (x, ffn)}
    for n in range(config["num_layers"] // config["inject_face_latents_blocks"]):
        block = f"face_adapter.fuser_blocks.{n}"
        layout |= {f"{block}.linear1_q": (x, x), f"{block}.linear1_kv": (2 * x, x), f"{block}.linear2": (x, x)}
    return layout


def minimax_h3_layout(config: dict) -> dict[str, tuple[int, int]]:
    """ComfyUI's MiniMax H3 (`MiniMaxH3Model`, comfy/ldm/minimax/model.py, MiniMax's names): width x, attention
    width a, SwiGLU width f; `video_patch_proj` reads a (1, 2, 2) patch of the latents, `audio_patch_proj` one audio
    latent; the unpruned time embedder `proj_in` / `proj_out`; text refiner and main blocks with a fused `qkv_proj`
    (3 x a), `out_proj`, `mlp.fc1` (2 x f: gate and value) and `fc2`; a main block's `adaln_proj.linear` gives six
    parameters for each of three modalities (18 x x); the final layer's `adaln_proj.linear` (2 x x) and its video
    and audio heads. Weight shapes (out, in)."""
    x, f, t = config["hidden_size"], config["ffn_dim"], config["time_embed_dim"]
    a = config["num_attention_heads"] * config["attention_head_dim"]
    video, audio = config["in_channels"] * config["patch_size"][0] * config["patch_size"][1] * \
        config["patch_size"][2], config["audio_in_channels"]
    layout = {"video_patch_proj": (x, video), "audio_patch_proj": (x, audio), "condition_proj": (x, config["text_dim"]),
              "time_embedder.proj_in": (config["time_embed_hidden_dim"], config["freq_dim"]),
              "time_embedder.proj_out": (t, config["time_embed_hidden_dim"]),
              "final_layer.adaln_proj.linear": (2 * x, t), "final_layer.video_out": (video, x),
              "final_layer.audio_out": (audio, x)}
    block = {"attn.qkv_proj": (3 * a, x), "attn.out_proj": (x, a), "mlp.fc1": (2 * f, x), "mlp.fc2": (x, f)}
    for n in range(config["num_refiner_layers"]):
        layout |= {f"token_refiner.blocks.{n}.{name}": shape for name, shape in block.items()}
    for n in range(config["num_layers"]):
        layout |= {f"blocks.{n}.{name}": shape for name, shape in {**block, "adaln_proj.linear": (18 * x, t)}.items()}
    return layout


LAYOUTS = {"mochi": mochi_layout, "hunyuan-video": hunyuan_video_layout, "hunyuan-video-1.5": hunyuan_video_layout,
           "hunyuan-video-1.5-i2v": hunyuan_video_layout, "kandinsky-5": kandinsky5_layout,
           "kandinsky-5-i2v": kandinsky5_layout, "wan-vace": wan_vace_layout, "wan-animate": wan_animate_layout,
           "minimax-h3": minimax_h3_layout}
# The families ComfyUI's core has a model for: those whose spec names ComfyUI's layers.
COMFYUI_FAMILIES = [family for family in available_models()
                    if get_spec_class(family).comfyui_lora_rules is not ModelSpec.comfyui_lora_rules]


def _adapter_on_every_linear(family: str, make_config) -> tuple[object, torch.nn.Module, dict[str, torch.Tensor]]:
    """A random adapter (nonzero A and B) on every linear layer of the tiny transformer."""
    config = make_config(family)
    spec = get_spec_class(family)(config.model)
    denoiser = spec.load_denoiser(CPU)
    torch.manual_seed(0)
    named = "|".join(re.escape(name) for name in linear_module_names(denoiser))  # whole names, not suffixes
    denoiser.add_adapter(LoraConfig(r=2, lora_alpha=3.0, init_lora_weights=False, target_modules=f"({named})"))
    return spec, denoiser, get_peft_model_state_dict(denoiser)


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_keys_are_the_modules_of_comfyuis_model_with_their_shapes(make_config, family):
    spec, denoiser, state = _adapter_on_every_linear(family, make_config)
    exported = comfyui_lora(state, spec.comfyui_lora_rules(), 3.0, family, spec.comfyui_model())
    layout = LAYOUTS[family](dict(denoiser.config))
    deltas = {key.removeprefix("diffusion_model.").removesuffix(".lora_B.weight"):
              exported[key] @ exported[key.replace("lora_B", "lora_A")] for key in exported if "lora_B" in key}
    assert 2 * len(deltas) == len(exported)
    # Every module of the layout has its adapter, under its name in ComfyUI and with its weight's shape.
    assert {name: tuple(delta.shape) for name, delta in deltas.items()} == layout


@pytest.mark.parametrize("preset", ["default", "all-linear"])
@pytest.mark.parametrize("family", COMFYUI_FAMILIES)
def test_comfyuis_model_reads_every_tensor_of_the_file(make_config, tmp_path, family, preset):
    """The file a run writes (through the trainer's own adapter and the export's check), for the family's default
    targets and for `all-linear`: every key is one ComfyUI's model of the family reads; with `all-linear`, every
    linear layer of that model has its adapter, but those of the layers the family leaves out of training."""
    lora = {"rank": 2, "alpha": 3.0} | ({"target_modules": "all-linear"} if preset == "all-linear" else {})
    config = make_config(family, lora=lora)
    spec = build_spec(config)
    denoiser = spec.load_denoiser(CPU)
    build_part(config, spec).configure(denoiser)
    state = {key: torch.randn_like(value) for key, value in get_peft_model_state_dict(denoiser).items()}
    model = spec.comfyui_model()
    save_comfyui_lora(spec, tmp_path, state, 3.0, RUN)
    files = sorted(tmp_path.iterdir())
    assert [path.name for path in files] == [COMFYUI_LORA_WEIGHTS]
    exported = load_file(files[0])
    names = model.lora_names()
    modules = {re.fullmatch(r"diffusion_model\.(.+)\.lora_[AB]\.weight", key).group(1) for key in exported}
    assert modules <= names.keys(), sorted(modules - names.keys())
    assert len(exported) == 2 * len(modules)
    if preset == "all-linear":
        left_out = set()
        for name in spec.lora_exclude_modules():
            rule = next((rule for rule in spec.comfyui_lora_rules() if re.fullmatch(rule.source, name)), None)
            if rule is not None:  # a layer ComfyUI's model has no name for has nothing to leave out there
                left_out.add(names[re.fullmatch(rule.source, name).expand(rule.target)])
        assert {names[module] for module in modules} == set(model.weights) - left_out


def test_a_key_comfyui_would_not_read_is_an_error_naming_it_and_nothing_is_written(make_config, tmp_path,
                                                                                     monkeypatch):
    config = make_config("wan")
    spec = get_spec_class("wan")(config.model)
    state = {"blocks.0.attn1.to_q.lora_A.weight": torch.ones(2, 4),
             "blocks.0.attn1.to_q.lora_B.weight": torch.ones(4, 2)}
    # A layout that names the query projection as the original checkpoint does not.
    monkeypatch.setattr(type(spec), "comfyui_lora_rules", lambda self: [Rule(r"blocks\.(\d+)\.attn1\.to_q",
                                                                            r"blocks.\1.self_attn.query")])
    with pytest.raises(ComfyUIExportError, match=r"WAN21 model \(wan\) would not load 2 of the 2 tensors.*"
                                                 r"diffusion_model\.blocks\.0\.self_attn\.query\.lora_A\.weight"):
        save_comfyui_lora(spec, tmp_path, state, 2.0, RUN)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("family", ["cogvideox", "cogvideox-i2v"])
def test_cogvideox_writes_no_comfyui_file_and_says_what_loads_its_lora(make_config, tmp_path, capsys, family):
    config = make_config(family, lora={"rank": 2})
    spec = build_spec(config)
    part = build_part(config, spec)
    denoiser = spec.load_denoiser(CPU)
    part.configure(denoiser)
    state = get_peft_model_state_dict(denoiser)
    assert part.save_comfyui(tmp_path, state, RUN) is None  # at the end of a run: said, not fatal
    assert list(tmp_path.iterdir()) == []
    line = capsys.readouterr().out
    assert "No LoRA file for ComfyUI: ComfyUI's core has no CogVideoX model" in line
    assert "ComfyUI-CogVideoXWrapper" in line and LORA_WEIGHTS in line
    with pytest.raises(ComfyUIExportError, match="no CogVideoX model"):  # `vidtune export --format comfyui`
        save_comfyui_lora(spec, tmp_path, state, 2.0, RUN)


def _delta(state: dict[str, torch.Tensor], module: str, scale: float) -> torch.Tensor:
    return state[f"{module}.lora_B.weight"] @ state[f"{module}.lora_A.weight"] * scale


def test_mochi_fused_and_swiglu_deltas_act_like_the_split_diffusers_ones(make_config):
    """The original forward (Genmo's: `x, gate = w1(h).chunk(2); w2(silu(x) * gate)`) with the ComfyUI deltas on
    the original weights equals diffusers' forward (SwiGLU: `h, gate = proj(x).chunk(2); h * silu(gate)`) with
    the adapters; the fused `qkv_x` delta is the q, k and v deltas stacked."""
    spec, denoiser, state = _adapter_on_every_linear("mochi", make_config)
    exported = comfyui_lora(state, spec.comfyui_lora_rules(), 3.0, "mochi")
    scale = 3.0 / 2

    def comfy(module: str) -> torch.Tensor:
        return exported[f"diffusion_model.{module}.lora_B.weight"] @ exported[f"diffusion_model.{module}.lora_A.weight"]

    qkv = torch.cat([_delta(state, f"transformer_blocks.0.attn1.to_{x}", scale) for x in "qkv"])
    torch.testing.assert_close(comfy("blocks.0.attn.qkv_x"), qkv)

    proj = denoiser.transformer_blocks[0].ff.net[0].proj.base_layer.weight.detach()
    ours = proj + _delta(state, "transformer_blocks.0.ff.net.0.proj", scale)
    half = proj.shape[0] // 2
    original = torch.cat([proj[half:], proj[:half]]) + comfy("blocks.0.mlp_x.w1")  # diffusers' conversion swaps
    h = _random(5, proj.shape[1], seed=7)
    value, gate = (h @ original.T).chunk(2, dim=-1)
    hidden, diffusers_gate = (h @ ours.T).chunk(2, dim=-1)
    silu = torch.nn.functional.silu
    torch.testing.assert_close(silu(value) * gate, hidden * silu(diffusers_gate))


def test_vidtune_export_format_comfyui_from_a_checkpoint_and_from_a_finished_run(make_config, tmp_path, capsys):
    """The ComfyUI file is named after the run (a checkpoint's also after its step), so several sit side by side
    in ComfyUI's loras folder; the diffusers file keeps the name diffusers looks for. Each export says what it
    wrote, a plain one the ComfyUI file too."""
    from vidtune.cli import main as cli_main
    from vidtune.cli import print_summary

    config = make_config("wan", training={"steps": 2, "learning_rate": 5e-2}, checkpoint={"every": 1, "keep": 2},
                         lora={"rank": 4, "alpha": 8})
    capsys.readouterr()
    result = build_trainer(config).run()
    run = Path(config.output_dir)
    assert run.name == RUN and (run / COMFYUI_LORA_WEIGHTS).is_file() and (run / LORA_WEIGHTS).is_file()
    assert f"Wrote the LoRA for ComfyUI: {run / COMFYUI_LORA_WEIGHTS}" in capsys.readouterr().out
    print_summary(result, 1.0)  # the end-of-run summary lists it beside the diffusers file
    assert f"  for ComfyUI  {run / COMFYUI_LORA_WEIGHTS}\n" in capsys.readouterr().out
    assert cli_main(["export", str(run / "checkpoints" / "step-00000001"), "--output", str(tmp_path / "step1"),
                     "--format", "comfyui"]) == 0
    step1_name = comfyui_lora_weights(f"{RUN}_step-00000001")
    # With the workflow that loads it (tests/export/test_comfyui_workflow.py).
    assert sorted(path.name for path in (tmp_path / "step1").iterdir()) == sorted(
        [step1_name, workflow_file(f"{RUN}_step-00000001")])
    # Without --format, a LoRA export writes both files, as the end of a run does, and says so.
    capsys.readouterr()
    assert cli_main(["export", str(run / "checkpoints" / "step-00000002"), "--output", str(tmp_path / "both")]) == 0
    step2_name = comfyui_lora_weights(f"{RUN}_step-00000002")
    # With the checkpoint's config.yaml, which `vidtune sample` reads to sample the export.
    assert {path.name for path in (tmp_path / "both").iterdir()} == {LORA_WEIGHTS, step2_name, "config.yaml",
                                                                   workflow_file(f"{RUN}_step-00000002")}
    assert f"Wrote the LoRA for ComfyUI: {tmp_path / 'both' / step2_name}" in capsys.readouterr().out
    # A finished run's folder, even without checkpoints: its final adapter, the file the run wrote at its end.
    shutil.rmtree(run / "checkpoints")
    assert cli_main(["export", str(run), "--output", str(tmp_path / "final"), "--format", "comfyui"]) == 0
    final, at_end = load_file(tmp_path / "final" / COMFYUI_LORA_WEIGHTS), load_file(run / COMFYUI_LORA_WEIGHTS)
    assert final.keys() == at_end.keys() and all(torch.equal(final[k], at_end[k]) for k in final)
    step1 = load_file(tmp_path / "step1" / step1_name)
    assert not all(torch.equal(step1[k], final[k]) for k in final)
    # Exporting again over the same file is refused, naming it.
    capsys.readouterr()
    assert cli_main(["export", str(run), "--output", str(tmp_path / "final"), "--format", "comfyui"]) == 2
    assert COMFYUI_LORA_WEIGHTS in capsys.readouterr().err

    full = make_config("ltx-video", training={"algorithm": "full", "steps": 1}, checkpoint={"every": 1, "keep": 1},
                       output_dir=str(tmp_path / "full"))
    build_trainer(full).run()
    capsys.readouterr()
    assert cli_main(["export", str(tmp_path / "full"), "--output", str(tmp_path / "nope"), "--format", "comfyui"]) == 2
    assert "converts LoRA adapters" in capsys.readouterr().err
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("family", ["hunyuan-video", "hunyuan-video-1.5"])
def test_hunyuan_video_fused_attention_and_embedders_carry_the_diffusers_deltas(make_config, family):
    """ComfyUI's fused `img_attn_qkv` / `txt_attn_qkv` get the q, k, v deltas stacked (1.5's checkpoint keeps them
    apart, ComfyUI's model does not), and its MLP embedders `time_in.in_layer` / `out_layer` the timestep
    embedder's."""
    spec, _, state = _adapter_on_every_linear(family, make_config)
    exported = comfyui_lora(state, spec.comfyui_lora_rules(), 3.0, family, spec.comfyui_model())
    scale = 3.0 / 2

    def comfy(module: str) -> torch.Tensor:
        return exported[f"diffusion_model.{module}.lora_B.weight"] @ exported[f"diffusion_model.{module}.lora_A.weight"]

    block = "transformer_blocks.0.attn"
    for fused_name, parts in (("img_attn_qkv", ("to_q", "to_k", "to_v")),
                              ("txt_attn_qkv", ("add_q_proj", "add_k_proj", "add_v_proj"))):
        expected = torch.cat([_delta(state, f"{block}.{part}", scale) for part in parts])
        torch.testing.assert_close(comfy(f"double_blocks.0.{fused_name}"), expected)
    timestep = "time_text_embed.timestep_embedder" if family == "hunyuan-video" else "time_embed.timestep_embedder"
    torch.testing.assert_close(comfy("time_in.in_layer"), _delta(state, f"{timestep}.linear_1", scale))
    torch.testing.assert_close(comfy("time_in.out_layer"), _delta(state, f"{timestep}.linear_2", scale))
    assert not any(".mlp.0." in key or "attn_q." in key for key in exported)
