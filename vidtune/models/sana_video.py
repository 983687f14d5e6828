"""Sana Video (NVIDIA, MIT HAN Lab): Gemma 2 text encoder, Wan 2.1's video VAE, and a linear-attention DiT.

`sana-video` is text-to-video (SanaVideoPipeline), `sana-video-i2v` image-to-video (SanaImageToVideoPipeline); both
pipelines run the same SanaVideoTransformer3DModel, so one checkpoint serves both names. Conventions taken from the
pipelines:
    text: the caption is lower-cased and stripped, prefixed with the pipeline's "complex human instruction", tokenised
        (right padded) to the instruction's tokens + `max_sequence_length` - 2, encoded by Gemma 2 with the mask,
        then the first token and the last `max_sequence_length` - 1 are kept, embeddings and mask; the empty caption
        (the unconditional side of guidance) is encoded without the instruction, as the pipeline encodes its
        negative prompt;
    latents: the VAE posterior normalised per channel, (z - vae.config.latents_mean) / vae.config.latents_std;
    objective: flow matching, read from the scheduler (DPMSolverMultistepScheduler with flow sigmas, or
        FlowMatchEulerDiscreteScheduler); the transformer is told sigma * 1000.
Image-to-video gives the denoiser the image's latent (the first frame encoded alone, its mode) in place of the first
latent frame, with timestep 0 on that frame's tokens, and leaves that frame out of the loss: the pipeline never
updates it. The text-to-video name takes the same conditioning on a share of its samples with
`model.first_frame_conditioning`, which teaches one adapter both pipelines.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, ClassVar

import diffusers
import torch
from diffusers import (
    AutoencoderKLWan,
    DPMSolverMultistepScheduler,
    SanaImageToVideoPipeline,
    SanaVideoPipeline,
    SanaVideoTransformer3DModel,
    SchedulerMixin,
)
from torch import nn
from transformers import Gemma2Model

from vidtune.errors import SchedulerError
from vidtune.models import first_frame
from vidtune.models.defaults import SANA_VIDEO
from vidtune.models.spec import (
    ALL_LINEAR,
    ATTENTION_TARGETS,
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
from vidtune.models.wan import wan_vae_compression
from vidtune.objectives import SUPPORTED_SCHEDULERS

DEFAULT_MAX_SEQUENCE_LENGTH = 300  # the pipelines' max_sequence_length
PIPELINE_SIDE_MULTIPLE = 32  # SanaVideoPipeline.check_inputs: height and width divisible by 32
# The feed-forward of a block is a GLU of 1x1 convolutions around a depthwise one (GLUMBTempConv): the 1x1 ones.
SANA_FEED_FORWARD_TARGETS = ("ff.conv_inverted", "ff.conv_point")


@functools.cache
def complex_human_instruction() -> tuple[str, ...]:
    """The instruction the pipelines put before every prompt by default (their `complex_human_instruction`)."""
    default = inspect.signature(SanaVideoPipeline.__call__).parameters["complex_human_instruction"].default
    return tuple(default or ())


class SanaVideoSpec(ModelSpec):
    name = "sana-video"
    control_input_layer = "patch_embedding"  # Conv3d over [B, C, F, H, W]
    validation_guidance_scale = 6.0  # the pipelines' default guidance_scale
    # Off by default; a share above 0 gives samples their clean first latent frame, as the image-to-video pipeline.
    first_frame_conditioning = 0.0
    defaults = SANA_VIDEO
    pipeline_class = SanaVideoPipeline
    text_encoder_class = Gemma2Model
    vae_class = AutoencoderKLWan
    denoiser_class = SanaVideoTransformer3DModel
    scheduler_class = DPMSolverMultistepScheduler
    lora_presets: ClassVar[dict[str, tuple[str, ...]]] = {
        "attention": ATTENTION_TARGETS,
        "attention+ffn": ATTENTION_TARGETS + SANA_FEED_FORWARD_TARGETS,
        ALL_LINEAR: (ALL_LINEAR,),
    }

    def native_max_sequence_length(self) -> int:
        return DEFAULT_MAX_SEQUENCE_LENGTH

    # ----- shape rules, read from the VAE / transformer configs (no weights needed) --------------------
    @functools.cached_property
    def compression(self) -> tuple[int, int, tuple[int, int, int]]:
        """(VAE spatial ratio, VAE temporal ratio, transformer patch size (t, h, w)): Wan 2.1's VAE."""
        return wan_vae_compression(self)

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        spatial, temporal, patch = self.compression
        # The transformer takes sides of VAE ratio x patch; the pipelines refuse any side not a multiple of 32.
        side = math.lcm(spatial * patch[1], spatial * patch[2], PIPELINE_SIDE_MULTIPLE)
        raise_shape_problems("Sana Video", [frame_count_problem(frames, temporal, patch[0]),
                                            *side_problems(height, width, side)],
                             self, shape_rule(temporal, patch[0], side))

    # ----- loading ---------------------------------------------------------------------------------
    def load_scheduler(self) -> Any:
        """The scheduler class the checkpoint names (DPMSolverMultistepScheduler with flow sigmas for text-to-video,
        FlowMatchEulerDiscreteScheduler in image-to-video conversions)."""
        name = self.load_config(self.scheduler_class, "scheduler").get("_class_name", self.scheduler_class.__name__)
        scheduler_class = getattr(diffusers, str(name), None)
        if not (isinstance(scheduler_class, type) and issubclass(scheduler_class, SchedulerMixin)):
            raise SchedulerError(
                f"{self.describe_file('scheduler', 'scheduler_config.json')}: _class_name {name!r} is not a diffusers "
                f"scheduler. Supported: {SUPPORTED_SCHEDULERS}."
            )
        return self.load_component(scheduler_class, "scheduler")

    # ----- tensors ---------------------------------------------------------------------------------
    def condition_identity(self) -> dict[str, Any]:
        # The instruction is diffusers' default: another diffusers release may bring another one.
        return {**super().condition_identity(), "instruction": list(complex_human_instruction())}

    @torch.no_grad()
    def prepare_conditions(self, text: TextComponents, captions: list[str]) -> Conditions:
        """Gemma 2 embeddings and mask, computed by the pipeline's own `encode_prompt`: captions with the
        instruction (the pipeline's prompts), the empty caption without it (the pipeline's negative prompt)."""
        encoder = SanaVideoPipeline(tokenizer=text["tokenizer"], text_encoder=text["text_encoder"], vae=None,
                                    transformer=None, scheduler=None)
        device = text["text_encoder"].device
        embeds: list[torch.Tensor | None] = [None] * len(captions)
        masks: list[torch.Tensor | None] = [None] * len(captions)
        for empty in (False, True):
            chosen = [i for i, caption in enumerate(captions) if (caption.strip() == "") == empty]
            if not chosen:
                continue
            prompt_embeds, mask, _, _ = encoder.encode_prompt(
                [captions[i] for i in chosen], do_classifier_free_guidance=False, device=device,
                max_sequence_length=self.max_sequence_length,
                complex_human_instruction=None if empty else list(complex_human_instruction()),
            )
            for row, i in enumerate(chosen):
                embeds[i], masks[i] = prompt_embeds[row], mask[row]
        return {"prompt_embeds": torch.stack(embeds), "prompt_attention_mask": torch.stack(masks)}

    def normalise(self, vae: nn.Module, latents: torch.Tensor, shift: bool = True) -> torch.Tensor:
        """(z - latents_mean) / latents_std per channel: the inverse of the pipelines' decode."""
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

    def token_timesteps(self, denoiser: nn.Module, timesteps: torch.Tensor, latents: torch.Tensor,
                        given: torch.Tensor) -> torch.Tensor:
        """[B, 1, F, H, W] per-token timesteps, as the image-to-video pipeline builds them: each sample's timestep,
        0 on the first latent frame of the samples given it (`given` [B], 1.0: given)."""
        patch_t, patch_h, patch_w = denoiser.config.patch_size
        batch, _, frames, height, width = latents.shape
        per_token = timesteps.to(latents.device).float().view(batch, 1, 1, 1, 1).expand(
            batch, 1, frames // patch_t, height // patch_h, width // patch_w).clone()
        per_token[:, :, 0] *= (1.0 - given.to(per_token)).view(batch, 1, 1, 1)
        return per_token

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        hidden_states, given = first_frame.give(noisy_latents, conditions)
        if bool(given.any()):
            timesteps = self.token_timesteps(denoiser, timesteps, noisy_latents, given)
        return self.denoise(denoiser, conditions, hidden_states, timesteps)

    def denoise(self, denoiser: nn.Module, conditions: Conditions, hidden_states: torch.Tensor,
                timesteps: torch.Tensor) -> torch.Tensor:
        """The transformer's prediction of the latents' channels (a model predicting twice as many, a learned
        variance, gives its first half, as the pipelines keep it)."""
        dtype = hidden_states.dtype
        prediction = denoiser(
            hidden_states=hidden_states,
            encoder_hidden_states=conditions["prompt_embeds"].to(dtype),
            encoder_attention_mask=conditions["prompt_attention_mask"].to(hidden_states.device),
            timestep=timesteps.to(hidden_states.device),
            return_dict=False,
        )[0]
        channels = hidden_states.shape[1]
        return prediction[:, :channels] if prediction.shape[1] == 2 * channels else prediction

    def per_clip_error(self, error: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        """A first frame given clean (first-frame conditioning) is not predicted: it stays out of the loss."""
        return first_frame.per_clip_error(error, conditions)

    # ----- ComfyUI ------------------------------------------------------------------------------------
    def comfyui_absent(self) -> str:
        return ("ComfyUI's core has no Sana Video model (comfy/ldm holds no Sana Video transformer), so there is no "
                "ComfyUI file to write. The run's diffusers adapter file loads with SanaVideoPipeline's or "
                "SanaImageToVideoPipeline's load_lora_weights, and with `vidtune sample`.")

    # ----- pipeline and outputs ----------------------------------------------------------------------
    def pipeline(self, text: TextComponents, vae: nn.Module, denoiser: nn.Module) -> Any:
        return self.pipeline_class(tokenizer=text["tokenizer"], text_encoder=text["text_encoder"], vae=vae,
                                   transformer=denoiser, scheduler=self.load_scheduler())

    def call_pipeline(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                      num_inference_steps: int, guidance_scale: float, generator: torch.Generator, output_type: str,
                      reference: torch.Tensor | None = None, callback: StepCallback | None = None) -> Any:
        """The pipelines name the frame count `frames`; the clip shape is taken as asked (no resolution binning,
        which would sample another size and resize it)."""
        return pipeline(
            **self.prompt_inputs(pipeline, prompt, guidance_scale),
            frames=frames,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            max_sequence_length=self.max_sequence_length,
            generator=generator,
            output_type=output_type,
            use_resolution_binning=False,
            **self.pipeline_inputs(reference),
            **step_callback(callback),
        )


class SanaVideoImageToVideoSpec(SanaVideoSpec):
    """Sana Video from an image: the first frame of the `reference` clip (validation gives the first dataset clip).
    Every sample is given its image, as the pipeline always is; a still (one latent frame) would be the image itself
    and trains unconditioned."""

    name = "sana-video-i2v"
    image_to_video = True
    conditioning_refusal = "SanaImageToVideoPipeline takes one first image; no other frame, clip or mask."
    first_frame_conditioning = None  # always conditioned: no share to choose
    pipeline_class = SanaImageToVideoPipeline

    def latent_identity(self) -> dict[str, Any]:
        return {**super().latent_identity(), "first_frame": "image latent (mode)"}

    @torch.no_grad()
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        """The clip's posterior, and `first_frame_latents`: the first frame encoded alone (its mode), normalised, as
        the pipeline encodes the image."""
        latents = super().prepare_latents(vae, videos)
        pixels = videos[:, 0].to(device=vae.device, dtype=vae.dtype).unsqueeze(2)
        latents[first_frame.LATENTS] = self.normalise(vae, vae.encode(pixels).latent_dist.mode())
        return latents

    def image_given(self, latents: torch.Tensor) -> torch.Tensor:
        """[B] 1.0 for each sample given its image (all, unless a still)."""
        value = 1.0 if latents.shape[2] > 1 else 0.0
        return torch.full((latents.shape[0],), value, device=latents.device)

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        given = self.image_given(noisy_latents)
        conditions = {**conditions, first_frame.GIVEN: given}
        hidden_states, _ = first_frame.give(noisy_latents, conditions)
        return self.denoise(denoiser, conditions, hidden_states,
                            self.token_timesteps(denoiser, timesteps, noisy_latents, given))

    def per_clip_error(self, error: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        given = self.image_given(error)
        return first_frame.per_clip_error(error, {**conditions, first_frame.GIVEN: given})

    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        return {"image": self.first_frame_image(reference)}
