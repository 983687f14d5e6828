"""HunyuanVideo 1.5 (Tencent): a Qwen2.5-VL text model + a ByT5 glyph encoder, a 16x spatial / 4x temporal causal VAE,
and a dual-stream DiT that reads the text, the glyph text and (image-to-video) SigLIP image tokens jointly.

`hunyuan-video-1.5` is text-to-video (HunyuanVideo15Pipeline), `hunyuan-video-1.5-i2v` image-to-video
(HunyuanVideo15ImageToVideoPipeline). Conventions taken from those pipelines:
    text: the caption goes through Qwen's chat template with the pipeline's system message, is padded to
        `crop_start + max_sequence_length` tokens (1000 after the crop by default), and the hidden state of the
        third-to-last layer is kept after cropping the template's first `crop_start` tokens; the quoted text of a
        caption ("...") is encoded by ByT5 as glyph text (256 tokens, zeros and an empty mask without quotes);
    latents: the VAE posterior times `vae.config.scaling_factor` (the pipelines decode latents / scaling_factor);
    input: the transformer takes [noisy latents, condition latents, mask] on the channel dim (2C + 1): zeros for
        text-to-video; for image-to-video the first frame's latents (its VAE mode, scaled) in latent frame 0 and a
        mask of ones there; image tokens are SigLIP's last hidden state of the first frame (all zeros, hence
        masked out, for text-to-video);
    guidance: true classifier-free guidance through the pipeline's `guider` (no guidance embedding);
    conditioning modes (image-to-video, `model.conditioning`): the condition channels and their mask carry other
        latents (vidtune/models/given_modes.py, `ChannelModes`): a clip's first frames encoded alone in its first
        latent frames, the last frame encoded alone in the last one, or a kept region of the clip (inpainting: the mask
        1 on its cells); the image tokens are SigLIP's of the first given picture (the first frame; the last frame
        for last-frame conditioning). Sampled through HunyuanVideo15ImageToVideoPipeline given those latents
        (`HunyuanVideo15GivenPipeline`).
The pipelines have no `load_lora_weights` in diffusers 0.42: `pipeline_class` adds diffusers' plain transformer
LoRA loader (the file is the standard `transformer.`-prefixed peft format, which `transformer.load_lora_adapter`
also reads), and they take no step callback: `call_pipeline` hands the final latents to a callback once.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo15,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from diffusers.loaders.lora_pipeline import CogVideoXLoraLoaderMixin
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5_image2video import retrieve_latents
from diffusers.pipelines.hunyuan_video1_5.pipeline_output import HunyuanVideo15PipelineOutput
from torch import nn
from transformers import AutoTokenizer, Qwen2_5_VLTextModel, SiglipImageProcessor, SiglipVisionModel, T5EncoderModel

from vidtune.errors import ConfigError
from vidtune.export.comfyui import Rule
from vidtune.export.comfyui_models import ComfyUIModel, hunyuan_video
from vidtune.export.comfyui_workflow import ModelFiles, WorkflowLayout, hunyuan_video15_parts
from vidtune.models import conditioning, in_context
from vidtune.models.conditioning import Given
from vidtune.models.defaults import HUNYUAN_VIDEO_15
from vidtune.models.given_modes import ChannelModes, compose
from vidtune.models.hunyuan_comfyui import shared_rules
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
    VAEWithExtras,
    frame_count_problem,
    frames_to_pil,
    raise_shape_problems,
    shape_rule,
    side_problems,
)


def _pipeline_default(function: Any, name: str) -> Any:
    return inspect.signature(function).parameters[name].default


# The pipelines' own constants, read from their encode functions so they follow the installed diffusers.
_MLLM = HunyuanVideo15Pipeline._get_mllm_prompt_embeds
SYSTEM_MESSAGE: str = _pipeline_default(_MLLM, "system_message")
CROP_START: int = _pipeline_default(_MLLM, "crop_start")
HIDDEN_LAYERS_TO_SKIP: int = _pipeline_default(_MLLM, "num_hidden_layers_to_skip")
DEFAULT_MAX_SEQUENCE_LENGTH: int = _pipeline_default(_MLLM, "tokenizer_max_length")  # 1000
GLYPH_MAX_LENGTH: int = _pipeline_default(HunyuanVideo15Pipeline._get_byt5_prompt_embeds, "tokenizer_max_length")


def trim_padding(embeds: torch.Tensor, mask: torch.Tensor, suffix: str) -> Conditions:
    """Text tokens cut after the batch's last unmasked one (at least one kept). Masked tokens take no part in the
    transformer (its attention masks them and its refiner pools over the mask), so the prediction is the same; the
    pipelines pad to 1000 Qwen and 256 ByT5 tokens, and training pays for the tokens a caption has only."""
    if mask.is_meta:  # `vidtune plan` traces without values: every token counts (the longest caption)
        return {f"prompt_embeds{suffix}": embeds, f"prompt_embeds_mask{suffix}": mask}
    valid = mask.bool().any(dim=0).nonzero()
    length = int(valid.max()) + 1 if len(valid) else 1
    return {f"prompt_embeds{suffix}": embeds[:, :length], f"prompt_embeds_mask{suffix}": mask[:, :length]}


class HunyuanVideo15LoraPipeline(CogVideoXLoraLoaderMixin, HunyuanVideo15Pipeline):
    """HunyuanVideo15Pipeline with diffusers' plain transformer LoRA loader (`load_lora_weights`,
    `save_lora_weights`, `lora_state_dict`), which its diffusers release does not have yet."""


class HunyuanVideo15ImageToVideoLoraPipeline(CogVideoXLoraLoaderMixin, HunyuanVideo15ImageToVideoPipeline):
    """HunyuanVideo15ImageToVideoPipeline with diffusers' plain transformer LoRA loader."""


