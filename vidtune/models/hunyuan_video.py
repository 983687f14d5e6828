"""HunyuanVideo (Tencent): Llama + CLIP text encoders, causal 3D VAE, and a guidance-distilled dual-stream DiT.

Conventions taken from diffusers' HunyuanVideoPipeline:
    text: the caption is wrapped in the pipeline's Llama prompt template, encoded with the attention mask,
        the hidden state of the third-to-last layer is kept and the template's first `crop_start` tokens
        are cropped (right padding, so the mask stays a prefix); CLIP's pooled output is the second input;
    latents: the VAE posterior times `vae.config.scaling_factor` (the pipeline decodes latents / scaling);
    guidance: the transformer's guidance embedding is given `model.guidance_scale * 1000` in training and
        in sampling alike (default 1.0: the unguided, data distribution; the pipeline samples at 6.0);
    captions: `model.max_sequence_length` Llama tokens after the template, default 256 as in the pipeline.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideoPipeline,
    HunyuanVideoTransformer3DModel,
)
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
from torch import nn
from transformers import AutoTokenizer, CLIPTextModel, LlamaModel

from vidtune.export.comfyui import Rule, fused
from vidtune.export.comfyui_models import ComfyUIModel, hunyuan_video
from vidtune.export.comfyui_workflow import ModelFiles, WorkflowLayout, hunyuan_video_parts
from vidtune.models.defaults import HUNYUAN_VIDEO
from vidtune.models.hunyuan_comfyui import embedder, shared_rules
from vidtune.models.spec import (
    ALL_LINEAR,
    ATTENTION_TARGETS,
    FEED_FORWARD_TARGETS,
    JOINT_ATTENTION_TARGETS,
    Conditions,
    Latents,
    ModelSpec,
    StepCallback,
    TextComponents,
    frame_count_problem,
    raise_shape_problems,
    shape_rule,
    side_problems,
    step_callback,
)

logger = logging.getLogger(__name__)

PROMPT_TEMPLATE: dict[str, Any] = dict(DEFAULT_PROMPT_TEMPLATE)  # the template text and crop_start (95)
LLAMA_LAYERS_TO_SKIP = 2  # the pipeline keeps hidden_states[-(2 + 1)]
CLIP_MAX_LENGTH = 77
DEFAULT_MAX_SEQUENCE_LENGTH = 256  # HunyuanVideoPipeline's default
DEFAULT_GUIDANCE_SCALE = 1.0
PIPELINE_SIDE_MULTIPLE = 16  # HunyuanVideoPipeline.check_inputs rejects other sizes
# diffusers' convert_hunyuan_video_transformer_to_diffusers splits single blocks at this width (single_file_utils.py)
HUNYUAN_CONVERTER_WIDTH = 3072


class HunyuanVideoSpec(ModelSpec):
    name = "hunyuan-video"
    defaults = HUNYUAN_VIDEO
    control_input_layer = "x_embedder.proj"  # Conv3d over [B, C, F, H, W]
    # The dual-stream blocks, then the single-stream ones (the token refiner's two small blocks stay in place).
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    # Joint attention: the text stream has projections of its own. `proj_mlp` is the single blocks' MLP input; their
    # output `proj_out` (attention and MLP fused) shares its name with the final projection: only `all-linear` has it.
    lora_presets: ClassVar[dict[str, tuple[str, ...]]] = {
        "attention": ATTENTION_TARGETS + JOINT_ATTENTION_TARGETS,
        "attention+ffn": ATTENTION_TARGETS + JOINT_ATTENTION_TARGETS + FEED_FORWARD_TARGETS
        + ("ff_context.net.0.proj", "ff_context.net.2", "proj_mlp"),
        ALL_LINEAR: (ALL_LINEAR,),
    }

    def required_components(self) -> tuple[str, ...]:
        return ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "vae", "transformer", "scheduler")

    @property
    def guidance_scale(self) -> float:
        """The embedded guidance the denoiser is trained and sampled with."""
        value = getattr(self.config, "guidance_scale", None)
        return DEFAULT_GUIDANCE_SCALE if value is None else float(value)

    def native_max_sequence_length(self) -> int:
        """Llama tokens kept after the template: the pipeline's 256."""
        return DEFAULT_MAX_SEQUENCE_LENGTH

    # ----- shape rules, read from the VAE / transformer configs (no weights needed) --------------------
    @functools.cached_property
    def compression(self) -> tuple[int, int, int, int]:
        """(VAE spatial ratio, VAE temporal ratio, transformer patch size, transformer temporal patch)."""
        vae = self.load_config(AutoencoderKLHunyuanVideo, "vae")
        transformer = self.load_config(HunyuanVideoTransformer3DModel, "transformer")
        return (
            vae.get("spatial_compression_ratio", 8),
            vae.get("temporal_compression_ratio", 4),
            transformer.get("patch_size", 2),
            transformer.get("patch_size_t", 1),
        )

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        vae_spatial, temporal, patch, patch_t = self.compression
        spatial = math.lcm(vae_spatial * patch, PIPELINE_SIDE_MULTIPLE)
        raise_shape_problems("HunyuanVideo", [frame_count_problem(frames, temporal, patch_t),
                                              *side_problems(height, width, spatial)],
                             self, shape_rule(temporal, patch_t, spatial))

    # ----- loading ---------------------------------------------------------------------------------
    def load_text_components(self, device: torch.device, load_on: torch.device | None = None) -> TextComponents:
        dtype = self.component_dtype("text_encoder", device)
        tokenizer = self.load_component(AutoTokenizer, "tokenizer")
        tokenizer_2 = self.load_component(AutoTokenizer, "tokenizer_2")
        text_encoder = self.load_component(LlamaModel, "text_encoder", torch_dtype=dtype)
        text_encoder_2 = self.load_component(CLIPTextModel, "text_encoder_2", torch_dtype=dtype)
        for encoder in (text_encoder, text_encoder_2):
            encoder.requires_grad_(False).eval().to(load_on or device)
        return TextComponents({
            "tokenizer": tokenizer,
            "text_encoder": text_encoder,
            "tokenizer_2": tokenizer_2,
            "text_encoder_2": text_encoder_2,
        })

    vae_class = AutoencoderKLHunyuanVideo
    denoiser_class = HunyuanVideoTransformer3DModel
    loads_single_file = True  # Tencent's original layout and ComfyUI's hunyuan_video_* files

    def single_file_problem(self, config: dict[str, Any]) -> str | None:
        """diffusers' HunyuanVideo converter splits each single-stream block's fused projection at the released
        model's width (3072)."""
        width = config.get("num_attention_heads", 0) * config.get("attention_head_dim", 0)
        if config.get("num_single_layers", 0) and width != HUNYUAN_CONVERTER_WIDTH:
            return (f"diffusers' converter for HunyuanVideo files splits the single-stream blocks at the released "
                    f"model's width {HUNYUAN_CONVERTER_WIDTH}; model.pretrained's transformer is {width} wide.")
        return None
    scheduler_class = FlowMatchEulerDiscreteScheduler
    pipeline_class = HunyuanVideoPipeline

    # ----- tensors ---------------------------------------------------------------------------------
    def condition_identity(self) -> dict[str, Any]:
        # Read at call time, so the key follows the constants prepare_conditions uses.
        return {**super().condition_identity(), "prompt_template": PROMPT_TEMPLATE,
                "llama_layers_to_skip": LLAMA_LAYERS_TO_SKIP, "clip_max_length": CLIP_MAX_LENGTH}

    @torch.no_grad()
    def prepare_conditions(self, text: TextComponents, captions: list[str]) -> Conditions:
        """Llama embeddings + mask and CLIP pooled embeddings, exactly as HunyuanVideoPipeline.encode_prompt."""
        captions = list(captions)
        tokenizer, text_encoder = text["tokenizer"], text["text_encoder"]
        crop_start = PROMPT_TEMPLATE["crop_start"]
        tokens = tokenizer(
            [PROMPT_TEMPLATE["template"].format(caption) for caption in captions],
            max_length=self.max_sequence_length + crop_start,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
            return_attention_mask=True,
        )
        device = text_encoder.device
        mask = tokens.attention_mask.to(device)
        hidden = text_encoder(
            input_ids=tokens.input_ids.to(device), attention_mask=mask, output_hidden_states=True
        ).hidden_states[-(LLAMA_LAYERS_TO_SKIP + 1)]
        prompt_embeds, mask = hidden[:, crop_start:], mask[:, crop_start:]

        tokenizer_2, text_encoder_2 = text["tokenizer_2"], text["text_encoder_2"]
        clip_tokens = tokenizer_2(
            captions, padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True, return_tensors="pt"
        )
        pooled = text_encoder_2(clip_tokens.input_ids.to(text_encoder_2.device), output_hidden_states=False)
        return {
            "prompt_embeds": prompt_embeds,
            "prompt_attention_mask": mask.bool(),
            "pooled_prompt_embeds": pooled.pooler_output.to(prompt_embeds.dtype),
        }

    @torch.no_grad()
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        # The pipeline decodes latents / scaling_factor.
        return self.normalised_posterior(self.vae_posterior(vae, videos), vae.config.scaling_factor)

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
        guidance_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`guidance_scale`: per clip, the embedded guidance instead of `model.guidance_scale` (guidance
        distillation teaches the embedding a range of scales)."""
        batch = noisy_latents.shape[0]
        guidance = None
        if denoiser.config.guidance_embeds:
            scale = torch.full((batch,), self.guidance_scale) if guidance_scale is None else guidance_scale
            guidance = (scale * 1000.0).to(device=noisy_latents.device, dtype=noisy_latents.dtype)
        return denoiser(
            hidden_states=noisy_latents,
            timestep=timesteps.to(noisy_latents.device),
            encoder_hidden_states=conditions["prompt_embeds"].to(noisy_latents.dtype),
            encoder_attention_mask=conditions["prompt_attention_mask"],
            pooled_projections=conditions["pooled_prompt_embeds"].to(noisy_latents.dtype),
            guidance=guidance,
            return_dict=False,
        )[0]

    # ----- ComfyUI ------------------------------------------------------------------------------------
    def comfyui_lora_rules(self) -> list[Rule]:
        """The double blocks, text refiner and final layer as 1.5's (`hunyuan_comfyui.shared_rules`), and 1.0's own
        layers: a single block's fused `linear1` (q, k, v and the MLP input), the guidance and pooled-text
        embedders."""
        config = self.load_config(HunyuanVideoTransformer3DModel, "transformer")
        hidden = config["num_attention_heads"] * config["attention_head_dim"]
        mlp = int(hidden * config["mlp_ratio"])
        single = r"single_transformer_blocks\.(\d+)"
        return [
            *shared_rules(hidden, r"time_text_embed\.timestep_embedder"),
            *fused([rf"{single}\.attn\.to_{x}" for x in "qkv"] + [rf"{single}\.proj_mlp"],
                   r"single_blocks.\1.linear1", [hidden] * 3 + [mlp]),
            Rule(rf"{single}\.proj_out", r"single_blocks.\1.linear2"),
            Rule(rf"{single}\.norm\.linear", r"single_blocks.\1.modulation.linear"),
            *embedder(r"time_text_embed\.guidance_embedder", "guidance_in"),
            *embedder(r"time_text_embed\.text_embedder", "vector_in"),
        ]

    def comfyui_model(self) -> ComfyUIModel:
        config = self.load_config(HunyuanVideoTransformer3DModel, "transformer")
        return hunyuan_video(config["num_layers"], config["num_single_layers"], config["num_refiner_layers"],
                             guidance=bool(config["guidance_embeds"]), vector=True)

    def comfyui_workflow(self) -> WorkflowLayout:
        """`hunyuan_video_text_to_video`: Comfy-Org's repackaged 720p model, CLIP-L and LLaVA-Llama-3, and the
        embedded guidance this run trains with (model.guidance_scale)."""
        embeds = bool(self.load_config(HunyuanVideoTransformer3DModel, "transformer")["guidance_embeds"])
        files = ModelFiles(("hunyuan_video_t2v_720p_bf16.safetensors",),
                           ("clip_l.safetensors", "llava_llama3_fp8_scaled.safetensors"), "hunyuan_video",
                           "hunyuan_video_vae_bf16.safetensors")
        return WorkflowLayout(files, functools.partial(hunyuan_video_parts,
                                                       embedded=self.guidance_scale if embeds else None))

    # ----- pipeline and outputs ----------------------------------------------------------------------
    def pipeline(self, text: TextComponents, vae: nn.Module, denoiser: nn.Module) -> HunyuanVideoPipeline:
        return HunyuanVideoPipeline(
            text_encoder=text["text_encoder"],
            tokenizer=text["tokenizer"],
            transformer=denoiser,
            vae=vae,
            scheduler=self.load_scheduler(),
            text_encoder_2=text["text_encoder_2"],
            tokenizer_2=text["tokenizer_2"],
        )

    def call_pipeline(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                      num_inference_steps: int, guidance_scale: float, generator: torch.Generator, output_type: str,
                      reference: torch.Tensor | None = None, callback: StepCallback | None = None) -> Any:
        """The embedded guidance is the trained `model.guidance_scale`; `guidance_scale` here (validation's) is
        HunyuanVideo's true classifier-free guidance against an empty prompt, off at 1.0."""
        return pipeline(
            prompt=prompt,
            negative_prompt="" if guidance_scale > 1.0 else None,
            num_frames=frames,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=self.guidance_scale,
            true_cfg_scale=guidance_scale,
            prompt_template=PROMPT_TEMPLATE,
            max_sequence_length=self.max_sequence_length,
            generator=generator,
            output_type=output_type,
            **step_callback(callback),
        )
