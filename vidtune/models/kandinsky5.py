"""Kandinsky 5 (Kandinsky Lab): a Qwen2.5-VL text encoder and a CLIP text model, the HunyuanVideo VAE (8x space, 4x
time) and a DiT whose text blocks refine the caption tokens and whose visual blocks cross-attend to them.

`kandinsky-5` is text-to-video (Kandinsky5T2VPipeline: Lite 2B and Pro 19B), `kandinsky-5-i2v` image-to-video
(Kandinsky5I2VPipeline). Conventions taken from those pipelines (diffusers 0.42):
    text: the caption goes through the pipeline's prompt template; Qwen's last hidden state is kept from token 128 of
        the template on (`prompt_template_encode_start_idx`), at most `max_sequence_length` (512) tokens; CLIP's
        pooled output (77 tokens) joins the timestep embedding. The transformer takes no text mask: the pipeline
        encodes one caption at a time, so its text tokens are the caption's own (`cu_seqlens` gives their count).
        Training stores each caption's tokens padded with their mask, and `forward` hands the transformer each clip's
        own tokens only (clips with captions of one length share a call);
    latents: channels last, [B, F, H, W, C] in the transformer; the VAE posterior times `vae.config.scaling_factor`
        (the pipelines decode latents / scaling_factor);
    timestep: the scheduler's timestep (sigma * 1000), one per clip; rotary positions by latent frame and patch row
        and column, divided by the pipeline's resolution `scale_factor` (1, 2, 2) when both sides are within
        480-854 pixels, else (1, 3.16, 3.16);
    image-to-video: the transformer takes [latents, condition latents, mask] on the channel dim (`visual_cond`); the
        pipeline puts the image's latents in the first latent frame of the latents themselves, leaves the condition
        latents zero and sets the mask to one on that frame, and steps only the frames after it: training gives the
        clip's first latent frame clean in the same way and leaves it out of the loss.
Sparse attention: checkpoints whose transformer config says `attention_type: nabla` (the 10 s and Pro models) sample
with NABLA (block-sparse flex attention over 8x8-token tiles, so sides are multiples of 128 pixels); training runs
full attention (`sparse_params=None`), which NABLA approximates, as kohya-ss/musubi-tuner's trainer does unless
forced (`--force_nabla_attention`).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    Kandinsky5I2VPipeline,
    Kandinsky5T2VPipeline,
    Kandinsky5Transformer3DModel,
)
from torch import nn
from transformers import AutoTokenizer, CLIPTextModel, Qwen2_5_VLForConditionalGeneration

from vidtune.errors import ConfigError
from vidtune.export.comfyui import Rule
from vidtune.export.comfyui_models import ComfyUIModel, kandinsky5
from vidtune.export.comfyui_workflow import ModelFiles, WorkflowLayout, kandinsky5_parts
from vidtune.models.defaults import KANDINSKY_5
from vidtune.models.spec import (
    ALL_LINEAR,
    Conditions,
    Latents,
    ModelSpec,
    TextComponents,
    frame_count_problem,
    raise_shape_problems,
    shape_rule,
    side_problems,
)


def _template_pipeline() -> Kandinsky5T2VPipeline:
    """The pipeline without components: its prompt template and crop are set in its constructor."""
    return Kandinsky5T2VPipeline(transformer=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                                 tokenizer_2=None, scheduler=None)


# The pipelines' own constants, read from the installed diffusers.
PROMPT_TEMPLATE: str = _template_pipeline().prompt_template
TEMPLATE_CROP: int = _template_pipeline().prompt_template_encode_start_idx  # 128
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # the pipelines' `max_sequence_length`
CLIP_MAX_LENGTH = 77  # `_encode_prompt_clip`

ATTENTION = ("to_query", "to_key", "to_value", "self_attention.out_layer", "cross_attention.out_layer")
FEED_FORWARD = ("feed_forward.in_layer", "feed_forward.out_layer")


def rope_scale_factor(height: int, width: int) -> tuple[float, float, float]:
    """The pipelines' resolution-dependent rotary scale for a clip of `height` x `width` pixels."""
    return tuple(Kandinsky5T2VPipeline._get_scale_factor(None, height, width))