class HunyuanVideo15GivenPipeline(HunyuanVideo15ImageToVideoLoraPipeline):
    """HunyuanVideo15ImageToVideoPipeline given a conditioning mode's latents in its condition channels and mask:
    `given_frames` ([1, 3, K, H, W] in [-1, 1]: a clip to extend, in its first latent frames; with `given_region`, a
    clip whose region ([1, 1, F, H, W] on the latent grid, 1.0 kept) is kept) and `given_last` ([1, 3, 1, H, W], in
    the last latent frame), each encoded alone as the pipeline encodes its image (the VAE's mode, scaled), the mask
    1 where they are; its `image` gives the image tokens. Everything else is the pipeline's."""

    def __call__(self, *args: Any, given_frames: torch.Tensor | None = None, given_last: torch.Tensor | None = None,
                 given_region: torch.Tensor | None = None, **kwargs: Any) -> Any:
        self._given = (given_frames, given_last, given_region)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            self._given = None

    def encode_given(self, pixels: torch.Tensor) -> torch.Tensor:
        latents = retrieve_latents(self.vae.encode(pixels.to(self.vae.device, self.vae.dtype)), sample_mode="argmax")
        return latents * self.vae.config.scaling_factor

    def prepare_cond_latents_and_mask(self, latents: torch.Tensor, image: Any, batch_size: int, height: int,
                                      width: int, dtype: torch.dtype, device: torch.device
                                      ) -> tuple[torch.Tensor, torch.Tensor]:
        given = getattr(self, "_given", None)
        if given is None or given == (None, None, None):
            return super().prepare_cond_latents_and_mask(latents, image, batch_size, height, width, dtype, device)
        frames, last, region = given
        condition = torch.zeros_like(latents)
        mask = torch.zeros_like(latents[:, :1])
        if frames is not None:
            encoded = self.encode_given(frames).to(condition)
            if region is not None:
                region = region.to(condition).expand_as(mask)
                condition, mask = region * encoded, region.clone()
            else:
                condition[:, :, : encoded.shape[2]] = encoded
                mask[:, :, : encoded.shape[2]] = 1.0
        if last is not None:
            condition[:, :, -1:] = self.encode_given(last).to(condition)
            mask[:, :, -1:] = 1.0
        return condition.to(device, dtype), mask.to(device, dtype)


HV15_FEED_FORWARD_TARGETS = (*FEED_FORWARD_TARGETS, "ff_context.net.0.proj", "ff_context.net.2")

