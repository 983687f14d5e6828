"""Wan 2.1 (Alibaba): UMT5 text encoder, causal video VAE, and a DiT with cross-attention to the text.

`wan` is text-to-video (WanPipeline), `wan-i2v` image-to-video (WanImageToVideoPipeline). Conventions taken
from those pipelines:
    text: the cleaned caption is tokenised to `max_sequence_length` tokens (default 512, the pipelines'),
        encoded by UMT5 with the attention mask, then each embedding is cut to its caption's length and
        zero padded back (the transformer has no text mask: padding is zeros, not pad-token states);
    latents: the VAE posterior normalised per channel, (z - vae.config.latents_mean) / vae.config.latents_std,
        which the pipelines invert before decoding;
    objective: flow matching, read from the scheduler (UniPC with flow_prediction / use_flow_sigmas).
Image-to-video adds two video-derived conditions, computed in `prepare_latents` from each clip's first
frame: `image_embeds` (the CLIP vision encoder's penultimate hidden states) and `image_condition` (four
mask channels plus the normalised latents of the first frame followed by zero frames), which `forward`
concatenates to the noisy latents on the channel dim, as the pipeline does.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from typing import Any, ClassVar

import diffusers
import torch
from diffusers import (
    AutoencoderKLWan,
    SchedulerMixin,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from diffusers.utils import is_ftfy_available
from torch import nn
from transformers import CLIPImageProcessor, CLIPVisionModel, UMT5EncoderModel

from vidtune.errors import ConfigError, SchedulerError
from vidtune.export.comfyui import Rule
from vidtune.export.comfyui_models import ComfyUIModel, wan21
from vidtune.export.comfyui_workflow import ModelFiles, WorkflowLayout, wan_parts
from vidtune.models.defaults import WAN
from vidtune.models.spec import (
    ALL_LINEAR,
    ATTENTION_TARGETS,
    Conditions,
    Latents,
    ModelSpec,
    TextComponents,
    VAEWithExtras,
    frame_count_problem,
    frames_to_pil,
    raise_shape_problems,
    shape_rule,
    side_problems,
)
from vidtune.models.wan_modes import WanConditioningModes
from vidtune.objectives import SUPPORTED_SCHEDULERS

logger = logging.getLogger(__name__)

DEFAULT_MAX_SEQUENCE_LENGTH = 512  # WanPipeline's default; WanImageToVideoPipeline's transformer requires it


def _ftfy_version() -> str | None:
    """The ftfy that `prompt_clean` uses, or None when it is not installed."""
    if not is_ftfy_available():
        return None
    try:
        return importlib.metadata.version("ftfy")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


WAN_FEED_FORWARD_TARGETS = ("ffn.net.0.proj", "ffn.net.2")  # Wan names its blocks' feed-forward `ffn`



def wan_vae_compression(spec: ModelSpec) -> tuple[int, int, tuple[int, int, int]]:
    """(VAE spatial ratio, VAE temporal ratio, transformer patch size (t, h, w)) of a model on Wan 2.1's VAE, read
    from the VAE's and the transformer's configs (no weights needed)."""
    vae = spec.load_config(AutoencoderKLWan, "vae")
    spatial = vae.get("scale_factor_spatial") or 2 ** (len(vae.get("dim_mult", [1, 2, 4, 4])) - 1)
    temporal = vae.get("scale_factor_temporal") or 2 ** sum(vae.get("temperal_downsample", [False, True, True]))
    transformer = spec.load_config(spec.denoiser_class, "transformer")
    return spatial, temporal, tuple(transformer.get("patch_size", (1, 2, 2)))
# Comfy-Org's repackaged umT5-XXL (the text encoder of every Wan workflow template).
WAN_TEXT_ENCODERS = ("umt5_xxl_fp8_e4m3fn_scaled.safetensors",)


class WanSpec(ModelSpec):
    name = "wan"
    control_input_layer = "patch_embedding"  # Conv3d over [B, C, F, H, W]
    block_lists = ("blocks",)
    validation_guidance_scale = 5.0
    defaults = WAN
    model_title: ClassVar[str] = "Wan"  # the published models' name in messages
    pipeline_class = WanPipeline
    lora_presets: ClassVar[dict[str, tuple[str, ...]]] = {
        "attention": ATTENTION_TARGETS,
        "attention+ffn": ATTENTION_TARGETS + WAN_FEED_FORWARD_TARGETS,
        ALL_LINEAR: (ALL_LINEAR,),
    }

    def native_max_sequence_length(self) -> int:
        """UMT5 tokens per caption: the pipelines' 512."""
        return DEFAULT_MAX_SEQUENCE_LENGTH

    # ----- shape rules, read from the VAE / transformer configs (no weights needed) --------------------
    @functools.cached_property
    def compression(self) -> tuple[int, int, tuple[int, int, int]]:
        """(VAE spatial ratio, VAE temporal ratio, transformer patch size (t, h, w))."""
        return wan_vae_compression(self)

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        vae_spatial, temporal, patch = self.compression
        raise_shape_problems(self.model_title, [frame_count_problem(frames, temporal, patch[0]),
                                     *side_problems(height, width, vae_spatial * patch[1], vae_spatial * patch[2])],
                             self, shape_rule(temporal, patch[0], vae_spatial * patch[1], vae_spatial * patch[2]))

    # ----- loading ---------------------------------------------------------------------------------
    text_encoder_class = UMT5EncoderModel
    vae_class = AutoencoderKLWan
    denoiser_class = WanTransformer3DModel
    loads_single_file = True  # Wan-AI's original layout and ComfyUI's wan2.1_* / wan2.2_* files

    def load_scheduler(self) -> Any:
        """The scheduler class the checkpoint names (Wan ships UniPCMultistepScheduler with flow sigmas)."""
        name = self.load_config(UniPCMultistepScheduler, "scheduler").get("_class_name", "UniPCMultistepScheduler")
        scheduler_class = getattr(diffusers, str(name), None)
        if not (isinstance(scheduler_class, type) and issubclass(scheduler_class, SchedulerMixin)):
            raise SchedulerError(
                f"{self.describe_file('scheduler', 'scheduler_config.json')}: _class_name {name!r} is not a diffusers "
                f"scheduler. Supported: {SUPPORTED_SCHEDULERS}."
            )
        return self.load_component(scheduler_class, "scheduler")

    # ----- tensors ---------------------------------------------------------------------------------
    def condition_identity(self) -> dict[str, Any]:
        # diffusers' prompt_clean fixes captions with ftfy only when it is installed: other text, other embeddings.
        return {**super().condition_identity(), "ftfy": _ftfy_version()}

    @torch.no_grad()
    def prepare_conditions(self, text: TextComponents, captions: list[str]) -> Conditions:
        """UMT5 embeddings, exactly as WanPipeline.encode_prompt computes them."""
        tokenizer, text_encoder = text["tokenizer"], text["text_encoder"]
        length = self.max_sequence_length
        tokens = tokenizer(
            [prompt_clean(caption) for caption in captions],
            padding="max_length",
            max_length=length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        device = text_encoder.device
        mask = tokens.attention_mask.to(device)
        embeds = text_encoder(tokens.input_ids.to(device), mask).last_hidden_state
        # Keep each caption's own tokens and zero the rest (the pipeline's trim + zero padding).
        keep = torch.arange(length, device=device)[None, :] < mask.gt(0).sum(dim=1, keepdim=True)
        return {"prompt_embeds": embeds * keep[..., None].to(embeds.dtype)}

    def normalise(self, vae: nn.Module, latents: torch.Tensor, shift: bool = True) -> torch.Tensor:
        """(z - latents_mean) / latents_std per channel, as the Wan pipelines normalise (inverted to decode)."""
        channels = vae.config.z_dim
        std = torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1).to(latents)
        if not shift:
            return latents / std
        mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1).to(latents)
        return (latents - mean) / std

    @torch.no_grad()
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        posterior = self.vae_posterior(vae, videos)
        return {
            "latents_mean": self.normalise(vae, posterior.mean),
            "latents_std": self.normalise(vae, posterior.std, shift=False),
        }

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        return denoiser(
            hidden_states=noisy_latents,
            timestep=timesteps.to(noisy_latents.device),
            encoder_hidden_states=conditions["prompt_embeds"].to(noisy_latents.dtype),
            return_dict=False,
        )[0]

    # ----- ComfyUI ------------------------------------------------------------------------------------
    def comfyui_lora_rules(self) -> list[Rule]:
        """Wan 2.1's original names (Wan-Video's repository, ComfyUI's WAN model), as diffusers' Wan converter
        reads them; image-to-video adds the image keys and values of cross-attention and the image embedder."""
        projections = {r"to_q": "q", r"to_k": "k", r"to_v": "v", r"to_out\.0": "o", r"add_k_proj": "k_img",
                       r"add_v_proj": "v_img"}
        rules = [Rule(rf"blocks\.(\d+)\.{attention}\.{ours}", rf"blocks.\1.{theirs}.{original}")
                 for attention, theirs in (("attn1", "self_attn"), ("attn2", "cross_attn"))
                 for ours, original in projections.items()]
        return [
            *rules,
            Rule(r"blocks\.(\d+)\.ffn\.net\.0\.proj", r"blocks.\1.ffn.0"),
            Rule(r"blocks\.(\d+)\.ffn\.net\.2", r"blocks.\1.ffn.2"),
            Rule(r"condition_embedder\.time_proj", "time_projection.1"),
            Rule(r"condition_embedder\.text_embedder\.linear_1", "text_embedding.0"),
            Rule(r"condition_embedder\.text_embedder\.linear_2", "text_embedding.2"),
            Rule(r"condition_embedder\.time_embedder\.linear_1", "time_embedding.0"),
            Rule(r"condition_embedder\.time_embedder\.linear_2", "time_embedding.2"),
            Rule(r"condition_embedder\.image_embedder\.ff\.net\.0\.proj", "img_emb.proj.1"),
            Rule(r"condition_embedder\.image_embedder\.ff\.net\.2", "img_emb.proj.3"),
            Rule(r"proj_out", "head.head"),
        ]

    def comfyui_model(self) -> ComfyUIModel:
        return wan21(self.load_config(self.denoiser_class, "transformer"))

    def comfyui_workflow(self) -> WorkflowLayout | None:
        """Comfy-Org's repackaged Wan 2.1 files (`text_to_video_wan`, `image_to_video_wan`): the 1.3B or 14B
        text-to-video model by size, the 480p image-to-video model with CLIP vision H."""
        large = self.load_config(self.denoiser_class, "transformer")["num_layers"] > 30
        model = ("wan2.1_i2v_480p_14B_fp16.safetensors" if self.image_to_video
                 else f"wan2.1_t2v_{'14B' if large else '1.3B'}_fp16.safetensors")
        files = ModelFiles((model,), WAN_TEXT_ENCODERS, "wan", "wan_2.1_vae.safetensors",
                           clip_vision="clip_vision_h.safetensors" if self.image_to_video else "")
        return WorkflowLayout(files, functools.partial(wan_parts, image=self.image_to_video,
                                                       latent_node="EmptyHunyuanLatentVideo"))

    # ----- pipeline and outputs ----------------------------------------------------------------------
    def pipeline(self, text: TextComponents, vae: nn.Module, denoiser: nn.Module) -> Any:
        return self.pipeline_class(
            tokenizer=text["tokenizer"],
            text_encoder=text["text_encoder"],
            vae=vae,
            scheduler=self.load_scheduler(),
            transformer=denoiser,
        )


