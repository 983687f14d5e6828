"""Encoding a family's inputs: captions into conditions, clips (and their sound) into latents, the clip shapes it
takes, and what a precomputed entry depends on (its cache identity)."""

from __future__ import annotations

import functools
from abc import abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from vidtune.config import ConditioningConfig, Config
from vidtune.data.audio import AudioFormat
from vidtune.data.inputs import INPUT_KINDS, input_key
from vidtune.data.sources import Clip
from vidtune.errors import ConfigError, DataError
from vidtune.models.spec.base import Conditions, Latents, SpecBase
from vidtune.models.spec.loading import TextComponents


class Encoding(SpecBase):
    """Captions and clips into the tensors the denoiser takes (see the latent conventions in spec/base.py)."""

    # Bump when the family's prepare_conditions / prepare_latents code changes what it computes, so that
    # precomputed entries made by the old code are not reused (see `condition_identity`).
    cache_version: ClassVar[int] = 1
    # The family's own conditioning reads a control clip per sample, whatever the algorithm (Wan VACE's control
    # video, Wan Animate's pose video): the data path then reads and encodes each sample's control clip
    # (`controls.txt`, `control_column`) beside it, on the fly and into the cache, and hands its latents to `forward`
    # as `conditions[CONTROL_LATENTS]`.
    reads_control_clip: ClassVar[bool] = False
    # The input kinds whose encoding reads the clip's control clip too (Wan VACE's mask splits the control video):
    # `encode_inputs` then finds the control clip's pixels, read with the same window, under `CONTROL_INPUT`, and the
    # cache keys such an input by its control clip as well.
    inputs_with_control: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        """Raise a ConfigError naming the nearest valid values when the shape breaks the model's rules."""

    @abstractmethod
    def prepare_conditions(self, text: TextComponents, captions: list[str]) -> Conditions: ...

    @abstractmethod
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        """videos: [B, F, 3, H, W] in [-1, 1] -> normalised posterior {"latents_mean", "latents_std"}. A family
        with an `audio_format` also takes `audio=` (an `AudioBatch`: each window's sound, or None)."""

    @staticmethod
    def vae_posterior(vae: nn.Module, videos: torch.Tensor) -> Any:
        """The VAE's posterior of clips [B, F, 3, H, W] in [-1, 1], encoded in the VAE's layout [B, C, F, H, W] on its
        device and in its dtype: where every family's `prepare_latents` starts."""
        pixels = videos.to(device=vae.device, dtype=vae.dtype).permute(0, 2, 1, 3, 4)
        return vae.encode(pixels).latent_dist

    @staticmethod
    def normalised_posterior(posterior: Any, scale: float | torch.Tensor, shift: torch.Tensor | None = None) -> Latents:
        """{"latents_mean", "latents_std"}: the posterior normalised as `(x - shift) * scale`, the inverse of the
        pipeline's decode (`latents / scale + shift`)."""
        mean = posterior.mean if shift is None else posterior.mean - shift
        return {"latents_mean": mean * scale, "latents_std": posterior.std * scale}

    def audio_format(self) -> AudioFormat | None:
        """The sound a family trains on beside the frames (sample rate, channels), which the data path then decodes
        for each window and hands to `prepare_latents` as `audio=`; None (the default): no sound is decoded."""
        return None

    # ----- captions that read their clip ---------------------------------------------------------------------
    @property
    def reads_clip_in_conditions(self) -> bool:
        """Whether a sample's caption is also encoded together with pictures of its clip window (MiniMax H3's
        keyframe presentation: its first and last frames): the data path then encodes `prepare_clip_conditions` per
        caption and clip window, on the fly and into the cache (its own entry kind, `clip_conditions`), and hands it
        to `forward` beside the latents."""
        return False

    def clip_condition_components(self) -> tuple[str, ...]:
        """Components beside the text encoders that `prepare_clip_conditions` reads (an image processor): their
        identity is in each entry's key."""
        return ()

    def clip_condition_identity(self) -> dict[str, Any]:
        """The constants `prepare_clip_conditions` reads beyond `condition_identity` (how the frame is presented)."""
        return {}

    def prepare_clip_conditions(self, text: TextComponents, captions: list[str], windows: torch.Tensor) -> Conditions:
        """Captions encoded with pictures of their clip windows ([B, F, 3, H, W] in [-1, 1], read as the windows'
        latents read them), padded to one length per clip shape; only a family that `reads_clip_in_conditions` has
        them."""
        raise NotImplementedError(f"{self.name} encodes its captions alone")

    def empty_conditions(self, conditions: Conditions) -> Conditions:
        """The `zero` caption-dropout technique: same shapes, zero embedding (masks kept)."""
        return {k: (torch.zeros_like(v) if v.is_floating_point() else v) for k, v in conditions.items()}

    def native_max_sequence_length(self) -> int:
        """Caption tokens the family's pipeline uses by default."""
        return 128

    @functools.cached_property
    def max_sequence_length(self) -> int:
        """Caption tokens: `model.max_sequence_length` when set, else the family's own."""
        return self.config.max_sequence_length or self.native_max_sequence_length()

    # ----- what a precomputed entry depends on ----------------------------------------------------------
    def condition_identity(self) -> dict[str, Any]:
        """Everything `prepare_conditions` depends on besides the text components' weights, their dtype and the
        caption (the cache adds those): part of every precomputed condition's key, and nothing else is.

        A family adds the constants its `prepare_conditions` reads (a prompt template, a hidden layer, a
        setting read from the model folder outside the text components). JSON values only. Settings that do
        not change the tensors (validation, LoRA targets, the denoiser's inputs) stay out, so that changing
        them keeps the cache."""
        return {"family": self.name, "version": self.cache_version, "max_sequence_length": self.max_sequence_length}

    def latent_identity(self) -> dict[str, Any]:
        """Everything `prepare_latents` depends on besides the VAE's (and image encoder's) weights, their dtype,
        the preprocessing and the clip (the cache adds those); a family adds the constants its
        `prepare_latents` reads (e.g. the noise augmentation of an image-to-video first frame). JSON values."""
        return {"family": self.name, "version": self.cache_version}

    # ----- per-clip inputs (vidtune/data/inputs.py) ------------------------------------------------------------
    def required_inputs(self, config: Config) -> tuple[str, ...]:
        """The input kinds every training clip must have (checked with the data, before loading): by default a
        `mask` when `training.masked_loss` is on. A family or mode that reads other kinds adds them."""
        return ("mask",) if config.training.masked_loss else ()

    def optional_inputs(self, config: Config) -> tuple[str, ...]:
        """The input kinds read where a clip has them (a batch's clips must then all have them or none)."""
        return ()

    def input_kinds(self, config: Config) -> tuple[str, ...]:
        """Every kind a run reads: the required ones, then the optional ones."""
        return tuple(dict.fromkeys((*self.required_inputs(config), *self.optional_inputs(config))))

    def input_identity(self, kind: str) -> dict[str, Any]:
        """What `encode_inputs` computes for `kind` depends on besides the pixels, the VAE and the latent grid (the
        cache adds those): part of each cached input's key. Bump the version when the encoding changes."""
        return {"input": kind, "version": 1, "latents": self.latent_identity()}

    def training_latents(self, latents: Latents) -> Latents:
        """A batch's latents as training draws its clean latents and conditions from them (by default as they are;
        Wan VACE puts its reference images' latents before the clip's)."""
        return latents

    def latent_frame_groups(self, frames: int, latent_frames: int) -> list[range]:
        """The clip frames each latent frame encodes. By default a causal VAE's (LTX, Wan, HunyuanVideo, CogVideoX,
        Mochi): the first latent frame is the first frame alone, each next one the following `r` frames,
        `r = (frames - 1) / (latent_frames - 1)`; frames that divide evenly otherwise: consecutive groups."""
        if latent_frames == 1:
            return [range(frames)]
        if (frames - 1) % (latent_frames - 1) == 0:
            ratio = (frames - 1) // (latent_frames - 1)
            return [range(1)] + [range(1 + i * ratio, 1 + (i + 1) * ratio) for i in range(latent_frames - 1)]
        if frames % latent_frames == 0:
            ratio = frames // latent_frames
            return [range(i * ratio, (i + 1) * ratio) for i in range(latent_frames)]
        raise ValueError(f"{self.name}: {frames} frames cannot be grouped into {latent_frames} latent frames; override "
                         "latent_frame_groups")

    def mask_to_latent_grid(self, mask: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """A mask [B, 3, F, H, W] in [-1, 1] (F 1: one still for the whole clip) -> [B, 1, F', H', W'] in [0, 1] on
        the latent grid (F', H', W'): each latent cell the mean of the pixels it encodes (the frames of
        `latent_frame_groups`, the area average over its pixels)."""
        weights = mask.float().mean(dim=1, keepdim=True).add(1.0).div(2.0).clamp(0.0, 1.0)
        frames, height, width = grid
        if weights.shape[2] > 1:
            groups = self.latent_frame_groups(weights.shape[2], frames)
            weights = torch.stack([weights[:, :, group.start:group.stop].mean(dim=2) for group in groups], dim=2)
        pooled = nn.functional.adaptive_avg_pool3d(weights, (weights.shape[2], height, width))
        return pooled.expand(-1, -1, frames, -1, -1).contiguous() if pooled.shape[2] == 1 else pooled

    def encode_inputs(self, vae: nn.Module | None, inputs: dict[str, Any], latents: Latents) -> dict[str, torch.Tensor]:
        """A batch's inputs (`item["inputs"]` stacked: [B, 3, F, H, W] per kind, a list per sample of [3, 1, H, W]
        for an `images` kind) -> `{input_<kind>: tensor}` beside the clips' `latents`: a mask on the latent grid
        ([B, 1, F', H', W'] in [0, 1]); any other kind its VAE posterior mean ([B, C, F', H', W']; an `images` kind's
        images one latent frame each, in order along the frames). `vae` may be None when only masks are encoded."""
        grid = tuple(int(size) for size in latents["latents_mean"].shape[-3:])
        encoded: dict[str, torch.Tensor] = {}
        for kind, value in inputs.items():
            if kind == "mask":
                encoded[input_key(kind)] = self.mask_to_latent_grid(value, grid)
                continue
            if vae is None:
                raise ValueError(f"encode_inputs: the {kind} input is VAE-encoded; pass the VAE")
            if INPUT_KINDS[kind].media == "images":
                per_sample = [torch.cat([self.input_latents(vae, image[None]) for image in images], dim=2)
                              for images in value]
                counts = {int(sample.shape[2]) for sample in per_sample}
                if len(counts) > 1:
                    raise ValueError(f"a batch's clips have {sorted(counts)} {kind}: give each clip of a run the "
                                     "same number, or train with training.batch_size=1")
                encoded[input_key(kind)] = torch.cat(per_sample)
            else:
                encoded[input_key(kind)] = self.input_latents(vae, value)
        return encoded

    def input_latents(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """The normalised posterior mean of input pixels [B, 3, F, H, W] in [-1, 1], as the clips' latents are made."""
        videos = pixels.permute(0, 2, 1, 3, 4)
        sound = {"audio": None} if self.audio_format() is not None else {}
        return self.prepare_latents(vae, videos, **sound)["latents_mean"].detach().float().cpu()

    # ----- each clip's frame rate -------------------------------------------------------------------------
    def clip_frame_rate(self, clip: Clip, data_fps: float | None) -> float | None:
        """The frame rate the denoiser is told for `clip` (None: the family takes none): `data.fps` when clips are
        resampled to it, else the clip's own rate as its file says; `model.frame_rate` for stills, clips that do
        not say their rate, and every clip when `model.clip_frame_rate` is off."""
        if not self.frame_rate_conditioned:
            return None
        if not self.config.clip_frame_rate:
            return self.frame_rate
        if data_fps:
            return float(data_fps)
        if clip.info is not None and not clip.is_image and clip.info.fps > 0:
            return float(clip.info.fps)
        return self.frame_rate

    def check_clip_inputs(self, clips: list[Clip]) -> None:
        """Before anything loads: every clip has what the family's conditioning reads beside it (a family that
        `reads_control_clip`: a control clip), each missing one named by its file and line."""
        if not self.reads_control_clip:
            return
        missing = [clip for clip in clips if clip.control is None]
        if missing:
            raise DataError(
                [f"{clip.where} ({clip.video.name}) has no control clip." for clip in missing],
                hint=f"{self.name} follows a control clip per sample: a `controls.txt` beside `videos.txt` (one "
                "control clip a line, in the same order), or `control_column` in a metadata dataset (see "
                "docs/algorithms.md).",
            )

    def check_frame_settings(self, config: Config, clips: list[Clip]) -> None:
        """Before any long work: `model.first_frame_conditioning` only for a family that takes it; and for a family
        whose sound lasts frames / rate (LTX-2), the clips a batch can hold (one bucket) must share a frame rate when
        batches hold several clips, as their sound is stacked."""
        if self.first_frame_conditioning is None and config.model.first_frame_conditioning is not None:
            raise ConfigError(
                f"model.first_frame_conditioning={config.model.first_frame_conditioning}: {self.name} takes no "
                "first-frame conditioning (the LTX families do).\nWhat to do: remove model.first_frame_conditioning."
            )
        animate = {key: value for key, value in (("animate_mode", config.model.animate_mode),
                                                   ("animate_segment_conditioning",
                                                    config.model.animate_segment_conditioning or None)) if value}
        if animate and not self.takes_animate_settings:
            raise ConfigError(f"{', '.join(f'model.{key}={value}' for key, value in animate.items())}: {self.name} "
                              "has no animate mode nor segments (wan-animate has).\nWhat to do: remove "
                              f"{' and '.join(f'model.{key}' for key in animate)}.")
        self.check_conditioning_modes(config.model.conditioning)
        if self.audio_format() is None or config.training.batch_size == 1:
            return
        by_bucket: dict[int, dict[float, Clip]] = {}
        for clip in clips:
            rate = self.clip_frame_rate(clip, config.data.fps)
            if rate is not None:
                by_bucket.setdefault(clip.bucket or 0, {}).setdefault(rate, clip)
        mixed = {bucket: rates for bucket, rates in by_bucket.items() if len(rates) > 1}
        if mixed:
            lines = [f"  - bucket {bucket}: " + "; ".join(f"{rate:g} fps ({clip.where})"
                                                          for rate, clip in rates.items())
                     for bucket, rates in sorted(mixed.items())]
            raise ConfigError(
                f"training.batch_size={config.training.batch_size}: {self.name} trains each clip with the sound of its "
                "frames at its own frame rate, so a batch's clips must share a rate, but clips of one bucket "
                "differ:\n" + "\n".join(lines) + "\nWhat to do: set data.fps to resample every clip to one rate, "
                "or training.batch_size=1 (training.gradient_accumulation gives the same clips per step), or set "
                "model.clip_frame_rate=false to tell every clip model.frame_rate."
            )

    def check_conditioning_modes(self, conditioning: ConditioningConfig) -> None:
        """Before any long work: `model.conditioning` names only modes the family trains and samples."""
        refused = [mode for mode in conditioning.enabled if mode not in self.conditioning_modes]
        if refused:
            takes = ", ".join(self.conditioning_modes) or "none of them"
            raise ConfigError(
                f"model.conditioning: {self.name} cannot train {' or '.join(m.replace('_', '-') for m in refused)} "
                f"conditioning: {self.conditioning_refusal}\nWhat to do: remove "
                f"{' and '.join('model.conditioning.' + mode for mode in refused)} ({self.name} takes {takes}; "
                "docs/models.md, \"Conditioning modes\", says which family takes which)."
            )