# The keys of a modes run's latents: the first frames of the clip to extend [B, C, k, H, W] and the last frame
# [B, C, 1, H, W], each encoded alone, and the last frame's image tokens.
GIVEN_EXTENSION = "given_extension_latents"
LAST_IMAGE = "last_image_latents"
LAST_EMBEDS = "last_image_embeds"


class HunyuanVideo15Spec(ModelSpec):
    name = "hunyuan-video-1.5"
    control_input_layer = "x_embedder.proj"  # Conv3d over [B, 2C + 1, F, H, W]
    validation_guidance_scale = 6.0  # the published guider's scale
    defaults = HUNYUAN_VIDEO_15
    pipeline_class = HunyuanVideo15LoraPipeline
    vae_class = AutoencoderKLHunyuanVideo15
    denoiser_class = HunyuanVideo15Transformer3DModel
    scheduler_class = FlowMatchEulerDiscreteScheduler
    lora_presets: ClassVar[dict[str, tuple[str, ...]]] = {
        "attention": ATTENTION_TARGETS + JOINT_ATTENTION_TARGETS,
        "attention+ffn": ATTENTION_TARGETS + JOINT_ATTENTION_TARGETS + HV15_FEED_FORWARD_TARGETS,
        ALL_LINEAR: (ALL_LINEAR,),
    }

    def required_components(self) -> tuple[str, ...]:
        return ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "vae", "transformer", "scheduler")

    def lora_exclude_modules(self) -> list[str]:
        """The last block's text-stream output (its attention output and feed-forward) reaches nothing: the final
        layer reads the video stream only."""
        last = f"transformer_blocks.{self.transformer_config['num_layers'] - 1}"
        return [f"{last}.attn.to_add_out", f"{last}.ff_context.net.0.proj", f"{last}.ff_context.net.2"]

    def native_max_sequence_length(self) -> int:
        """Qwen tokens kept after the template: the pipelines' 1000."""
        return DEFAULT_MAX_SEQUENCE_LENGTH

    # ----- shape rules, read from the VAE / transformer configs (no weights needed) --------------------
    @functools.cached_property
    def transformer_config(self) -> dict[str, Any]:
        return self.load_config(HunyuanVideo15Transformer3DModel, "transformer")

    @functools.cached_property
    def compression(self) -> tuple[int, int, int, int]:
        """(VAE spatial ratio, VAE temporal ratio, transformer patch size, transformer temporal patch)."""
        vae = self.load_config(AutoencoderKLHunyuanVideo15, "vae")
        transformer = self.transformer_config
        return (vae.get("spatial_compression_ratio", 16), vae.get("temporal_compression_ratio", 4),
                transformer.get("patch_size", 1), transformer.get("patch_size_t", 1))

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        vae_spatial, temporal, patch, patch_t = self.compression
        spatial = vae_spatial * patch
        raise_shape_problems("HunyuanVideo 1.5", [frame_count_problem(frames, temporal, patch_t),
                                                  *side_problems(height, width, spatial)],
                             self, shape_rule(temporal, patch_t, spatial))
        if self.transformer_config.get("use_meanflow"):
            raise ConfigError(
                f"{self.describe_file('transformer', 'config.json')}: this is a step-distilled (meanflow) "
                "HunyuanVideo 1.5 transformer, which takes a second timestep vidtune does not train.\n"
                "What to do: train the non-distilled checkpoint of the same resolution."
            )

    # ----- loading ---------------------------------------------------------------------------------
    def load_text_components(self, device: torch.device) -> TextComponents:
        dtype = self.component_dtype("text_encoder", device)
        text_encoder = self.load_component(Qwen2_5_VLTextModel, "text_encoder", torch_dtype=dtype)
        text_encoder_2 = self.load_component(T5EncoderModel, "text_encoder_2", torch_dtype=dtype)
        for encoder in (text_encoder, text_encoder_2):
            encoder.requires_grad_(False).eval().to(device)
        return TextComponents({
            "tokenizer": self.load_component(AutoTokenizer, "tokenizer"),
            "text_encoder": text_encoder,
            "tokenizer_2": self.load_component(AutoTokenizer, "tokenizer_2"),
            "text_encoder_2": text_encoder_2,
        })

    def load_vae(self, device: torch.device) -> Any:
        """The frozen VAE, one clip at a time: in diffusers 0.42 its causal attention mask breaks batches larger
        than one (the mask's batch dimension lands on the heads), and slicing is the VAE's own per-clip path."""
        vae = super().load_vae(device)
        vae.enable_slicing()
        return vae

    def guider(self, guidance_scale: float) -> ClassifierFreeGuidance:
        """The pipeline's classifier-free guider at `guidance_scale` (1.0: off, one forward a step)."""
        return ClassifierFreeGuidance(guidance_scale=guidance_scale)

    # ----- tensors ---------------------------------------------------------------------------------
    def condition_identity(self) -> dict[str, Any]:
        return {**super().condition_identity(), "system_message": SYSTEM_MESSAGE, "crop_start": CROP_START,
                "hidden_layers_to_skip": HIDDEN_LAYERS_TO_SKIP, "glyph_max_length": GLYPH_MAX_LENGTH}

    @torch.no_grad()
    def prepare_conditions(self, text: TextComponents, captions: list[str]) -> Conditions:
        """Qwen and ByT5 embeddings with their masks, by the pipeline's own encode functions."""
        captions = list(captions)
        encoder = text["text_encoder"]
        embeds, mask = HunyuanVideo15Pipeline._get_mllm_prompt_embeds(
            text_encoder=encoder, tokenizer=text["tokenizer"], prompt=captions, device=encoder.device,
            tokenizer_max_length=self.max_sequence_length, num_hidden_layers_to_skip=HIDDEN_LAYERS_TO_SKIP,
            system_message=SYSTEM_MESSAGE, crop_start=CROP_START,
        )
        glyph_encoder = text["text_encoder_2"]
        glyph, glyph_mask = HunyuanVideo15Pipeline._get_byt5_prompt_embeds(
            tokenizer=text["tokenizer_2"], text_encoder=glyph_encoder, prompt=captions, device=glyph_encoder.device,
            tokenizer_max_length=GLYPH_MAX_LENGTH,
        )
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask.bool(),
                "prompt_embeds_2": glyph.to(embeds.dtype), "prompt_embeds_mask_2": glyph_mask.bool()}

    @torch.no_grad()
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        # The pipelines decode latents / scaling_factor.
        return self.normalised_posterior(self.vae_posterior(vae, videos), vae.config.scaling_factor)

    def condition_input(self, conditions: Conditions, noisy_latents: torch.Tensor) -> torch.Tensor:
        """The condition latents and mask concatenated to the noisy latents: zeros for text-to-video, as
        HunyuanVideo15Pipeline.prepare_cond_latents_and_mask."""
        batch, channels, frames, height, width = noisy_latents.shape
        return noisy_latents.new_zeros(batch, channels + 1, frames, height, width)

    def image_tokens(self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor) -> torch.Tensor:
        """Text-to-video: all-zero image tokens, which the transformer masks out. One token, not the pipeline's
        729: masked tokens take no part in attention, so the prediction is the same."""
        return noisy_latents.new_zeros(noisy_latents.shape[0], 1, denoiser.config.image_embed_dim)

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        dtype = noisy_latents.dtype
        conditions = {**conditions, **trim_padding(conditions["prompt_embeds"], conditions["prompt_embeds_mask"], ""),
                      **trim_padding(conditions["prompt_embeds_2"], conditions["prompt_embeds_mask_2"], "_2")}
        hidden_states = torch.cat([noisy_latents, self.condition_input(conditions, noisy_latents).to(dtype)], dim=1)
        return denoiser(
            hidden_states=hidden_states,
            timestep=timesteps.to(device=noisy_latents.device, dtype=dtype),
            encoder_hidden_states=conditions["prompt_embeds"].to(dtype),
            encoder_attention_mask=conditions["prompt_embeds_mask"],
            encoder_hidden_states_2=conditions["prompt_embeds_2"].to(dtype),
            encoder_attention_mask_2=conditions["prompt_embeds_mask_2"],
            image_embeds=self.image_tokens(denoiser, conditions, noisy_latents).to(dtype),
            return_dict=False,
        )[0]

    def control_channels(self, denoiser: nn.Module) -> int:
        return int(denoiser.config.out_channels)

    # ----- ComfyUI ------------------------------------------------------------------------------------
    def comfyui_lora_rules(self) -> list[Rule]:
        """The double blocks, text refiner and final layer as 1.0's (`hunyuan_comfyui.shared_rules`; Tencent's 1.5
        checkpoint keeps q, k and v apart, ComfyUI's model fuses them), and 1.5's own layers: the glyph projection
        `byt5_in` and the image projection `vision_in`."""
        config = self.transformer_config
        hidden = config["num_attention_heads"] * config["attention_head_dim"]
        return [
            *shared_rules(hidden, r"time_embed\.timestep_embedder"),
            Rule(r"context_embedder_2\.linear_([123])", r"byt5_in.fc\1"),
            Rule(r"image_embedder\.linear_1", "vision_in.proj.1"),
            Rule(r"image_embedder\.linear_2", "vision_in.proj.3"),
        ]

    def comfyui_model(self) -> ComfyUIModel:
        config = self.transformer_config
        return hunyuan_video(config["num_layers"], refiner=config["num_refiner_layers"], glyph=True, image=True)

    def comfyui_workflow(self) -> WorkflowLayout:
        """`video_hunyuan_video_1.5_720p_t2v` / `_i2v` (without their super-resolution pass): Comfy-Org's
        repackaged 720p models, Qwen2.5-VL and ByT5, and SigLIP for image-to-video."""
        kind = "i2v" if self.image_to_video else "t2v"
        files = ModelFiles((f"hunyuanvideo1.5_720p_{kind}_fp16.safetensors",),
                           ("qwen_2.5_vl_7b_fp8_scaled.safetensors", "byt5_small_glyphxl_fp16.safetensors"),
                           "hunyuan_video_15", "hunyuanvideo15_vae_fp16.safetensors",
                           clip_vision="sigclip_vision_patch14_384.safetensors" if self.image_to_video else "")
        return WorkflowLayout(files, functools.partial(hunyuan_video15_parts, image=self.image_to_video))

    # ----- pipeline and outputs ----------------------------------------------------------------------
    def pipeline(self, text: TextComponents, vae: nn.Module, denoiser: nn.Module) -> Any:
        return HunyuanVideo15LoraPipeline(
            text_encoder=text["text_encoder"], tokenizer=text["tokenizer"], transformer=denoiser, vae=vae,
            scheduler=self.load_scheduler(), text_encoder_2=text["text_encoder_2"], tokenizer_2=text["tokenizer_2"],
            guider=self.guider(self.validation_guidance_scale),
        )

    def prompt_inputs(self, pipeline: Any, prompt: str, guidance_scale: float) -> dict[str, Any]:
        """Embeddings computed like the pipeline's encode_prompt, at `model.max_sequence_length` (the pipeline's
        own length is fixed) and without the padding `forward` trims too; the negative prompt is the empty one when
        guidance is on (the guider runs it as a batch of its own, so its length may differ)."""
        text = TextComponents({name: getattr(pipeline, name)
                               for name in ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")})
        dtype = pipeline.transformer.dtype

        def encoded(caption: str, prefix: str) -> dict[str, torch.Tensor]:
            conditions = self.prepare_conditions(text, [caption])
            trimmed = {**trim_padding(conditions["prompt_embeds"], conditions["prompt_embeds_mask"], ""),
                       **trim_padding(conditions["prompt_embeds_2"], conditions["prompt_embeds_mask_2"], "_2")}
            return {f"{prefix}{key}": value.to(dtype) for key, value in trimmed.items()}

        return {**encoded(prompt, ""), **(encoded("", "negative_") if guidance_scale > 1.0 else {})}

    def pipeline_size(self, height: int, width: int) -> dict[str, int]:
        """The size arguments of the pipeline call (text-to-video takes them as they are)."""
        return {"height": height, "width": width}

    def call_pipeline(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                      num_inference_steps: int, guidance_scale: float, generator: torch.Generator, output_type: str,
                      reference: torch.Tensor | None = None, callback: StepCallback | None = None,
                      given: Given | None = None) -> Any:
        """One call with the guider at `guidance_scale`. The pipeline has no step callback: with `callback`, it
        returns its final latents, the callback gets them once, and they are decoded as the pipeline decodes."""
        pipeline.register_modules(guider=self.guider(guidance_scale))
        result = pipeline(
            **self.prompt_inputs(pipeline, prompt, guidance_scale),
            num_frames=frames,
            num_inference_steps=num_inference_steps,
            generator=generator,
            output_type="latent" if callback is not None else output_type,
            **self.pipeline_size(height, width),
            **(self.pipeline_inputs(reference) if given is None else self.given_inputs(given, frames, height, width)),
        )
        if callback is None or output_type == "latent":
            if callback is not None:
                callback(pipeline, num_inference_steps - 1, None, {"latents": result.frames})
            return result
        latents = callback(pipeline, num_inference_steps - 1, None, {"latents": result.frames})["latents"]
        video = pipeline.vae.decode(latents.to(pipeline.vae.dtype) / pipeline.vae.config.scaling_factor,
                                    return_dict=False)[0]
        return HunyuanVideo15PipelineOutput(frames=pipeline.video_processor.postprocess_video(video,
                                                                                              output_type=output_type))


class HunyuanVideo15ImageEncoders(VAEWithExtras):
    """What `HunyuanVideo15ImageToVideoSpec.load_vae` returns: the VAE with the SigLIP image encoder and its
    processor. Opaque to trainers; the spec's `prepare_latents` and `pipeline` take it apart."""

    def __init__(self, vae: nn.Module, image_encoder: nn.Module, feature_extractor: SiglipImageProcessor) -> None:
        super().__init__(vae)
        self.image_encoder = image_encoder
        self.feature_extractor = feature_extractor


class HunyuanVideo15ImageToVideoSpec(ChannelModes, HunyuanVideo15Spec):
    """HunyuanVideo 1.5 image-to-video: the first frame's latents and SigLIP tokens condition every clip. The
    pipeline picks its output size from the image (its `target_size` buckets), so samples have the clip's size
    only where that bucket is the clip's size (checked before sampling)."""

    name = "hunyuan-video-1.5-i2v"
    image_to_video = True
    conditioning_refusal = ("HunyuanVideo15ImageToVideoPipeline takes latents and a mask on condition channels "
                            "(HunyuanVideo15GivenPipeline places each mode's there).")
    conditioning_modes = ("extension", "last_frame", "first_last", "inpaint")
    modes_pipeline = "HunyuanVideo15ImageToVideoPipeline"
    pipeline_class = HunyuanVideo15ImageToVideoLoraPipeline

    def required_components(self) -> tuple[str, ...]:
        return (*super().required_components(), "image_encoder", "feature_extractor")

    def load_vae(self, device: torch.device) -> HunyuanVideo15ImageEncoders:
        vae = super().load_vae(device)
        dtype = self.component_dtype("image_encoder", device)
        image_encoder = self.load_component(SiglipVisionModel, "image_encoder", torch_dtype=dtype)
        feature_extractor = self.load_component(SiglipImageProcessor, "feature_extractor")
        return HunyuanVideo15ImageEncoders(vae, image_encoder.requires_grad_(False).eval().to(device),
                                           feature_extractor)

    @torch.no_grad()
    def prepare_latents(self, vae: HunyuanVideo15ImageEncoders, videos: torch.Tensor) -> Latents:
        latents = super().prepare_latents(vae.vae, videos)
        first_frames = videos[:, 0]
        # The first frame alone through the VAE, its mode scaled: HunyuanVideo15ImageToVideoPipeline._get_image_latents.
        pixels = first_frames.to(device=vae.device, dtype=vae.dtype).unsqueeze(2)
        image_latents = vae.vae.encode(pixels).latent_dist.mode() * vae.vae.config.scaling_factor
        latents["image_latents"] = image_latents.to(latents["latents_mean"].dtype)
        embeds = [HunyuanVideo15ImageToVideoPipeline._get_image_embeds(vae.image_encoder, vae.feature_extractor,
                                                                       image, vae.device)
                  for image in frames_to_pil(first_frames)]
        latents["image_embeds"] = torch.cat(embeds).to(latents["latents_mean"].dtype)
        dtype = latents["latents_mean"].dtype
        if self.modes_on and self.config.conditioning.extension > 0:  # the first frames alone, as the pipeline would
            count = self.config.conditioning.extension_frames
            clips = videos[:, :count].to(device=vae.device, dtype=vae.dtype).transpose(1, 2)
            latents[GIVEN_EXTENSION] = (vae.vae.encode(clips).latent_dist.mode()
                                        * vae.vae.config.scaling_factor).to(dtype)
        if self.modes_on and self.takes_last_frame:  # the last frame as the pipeline encodes an image
            last = videos[:, -1].to(device=vae.device, dtype=vae.dtype).unsqueeze(2)
            latents[LAST_IMAGE] = (vae.vae.encode(last).latent_dist.mode() * vae.vae.config.scaling_factor).to(dtype)
            embeds = [HunyuanVideo15ImageToVideoPipeline._get_image_embeds(vae.image_encoder, vae.feature_extractor,
                                                                           image, vae.device)
                      for image in frames_to_pil(videos[:, -1])]
            latents[LAST_EMBEDS] = torch.cat(embeds).to(dtype)
        return latents

    def latent_identity(self) -> dict[str, Any]:
        identity = super().latent_identity()
        if self.modes_on:
            identity["given_latents"] = {"extension_frames": self.config.conditioning.extension_frames,
                                         "last_frame": self.takes_last_frame}
        return identity

    def visit_conditions(self, x0: torch.Tensor, positions: torch.Tensor, seed: int) -> Conditions:
        """With `model.conditioning`, each sample's mode (the first frame for the rest)."""
        return self.draw_channel_modes(x0, positions, seed) if self.modes_on else {}

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        super().check_video_shape(frames, height, width)
        problems = self.extension_problems(frames) if self.modes_on else []
        if problems:
            raise ConfigError("The conditioning modes do not fit:\n" + "\n".join(f"  - {p}" for p in problems)
                              + "\nWhat to do: fix model.conditioning as said above.")

    def condition_input(self, conditions: Conditions, noisy_latents: torch.Tensor) -> torch.Tensor:
        """The first frame's latents in latent frame 0 (zeros after) and a mask of ones there, as
        HunyuanVideo15ImageToVideoPipeline.prepare_cond_latents_and_mask; with drawn modes each sample's given
        latents where its mode puts them, the mask 1 there (HunyuanVideo15GivenPipeline)."""
        condition = torch.zeros_like(noisy_latents)
        condition[:, :, :1] = conditions["image_latents"].to(noisy_latents)
        mask = torch.zeros_like(noisy_latents[:, :1])
        mask[:, :, 0] = 1.0
        if conditioning.MODE not in conditions:
            return torch.cat([condition, mask], dim=1)
        codes = conditions[conditioning.MODE]
        pieces: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {"extension": None, "last": None}
        if GIVEN_EXTENSION in conditions:
            given = conditions[GIVEN_EXTENSION].to(noisy_latents)
            extension, where = torch.zeros_like(noisy_latents), torch.zeros_like(mask)
            extension[:, :, : given.shape[2]], where[:, :, : given.shape[2]] = given, 1.0
            pieces["extension"] = (extension, where)
        if LAST_IMAGE in conditions:
            last, where = torch.zeros_like(noisy_latents), torch.zeros_like(mask)
            last[:, :, -1:], where[:, :, -1:] = conditions[LAST_IMAGE].to(noisy_latents), 1.0
            pieces["last"] = (last, where)
        kept = self.inpaint_region(conditions, noisy_latents.shape).to(noisy_latents)
        inpaint = kept * conditions[conditioning.LATENTS].to(noisy_latents)
        latents = compose(codes, condition, *(piece and piece[0] for piece in pieces.values()), inpaint)
        masks = compose(codes, mask, *(piece and piece[1] for piece in pieces.values()), kept)
        return torch.cat([latents, masks], dim=1)

    def image_tokens(self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor) -> torch.Tensor:
        """SigLIP's tokens of the first frame, or (last-frame conditioning) of the last frame."""
        if conditioning.MODE not in conditions or LAST_EMBEDS not in conditions:
            return conditions["image_embeds"]
        last = conditioning.is_mode(conditions[conditioning.MODE], ("last_frame",)).view(-1, 1, 1)
        return torch.where(last.to(conditions["image_embeds"].device), conditions[LAST_EMBEDS],
                           conditions["image_embeds"])

    def call_pipeline(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                      num_inference_steps: int, guidance_scale: float, generator: torch.Generator, output_type: str,
                      reference: torch.Tensor | None = None, callback: StepCallback | None = None,
                      given: Given | None = None) -> Any:
        """A conditioning mode samples through HunyuanVideo15GivenPipeline over the components of `pipeline`."""
        if given is not None and given.mode != "first_frame":
            placing = in_context.pipeline_like(HunyuanVideo15GivenPipeline, pipeline)
            placing.set_progress_bar_config(**getattr(pipeline, "_progress_bar_config", {}))
            pipeline = placing
        return super().call_pipeline(pipeline, prompt, frames, height, width, num_inference_steps, guidance_scale,
                                     generator, output_type, reference, callback, given=given)

    def given_inputs(self, given: Given, frames: int, height: int, width: int) -> dict[str, Any]:
        """The pipeline's `image` (the first given picture: the image tokens' source) and the mode's pictures,
        [1, 3, K, H, W]: the clip to extend or inpaint (`given_frames`, with the kept region `given_region`), the
        last frame (`given_last`)."""
        if given.mode == "first_frame":
            return self.pipeline_inputs(given.frames)
        self.check_given_frames(given, frames)
        pictures = given.frames if given.frames is not None else given.last
        assert pictures is not None
        inputs = self.pipeline_inputs(pictures)
        if given.frames is not None:  # the first frame (first-last), the clip to extend or to inpaint
            inputs["given_frames"] = given.frames.permute(1, 0, 2, 3).unsqueeze(0).float()
        if given.mode == "inpaint":
            inputs["given_region"] = self.sampling_region(given, frames, height, width)
        if given.last is not None:
            inputs["given_last"] = given.last[-1:].permute(1, 0, 2, 3).unsqueeze(0).float()
        return inputs

    def pipeline(self, text: TextComponents, vae: HunyuanVideo15ImageEncoders, denoiser: nn.Module) -> Any:
        return HunyuanVideo15ImageToVideoLoraPipeline(
            text_encoder=text["text_encoder"], tokenizer=text["tokenizer"], transformer=denoiser, vae=vae.vae,
            scheduler=self.load_scheduler(), text_encoder_2=text["text_encoder_2"], tokenizer_2=text["tokenizer_2"],
            guider=self.guider(self.validation_guidance_scale), image_encoder=vae.image_encoder,
            feature_extractor=vae.feature_extractor,
        )

    def pipeline_size(self, height: int, width: int) -> dict[str, int]:
        """The pipeline takes no size: it resizes the image to the bucket of its `target_size` nearest the image's
        aspect ratio. A size that is not that bucket cannot be sampled at that size."""
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        spatial = self.compression[0]
        target = int(self.transformer_config.get("target_size", 640))
        bucket = HunyuanVideo15ImageProcessor(vae_scale_factor=spatial).calculate_default_height_width(
            height, width, target)
        if tuple(bucket) != (height, width):
            raise ConfigError(
                f"HunyuanVideo 1.5 image-to-video samples {height}x{width} images at {bucket[0]}x{bucket[1]} (the "
                f"bucket of its transformer's target_size {target} for that aspect ratio), not at {height}x{width}.\n"
                f"What to do: sample at {bucket[0]}x{bucket[1]} (validation.height / validation.width or "
                "--height / --width)."
            )
        return {}

    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        return {"image": self.first_frame_image(reference)}

