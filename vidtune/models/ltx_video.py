"""LTX-Video (Lightricks): T5 text encoder, causal video VAE, and a DiT over packed latent tokens."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from diffusers import (
    AutoencoderKLLTXVideo,
    FlowMatchEulerDiscreteScheduler,
    LTXConditionPipeline,
    LTXImageToVideoPipeline,
    LTXPipeline,
    LTXVideoTransformer3DModel,
)
from diffusers.pipelines.ltx.pipeline_ltx_condition import LTXVideoCondition, retrieve_latents
from torch import nn
from transformers import T5EncoderModel

from vidtune.errors import ConfigError, ModelError
from vidtune.export.comfyui import Rule
from vidtune.export.comfyui_models import ComfyUIModel, ltxv
from vidtune.export.comfyui_workflow import ModelFiles, WorkflowLayout, ltxv_parts
from vidtune.models import conditioning, first_frame, key_mask
from vidtune.models.conditioning import Given
from vidtune.models.defaults import LTX_VIDEO
from vidtune.models.given_modes import InPlaceModes
from vidtune.models.spec import (
    Conditions,
    Latents,
    ModelSpec,
    TextComponents,
    frame_count_problem,
    frames_to_pil,
    raise_shape_problems,
    shape_rule,
    side_problems,
)

logger = logging.getLogger(__name__)

# The key of the last frame encoded alone [B, C, 1, h, w] (ltx-video-i2v with a last-frame mode).
LAST_FRAME = "last_frame_latents"


def vae_downsampling_steps(vae: dict[str, Any]) -> tuple[int, int]:
    """(spatial, temporal) halvings of an LTX-Video VAE encoder, from its config: 0.9.0 / 0.9.1 halve both in every
    scaling block; 0.9.5+ name each block's `downsample_type` (spatial, temporal, spatiotemporal, or conv: both)."""
    scaling = vae["spatio_temporal_scaling"]
    kinds = vae.get("downsample_type") or ["conv"] * len(scaling)
    used = [kind for kind, scales in zip(kinds, scaling, strict=False) if scales]
    spatial = sum(kind in ("conv", "spatial", "spatiotemporal") for kind in used)
    temporal = sum(kind in ("conv", "temporal", "spatiotemporal") for kind in used)
    return spatial, temporal