class Kandinsky5Spec(ModelSpec):
    name = "kandinsky-5"
    defaults = KANDINSKY_5
    validation_guidance_scale = 5.0  # the pipelines' default
    pipeline_class = Kandinsky5T2VPipeline
    text_encoder_class = Qwen2_5_VLForConditionalGeneration
    vae_class = AutoencoderKLHunyuanVideo
    denoiser_class = Kandinsky5Transformer3DModel
    scheduler_class = FlowMatchEulerDiscreteScheduler
    block_lists = ("text_transformer_blocks", "visual_transformer_blocks")
    control_input_layer = "visual_embeddings.in_layer"  # a Linear over (1, 2, 2) patches, channels innermost
    control_channels_innermost = True
    lora_presets: ClassVar[dict[str, tuple[str, ...]]] = {
        "attention": ATTENTION,
        "attention+ffn": ATTENTION + FEED_FORWARD,
        ALL_LINEAR: (ALL_LINEAR,),
    }

    def required_components(self) -> tuple[str, ...]:
        return ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "vae", "transformer", "scheduler")

    def native_max_sequence_length(self) -> int:
        return DEFAULT_MAX_SEQUENCE_LENGTH

    # ----- shape rules, read from the VAE / transformer configs (no weights needed) --------------------
    @functools.cached_property
    def transformer_config(self) -> dict[str, Any]:
        return self.load_config(Kandinsky5Transformer3DModel, "transformer")

    @functools.cached_property
    def vae_compression(self) -> tuple[int, int]:
        """(spatial, temporal) compression of the VAE."""
        vae = self.load_config(AutoencoderKLHunyuanVideo, "vae")
        return int(vae.get("spatial_compression_ratio", 8)), int(vae.get("temporal_compression_ratio", 4))

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        spatial, temporal = self.vae_compression
        patch_t, patch_h, patch_w = self.patch_sizes
        side = spatial * max(patch_h, patch_w)
        problems = [frame_count_problem(frames, temporal, patch_t), *side_problems(height, width, side)]
        rule = shape_rule(temporal, patch_t, side)
        if self.transformer_config.get("attention_type") == "nabla":
            # NABLA flattens the token grid in 8x8 tiles: validation samples at the training size go through it.
            nabla_side = side * 8
            problems += side_problems(height, width, nabla_side)
            rule = shape_rule(temporal, patch_t, nabla_side) + " (NABLA sparse attention)"
        raise_shape_problems("Kandinsky 5", problems, self, rule)

    # ----- loading ---------------------------------------------------------------------------------
    def load_text_components(self, device: torch.device, load_on: torch.device | None = None) -> TextComponents:
        """Qwen2.5-VL as the pipeline loads it, and its tokenizer as a plain tokenizer: the pipeline calls its
        processor with text only, which is the tokenizer's call (the processor's image and video halves would need
        torchvision)."""
        dtype = self.component_dtype("text_encoder", device)
        text_encoder = self.load_component(Qwen2_5_VLForConditionalGeneration, "text_encoder", torch_dtype=dtype)
        text_encoder_2 = self.load_component(CLIPTextModel, "text_encoder_2", torch_dtype=dtype)
        for encoder in (text_encoder, text_encoder_2):
            encoder.requires_grad_(False).eval().to(load_on or device)
        return TextComponents({
            "tokenizer": self.load_component(AutoTokenizer, "tokenizer"),
            "text_encoder": text_encoder,
            "tokenizer_2": self.load_component(AutoTokenizer, "tokenizer_2"),
            "text_encoder_2": text_encoder_2,
        })

    # ----- tensors ---------------------------------------------------------------------------------
    def condition_identity(self) -> dict[str, Any]:
        return {**super().condition_identity(), "prompt_template": PROMPT_TEMPLATE, "template_crop": TEMPLATE_CROP,
                "clip_max_length": CLIP_MAX_LENGTH}

    @torch.no_grad()
    def prepare_conditions(self, text: TextComponents, captions: list[str]) -> Conditions:
        """The pipeline's `encode_prompt`, one caption at a time as the pipeline encodes them: Qwen's tokens padded
        to `max_sequence_length` with their mask, and CLIP's pooled output."""
        encoder = text["text_encoder"]
        pipeline = Kandinsky5T2VPipeline(transformer=None, vae=None, text_encoder=encoder, tokenizer=text["tokenizer"],
                                         text_encoder_2=text["text_encoder_2"], tokenizer_2=text["tokenizer_2"],
                                         scheduler=None)
        length = self.max_sequence_length
        embeds, masks, pooled = [], [], []
        for caption in captions:
            tokens, clip, _ = pipeline.encode_prompt(prompt=[caption], max_sequence_length=length,
                                                     device=encoder.device, dtype=encoder.dtype)
            count = tokens.shape[1]
            embeds.append(torch.nn.functional.pad(tokens, (0, 0, 0, length - count)))
            mask = torch.zeros(1, length, dtype=torch.bool, device=tokens.device)
            mask[:, :count] = True
            masks.append(mask)
            pooled.append(clip)
        return {"prompt_embeds": torch.cat(embeds), "prompt_embeds_mask": torch.cat(masks),
                "pooled_projections": torch.cat(pooled)}

    @torch.no_grad()
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        # The pipelines decode latents / scaling_factor.
        return self.normalised_posterior(self.vae_posterior(vae, videos), vae.config.scaling_factor)

    def visual_input(self, conditions: Conditions, hidden_states: torch.Tensor) -> torch.Tensor:
        """The transformer's `hidden_states` [B, F, H, W, C'] from the noisy latents in its layout: the latents, and
        for a transformer with condition inputs (`visual_cond`: the Pro text-to-video models have them) zero
        condition latents and a zero mask, as Kandinsky5T2VPipeline.prepare_latents gives them."""
        if not self.transformer_config.get("visual_cond"):
            return hidden_states
        return torch.cat([hidden_states, torch.zeros_like(hidden_states), torch.zeros_like(hidden_states[..., :1])],
                         dim=-1)

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        dtype = noisy_latents.dtype
        hidden = self.visual_input(conditions, noisy_latents.permute(0, 2, 3, 4, 1)).to(dtype)
        _, frames, height, width, _ = hidden.shape
        _, patch_h, patch_w = self.patch_sizes
        device = hidden.device
        visual_rope_pos = [torch.arange(frames, device=device), torch.arange(height // patch_h, device=device),
                           torch.arange(width // patch_w, device=device)]
        spatial = self.vae_compression[0]
        scale = rope_scale_factor(height * spatial, width * spatial)
        embeds, mask = conditions["prompt_embeds"], conditions["prompt_embeds_mask"]
        pooled = conditions["pooled_projections"]
        timesteps = timesteps.to(device=device, dtype=dtype)

        def predict(rows: torch.Tensor | slice, tokens: int) -> torch.Tensor:
            return denoiser(
                hidden_states=hidden[rows], encoder_hidden_states=embeds[rows, :tokens].to(dtype),
                pooled_projections=pooled[rows].to(dtype), timestep=timesteps[rows],
                visual_rope_pos=visual_rope_pos, text_rope_pos=torch.arange(tokens, device=device),
                scale_factor=scale, sparse_params=None, return_dict=True,
            ).sample  # (with return_dict=False it returns the tensor itself, not a tuple)

        if mask.is_meta:  # `vidtune plan` traces without values: every token counts (the longest caption)
            return predict(slice(None), embeds.shape[1]).permute(0, 4, 1, 2, 3)
        # The transformer has no text mask: each clip sees its caption's tokens only, as in the pipeline.
        counts = mask.sum(dim=1).clamp_min(1).tolist()
        prediction = None
        for count in sorted(set(counts)):
            rows = torch.tensor([i for i, c in enumerate(counts) if c == count], device=device)
            part = predict(rows, int(count))
            if len(rows) == len(counts):
                prediction = part
                break
            if prediction is None:
                prediction = part.new_empty((len(counts), *part.shape[1:]))
            prediction = prediction.index_copy(0, rows, part)
        return prediction.permute(0, 4, 1, 2, 3)

    def input_channels(self, denoiser: nn.Module) -> int:
        """The latents, and the condition latents and mask of a transformer with `visual_cond`."""
        config = denoiser.config
        return 2 * int(config.in_visual_dim) + 1 if config.visual_cond else int(config.in_visual_dim)

    def control_channels(self, denoiser: nn.Module) -> int:
        return int(denoiser.config.out_visual_dim)

    def pack_control(self, control: torch.Tensor, denoiser: nn.Module,
                     hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Channels last, as the transformer's `hidden_states`: appended after the condition channels, they join each
        patch position's channels, where the widened inputs of `visual_embeddings.in_layer` are."""
        return control.permute(0, 2, 3, 4, 1), -1

    # ----- ComfyUI ------------------------------------------------------------------------------------
    def comfyui_lora_rules(self) -> list[Rule]:
        """Every module under its own name: diffusers' Kandinsky 5 transformer keeps the module names of Kandinsky
        Lab's checkpoint (its single-file loader maps no key), which ComfyUI's model uses too."""
        return [Rule(r"(.+)", r"\1")]

    def comfyui_model(self) -> ComfyUIModel:
        return kandinsky5(self.transformer_config)

    def comfyui_workflow(self) -> WorkflowLayout:
        """`video_kandinsky5_t2v` / `_i2v`: Comfy-Org's repackaged Lite 5 s models, Qwen2.5-VL and CLIP-L, and
        HunyuanVideo's VAE."""
        model = "kandinsky5lite_i2v_5s.safetensors" if self.image_to_video else "kandinsky5lite_t2v_sft_5s.safetensors"
        files = ModelFiles((model,), ("qwen_2.5_vl_7b_fp8_scaled.safetensors", "clip_l.safetensors"), "kandinsky5",
                           "hunyuan_video_vae_bf16.safetensors")
        return WorkflowLayout(files, functools.partial(kandinsky5_parts, image=self.image_to_video))

    # ----- pipeline and outputs ----------------------------------------------------------------------
    def pipeline(self, text: TextComponents, vae: nn.Module, denoiser: nn.Module) -> Any:
        return self.pipeline_class(
            transformer=denoiser, vae=vae, text_encoder=text["text_encoder"], tokenizer=text["tokenizer"],
            text_encoder_2=text["text_encoder_2"], tokenizer_2=text["tokenizer_2"], scheduler=self.load_scheduler(),
        )

    def latents_from_pipeline(self, latents: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
        """[B, F, H, W, C] (a step's latents also carry the condition channels) -> [B, C, F, H, W]."""
        channels = int(self.transformer_config.get("out_visual_dim", 4))
        return latents[..., :channels].permute(0, 4, 1, 2, 3)


class Kandinsky5ImageToVideoSpec(Kandinsky5Spec):
    """Kandinsky5I2VPipeline: the first latent frame is the image's, given clean; the transformer is told so by a mask
    channel (its condition latents stay zero, as the pipeline leaves them)."""

    name = "kandinsky-5-i2v"
    conditioning_refusal = "Kandinsky5I2VPipeline takes one first image; no other frame, clip or mask."
    pipeline_class = Kandinsky5I2VPipeline
    image_to_video = True

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        super().check_video_shape(frames, height, width)
        if frames == 1:  # its one latent frame is the image's, which stays out of the loss
            raise ConfigError(
                f"Kandinsky 5 image-to-video cannot train on stills ({frames}x{height}x{width}): a still's only frame "
                "is the image the model is given, which leaves nothing to learn.\nWhat to do: leave the stills out "
                "(a bucket with more frames, data.frames > 1), or train them with model.name: kandinsky-5."
            )
        if not self.transformer_config.get("visual_cond"):
            raise ConfigError(
                f"{self.describe_file('transformer', 'config.json')}: visual_cond is false, so this transformer takes "
                "no first frame: it is a text-to-video Kandinsky 5.\nWhat to do: set model.name: kandinsky-5, or "
                "point model.pretrained at an image-to-video checkpoint (Kandinsky-5.0-I2V-...)."
            )

    @torch.no_grad()
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        """The clip's posterior and its first frame encoded alone, as the pipeline encodes the image (not the clip's
        first latent frame: the VAE's group norms reach across frames), scaled like the latents; its mean, where the
        pipeline draws from a posterior this narrow."""
        latents = super().prepare_latents(vae, videos)
        image = self.vae_posterior(vae, videos[:, :1]).mean * vae.config.scaling_factor
        return {**latents, "image_latents": image}

    def visual_input(self, conditions: Conditions, hidden_states: torch.Tensor) -> torch.Tensor:
        """[latents with the image's first frame, zero condition latents, mask one on that frame]."""
        first = conditions["image_latents"].permute(0, 2, 3, 4, 1).to(hidden_states)
        latents = torch.cat([first, hidden_states[:, 1:]], dim=1)
        mask = torch.zeros_like(hidden_states[..., :1])
        mask[:, :1] = 1.0
        return torch.cat([latents, torch.zeros_like(hidden_states), mask], dim=-1)

    def per_clip_error(self, error: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        """The first latent frame is the image's: the pipeline never steps it, so it stays out of the loss."""
        return error[:, :, 1:].flatten(1).mean(dim=1)

    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        return {"image": self.first_frame_image(reference)}

    def latents_from_pipeline(self, latents: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
        """The pipeline evens out its first four latent frames after the last step (`normalize_first_frame`): a step's
        latents (which still carry the condition channels) get it too, so the last step's are the final latents."""
        channels = int(self.transformer_config.get("out_visual_dim", 4))
        if latents.shape[-1] > channels:
            latents = Kandinsky5I2VPipeline.normalize_first_frame(Kandinsky5I2VPipeline, latents[..., :channels])
        return super().latents_from_pipeline(latents, frames, height, width)
