"""The LoRA names ComfyUI's own models pick up, per model of ComfyUI's core, built from the diffusers config.

ComfyUI's LoRA loader (`comfy/lora.py`, `model_lora_keys_unet`) reads a key `diffusion_model.<name>.lora_A.weight`
only when `<name>` is in the key map it builds from the model's own state dict: every weight `<name>.weight` of the
model under its own name, and for HunyuanVideo (1.0 and 1.5, `comfy.model_base.HunyuanVideo` and its subclasses)
also under the original checkpoint's names (`img_attn_qkv` for `img_attn.qkv`, `img_mlp.fc1` for `img_mlp.0`,
`img_mod.linear` for `img_mod.lin`). Anything else is left out with a "lora key not loaded" warning, so the LoRA
half-applies. Each function below lists the linear layers of one ComfyUI model (its class's module tree, read from
ComfyUI's source: `comfy/ldm/lightricks/model.py` and `av_model.py`, `comfy/ldm/wan/model.py`,
`comfy/ldm/hunyuan_video/model.py` with `comfy/ldm/flux/layers.py`, `comfy/ldm/genmo/joint_model/
asymm_models_joint.py`, `comfy/ldm/minimax/model.py`) for the sizes in a diffusers transformer config;
`ComfyUIModel.lora_names` applies the key map. CogVideoX has no model in ComfyUI's core, so it has none here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


def _same_name(weight: str) -> tuple[str, ...]:
    return (weight,)


def _hunyuan_video_names(weight: str) -> tuple[str, ...]:
    """ComfyUI's HunyuanVideo key map: the model's name and the original checkpoint's (the same replacements, in
    the same order, as `model_lora_keys_unet`)."""
    # ComfyUI replaces in `<name>.weight`: the patterns end with a dot, so `mlp.0.` matches a name's last part too.
    original = ((weight + ".").replace("_mod.lin.", "_mod.linear.").replace("_attn.qkv.", "_attn_qkv.")
                .replace("_attn.proj.", "_attn_proj.").replace("mlp.0.", "mlp.fc1.").replace("mlp.2.", "mlp.fc2.")
                .replace(".modulation.lin.", ".modulation.linear."))
    return weight, original.removesuffix(".")


@dataclass(frozen=True)
class ComfyUIModel:
    """One model of ComfyUI's core as its LoRA loader sees it."""

    name: str  # ComfyUI's model class (comfy/model_base.py)
    weights: frozenset[str]  # the model's linear layers, by ComfyUI's module names
    key_map: Callable[[str], tuple[str, ...]] = field(default=_same_name)

    def lora_names(self) -> dict[str, str]:
        """LoRA module name (what follows `diffusion_model.` in a key) -> the model's layer it adapts."""
        names: dict[str, str] = {}
        for weight in sorted(self.weights):
            for name in self.key_map(weight):
                names[name] = weight
        return names


def _blocks(prefix: str, count: int, layers: Iterable[str]) -> set[str]:
    layers = tuple(layers)
    return {f"{prefix}.{n}.{layer}" for n in range(count) for layer in layers}


def _attention(*names: str) -> list[str]:
    return [f"{name}.{part}" for name in names for part in ("to_q", "to_k", "to_v", "to_out.0")]


def _adaln_single(prefix: str) -> set[str]:
    return {f"{prefix}.emb.timestep_embedder.linear_1", f"{prefix}.emb.timestep_embedder.linear_2", f"{prefix}.linear"}


def ltxv(config: dict[str, Any]) -> ComfyUIModel:
    """LTX-Video (`LTXV`, `LTXVModel`): diffusers' names in the blocks, `patchify_proj`, `adaln_single`."""
    block = [*_attention("attn1", "attn2"), "ff.net.0.proj", "ff.net.2"]
    weights = {"patchify_proj", "caption_projection.linear_1", "caption_projection.linear_2", "proj_out",
               *_adaln_single("adaln_single"), *_blocks("transformer_blocks", config["num_layers"], block)}
    return ComfyUIModel("LTXV", frozenset(weights))