class WanImageEncoders(VAEWithExtras):
    """What `WanImageToVideoSpec.load_vae` returns: the VAE with the CLIP image encoder and its processor.

    Opaque to trainers (they only hand it back to the spec); the spec's `prepare_latents` and `pipeline`
    take it apart.
    """

    def __init__(self, vae: nn.Module, image_encoder: nn.Module, image_processor: Any) -> None:
        super().__init__(vae)
        self.image_encoder = image_encoder
        self.image_processor = image_processor


class EmbeddedPrompts:
    """Prompts handed to the pipeline as embeddings computed like `WanSpec.prepare_conditions`, mixed into a `WanSpec`
    subclass whose pipeline cleans prompts with `ftfy` unconditionally (WanImageToVideoPipeline, the SkyReels V2
    pipelines; WanPipeline only when it is installed): handing it embeddings keeps ftfy optional."""

    def prompt_inputs(self, pipeline: Any, prompt: str, guidance_scale: float) -> dict[str, Any]:
        text = TextComponents({"tokenizer": pipeline.tokenizer, "text_encoder": pipeline.text_encoder})
        inputs = {"prompt_embeds": self.prepare_conditions(text, [prompt])["prompt_embeds"]}
        if guidance_scale > 1.0:
            inputs["negative_prompt_embeds"] = self.prepare_conditions(text, [""])["prompt_embeds"]
        return inputs


