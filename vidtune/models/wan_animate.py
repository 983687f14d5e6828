"""Wan Animate (Wan2.2-Animate-14B): Wan 2.1 image-to-video's text encoder, VAE, CLIP image encoder and blocks,
animated by a pose video and a face video (WanAnimatePipeline, `mode="animate"`).

Conventions taken from WanAnimatePipeline (one segment of `segment_frame_length` = the clip's frames):
    latents: one latent frame more than the clip's: position 0 is the reference image's, then the clip's; the
        pipeline decodes `latents[:, :, 1:]`. Training's target there is the reference image's own latents (its
        first frame by default), as DiffSynth-Studio's Wan Animate training, whose clip starts with the reference;
    reference condition (concatenated to the noisy latents on the channel dim): four mask channels of ones and the
        normalised latents of the reference image (argmax), then, for the clip's frames, four mask channels of
        zeros and the normalised latents of a mid-grey video (pixel 0: the pipeline's first segment in animate
        mode has no previous frames);
    image_embeds: the CLIP vision encoder's penultimate hidden states of the reference image;
    pose: the pose video's normalised latents (argmax), added after the patch embedding of every frame but the
        reference's. It comes from the sample's `pose` input, else its control clip (`controls.txt` /
        `control_column`); without either the model sees a black pose video, what sampling without a pose gives;
    face: the sample's `face` input at the motion encoder's size, which the transformer encodes itself (motion
        encoder, face encoder, face adapters). Without one the model sees black frames (-1), the pipeline's own
        "no face" (its unconditional branch);
    character image: the sample's `reference_images` input (its one image) where given, else the clip's first frame:
        its latents go first in the condition and in the target, its CLIP tokens to the image cross-attention;
    replace mode (`model.animate_mode: replace`, the pipeline's `mode="replace"`): the clip's part of the condition
        is the `background` input's argmax latents under the pipeline's mask channels of what is kept (1 - the `mask`
        input, grey levels, nearest to the latent grid, first frame repeated over the VAE's temporal ratio);
    later segments (`model.animate_segment_conditioning`, animate mode): the clip's first `animate_segment_frames`
        frames stand for the previous segment's last ones: encoded with black after them, mask channels one on them,
        as the pipeline conditions every segment after the first.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from diffusers import WanAnimatePipeline, WanAnimateTransformer3DModel
from diffusers.pipelines.wan.image_processor import WanAnimateImageProcessor
from diffusers.video_processor import VideoProcessor
from torch import nn

from vidtune.config import Config
from vidtune.data.inputs import input_key
from vidtune.data.sources import Clip
from vidtune.errors import ConfigError, DataError, ModelError
from vidtune.export.comfyui import Rule, fused
from vidtune.export.comfyui_models import ComfyUIModel, wan_animate
from vidtune.models.conditioning import uniform_draws
from vidtune.models.defaults import WAN_ANIMATE
from vidtune.models.spec import CONTROL_LATENTS, Conditions, GeneratedSample, Latents, frames_to_pil
from vidtune.models.spec.sampling import step_callback
from vidtune.models.wan import WanImageEncoders, WanImageToVideoSpec, WanSpec

logger = logging.getLogger(__name__)

# The video-derived conditions `prepare_latents` returns beside the posterior.
REFERENCE_CONDITION = "reference_condition"  # [B, 4 + C, 1 + F', H', W']: mask channels + reference / segment
IMAGE_EMBEDS = "image_embeds"  # [B, tokens, width]: CLIP of the reference image
BLANK_POSE = "blank_pose"  # [B, C, F', H', W']: the latents of a black pose video, used without a control clip
# Each sample's own inputs (vidtune/data/inputs.py), as `encode_inputs` puts them beside its latents: the pose
# video's latents [B, C, F', H', W'] and the face video at the motion encoder's size [B, 3, F, S, S].
POSE_LATENTS = input_key("pose")
FACE_PIXELS = input_key("face")
# Replace mode: the background video's argmax latents [B, C, F', H', W'], and beside a clip's mask (its loss weights,
# `input_mask`) the pipeline's mask channels of what the background keeps [B, 4, F', H', W'].
BACKGROUND_LATENTS = input_key("background")
KEPT_MASK = "replace_kept_mask"
# Later segments: the clip's part of the condition of a segment after the first [B, 4 + C, F', H', W'], and per
# visit which samples train as one ([B] float, 1: a later segment).
SEGMENT_CONDITION = "segment_condition"
LATER_SEGMENT = "later_segment"


class WanAnimateSpec(WanImageToVideoSpec):
    """Wan Animate, animate mode. `sample`'s `reference` is the clip whose first frame is the character image;
    `inputs` may give its `pose` and `face` videos ([3, F, H, W] in [-1, 1])."""

    name = "wan-animate"
    model_title = "Wan Animate"
    defaults = WAN_ANIMATE
    validation_guidance_scale = 1.0  # WanAnimatePipeline's default: Wan Animate samples without guidance
    pipeline_class = WanAnimatePipeline
    denoiser_class = WanAnimateTransformer3DModel
    # diffusers has a converter for Wan-AI's original Animate file, but it is not checked against vidtune's
    # single-file tests yet: `model.transformer_file` is refused for this family.
    loads_single_file = False
    control_input_layer = None
    control_refusal = ("its pose video already conditions the model: give each clip its pose video (a `pose` input, "
                       "or controls.txt) and train with `lora` or `full`.")
    reads_control_clip = True  # the pose video of a clip without a `pose` input: its control clip
    takes_animate_settings = True

    def comfyui_workflow(self) -> None:
        """No workflow yet: a Wan Animate workflow takes the pose and face videos of WanAnimateToVideo.
        The LoRA file for ComfyUI is still written (docs/comfyui.md)."""
        return None

    @property
    def mode(self) -> str:
        """`model.animate_mode`: `animate` (the default) or `replace`."""
        return self.config.animate_mode or "animate"

    @property
    def segment_frames(self) -> int:
        """The frames a later segment is given from the previous one; 0 when no sample trains as a later segment."""
        return self.config.animate_segment_frames if self.config.animate_segment_conditioning > 0 else 0

    @property
    def sampling_inputs(self) -> tuple[str, ...]:  # type: ignore[override]
        """The inputs the pipeline call takes: pose, face and the character image; in replace mode also the
        background and its mask."""
        return ("pose", "face", "reference_images", *(("background", "mask") if self.mode == "replace" else ()))

    def check_frame_settings(self, config: Config, clips: list[Clip]) -> None:
        super().check_frame_settings(config, clips)
        if self.segment_frames and self.mode == "replace":
            raise ConfigError(
                f"model.animate_segment_conditioning={config.model.animate_segment_conditioning} with "
                "model.animate_mode=replace: a later segment in replace mode is conditioned on the previous segment's "
                "frames over the background video, which vidtune does not encode together yet.\nWhat to do: set "
                "model.animate_segment_conditioning to 0, or train animate mode.")
        if self.segment_frames and self.segment_frames >= config.data.frames:
            raise ConfigError(
                f"model.animate_segment_frames={self.segment_frames}: a later segment needs frames after the "
                f"{self.segment_frames} it is given, and data.frames is {config.data.frames}.\nWhat to do: train "
                "longer clips, or set model.animate_segment_conditioning to 0.")
    control_input_kind = "pose"

    def check_clip_inputs(self, clips: list[Clip]) -> None:
        """Before anything loads: a clip's character image is one image (the pipeline takes one). Its pose is its
        `pose` input, else its control clip, else a black pose video (what the pipeline samples from without one);
        replace mode's `background` and `mask` are required inputs, checked with the data."""
        several = [clip for clip in clips if len(clip.inputs.get("reference_images", ())) > 1]
        if several:
            raise DataError(
                [f"{clip.where} ({clip.video.name}) has {len(clip.inputs['reference_images'])} reference images."
                 for clip in several],
                hint=f"{self.name} animates one character image per clip (WanAnimatePipeline's `image`): give each "
                "clip one reference image.")

    def required_inputs(self, config: Config) -> tuple[str, ...]:
        """Replace mode reads each clip's background video and its mask (white: where the character goes)."""
        replace = ("background", "mask") if (config.model.animate_mode or "animate") == "replace" else ()
        return tuple(dict.fromkeys((*super().required_inputs(config), *replace)))

    # ----- encoding --------------------------------------------------------------------------------------------
    def latent_identity(self) -> dict[str, Any]:
        # The condition layout and the blank inputs are constants of this module: their version keys the cache.
        identity = {**super().latent_identity(), "animate_conditions": 1}
        return {**identity, "segment_frames": self.segment_frames} if self.segment_frames else identity

    @functools.cached_property
    def _processors(self) -> tuple[WanAnimateImageProcessor, VideoProcessor]:
        """The pipeline's reference-image and video processors (WanAnimatePipeline.__init__), for the VAE ratio
        and patch size of this model: training prepares its images exactly as sampling does."""
        spatial, _, patch = self.compression
        image = WanAnimateImageProcessor(vae_scale_factor=spatial, spatial_patch_size=patch[1:], resample="bilinear",
                                         fill_color=0)
        return image, VideoProcessor(vae_scale_factor=spatial)

    def motion_size(self) -> int:
        """The side of the square face frames the motion encoder reads (the released model's: 512)."""
        return int(self.load_config(self.denoiser_class, "transformer").get("motion_encoder_size", 512))

    @torch.no_grad()
    def reference_pixels(self, first_frames: torch.Tensor, height: int | None = None,
                         width: int | None = None) -> torch.Tensor:
        """Each reference image [B, 3, h, w] in [-1, 1] as the pipeline prepares the picture it is given (RGB
        bytes, then its processor's fill resize to the clip's size, by default the image's own), as
        [B, 3, 1, H, W]."""
        processor, _ = self._processors
        height, width = (height, width) if height and width else first_frames.shape[-2:]
        pixels = processor.preprocess(frames_to_pil(first_frames), height=height, width=width, resize_mode="fill")
        return pixels.unsqueeze(2)

    @torch.no_grad()
    def kept_mask(self, masks: torch.Tensor, frames: int, latent_grid: tuple[int, int]) -> torch.Tensor:
        """Replace mode's mask channels from mask videos [B, 3, F, H, W] in [-1, 1] (F 1: a still for every frame),
        as the pipeline makes them from `mask_video`: its grey levels in [0, 1] (the pipeline's mask processor on the
        frames' pictures), 1 - that (what the background keeps), nearest to the latent grid, the first frame
        repeated over the VAE's temporal ratio, then four frames a latent frame: [B, 4, F', H', W']."""
        spatial, temporal, _ = self.compression
        processor = VideoProcessor(vae_scale_factor=spatial, do_normalize=False, do_convert_grayscale=True)
        height, width = masks.shape[-2:]
        grey = torch.cat([processor.preprocess_video(frames_to_pil(mask.transpose(0, 1)), height=height, width=width)
                          for mask in masks])
        kept = (1 - grey).expand(-1, -1, frames, -1, -1) if grey.shape[2] == 1 else 1 - grey
        batch = kept.shape[0]
        kept = nn.functional.interpolate(kept.transpose(1, 2).flatten(0, 1), size=latent_grid, mode="nearest")
        kept = kept.unflatten(0, (batch, -1)).transpose(1, 2)  # [B, 1, F, H', W']
        kept = torch.cat([kept[:, :, :1].repeat_interleave(temporal, dim=2), kept[:, :, 1:]], dim=2)
        return kept.view(batch, -1, temporal, *latent_grid).transpose(1, 2).contiguous()

    def segment_mask(self, batch: int, frames: int, given: int, latent_grid: tuple[int, int],
                     like: torch.Tensor) -> torch.Tensor:
        """The mask channels of a segment whose first `given` frames are known (0: the first segment of animate
        mode): [B, 4, F', H', W'], as the pipeline's `get_i2v_mask`."""
        _, temporal, _ = self.compression
        known = like.new_zeros(batch, 1, frames, *latent_grid)
        known[:, :, :given] = 1
        known = torch.cat([known[:, :, :1].repeat_interleave(temporal, dim=2), known[:, :, 1:]], dim=2)
        return known.view(batch, -1, temporal, *latent_grid).transpose(1, 2).contiguous()

    @torch.no_grad()
    def face_pixels(self, faces: torch.Tensor) -> torch.Tensor:
        """Face videos [B, 3, F, H, W] in [-1, 1] resized to the motion encoder's square as the pipeline resizes
        the frames it is given: [B, 3, F, S, S]."""
        _, processor = self._processors
        size = self.motion_size()
        videos = [frames_to_pil(face.transpose(0, 1)) for face in faces]
        return torch.cat([processor.preprocess_video(video, height=size, width=size) for video in videos])

    def _vae_latents(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised argmax latents of [B, 3, F, H, W] pixels, as the pipeline's `retrieve_latents(...,
        sample_mode="argmax")` then `(z - mean) / std`."""
        return self.normalise(vae, vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode())

    @torch.no_grad()
    def prepare_latents(self, vae: WanImageEncoders, videos: torch.Tensor) -> Latents:
        batch, frames, _, height, width = videos.shape
        clip = WanSpec.prepare_latents(self, vae.vae, videos)  # the clip's posterior, as text-to-video's
        reference = self.reference_pixels(videos[:, 0])
        reference_latents = self._vae_latents(vae.vae, reference)
        # One grey segment and one black pose video serve the batch: they do not depend on the clip.
        grey = self._vae_latents(vae.vae, reference.new_zeros(1, 3, frames, height, width))
        black = self._vae_latents(vae.vae, reference.new_full((1, 3, frames, height, width), -1.0))
        ones = reference_latents.new_ones(batch, 4, *reference_latents.shape[2:])
        zeros = grey.new_zeros(batch, 4, *grey.shape[2:])
        condition = torch.cat([torch.cat([ones, reference_latents], dim=1),
                               torch.cat([zeros, grey.expand(batch, -1, -1, -1, -1)], dim=1)], dim=2)
        dtype = clip["latents_mean"].dtype
        latents = {
            "latents_mean": torch.cat([reference_latents.to(dtype), clip["latents_mean"]], dim=2),
            # The reference is encoded by its mode: no spread there.
            "latents_std": torch.cat([torch.zeros_like(reference_latents, dtype=dtype), clip["latents_std"]], dim=2),
            REFERENCE_CONDITION: condition.to(dtype),
            IMAGE_EMBEDS: self.encode_image(vae, videos[:, 0]).to(dtype),
            BLANK_POSE: black.expand(batch, -1, -1, -1, -1).to(dtype).contiguous(),
        }
        if self.segment_frames:  # a later segment: the clip's first frames, then black (pixel 0), as the pipeline
            given = self.segment_frames
            pixels = videos.transpose(1, 2).clone()
            pixels[:, :, given:] = 0
            known = self._vae_latents(vae.vae, pixels)
            mask = self.segment_mask(batch, frames, given, tuple(known.shape[-2:]), known)
            latents[SEGMENT_CONDITION] = torch.cat([mask, known], dim=1).to(dtype)
        return latents

    # ----- per-clip inputs: pose and face videos, masks ----------------------------------------------------------
    def mask_to_latent_grid(self, mask: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """The clip's mask on its latent frames, and before them, at the reference image's position, the mask of
        the clip's first frame (the reference image by default)."""
        frames, height, width = grid
        weights = super().mask_to_latent_grid(mask, (frames - 1, height, width))
        return torch.cat([weights[:, :, :1], weights], dim=2)

    def optional_inputs(self, config: Config) -> tuple[str, ...]:
        return (*super().optional_inputs(config), "pose", "face", "reference_images")

    def input_identity(self, kind: str) -> dict[str, Any]:
        # The pose and background are encoded as the pipeline encodes its videos (argmax), the face kept as the
        # motion encoder's pixels, the character image as the pipeline's `image`, a mask also as replace mode's
        # channels: not the layer's default encoding, so their own identity.
        identity = super().input_identity(kind)
        if kind == "face":
            return {**identity, "encoding": "motion encoder pixels", "size": self.motion_size()}
        own = {"pose": "argmax latents", "background": "argmax latents", "reference_images": "character image 1",
               "mask": f"loss weights and {self.mode} mask channels"}
        return {**identity, "encoding": own[kind]} if kind in own else identity

    def encode_inputs(self, vae: nn.Module | None, inputs: dict[str, Any], latents: Latents) -> dict[str, torch.Tensor]:
        """The pose and background videos' normalised argmax latents (the pipeline's `prepare_pose_latents`,
        `prepare_prev_segment_cond_latents`), the face video at the motion encoder's size (the pipeline's face
        preprocessing), in replace mode a mask's channels beside its loss weights, and the character image in place
        of the clip's first frame (`character_latents`); other kinds as every family's."""
        inputs = dict(inputs)
        encoded: dict[str, torch.Tensor] = {}
        frames = (latents["latents_mean"].shape[2] - 2) * self.compression[1] + 1  # the clip's, after the reference
        grid = tuple(int(size) for size in latents["latents_mean"].shape[-2:])
        if "face" in inputs:
            encoded[FACE_PIXELS] = self.face_pixels(inputs.pop("face")).float().cpu()
        if "mask" in inputs and self.mode == "replace":
            encoded[KEPT_MASK] = self.kept_mask(inputs["mask"], frames, grid).float().cpu()
        for kind, key in (("pose", POSE_LATENTS), ("background", BACKGROUND_LATENTS)):
            if kind in inputs:
                if vae is None:
                    raise ValueError(f"encode_inputs: the {kind} input is VAE-encoded; pass the VAE")
                pixels = inputs.pop(kind)
                pixels = pixels.expand(-1, -1, frames, -1, -1) if pixels.shape[2] == 1 else pixels  # a still
                encoded[key] = self._vae_latents(getattr(vae, "vae", vae), pixels).detach().float().cpu()
        if "reference_images" in inputs:
            if not isinstance(vae, WanImageEncoders):
                raise ValueError("encode_inputs: the character image is encoded with the VAE and the CLIP image "
                                 "encoder; pass what load_vae returns")
            images = torch.stack([sample[0][:, 0] for sample in inputs.pop("reference_images")])
            encoded.update(self.character_latents(vae, images, latents))
        return {**super().encode_inputs(vae, inputs, latents), **encoded}

    @torch.no_grad()
    def character_latents(self, vae: WanImageEncoders, images: torch.Tensor, latents: Latents
                          ) -> dict[str, torch.Tensor]:
        """Clip latents whose reference position is the character image's: images [B, 3, h, w] in [-1, 1]
        prepared as the pipeline prepares its `image` (fill to the clip's size), their argmax latents in the target
        and the condition's reference position, their CLIP tokens for the image cross-attention."""
        spatial = self.compression[0]
        height, width = (int(size) * spatial for size in latents["latents_mean"].shape[-2:])
        reference = self._vae_latents(vae.vae, self.reference_pixels(images, height, width)).float().cpu()
        mean, std, condition = (latents[key].float().cpu() for key in ("latents_mean", "latents_std",
                                                                        REFERENCE_CONDITION))
        return {
            "latents_mean": torch.cat([reference, mean[:, :, 1:]], dim=2),
            "latents_std": torch.cat([torch.zeros_like(reference), std[:, :, 1:]], dim=2),
            REFERENCE_CONDITION: torch.cat([torch.cat([condition[:, :4, :1], reference], dim=1), condition[:, :, 1:]],
                                           dim=2),
            IMAGE_EMBEDS: self.encode_image(vae, images).float().cpu(),
        }

    # ----- denoising -------------------------------------------------------------------------------------------
    def pose_latents(self, conditions: Conditions) -> torch.Tensor:
        """The pose latents of each sample: its `pose` input's, else its control clip's (the clip's own frames,
        without the reference position `prepare_latents` puts first), else a black pose video's."""
        if POSE_LATENTS in conditions:
            return conditions[POSE_LATENTS]
        if CONTROL_LATENTS in conditions:
            return conditions[CONTROL_LATENTS][:, :, 1:]
        return conditions[BLANK_POSE]

    def blank_faces(self, batch: int, latent_frames: int, like: torch.Tensor) -> torch.Tensor:
        """Black face frames (-1), the pipeline's "no face", one per clip frame: [B, 3, F, S, S]."""
        temporal = self.compression[1]
        size = self.motion_size()
        return like.new_full((batch, 3, (latent_frames - 1) * temporal + 1, size, size), -1.0)

    def visit_conditions(self, x0: torch.Tensor, positions: torch.Tensor, seed: int) -> Conditions:
        """Which samples train as a later segment (`model.animate_segment_conditioning`), drawn per visit."""
        conditions = super().visit_conditions(x0, positions, seed)
        if not self.segment_frames:
            return conditions
        share = self.config.animate_segment_conditioning
        later = torch.tensor([u < share for u in uniform_draws(positions, seed)], dtype=torch.float32)
        return {**conditions, LATER_SEGMENT: later.to(x0.device)}

    def condition(self, conditions: Conditions) -> torch.Tensor:
        """What is concatenated to the noisy latents: the reference image's position, then the clip's part: the
        background's in replace mode, else the first segment's of animate mode, or a later segment's where drawn."""
        reference = conditions[REFERENCE_CONDITION]
        segment = reference[:, :, 1:]
        if BACKGROUND_LATENTS in conditions:
            if KEPT_MASK not in conditions:
                raise ValueError("replace mode: a sample has a background input but no mask input")
            segment = torch.cat([conditions[KEPT_MASK].to(segment), conditions[BACKGROUND_LATENTS].to(segment)], dim=1)
        if LATER_SEGMENT in conditions:
            later = conditions[LATER_SEGMENT].to(segment).view(-1, 1, 1, 1, 1)
            segment = later * conditions[SEGMENT_CONDITION].to(segment) + (1 - later) * segment
        return torch.cat([reference[:, :, :1], segment], dim=2)

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        dtype = noisy_latents.dtype
        batch, _, frames = noisy_latents.shape[:3]
        hidden_states = torch.cat([noisy_latents, self.condition(conditions).to(dtype)], dim=1)
        faces = conditions.get(FACE_PIXELS)
        return denoiser(
            hidden_states=hidden_states,
            timestep=timesteps.to(noisy_latents.device),
            encoder_hidden_states=conditions["prompt_embeds"].to(dtype),
            encoder_hidden_states_image=conditions[IMAGE_EMBEDS].to(dtype),
            pose_hidden_states=self.pose_latents(conditions).to(dtype),
            face_pixel_values=(self.blank_faces(batch, frames - 1, noisy_latents) if faces is None
                               else faces.to(dtype)),
            return_dict=False,
        )[0]

    # ----- sampling --------------------------------------------------------------------------------------------
    def call_pipeline(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                      num_inference_steps: int, guidance_scale: float, generator: torch.Generator, output_type: str,
                      reference: torch.Tensor | None = None, callback: Any = None,
                      inputs: dict[str, torch.Tensor] | None = None) -> Any:
        """One segment of `frames` frames in the run's mode: the `reference_images` input as the character image,
        else the reference clip's first frame; the pose and face videos from `inputs` (black frames where missing,
        as training without them); in replace mode the background and mask videos from `inputs`."""
        inputs = inputs or {}
        size = self.motion_size()
        pose = self.input_frames(inputs.get("pose"), frames, "pose", torch.full((frames, 3, height, width), -1.0))
        face = self.input_frames(inputs.get("face"), frames, "face", torch.full((frames, 3, size, size), -1.0))
        replace: dict[str, Any] = {}
        if self.mode == "replace":
            missing = [kind for kind in ("background", "mask") if inputs.get(kind) is None]
            if missing:
                raise ModelError(f"Wan Animate in replace mode samples into a background video under a mask; the "
                                 f"sample has no {' and no '.join(missing)} video.\nWhat to do: give the first clip "
                                 "its `background` and `mask` inputs (docs/algorithms.md, \"Wan Animate\").")
            replace = {f"{kind}_video": frames_to_pil(self.input_frames(inputs[kind], frames, kind, inputs[kind]))
                       for kind in ("background", "mask")}
        character = inputs.get("reference_images")
        image = (frames_to_pil(character[:, 0][None])[0] if character is not None
                 else self.first_frame_image(reference))
        return pipeline(
            **self.prompt_inputs(pipeline, prompt, guidance_scale),
            image=image,
            pose_video=frames_to_pil(pose),
            face_video=frames_to_pil(face),
            mode=self.mode,
            **replace,
            segment_frame_length=frames,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            max_sequence_length=self.max_sequence_length,
            generator=generator,
            output_type=output_type,
            **step_callback(callback),
        )

    def sampled_latents(self, pipeline: Any, result: Any, frames: int, height: int, width: int) -> GeneratedSample:
        """WanAnimatePipeline's `output_type="latent"` result is denormalised (`z * std + mean`, what it decodes),
        unlike its step latents: normalised back to the training layout."""
        return GeneratedSample(latents=self.normalise(pipeline.vae, result.frames))

    @staticmethod
    def input_frames(video: torch.Tensor | None, frames: int, kind: str, blank: torch.Tensor) -> torch.Tensor:
        """An input video [3, F, H, W] as the frames [F, 3, H, W] the pipeline is given (`blank` without one; a
        still, [3, 1, H, W], for every frame)."""
        if video is None:
            return blank
        if video.ndim == 4 and video.shape[1] == 1:
            video = video.expand(-1, frames, -1, -1)
        if video.ndim != 4 or video.shape[0] != 3 or video.shape[1] < frames:
            raise ModelError(f"Wan Animate: the {kind} video has shape {tuple(video.shape)}; it needs [3, F, H, W] "
                             f"with at least {frames} frames (the sample's).\nWhat to do: give a {kind} clip as long "
                             "as the sample.")
        return video[:, :frames].transpose(0, 1)

    # ----- ComfyUI ---------------------------------------------------------------------------------------------
    def comfyui_lora_rules(self) -> list[Rule]:
        """Wan 2.1's names, and the Animate parts as Wan-AI's original checkpoint (ComfyUI's AnimateWanModel)
        names them: each face adapter is `face_adapter.fuser_blocks.N` with the key and value projections fused
        into `linear1_kv`; the face encoder's output projection keeps its name."""
        inner = self.load_config(self.denoiser_class, "transformer")
        width = inner["num_attention_heads"] * inner["attention_head_dim"]
        return [
            *super().comfyui_lora_rules(),
            Rule(r"face_adapter\.(\d+)\.to_q", r"face_adapter.fuser_blocks.\1.linear1_q"),
            *fused([r"face_adapter\.(\d+)\.to_k", r"face_adapter\.(\d+)\.to_v"],
                   r"face_adapter.fuser_blocks.\1.linear1_kv", [width, width]),
            Rule(r"face_adapter\.(\d+)\.to_out", r"face_adapter.fuser_blocks.\1.linear2"),
            Rule(r"face_encoder\.out_proj", "face_encoder.out_proj"),
        ]

    def comfyui_model(self) -> ComfyUIModel:
        return wan_animate(self.load_config(self.denoiser_class, "transformer"))