def ltxav(config: dict[str, Any]) -> ComfyUIModel:
    """LTX-2 (`LTXAV`, `LTXAVModel`): LTX-Video's layers, their audio twins, the audio-video cross-attentions and
    their four modulation embeddings."""
    attentions = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
    block = [*_attention(*attentions), "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2"]
    weights = {"patchify_proj", "audio_patchify_proj", "proj_out", "audio_proj_out",
               *{f"{prefix}caption_projection.linear_{n}" for prefix in ("", "audio_") for n in (1, 2)},
               *_adaln_single("adaln_single"), *_adaln_single("audio_adaln_single"),
               *[name for part in ("video_scale_shift", "a2v_gate", "audio_scale_shift", "v2a_gate")
                 for name in _adaln_single(f"av_ca_{part}_adaln_single")],
               *_blocks("transformer_blocks", config["num_layers"], block)}
    return ComfyUIModel("LTXAV", frozenset(weights))


def wan21(config: dict[str, Any]) -> ComfyUIModel:
    """Wan 2.1 and 2.2 (`WAN21`, `WanModel`): image-to-video models with a CLIP image input (diffusers'
    `image_dim`) add the image keys and values of cross-attention and the image embedder `img_emb`."""
    image = config.get("image_dim") is not None
    attention = [f"{name}.{part}" for name in ("self_attn", "cross_attn") for part in "qkvo"]
    block = [*attention, "ffn.0", "ffn.2", *(["cross_attn.k_img", "cross_attn.v_img"] if image else [])]
    weights = {"text_embedding.0", "text_embedding.2", "time_embedding.0", "time_embedding.2", "time_projection.1",
               "head.head", *(["img_emb.proj.1", "img_emb.proj.3"] if image else []),
               *_blocks("blocks", config["num_layers"], block)}
    return ComfyUIModel("WAN21", frozenset(weights))


def wan21_vace(config: dict[str, Any]) -> ComfyUIModel:
    """Wan VACE (`WAN21_Vace`, `VaceWanModel`): Wan 2.1's layers and the VACE blocks, Wan blocks of their own
    (`vace_blocks.N`, text cross-attention) with `after_proj`, and `before_proj` in the first."""
    base = wan21(config)
    attention = [f"{name}.{part}" for name in ("self_attn", "cross_attn") for part in "qkvo"]
    vace = _blocks("vace_blocks", len(config["vace_layers"]), [*attention, "ffn.0", "ffn.2", "after_proj"])
    return ComfyUIModel("WAN21_Vace", frozenset({*base.weights, *vace, "vace_blocks.0.before_proj"}))


def wan_animate(config: dict[str, Any]) -> ComfyUIModel:
    """Wan Animate (`WAN22_Animate`, `AnimateWanModel` in comfy/ldm/wan/model_animate.py): Wan 2.1
    image-to-video's layers, a face adapter block (`face_adapter.fuser_blocks.N`: `linear1_q`, the fused
    `linear1_kv`, `linear2`) after every `inject_face_latents_blocks` blocks, and the face encoder's `out_proj`."""
    adapters = config["num_layers"] // config.get("inject_face_latents_blocks", 5)
    base = wan21(config)
    weights = {*base.weights, "face_encoder.out_proj",
               *_blocks("face_adapter.fuser_blocks", adapters, ["linear1_q", "linear1_kv", "linear2"])}
    return ComfyUIModel("WAN22_Animate", frozenset(weights))


def hunyuan_video(double: int, single: int = 0, refiner: int = 2, guidance: bool = False, vector: bool = False,
                  glyph: bool = False, image: bool = False) -> ComfyUIModel:
    """HunyuanVideo 1.0 and 1.5 (`HunyuanVideo`, `HunyuanVideo15`; one model class): Flux's double and single
    stream blocks with fused `qkv` (`comfy/ldm/flux/layers.py`), the text refiner `txt_in`, MLP embedders with
    `in_layer` / `out_layer`. 1.0 has single blocks, `vector_in` and (guidance-distilled) `guidance_in`; 1.5 has
    the glyph projection `byt5_in` and the image projection `vision_in` (vidtune trains no MeanFlow model, whose
    `time_r_in` is left out)."""
    embedders = ["time_in", "txt_in.t_embedder", "txt_in.c_embedder"]
    embedders += [name for name, present in (("guidance_in", guidance), ("vector_in", vector)) if present]
    stream = ["mod.lin", "attn.qkv", "attn.proj", "mlp.0", "mlp.2"]
    weights = {"txt_in.input_embedder", "final_layer.linear", "final_layer.adaLN_modulation.1",
               *{f"{name}.{layer}" for name in embedders for layer in ("in_layer", "out_layer")},
               *_blocks("txt_in.individual_token_refiner.blocks", refiner,
                        ["adaLN_modulation.1", "self_attn.qkv", "self_attn.proj", "mlp.0", "mlp.2"]),
               *_blocks("double_blocks", double, [f"{s}_{layer}" for s in ("img", "txt") for layer in stream]),
               *_blocks("single_blocks", single, ["linear1", "linear2", "modulation.lin"]),
               *(["byt5_in.fc1", "byt5_in.fc2", "byt5_in.fc3"] if glyph else []),
               *(["vision_in.proj.1", "vision_in.proj.3"] if image else [])}
    return ComfyUIModel("HunyuanVideo15" if glyph else "HunyuanVideo", frozenset(weights), _hunyuan_video_names)