class WanImageConditioning(WanConditioningModes, EmbeddedPrompts):
    """What WanImageToVideoPipeline's families share (Wan 2.1 image-to-video, Wan 2.2 I2V-A14B, SkyReels V2
    image-to-video), mixed into a `WanSpec` subclass (it uses the spec's `normalise` and `prepare_conditions`): the
    first frame as mask channels + latents concatenated to the input, the conditioning modes
    (vidtune/models/wan_modes.py), and prompts handed to the pipeline as embeddings."""

    @torch.no_grad()
    def image_condition(self, vae: nn.Module, first_frames: torch.Tensor, frames: int,
                        last_frames: torch.Tensor | None = None) -> torch.Tensor:
        """Mask channels + normalised latents of [first frame, zeros...] (or [first frame, zeros..., last frame]),
        as WanImageToVideoPipeline.prepare_latents builds them from `image` (and `last_image`)."""
        batch, channels, height, width = first_frames.shape
        pixels = first_frames.to(device=vae.device, dtype=vae.dtype).unsqueeze(2)
        last = [] if last_frames is None else [last_frames.to(pixels).unsqueeze(2)]
        blank = pixels.new_zeros(batch, channels, frames - 1 - len(last), height, width)
        latents = self.normalise(vae, vae.encode(torch.cat([pixels, blank, *last], dim=2)).latent_dist.mode())
        temporal = vae.config.scale_factor_temporal
        _, _, latent_frames, latent_height, latent_width = latents.shape
        # One mask value per pixel frame, the first repeated `temporal` times, folded into `temporal` channels.
        mask = torch.zeros(batch, 1, frames + temporal - 1, latent_height, latent_width, device=latents.device)
        mask[:, :, :temporal] = 1
        if last:
            mask[:, :, -1] = 1
        mask = mask.view(batch, latent_frames, temporal, latent_height, latent_width).transpose(1, 2)
        return torch.cat([mask.to(latents.dtype), latents], dim=1)


