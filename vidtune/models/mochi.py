"""Mochi 1 (Genmo): T5 text encoder, asymmetric VAE (12 latent channels), and an asymmetric DiT.

Every convention below is read from MochiPipeline.__call__:
  * text: T5 run *with* the attention mask, captions padded to `max_sequence_length` (the pipeline's 256);
    the mask goes to the transformer too. Empty captions become all-zero ids and mask where the pipeline's
    `force_zeros_for_empty_prompt` is set.
  * latents: the pipeline decodes latents * latents_std / scaling_factor + latents_mean (per channel, from
    the VAE config), so training latents are (posterior - mean) * scaling_factor / std. The transformer takes
    the shared [B, C, F, H, W] layout as it is.
  * time runs backwards: the scheduler has `invert_sigmas`, so at noise level sigma the transformer is told
    timestep (1 - sigma) * 1000 (0 = pure noise), and the Euler step x += (s_next - s) * prediction runs over
    s = 1 - sigma, i.e. the prediction is d x / d s = x0 - noise, minus the usual velocity. Both are data of
    the objective (`FlowMatching.invert_timesteps` / `negate_target`, set from the scheduler's
    `invert_sigmas` in `objective_from_scheduler`); nothing here special-cases them.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLMochi,
    FlowMatchEulerDiscreteScheduler,
    MochiPipeline,
    MochiTransformer3DModel,
)
from torch import nn
from transformers import T5EncoderModel

from vidtune.export.comfyui import Rule, fused
from vidtune.export.comfyui_models import ComfyUIModel, mochi
from vidtune.export.comfyui_workflow import ModelFiles, WorkflowLayout, mochi_parts
from vidtune.models.defaults import MOCHI
from vidtune.models.spec import (
    ALL_LINEAR,
    ATTENTION_TARGETS,
    FEED_FORWARD_TARGETS,
    JOINT_ATTENTION_TARGETS,
    Conditions,
    Latents,
    ModelSpec,
    TextComponents,
    frame_count_problem,
    raise_shape_problems,
    shape_rule,
    side_problems,
)

logger = logging.getLogger(__name__)
# diffusers' convert_mochi_transformer_checkpoint_to_diffusers reads this many blocks (single_file_utils.py)
MOCHI_CONVERTER_LAYERS = 48


class MochiSpec(ModelSpec):
    name = "mochi"
    control_input_layer = "patch_embed.proj"  # Conv2d over each frame's [C, H, W]
    # Joint attention: the text stream has projections (and a feed-forward) of its own.
    lora_presets: ClassVar[dict[str, tuple[str, ...]]] = {
        "attention": ATTENTION_TARGETS + JOINT_ATTENTION_TARGETS,
        "attention+ffn": ATTENTION_TARGETS + JOINT_ATTENTION_TARGETS + FEED_FORWARD_TARGETS
        + ("ff_context.net.0.proj", "ff_context.net.2"),
        ALL_LINEAR: (ALL_LINEAR,),
    }
    validation_guidance_scale = 4.5
    defaults = MOCHI

    # ----- shape rules, read from the VAE / transformer configs (no weights needed) --------------------
    @functools.cached_property
    def transformer_config(self) -> dict[str, Any]:
        return self.load_config(MochiTransformer3DModel, "transformer")

    @functools.cached_property
    def compression(self) -> tuple[int, int, int]:
        """(VAE spatial ratio, VAE temporal ratio, transformer patch size)."""
        vae = self.load_config(AutoencoderKLMochi, "vae")
        spatial = math.prod(vae.get("spatial_expansions", (2, 2, 2)))
        temporal = math.prod(vae.get("temporal_expansions", (1, 2, 3)))
        return spatial, temporal, self.transformer_config.get("patch_size", 2)

    def native_max_sequence_length(self) -> int:
        """The transformer's `max_sequence_length` (256, MochiPipeline's default, in the released checkpoint)."""
        return int(self.transformer_config.get("max_sequence_length", 256))

    @functools.cached_property
    def force_zeros_for_empty_prompt(self) -> bool:
        """The pipeline setting of model_index.json (False when there is none)."""
        try:
            config = MochiPipeline.load_config(self.config.pretrained, revision=self.config.revision)
        except (OSError, ValueError):
            return False
        return bool(config.get("force_zeros_for_empty_prompt", False))

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        vae_spatial, temporal, patch = self.compression
        raise_shape_problems("Mochi", [frame_count_problem(frames, temporal), *side_problems(height, width,
                                                                                          vae_spatial * patch)],
                             self, shape_rule(temporal, 1, vae_spatial * patch))

    # ----- loading: the defaults of ModelSpec, with these classes ----------------------------------------------
    text_encoder_class = T5EncoderModel
    vae_class = AutoencoderKLMochi
    denoiser_class = MochiTransformer3DModel
    loads_single_file = True  # Genmo's original layout and ComfyUI's mochi_preview_* files

    def single_file_problem(self, config: dict[str, Any]) -> str | None:
        """diffusers' Mochi converter reads exactly the released model's 48 blocks."""
        if config.get("num_layers") != MOCHI_CONVERTER_LAYERS:
            return (f"diffusers' converter for Mochi files reads the released model's {MOCHI_CONVERTER_LAYERS} "
                    f"blocks; model.pretrained's transformer has {config.get('num_layers')}.")
        return None
    scheduler_class = FlowMatchEulerDiscreteScheduler
    pipeline_class = MochiPipeline

    # ----- tensors ---------------------------------------------------------------------------------
    def condition_identity(self) -> dict[str, Any]:
        # Read from model_index.json, which is not part of the text components' identity.
        return {**super().condition_identity(), "force_zeros_for_empty_prompt": self.force_zeros_for_empty_prompt}

    @torch.no_grad()
    def prepare_conditions(self, text: TextComponents, captions: list[str]) -> Conditions:
        """T5 embeddings + mask exactly as MochiPipeline.encode_prompt computes them."""
        tokenizer, text_encoder = text["tokenizer"], text["text_encoder"]
        tokens = tokenizer(
            list(captions),
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        ids, mask = tokens.input_ids, tokens.attention_mask.bool()
        if self.force_zeros_for_empty_prompt:
            # Per caption; the pipeline zeroes a whole batch when its last prompt is empty.
            empty = torch.tensor([caption == "" for caption in captions])
            ids = torch.where(empty[:, None], torch.zeros_like(ids), ids)
            mask = mask & ~empty[:, None]
        device = text_encoder.device
        embeds = text_encoder(ids.to(device), attention_mask=mask.to(device))[0]
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask.to(device)}

    @staticmethod
    def latent_normalisation(vae: nn.Module, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(shift, scale) with normalised = (raw - shift) * scale, the inverse of the pipeline's decode."""
        config = vae.config
        channels = config.latent_channels
        if config.get("latents_mean") is not None and config.get("latents_std") is not None:
            shift = torch.tensor(config.latents_mean).view(1, channels, 1, 1, 1)
            scale = config.scaling_factor / torch.tensor(config.latents_std).view(1, channels, 1, 1, 1)
        else:
            shift = torch.zeros(1, channels, 1, 1, 1)
            scale = torch.full((1, channels, 1, 1, 1), float(config.scaling_factor))
        return shift.to(like), scale.to(like)

    @torch.no_grad()
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        posterior = self.vae_posterior(vae, videos)  # the VAE's layout is the transformer's
        shift, scale = self.latent_normalisation(vae, posterior.mean)
        return self.normalised_posterior(posterior, scale, shift)

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        return denoiser(
            hidden_states=noisy_latents,
            encoder_hidden_states=conditions["prompt_embeds"],
            timestep=timesteps.to(noisy_latents.dtype),  # the pipeline's timestep dtype
            encoder_attention_mask=conditions["prompt_attention_mask"],
            return_dict=False,
        )[0]

    # ----- ComfyUI ------------------------------------------------------------------------------------
    def comfyui_lora_rules(self) -> list[Rule]:
        """Mochi 1's original names (Genmo's repository, ComfyUI's Mochi model): fused `qkv_x` / `qkv_y`, and
        SwiGLU `w1` and the final modulation with their two halves in the other order than diffusers'."""
        config = self.transformer_config
        inner = config["num_attention_heads"] * config["attention_head_dim"]
        block = r"transformer_blocks\.(\d+)"
        return [
            *fused([rf"{block}\.attn1\.to_{x}" for x in "qkv"], r"blocks.\1.attn.qkv_x", [inner] * 3),
            *fused([rf"{block}\.attn1\.add_{x}_proj" for x in "qkv"], r"blocks.\1.attn.qkv_y", [inner] * 3),
            Rule(rf"{block}\.attn1\.to_out\.0", r"blocks.\1.attn.proj_x"),
            Rule(rf"{block}\.attn1\.to_add_out", r"blocks.\1.attn.proj_y"),
            # Genmo's w1 puts the half that goes through SiLU first, diffusers' SwiGLU puts it second.
            Rule(rf"{block}\.ff\.net\.0\.proj", r"blocks.\1.mlp_x.w1", swap_halves=True),
            Rule(rf"{block}\.ff\.net\.2", r"blocks.\1.mlp_x.w2"),
            Rule(rf"{block}\.ff_context\.net\.0\.proj", r"blocks.\1.mlp_y.w1", swap_halves=True),
            Rule(rf"{block}\.ff_context\.net\.2", r"blocks.\1.mlp_y.w2"),
            Rule(rf"{block}\.norm1\.linear", r"blocks.\1.mod_x"),
            Rule(rf"{block}\.norm1_context\.linear(?:_1)?", r"blocks.\1.mod_y"),
            Rule(r"time_embed\.timestep_embedder\.linear_1", "t_embedder.mlp.0"),
            Rule(r"time_embed\.timestep_embedder\.linear_2", "t_embedder.mlp.2"),
            Rule(r"time_embed\.pooler\.(to_kv|to_q|to_out)", r"t5_y_embedder.\1"),
            Rule(r"time_embed\.caption_proj", "t5_yproj"),
            Rule(r"proj_out", "final_layer.linear"),
            # The original modulation gives (shift, scale), diffusers' AdaLayerNormContinuous (scale, shift).
            Rule(r"norm_out\.linear", "final_layer.mod", swap_halves=True),
        ]

    def comfyui_model(self) -> ComfyUIModel:
        return mochi(self.transformer_config)

    def comfyui_workflow(self) -> WorkflowLayout:
        """Comfy-Org's repackaged Mochi preview, T5-XXL and VAE; Genmo's linear-quadratic schedule, which ComfyUI
        has as the `linear_quadratic` scheduler and MochiPipeline samples with."""
        files = ModelFiles(("mochi_preview_bf16.safetensors",), ("t5xxl_fp16.safetensors",), "mochi",
                           "mochi_vae.safetensors")
        return WorkflowLayout(files, mochi_parts, scheduler="linear_quadratic")

    # ----- pipeline and outputs ----------------------------------------------------------------------
    def pipeline(self, text: TextComponents, vae: nn.Module, denoiser: nn.Module) -> MochiPipeline:
        return MochiPipeline(
            scheduler=self.load_scheduler(),
            vae=vae,
            text_encoder=text["text_encoder"],
            tokenizer=text["tokenizer"],
            transformer=denoiser,
            force_zeros_for_empty_prompt=self.force_zeros_for_empty_prompt,
        )
