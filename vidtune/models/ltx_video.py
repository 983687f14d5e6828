"""LTX-Video (Lightricks): T5 text encoder, causal video VAE, and a DiT over packed latent tokens."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from diffusers import (
    AutoencoderKLLTXVideo,
    FlowMatchEulerDiscreteScheduler,
    LTXPipeline,
    LTXVideoTransformer3DModel,
)
from torch import nn
from transformers import T5EncoderModel

from vidtune.export.comfyui import Rule
from vidtune.models.defaults import FamilyDefaults
from vidtune.models.spec import (
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


class LTXVideoSpec(ModelSpec):
    name = "ltx-video"
    control_input_layer = "proj_in"  # Linear over packed patches [B, F*H*W, C*pt*p*p]
    validation_guidance_scale = 3.0
    defaults = FamilyDefaults(frames=49, height=512, width=768, fps=25.0, source=(
        "finetrainers' LTX-Video LoRA recipe (49x512x768, logit-normal); LTXPipeline's frame_rate and guidance"))

    # ----- shape rules, read from the VAE / transformer configs (no weights needed) --------------------
    @functools.cached_property
    def compression(self) -> tuple[int, int, int, int]:
        """(VAE spatial ratio, VAE temporal ratio, transformer patch size, transformer temporal patch)."""
        vae = self.load_config(AutoencoderKLLTXVideo, "vae")
        scaling = 2 ** sum(vae["spatio_temporal_scaling"])
        spatial = vae.get("spatial_compression_ratio") or vae["patch_size"] * scaling
        temporal = vae.get("temporal_compression_ratio") or vae["patch_size_t"] * scaling
        transformer = self.load_config(LTXVideoTransformer3DModel, "transformer")
        return spatial, temporal, transformer.get("patch_size", 1), transformer.get("patch_size_t", 1)

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        vae_spatial, temporal, patch, patch_t = self.compression
        raise_shape_problems("LTX-Video", [
            frame_count_problem(frames, temporal, patch_t), *side_problems(height, width, vae_spatial * patch)
        ], self, shape_rule(temporal, patch_t, vae_spatial * patch))

    # ----- loading: the defaults of ModelSpec, with these classes ----------------------------------------------
    text_encoder_class = T5EncoderModel
    vae_class = AutoencoderKLLTXVideo
    denoiser_class = LTXVideoTransformer3DModel
    scheduler_class = FlowMatchEulerDiscreteScheduler
    pipeline_class = LTXPipeline

    # ----- tensors ---------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare_conditions(self, text: TextComponents, captions: list[str]) -> Conditions:
        """T5 embeddings + mask, exactly as LTXPipeline.encode_prompt computes them."""
        tokenizer, text_encoder = text["tokenizer"], text["text_encoder"]
        tokens = tokenizer(
            list(captions),
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        device = text_encoder.device
        # The pipeline runs T5 without the attention mask and applies the mask in the transformer only.
        embeds = text_encoder(tokens.input_ids.to(device))[0]
        return {"prompt_embeds": embeds, "prompt_attention_mask": tokens.attention_mask.bool().to(device)}

    @torch.no_grad()
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        # [B, F, C, H, W] -> [B, C, F, H, W], the VAE's layout.
        pixels = videos.to(device=vae.device, dtype=vae.dtype).permute(0, 2, 1, 3, 4)
        posterior = vae.encode(pixels).latent_dist
        mean_shift = vae.latents_mean.view(1, -1, 1, 1, 1).to(posterior.mean)
        scale = (vae.config.scaling_factor / vae.latents_std).view(1, -1, 1, 1, 1).to(posterior.mean)
        # The pipeline decodes latents * std / scaling + mean; normalise so that inverts it.
        return {"latents_mean": (posterior.mean - mean_shift) * scale, "latents_std": posterior.std * scale}

    def rope_interpolation_scale(self) -> tuple[float, float, float]:
        """The scale LTXPipeline passes at inference; training with another one builds an unusable model."""
        spatial, temporal, _, _ = self.compression
        return (temporal / self.frame_rate, spatial, spatial)

    def pack_control(self, control: torch.Tensor, denoiser: nn.Module) -> tuple[torch.Tensor, int]:
        """Packed like the latents ([B, tokens, C * patch volume], channels most significant): appended on the
        last dimension, the control's patches meet the widened inputs of `proj_in`."""
        config = denoiser.config
        return LTXPipeline._pack_latents(control, config.patch_size, config.patch_size_t), -1

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        patch = denoiser.config.patch_size
        patch_t = denoiser.config.patch_size_t
        _, _, frames, height, width = noisy_latents.shape
        packed = LTXPipeline._pack_latents(noisy_latents, patch, patch_t)
        prediction = denoiser(
            hidden_states=packed,
            encoder_hidden_states=conditions["prompt_embeds"],
            timestep=timesteps,
            encoder_attention_mask=conditions["prompt_attention_mask"],
            num_frames=frames // patch_t,
            height=height // patch,
            width=width // patch,
            rope_interpolation_scale=self.rope_interpolation_scale(),
            return_dict=False,
        )[0]
        return LTXPipeline._unpack_latents(
            prediction, frames // patch_t, height // patch, width // patch, patch, patch_t
        )

    # ----- ComfyUI ------------------------------------------------------------------------------------
    def comfyui_lora_rules(self) -> list[Rule]:
        """The original names (Lightricks' LTX-Video, ComfyUI's LTXV model) are diffusers' inside the blocks; the
        patch projection and the timestep embedding are named differently (diffusers' LTX-Video converter only
        strips `diffusion_model.`, so it reads back the block keys, not these two)."""
        block = r"transformer_blocks\.\d+\.(?:attn[12]\.(?:to_q|to_k|to_v|to_out\.0)|ff\.net\.(?:0\.proj|2))"
        return [
            Rule(f"({block})", r"\1"),
            Rule(r"caption_projection\.(linear_[12])", r"caption_projection.\1"),
            Rule(r"proj_out", "proj_out"),
            Rule(r"proj_in", "patchify_proj"),
            Rule(r"time_embed\.(emb\.timestep_embedder\.linear_[12]|linear)", r"adaln_single.\1"),
        ]

    # ----- pipeline and outputs ----------------------------------------------------------------------
    def pipeline(self, text: TextComponents, vae: nn.Module, denoiser: nn.Module) -> LTXPipeline:
        return LTXPipeline(
            scheduler=self.load_scheduler(),
            vae=vae,
            text_encoder=text["text_encoder"],
            tokenizer=text["tokenizer"],
            transformer=denoiser,
        )

    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        return {"frame_rate": self.frame_rate}

    def latents_from_pipeline(self, latents: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
        spatial, temporal, patch, patch_t = self.compression
        return LTXPipeline._unpack_latents(
            latents, ((frames - 1) // temporal + 1) // patch_t, height // spatial // patch, width // spatial // patch,
            patch, patch_t,
        )