class WanImageToVideoSpec(WanImageConditioning, WanSpec):
    """Wan 2.1 image-to-video. The conditioning image of `sample` is the first frame of its `reference` clip
    (validation gives the first dataset clip)."""

    name = "wan-i2v"
    image_to_video = True
    pipeline_class = WanImageToVideoPipeline
    # The classes the pipeline's image encoder and processor may be (the checkpoint's model_index.json says which).
    image_encoder_classes: ClassVar[tuple[type, ...]] = (CLIPVisionModel,)
    image_processor_classes: ClassVar[tuple[type, ...]] = (CLIPImageProcessor,)
    # The cross-attention to the image has key / value projections of its own (diffusers pads a text-to-video
    # adapter with zeros there).
    lora_presets: ClassVar[dict[str, tuple[str, ...]]] = {
        "attention": (*ATTENTION_TARGETS, "add_k_proj", "add_v_proj"),
        "attention+ffn": (*ATTENTION_TARGETS, "add_k_proj", "add_v_proj", *WAN_FEED_FORWARD_TARGETS),
        ALL_LINEAR: (ALL_LINEAR,),
    }

    def required_components(self) -> tuple[str, ...]:
        return (*super().required_components(), "image_encoder", "image_processor")

    @functools.cached_property
    def max_sequence_length(self) -> int:
        length = self.config.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        if length != DEFAULT_MAX_SEQUENCE_LENGTH:
            # The transformer splits its context as [image tokens, last 512 tokens = text]: no other length works.
            raise ConfigError(
                f"model.max_sequence_length={length}: Wan image-to-video needs {DEFAULT_MAX_SEQUENCE_LENGTH} "
                "(its transformer takes the last 512 context tokens as text); leave it unset."
            )
        return length

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        super().check_video_shape(frames, height, width)
        _ = self.max_sequence_length  # fails early on a text length the transformer cannot take

    def load_vae(self, device: torch.device) -> WanImageEncoders:
        vae = super().load_vae(device)
        dtype = self.component_dtype("image_encoder", device)
        image_encoder = self.load_component(self.component_class("image_encoder", self.image_encoder_classes),
                                            "image_encoder", torch_dtype=dtype)
        image_processor = self.load_component(self.component_class("image_processor", self.image_processor_classes),
                                              "image_processor")
        return WanImageEncoders(vae, image_encoder.requires_grad_(False).eval().to(device), image_processor)

    @torch.no_grad()
    def encode_image(self, encoders: WanImageEncoders, first_frames: torch.Tensor) -> torch.Tensor:
        """CLIP penultimate hidden states of each first frame, as WanImageToVideoPipeline.encode_image."""
        inputs = encoders.image_processor(images=frames_to_pil(first_frames), return_tensors="pt")
        pixel_values = inputs.pixel_values.to(encoders.image_encoder.device, encoders.image_encoder.dtype)
        return encoders.image_encoder(pixel_values=pixel_values, output_hidden_states=True).hidden_states[-2]

    @torch.no_grad()
    def prepare_latents(self, vae: WanImageEncoders, videos: torch.Tensor) -> Latents:
        latents = super().prepare_latents(vae.vae, videos)
        first_frames = videos[:, 0]
        latents["image_embeds"] = self.encode_image(vae, first_frames).to(latents["latents_mean"].dtype)
        latents["image_condition"] = self.image_condition(vae.vae, first_frames, videos.shape[1])
        return latents

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        dtype = noisy_latents.dtype
        conditions = self.mode_conditions(conditions)
        hidden_states = torch.cat([noisy_latents, conditions["image_condition"].to(dtype)], dim=1)
        return denoiser(
            hidden_states=hidden_states,
            timestep=timesteps.to(noisy_latents.device),
            encoder_hidden_states=conditions["prompt_embeds"].to(dtype),
            encoder_hidden_states_image=conditions["image_embeds"].to(dtype),
            return_dict=False,
        )[0]

    def pipeline(self, text: TextComponents, vae: WanImageEncoders, denoiser: nn.Module) -> Any:
        return self.region_pipeline_class()(
            tokenizer=text["tokenizer"],
            text_encoder=text["text_encoder"],
            vae=vae.vae,
            scheduler=self.load_scheduler(),
            image_processor=vae.image_processor,
            image_encoder=vae.image_encoder,
            transformer=denoiser,
        )

    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        return {"image": self.first_frame_image(reference)}