def mochi(config: dict[str, Any]) -> ComfyUIModel:
    """Mochi (`GenmoMochi`, `AsymmDiTJoint`): Genmo's names; the last block updates no text stream (no `proj_y`,
    `mlp_y`)."""
    layers = config["num_layers"]
    block = ["mod_x", "mod_y", "attn.qkv_x", "attn.qkv_y", "attn.proj_x", "mlp_x.w1", "mlp_x.w2"]
    weights = {"t_embedder.mlp.0", "t_embedder.mlp.2", "t5_y_embedder.to_kv", "t5_y_embedder.to_q",
               "t5_y_embedder.to_out", "t5_yproj", "final_layer.mod", "final_layer.linear",
               *_blocks("blocks", layers, block),
               *_blocks("blocks", layers - 1, ["attn.proj_y", "mlp_y.w1", "mlp_y.w2"])}
    return ComfyUIModel("GenmoMochi", frozenset(weights))


def kandinsky5(config: dict[str, Any]) -> ComfyUIModel:
    """Kandinsky 5 (`Kandinsky5`, `comfy/ldm/kandinsky5/model.py`): Kandinsky Lab's names, which diffusers keeps;
    text blocks (self-attention), visual blocks (self- and cross-attention), each with its modulation."""
    attention = ("to_query", "to_key", "to_value", "out_layer")
    feed_forward = ("feed_forward.in_layer", "feed_forward.out_layer")
    text = ["text_modulation.out_layer", *[f"self_attention.{part}" for part in attention], *feed_forward]
    visual = ["visual_modulation.out_layer", *[f"{name}.{part}" for name in ("self_attention", "cross_attention")
                                               for part in attention], *feed_forward]
    weights = {"time_embeddings.in_layer", "time_embeddings.out_layer", "text_embeddings.in_layer",
               "pooled_text_embeddings.in_layer", "visual_embeddings.in_layer", "out_layer.modulation.out_layer",
               "out_layer.out_layer", *_blocks("text_transformer_blocks", config["num_text_blocks"], text),
               *_blocks("visual_transformer_blocks", config["num_visual_blocks"], visual)}
    return ComfyUIModel("Kandinsky5", frozenset(weights))


def minimax_h3(config: dict[str, Any]) -> ComfyUIModel:
    """MiniMax H3 (`MiniMaxH3`, `MiniMaxH3Model` in comfy/ldm/minimax/model.py, MiniMax's names): the video and audio
    patch projections, the caption projection `condition_proj`, the time embedder (`proj_in` / `proj_out`: the
    unpruned checkpoint's; the pruned one replaces it with a table), the text refiner and main blocks with a fused
    `attn.qkv_proj`, `attn.out_proj` and a SwiGLU `mlp.fc1` / `mlp.fc2` (main blocks with `adaln_proj.linear`), and
    the final layer's modulation and two output heads."""
    block = ["attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"]
    weights = {"video_patch_proj", "audio_patch_proj", "condition_proj", "time_embedder.proj_in",
               "time_embedder.proj_out", "final_layer.adaln_proj.linear", "final_layer.video_out",
               "final_layer.audio_out", *_blocks("token_refiner.blocks", config["num_refiner_layers"], block),
               *_blocks("blocks", config["num_layers"], [*block, "adaln_proj.linear"])}
    return ComfyUIModel("MiniMaxH3", frozenset(weights))