def predict_video(denoiser: nn.Module, conditions: Conditions, inputs: torch.Tensor, timesteps: torch.Tensor,
                  video_tokens: int, frames: int, height: int, width: int, **position: Any) -> torch.Tensor:
    """The LTX transformer on packed `inputs` (any condition tokens first, then the clip's `video_tokens`), told
    where tokens sit by `position` (a rotary scale or coordinates): the clip's prediction unpacked to the latents'
    layout [B, C, F, H, W] of `frames` x `height` x `width`."""
    patch, patch_t = denoiser.config.patch_size, denoiser.config.patch_size_t
    prediction = denoiser(
        hidden_states=inputs,
        encoder_hidden_states=conditions["prompt_embeds"],
        timestep=timesteps,
        encoder_attention_mask=conditions["prompt_attention_mask"],
        num_frames=frames // patch_t,
        height=height // patch,
        width=width // patch,
        **position,
        return_dict=False,
    )[0]
    prediction = prediction[:, inputs.shape[1] - video_tokens:]
    return LTXPipeline._unpack_latents(prediction, frames // patch_t, height // patch, width // patch, patch, patch_t)

class LTXRegionConditionPipeline(LTXConditionPipeline):
    """LTXConditionPipeline given a region of a clip to keep (inpainting / outpainting): `given_region` ([1, 1, F, H,
    W] on the latent grid, 1.0 kept) with the clip as its one video condition at frame 0. The kept latents start
    clean and their tokens run at timestep 0 through the pipeline's own per-token conditioning mask, which its
    frame-indexed conditions fill frame by frame; everything else is the pipeline's."""

    def __call__(self, *args: Any, given_region: torch.Tensor | None = None, **kwargs: Any) -> Any:
        self._given_region = given_region
        try:
            return super().__call__(*args, **kwargs)
        finally:
            self._given_region = None

    def prepare_latents(self, conditions: list[torch.Tensor] | None = None,
                        condition_strength: list[float] | None = None,
                        condition_frame_index: list[int] | None = None, batch_size: int = 1,
                        num_channels_latents: int = 128, height: int = 512, width: int = 704, num_frames: int = 161,
                        num_prefix_latent_frames: int = 2, sigma: torch.Tensor | None = None,
                        latents: torch.Tensor | None = None, generator: torch.Generator | None = None,
                        device: torch.device | None = None, dtype: torch.dtype | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int]:
        given_region = getattr(self, "_given_region", None)
        if given_region is None:
            return super().prepare_latents(conditions, condition_strength, condition_frame_index, batch_size,
                                           num_channels_latents, height, width, num_frames, num_prefix_latent_frames,
                                           sigma, latents, generator, device, dtype)
        if not conditions or len(conditions) != 1 or condition_frame_index != [0]:
            raise ValueError("a given region takes the clip it keeps as the one video condition, at frame 0")
        noise, _, video_ids, _ = super().prepare_latents([], [], [], batch_size, num_channels_latents, height, width,
                                                         num_frames, num_prefix_latent_frames, sigma, latents,
                                                         generator, device, dtype)
        clean = retrieve_latents(self.vae.encode(conditions[0]), generator=generator)
        clean = self._normalize_latents(clean, self.vae.latents_mean, self.vae.latents_std).to(device, dtype=dtype)
        patch, patch_t = self.transformer_spatial_patch_size, self.transformer_temporal_patch_size
        mask = self._pack_latents(given_region.to(device, dtype=dtype).expand(batch_size, -1, -1, -1, -1),
                                  patch, patch_t).amin(dim=-1)
        latents = torch.lerp(noise, self._pack_latents(clean, patch, patch_t), mask[..., None])
        return latents, mask, video_ids, 0


class LTXVideoSpec(ModelSpec):
    name = "ltx-video"
    control_input_layer = "proj_in"  # Linear over packed patches [B, F*H*W, C*pt*p*p]
    validation_guidance_scale = 3.0
    frame_rate_conditioned = True
    first_frame_conditioning = 0.1  # LTX-Video-Trainer configs/ltxv_2b_lora.yaml: first_frame_conditioning_p
    conditioning_refusal = ("it samples from text with LTXPipeline; ltx-video-i2v (the same checkpoints) trains "
                            "and samples every mode with LTXConditionPipeline.")
    defaults = LTX_VIDEO

    # ----- shape rules, read from the VAE / transformer configs (no weights needed) --------------------
    @functools.cached_property
    def compression(self) -> tuple[int, int, int, int]:
        """(VAE spatial ratio, VAE temporal ratio, transformer patch size, transformer temporal patch)."""
        vae = self.load_config(AutoencoderKLLTXVideo, "vae")
        spatial_steps, temporal_steps = vae_downsampling_steps(vae)
        spatial = vae.get("spatial_compression_ratio") or vae["patch_size"] * 2**spatial_steps
        temporal = vae.get("temporal_compression_ratio") or vae["patch_size_t"] * 2**temporal_steps
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
    loads_single_file = True  # Lightricks' ltx-video-*.safetensors (transformer and VAE), ComfyUI's too
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
        posterior = self.vae_posterior(vae, videos)
        mean_shift = vae.latents_mean.view(1, -1, 1, 1, 1).to(posterior.mean)
        scale = (vae.config.scaling_factor / vae.latents_std).view(1, -1, 1, 1, 1).to(posterior.mean)
        # The pipeline decodes latents * std / scaling + mean; normalise so that inverts it.
        return self.normalised_posterior(posterior, scale, mean_shift)

    def rope_interpolation_scale(self, frame_rates: torch.Tensor | None = None) -> tuple[Any, float, float]:
        """The scale LTXPipeline passes at inference (VAE temporal ratio / frame rate, spatial ratio twice); training
        with another one builds an unusable model. `frame_rates` [B]: each sample's own rate (one rate: a float, as
        the pipeline passes it; several: a [B, 1, 1, 1, 1] tensor, which the rotary embedding multiplies its frame
        coordinates [B, 1, F, H, W] by)."""
        spatial, temporal, _, _ = self.compression
        if frame_rates is None or bool((frame_rates == frame_rates[0]).all()):
            rate = self.frame_rate if frame_rates is None else float(frame_rates[0])
            return (temporal / rate, spatial, spatial)
        return ((temporal / frame_rates.float()).view(-1, 1, 1, 1, 1), spatial, spatial)

    def pack_control(self, control: torch.Tensor, denoiser: nn.Module,
                     hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Packed like the latents ([B, tokens, C * patch volume], channels most significant): appended on the
        last dimension, the control's patches meet the widened inputs of `proj_in`."""
        config = denoiser.config
        return LTXPipeline._pack_latents(control, config.patch_size, config.patch_size_t), -1

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        patch = denoiser.config.patch_size
        patch_t = denoiser.config.patch_size_t
        batch, _, frames, height, width = noisy_latents.shape
        noisy_latents, given = first_frame.give(noisy_latents, conditions)
        packed = LTXPipeline._pack_latents(noisy_latents, patch, patch_t)
        if bool(given.any()):  # timestep 0 on the given first frame's tokens (tokens run frame by frame)
            timesteps = first_frame.token_timesteps(timesteps, given, (height // patch) * (width // patch),
                                                    packed.shape[1])
        scale = self.rope_interpolation_scale(self.frame_rates(conditions, batch))
        return predict_video(denoiser, conditions, packed, timesteps, packed.shape[1], frames, height, width,
                             rope_interpolation_scale=scale)

    def per_clip_error(self, squared_error: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        """A first frame given clean (first-frame conditioning) is not predicted: it stays out of the loss."""
        return first_frame.per_clip_error(squared_error, conditions)

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

    def comfyui_model(self) -> ComfyUIModel:
        return ltxv(self.load_config(LTXVideoTransformer3DModel, "transformer"))

    def comfyui_workflow(self) -> WorkflowLayout:
        """Lightricks' single checkpoint (model and VAE) in models/checkpoints: the 13B's or the 2B's by size."""
        large = self.load_config(LTXVideoTransformer3DModel, "transformer")["num_layers"] > 28
        checkpoint = "ltxv-13b-0.9.8-dev.safetensors" if large else "ltx-video-2b-v0.9.5.safetensors"
        files = ModelFiles(checkpoint=checkpoint, text_encoders=("t5xxl_fp16.safetensors",), clip_type="ltxv")
        return WorkflowLayout(files, functools.partial(ltxv_parts, image=self.image_to_video), scheduler="ltxv")

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

    @classmethod
    def context_parallel_plan(cls) -> dict[str, Any] | str:
        """diffusers' plan, with first-frame conditioning's per-token timesteps ([B, tokens]) split like the tokens
        (a [B] timestep is left whole: the split applies to two-dimensional ones only)."""
        from diffusers.models._modeling_parallel import ContextParallelInput

        plan = super().context_parallel_plan()
        if isinstance(plan, str):
            return plan
        return {**plan, "": {**plan[""], "timestep": ContextParallelInput(split_dim=1, expected_dims=2)}}


class LTXVideoImageToVideoSpec(InPlaceModes, LTXVideoSpec):
    """LTX-Video conditioned on frames of the clip (`model.condition_frames`: the first frame, or keyframes).

    Trained the way the pipelines sample: each condition frame is encoded on its own (a one-frame clip), and its
    latent is given to the denoiser clean, with timestep 0 on its tokens; the loss leaves those tokens out. The
    first frame takes the place of the first latent frame; a keyframe at frame k > 0 is appended as extra tokens
    whose rotary position is frame k, and its prediction is dropped (LTXConditionPipeline.prepare_latents).

    Which pipeline samples it is read from the checkpoint's scheduler: 0.9.5+ and 13B checkpoints (a fixed-shift
    scheduler) sample with LTXConditionPipeline, whose rotary time coordinates (`video_coords`) training uses too;
    0.9.0 / 0.9.1 checkpoints (dynamic shifting, which that pipeline cannot take) with LTXImageToVideoPipeline,
    first frame only.
    """

    name = "ltx-video-i2v"
    image_to_video = True
    pipeline_class = LTXConditionPipeline
    # Every sample conditioned, unless `model.first_frame_conditioning` says otherwise (first frame only, then).
    first_frame_conditioning = 1.0
    # Each as LTXConditionPipeline samples it: the first frames of a clip in place (a video condition at frame 0),
    # the last frame as a keyframe's extra tokens (an image condition at the last frame), and a kept region in place
    # (the pipeline's per-token conditioning mask, given the region: `LTXRegionConditionPipeline`).
    conditioning_modes = ("extension", "last_frame", "first_last", "inpaint")
    modes_pipeline = "LTXConditionPipeline"

    @classmethod
    def context_parallel_plan(cls) -> dict[str, Any] | str:
        return ("its condition frames are encoded apart and keyframes appended as extra tokens with rotary "
                "coordinates of their own, which the plan does not split")

    def load_denoiser(self, device: torch.device, load_on: torch.device | None = None) -> nn.Module:
        """With a last-frame mode drawn, a batch may mix samples with and without a keyframe's extra tokens: the
        denoiser takes the key mask that hides the padding of those without (`forward_modes`)."""
        denoiser = super().load_denoiser(device, load_on)
        if self.takes_last_frame:
            self.key_mask.attach(denoiser)
        return denoiser

    @functools.cached_property
    def key_mask(self) -> key_mask.KeyMask:
        return key_mask.KeyMask("attn1")

    # ----- which pipeline, and the condition frames -------------------------------------------------------------
    @functools.cached_property
    def uses_condition_pipeline(self) -> bool:
        """LTXConditionPipeline sets its own timesteps, which a scheduler with dynamic shifting refuses (it needs a
        `mu` that pipeline never passes): such checkpoints (0.9.0 / 0.9.1) sample with LTXImageToVideoPipeline."""
        scheduler = self.load_config(FlowMatchEulerDiscreteScheduler, "scheduler")
        return not scheduler.get("use_dynamic_shifting", False)

    @property
    def condition_frames(self) -> list[int]:
        return list(self.config.condition_frames)

    def frames_given(self, latent_frames: int) -> list[int]:
        """The condition frames of a clip with `latent_frames` latent frames: none for a still (one latent frame,
        nothing after it to predict: it trains unconditioned, as text-to-image), else `condition_frames`."""
        return [] if latent_frames == 1 else self.condition_frames

    def keyframes(self, latent_frames: int) -> list[int]:
        """The condition frames after the first: extra tokens rather than the first latent frame."""
        return [frame for frame in self.frames_given(latent_frames) if frame > 0]

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        super().check_video_shape(frames, height, width)
        chosen = self.condition_frames
        problems = []
        if len(set(chosen)) != len(chosen):
            problems.append(f"model.condition_frames={chosen} names a frame twice; name each frame once")
        outside = [frame for frame in chosen if frame >= frames]
        if outside and frames > 1:  # a still trains unconditioned
            problems.append(f"model.condition_frames={chosen}: frame(s) {outside} lie outside the {frames} frames of "
                            f"a clip (data.frames); use frames 0 to {frames - 1}")
        if chosen != [0] and self.first_frame_probability < 1:
            problems.append(f"model.condition_frames={chosen} with model.first_frame_conditioning="
                            f"{self.first_frame_probability:g}: a share of unconditioned samples works with the "
                            "first frame only; set model.condition_frames to [0], or first_frame_conditioning to 1")
        if chosen != [0] and not self.uses_condition_pipeline:
            problems.append(
                f"model.condition_frames={chosen}: the model at {self.config.pretrained} samples with "
                "LTXImageToVideoPipeline (its scheduler uses dynamic shifting, as LTX-Video 0.9.0 / 0.9.1 do), "
                "which conditions on the first frame only; set model.condition_frames to [0], or use a 0.9.5+ "
                "checkpoint for keyframes"
            )
        problems += self.mode_problems(frames)
        if problems:
            raise ConfigError("The condition frames do not fit:\n" + "\n".join(f"  - {p}" for p in problems)
                              + "\nWhat to do: fix model.condition_frames as said above.")

    def mode_problems(self, frames: int) -> list[str]:
        """What keeps `model.conditioning`'s modes from clips of `frames` frames."""
        if not self.modes_on:
            return []
        problems = []
        if self.condition_frames != [0]:
            problems.append(f"model.conditioning with model.condition_frames={self.condition_frames}: the modes "
                            "draw which frames each sample is given; set model.condition_frames to [0]")
        if not self.uses_condition_pipeline:
            problems.append(f"model.conditioning: the model at {self.config.pretrained} samples with "
                            "LTXImageToVideoPipeline (a dynamic-shifting scheduler, LTX-Video 0.9.0 / 0.9.1), which "
                            "takes a first frame only; use a 0.9.5+ checkpoint for the modes")
        return problems + self.extension_problems(frames)

    def latent_identity(self) -> dict[str, Any]:
        identity = {**super().latent_identity(), "condition_frames": self.condition_frames}
        if self.takes_last_frame:
            identity["last_frame"] = "encoded alone"
        return identity

    def visit_conditions(self, x0: torch.Tensor, positions: torch.Tensor, seed: int) -> Conditions:
        """Which samples are conditioned, when `model.first_frame_conditioning` is below 1 (else all are); the
        condition is the first frame encoded alone (`condition_latents`), as the pipelines encode the image. With
        `model.conditioning`, each sample's mode (vidtune/models/conditioning.py)."""
        if self.modes_on:
            return self.draw_modes(x0, positions, seed, self.first_frame_probability)
        probability = self.first_frame_probability
        if probability >= 1:
            return {}
        return {first_frame.GIVEN: first_frame.draw(probability, x0, positions, seed)[first_frame.GIVEN]}

    def first_frame_given(self, conditions: Conditions, batch: int, frames: int, device: torch.device
                          ) -> torch.Tensor:
        """[B] float: 1.0 where a sample's first latent frame is its condition (every sample without a draw)."""
        if 0 not in self.frames_given(frames):
            return torch.zeros(batch, device=device)
        if first_frame.GIVEN not in conditions:
            return torch.ones(batch, device=device)
        return first_frame.given_mask(conditions, batch, device)

    # ----- tensors ---------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        """The clip's posterior, and `condition_latents` [B, C, K, h, w]: each condition frame encoded alone (as
        the pipelines encode a conditioning image) and normalised like the clip, in `condition_frames` order."""
        latents = super().prepare_latents(vae, videos)
        mean = latents["latents_mean"]
        given = self.frames_given(mean.shape[2])
        if not given:
            latents["condition_latents"] = mean[:, :, :0]
            return latents
        # [B, K, 3, H, W] -> K one-frame clips per sample, encoded together.
        singles = videos[:, given].flatten(0, 1).unsqueeze(1)
        encoded = super().prepare_latents(vae, singles)["latents_mean"]  # [B * K, C, 1, h, w]
        latents["condition_latents"] = encoded.view(videos.shape[0], len(given), *encoded.shape[1:]) \
            .squeeze(3).transpose(1, 2)
        if self.takes_last_frame:  # the last frame as the pipeline encodes an image condition: alone
            latents[LAST_FRAME] = super().prepare_latents(vae, videos[:, -1:])["latents_mean"]
        return latents

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        if conditioning.MODE in conditions:
            return self.forward_modes(denoiser, conditions, noisy_latents, timesteps)
        patch, patch_t = denoiser.config.patch_size, denoiser.config.patch_size_t
        batch, _, frames, height, width = noisy_latents.shape
        condition = conditions["condition_latents"].to(noisy_latents)
        order = self.frames_given(frames)
        frame_mask = noisy_latents.new_zeros(batch, frames)
        if 0 in order:
            first = order.index(0)
            given = self.first_frame_given(conditions, batch, frames, noisy_latents.device).to(noisy_latents.dtype)
            chosen = given.view(-1, 1, 1, 1, 1)
            start = chosen * condition[:, :, first : first + 1] + (1.0 - chosen) * noisy_latents[:, :, :1]
            noisy_latents = torch.cat([start, noisy_latents[:, :, 1:]], dim=2)
            frame_mask[:, 0] = given
        tokens = LTXPipeline._pack_latents(noisy_latents, patch, patch_t)
        # One mask value per token (tokens run frame by frame), as the pipelines gather it.
        token_mask = frame_mask[:, :: patch_t].repeat_interleave((height // patch) * (width // patch), dim=1)
        extra = [LTXPipeline._pack_latents(condition[:, :, order.index(k) : order.index(k) + 1], patch, patch_t)
                 for k in self.keyframes(frames)]
        inputs = torch.cat([*extra, tokens], dim=1)
        mask = torch.cat([*(token_mask.new_ones(part.shape[:2]) for part in extra), token_mask], dim=1)
        # Timestep 0 on the clean tokens (the pipelines' min(t, (1 - mask) * 1000)).
        per_token = torch.minimum(timesteps.to(mask)[:, None], (1.0 - mask) * 1000.0)
        position = self.rotary_inputs(batch, frames, height, width, patch, patch_t, inputs.device,
                                      self.frame_rates(conditions, batch))
        return predict_video(denoiser, conditions, inputs, per_token, tokens.shape[1], frames, height, width,
                             **position)

    # ----- conditioning modes --------------------------------------------------------------------------------
    def forward_modes(self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor,
                      timesteps: torch.Tensor) -> torch.Tensor:
        """The denoiser on a batch of drawn modes, as LTXConditionPipeline gives each: the given region in place at
        timestep 0 (the first frame encoded alone, as the pipeline encodes an image), the last frame as a keyframe's
        extra tokens at the clip's last frame. A batch mixing samples with and without those extra tokens runs in
        one call: every sample takes them, hidden from the attention of the samples without (vidtune/models/
        key_mask.py), which thus predict what they predict alone."""
        batch, _, frames, height, width = noisy_latents.shape
        codes = conditions[conditioning.MODE].flatten()
        last = conditioning.is_mode(codes, conditioning.LAST_FRAME_MODES)
        patch, patch_t = denoiser.config.patch_size, denoiser.config.patch_size_t
        given = self.given_region(conditions, noisy_latents.shape)
        clean = conditions[conditioning.LATENTS].to(noisy_latents)
        first = conditioning.is_mode(codes, conditioning.FIRST_FRAME_MODES).view(-1, 1, 1, 1, 1)
        image = conditions["condition_latents"][:, :, :1].to(noisy_latents)
        image = image if image.shape[2] else clean[:, :, :1]  # a still: no first-frame mode is drawn
        clean = torch.cat([torch.where(first, image, clean[:, :, :1]), clean[:, :, 1:]], dim=2)
        tokens = LTXPipeline._pack_latents(conditioning.give(noisy_latents, clean, given), patch, patch_t)
        # A token is given when all its cells are (the LTX-Video transformers patch 1 x 1 x 1: one cell a token).
        token_mask = LTXPipeline._pack_latents(given.to(noisy_latents), patch, patch_t).amin(dim=-1)
        keyframes = [(frames - 1) * self.compression[1]] if bool(last.any()) else []
        extra = [LTXPipeline._pack_latents(conditions[LAST_FRAME].to(noisy_latents), patch, patch_t)] \
            if keyframes else []
        inputs = torch.cat([*extra, tokens], dim=1)
        mask = torch.cat([*(token_mask.new_ones(part.shape[:2]) for part in extra), token_mask], dim=1)
        per_token = torch.minimum(timesteps.to(mask)[:, None], (1.0 - mask) * 1000.0)
        position = self.rotary_inputs(batch, frames, height, width, patch, patch_t, inputs.device,
                                      self.frame_rates(conditions, batch), keyframes)
        if bool(last.all()) or not keyframes:
            return predict_video(denoiser, conditions, inputs, per_token, tokens.shape[1], frames, height, width,
                                 **position)
        # Both layouts: the keyframe's tokens of the samples not given it are padding, out of their attention.
        keep = torch.cat([last.to(inputs.device)[:, None].expand(-1, extra[0].shape[1]),
                          torch.ones(tokens.shape[:2], dtype=torch.bool, device=inputs.device)], dim=1)
        self.key_mask.used = 0
        prediction = predict_video(denoiser, conditions, inputs, per_token, tokens.shape[1], frames, height, width,
                                   **position, **key_mask.padded_call(keep))
        if not self.key_mask.used:  # a denoiser not loaded by this spec: the padding would be attended to
            raise RuntimeError(f"{self.name}'s key mask is not on this denoiser (load it with the spec's "
                               "load_denoiser)")
        return prediction

    def rotary_inputs(self, batch: int, frames: int, height: int, width: int, patch: int, patch_t: int,
                      device: torch.device, frame_rates: torch.Tensor,
                      keyframes: list[int] | None = None) -> dict[str, Any]:
        """Where each token sits, as the sampling pipeline tells the transformer: LTXConditionPipeline's
        `video_coords` (the keyframes' tokens first, at their frames; seconds: frame / each sample's rate), or
        LTXImageToVideoPipeline's `rope_interpolation_scale`."""
        if not self.uses_condition_pipeline:
            return {"rope_interpolation_scale": self.rope_interpolation_scale(frame_rates)}
        spatial, temporal, _, _ = self.compression

        def coords(count: int, frame_index: int) -> torch.Tensor:
            ids = LTXConditionPipeline._prepare_video_ids(batch, count, height, width, patch, patch_t, device)
            return LTXConditionPipeline._scale_video_ids(ids, spatial, temporal, frame_index)

        keyframes = self.keyframes(frames) if keyframes is None else keyframes
        video_coords = torch.cat([*(coords(1, k) for k in keyframes), coords(frames, 0)], dim=2).float()
        video_coords[:, 0] = video_coords[:, 0] / frame_rates.float().to(device).view(-1, 1)
        return {"video_coords": video_coords}

    def pack_control(self, control: torch.Tensor, denoiser: nn.Module,
                     hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """As LTX-Video packs it, behind zero controls for the keyframes' extra tokens, which lead the clip's (those
        of `model.condition_frames`, or of a drawn mode's keyframes: they take no control)."""
        packed, dim = super().pack_control(control, denoiser, hidden)
        extra = hidden.shape[1] - packed.shape[1]
        return torch.cat([packed.new_zeros(packed.shape[0], extra, packed.shape[2]), packed], dim=1), dim

    def per_clip_error(self, squared_error: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        """The clean first latent frame is given, not predicted: it stays out of the loss (where it is given); so
        does a drawn mode's given region."""
        if conditioning.MODE in conditions:
            return self.modes_error(squared_error, conditions)
        batch, frames = squared_error.shape[0], squared_error.shape[2]
        given = self.first_frame_given(conditions, batch, frames, squared_error.device)
        whole = squared_error.flatten(1).mean(dim=1)
        if not bool(given.any()):
            return whole
        return torch.where(given > 0, squared_error[:, :, 1:].flatten(1).mean(dim=1), whole)

    # ----- pipeline and outputs ----------------------------------------------------------------------
    def pipeline(self, text: TextComponents, vae: nn.Module, denoiser: nn.Module) -> Any:
        # The region pipeline is LTXConditionPipeline itself unless it is given a region to keep (inpainting).
        pipeline_class = LTXRegionConditionPipeline if self.uses_condition_pipeline else LTXImageToVideoPipeline
        return pipeline_class(
            scheduler=self.load_scheduler(),
            vae=vae,
            text_encoder=text["text_encoder"],
            tokenizer=text["tokenizer"],
            transformer=denoiser,
        )

    def reference_frame_count(self, frames: int) -> int:
        return max(self.condition_frames) + 1

    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        reference = self.given_reference(reference)
        if not self.uses_condition_pipeline:
            return {"image": self.first_frame_image(reference), "frame_rate": self.frame_rate}
        given = [frame for frame in self.condition_frames if frame < reference.shape[0]]
        if given != self.condition_frames:
            logger.warning("Sampling from frame(s) %s of the %d given; the model was trained on frames %s.",
                           given, reference.shape[0], self.condition_frames)
        if not given:
            raise ModelError(f"{self.name}: the reference has {reference.shape[0]} frame(s), fewer than any condition "
                             f"frame {self.condition_frames}.\nWhat to do: give a clip with frame "
                             f"{min(self.condition_frames)}.")
        conditions = [LTXVideoCondition(image=frames_to_pil(reference[frame:frame + 1])[0], frame_index=frame)
                      for frame in given]
        return {"conditions": conditions, "frame_rate": self.frame_rate}

    def check_given(self, given: Given) -> None:
        super().check_given(given)
        if given.mode != "first_frame" and not self.uses_condition_pipeline:
            raise ModelError(f"{self.name}: the model at {self.config.pretrained} samples with "
                             "LTXImageToVideoPipeline (LTX-Video 0.9.0 / 0.9.1), which takes a first frame only, not "
                             f"{given.mode.replace('_', '-')} conditioning.\nWhat to do: sample from a first frame "
                             "(--image), or use a 0.9.5+ checkpoint.")

    def frame_condition(self, picture: Any, last: bool, frames: int) -> LTXVideoCondition:
        """LTXConditionPipeline's frame-indexed condition: an image or a video, at frame 0 or the clip's last frame."""
        kind = "video" if isinstance(picture, list) else "image"
        return LTXVideoCondition(**{kind: picture}, frame_index=frames - 1 if last else 0)

    def latents_from_pipeline(self, latents: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
        if latents.ndim == 5:
            return latents  # LTXConditionPipeline's result, unpacked by it
        # A step's latents (packed), behind the keyframes' extra tokens in LTXConditionPipeline.
        spatial, temporal, patch, patch_t = self.compression
        video_tokens = ((frames - 1) // temporal + 1) // patch_t * (height // spatial // patch) \
            * (width // spatial // patch)
        return super().latents_from_pipeline(latents[:, -video_tokens:], frames, height, width)
