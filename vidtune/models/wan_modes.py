"""Conditioning modes of the Wan image-to-video families (`wan-i2v`, `skyreels-v2-i2v`, `wan2.2-i2v` A14B):
video extension, first-last-frame and inpainting / outpainting (vidtune/models/conditioning.py, `model.conditioning`).

These models are conditioned through channels beside the noisy latents: four mask channels (one per pixel frame of
each latent frame: 1 where the frame is given) and the normalised latents of the given pixels
(WanImageToVideoPipeline.prepare_latents). The modes fill that same condition:
    first-last: the pipeline's own `last_image` (pixels [first, zeros..., last] through the VAE, the first and the
        last pixel frames marked given), where the model takes no CLIP image tokens (A14B; Wan 2.1's I2V
        transformer reads one image's tokens, FLF2V's two, which its pipeline hands it for every sample);
    extension and inpainting: a region of the latent grid (the first latent frames of the given frames; the cells a
        mask or `model.conditioning.mask_rectangle` keeps), every mask channel 1 there, and the clip's latents on
        the region, 0 (the normalised latents' mean) elsewhere. Sampling gives the same through
        `GivenRegionPipeline` (the family's pipeline with `given_video` and `given_region`), which puts the given
        latents back in place after its last step, so the kept frames / region come out as given; training leaves
        them out of the loss. What the pipeline itself generates (the first frame of image-to-video and
        first-last) stays in the loss, as plain image-to-video trains it.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import SkyReelsV2ImageToVideoPipeline, WanImageToVideoPipeline

from vidtune.config import Config
from vidtune.errors import ConfigError, ModelError
from vidtune.models import conditioning
from vidtune.models.conditioning import Given, ModeName
from vidtune.models.spec import Conditions, frames_to_pil

# The image condition of a first-last sample, beside `image_condition` (the first frame alone).
FIRST_LAST_CONDITION = "image_condition_first_last"
REGION_MODES: tuple[ModeName, ...] = ("extension", "inpaint")


class GivenRegionPipeline:
    """Mixed into a Wan image-to-video pipeline: `given_video` ([F, 3, H, W] in [-1, 1]: the frames to extend, or the
    clip whose region is kept) and `given_region` ([1, 1, F', H', W'] on the latent grid, 1: given) replace its image
    condition (mask channels 1 on the region, the video's latents there, 0 elsewhere), and the given latents are put
    back in place after the last step. Without them it is the pipeline itself."""

    _given_region: torch.Tensor | None = None
    _given_video: torch.Tensor | None = None
    _given_latents: torch.Tensor | None = None

    def __call__(self, *args: Any, given_region: torch.Tensor | None = None, given_video: torch.Tensor | None = None,
                 **kwargs: Any) -> Any:
        if given_region is None:
            return super().__call__(*args, **kwargs)
        if given_video is None:
            raise ValueError("a given region takes the video it keeps (given_video)")
        self._given_region, self._given_video = given_region, given_video
        callback = kwargs.pop("callback_on_step_end", None)

        def in_place(pipeline: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            result = dict(callback(pipeline, step, timestep, tensors)) if callback is not None else {}
            if step == pipeline._num_timesteps - 1 and pipeline._given_latents is not None:
                latents = result.get("latents", tensors["latents"])
                region = pipeline._given_region.to(latents)
                result["latents"] = region * pipeline._given_latents.to(latents) + (1.0 - region) * latents
            return result

        kwargs["callback_on_step_end_tensor_inputs"] = kwargs.get("callback_on_step_end_tensor_inputs") or ["latents"]
        try:
            return super().__call__(*args, callback_on_step_end=in_place, **kwargs)
        finally:
            self._given_region = self._given_video = self._given_latents = None

    def prepare_latents(self, image: Any, batch_size: int, num_channels_latents: int = 16, height: int = 480,
                        width: int = 832, num_frames: int = 81, dtype: torch.dtype | None = None,
                        device: torch.device | None = None, generator: Any = None,
                        latents: torch.Tensor | None = None, last_image: torch.Tensor | None = None) -> Any:
        prepared = super().prepare_latents(image, batch_size, num_channels_latents, height, width,
                                           num_frames, dtype, device, generator, latents, last_image)
        if self._given_region is None or self._given_video is None:
            return prepared
        noise, condition = prepared[:2]
        vae = self.vae
        pixels = self._given_video.permute(1, 0, 2, 3)[None].to(device=vae.device, dtype=vae.dtype)
        encoded = vae.encode(pixels).latent_dist.mode()
        channels = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1).to(encoded)
        std = torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1).to(encoded)
        encoded = (encoded - mean) / std
        clean = encoded.new_zeros(1, channels, *noise.shape[2:])
        clean[:, :, : encoded.shape[2]] = encoded[:, :, : noise.shape[2]]
        region = self._given_region.to(clean)
        self._given_latents = clean * region
        if len(prepared) == 3:  # `expand_timesteps` (TI2V-5B): in place, where its `first_frame_mask` is 0
            return noise, self._given_latents.to(condition), (1.0 - region).to(prepared[2])
        mask_channels = condition.shape[1] - channels
        built = region_condition(region, clean, mask_channels)
        return noise, built.expand(noise.shape[0], -1, -1, -1, -1).to(condition)


class WanRegionImageToVideoPipeline(GivenRegionPipeline, WanImageToVideoPipeline):
    """WanImageToVideoPipeline that also takes a clip to extend or a region to keep (`GivenRegionPipeline`)."""


class SkyReelsV2RegionImageToVideoPipeline(GivenRegionPipeline, SkyReelsV2ImageToVideoPipeline):
    """SkyReelsV2ImageToVideoPipeline that also takes a clip to extend or a region to keep (`GivenRegionPipeline`)."""


REGION_PIPELINES: dict[type, type] = {WanImageToVideoPipeline: WanRegionImageToVideoPipeline,
                                      SkyReelsV2ImageToVideoPipeline: SkyReelsV2RegionImageToVideoPipeline}


def region_condition(region: torch.Tensor, clean: torch.Tensor, mask_channels: int) -> torch.Tensor:
    """The image condition of a given region ([B, 1, F, H, W], 1: given) of clean latents [B, C, F, H, W]: every
    mask channel 1 on the region (each latent frame's pixel frames alike), then the latents there, 0 elsewhere."""
    region = region.to(clean)
    batch = clean.shape[0]
    mask = region.expand(batch, mask_channels, -1, -1, -1)
    return torch.cat([mask, clean * region.expand(batch, -1, -1, -1, -1)], dim=1)


class WanConditioningModes:
    """The modes, mixed into the Wan image-to-video specs (before their ModelSpec base): which the checkpoint takes
    (`wan_modes`), the per-visit draw, the image condition of each drawn mode, the loss and the pipeline inputs."""

    # What the spec the class is mixed into has.
    config: Any
    pipeline_class: Any
    name: str
    compression: Any

    def wan_modes(self) -> tuple[ModeName, ...]:
        """The modes this checkpoint takes: extension and inpainting through a region pipeline (Wan 2.1 and SkyReels
        V2 image-to-video read CLIP tokens of one image, so no last frame)."""
        return REGION_MODES if self.pipeline_class in REGION_PIPELINES else ()

    @property
    def conditioning_modes(self) -> tuple[str, ...]:
        return self.wan_modes()

    @property
    def conditioning_refusal(self) -> str:
        if not self.wan_modes():
            return f"{self.pipeline_class.__name__} takes no clip to extend, no last frame and no mask"
        return (f"{self.pipeline_class.__name__} always takes a first image, so no last frame alone; a last one "
                "(`last_image`) reaches Wan 2.1 and SkyReels V2 image-to-video also as CLIP image tokens, which only "
                "the FLF2V transformer reads (two images' tokens for every sample)")

    @property
    def modes_on(self) -> bool:
        return bool(self.wan_modes()) and bool(self.config.conditioning.enabled)

    @property
    def takes_first_last(self) -> bool:
        return self.modes_on and "first_last" in self.config.conditioning.enabled

    @property
    def extension_latent_frames(self) -> int:
        """Latent frames of the `extension_frames` given frames (Wan's VAE is causal in time: what encoding those
        frames alone gives)."""
        return (self.config.conditioning.extension_frames - 1) // self.temporal_ratio + 1

    @property
    def temporal_ratio(self) -> int:
        return int(self.compression[1])

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        super().check_video_shape(frames, height, width)
        problems = self.mode_problems(frames)
        if problems:
            raise ConfigError("model.conditioning does not fit the clips:\n" + "\n".join(f"  - {p}" for p in problems)
                              + "\nWhat to do: fix model.conditioning as said above.")

    def mode_problems(self, frames: int) -> list[str]:
        """What keeps `model.conditioning`'s modes from clips of `frames` frames."""
        if not self.modes_on:
            return []
        return conditioning.extension_problems(self.config.conditioning, self.temporal_ratio, frames,
                                               f"{self.name}'s image condition (whole latent frames)")

    def optional_inputs(self, config: Config) -> tuple[str, ...]:
        """Inpainting keeps what each clip's `mask` input leaves black, where the data gives one; clips without one
        keep what `model.conditioning.mask_rectangle` leaves."""
        base = super().optional_inputs(config)
        return (*base, "mask") if self.wan_modes() and config.model.conditioning.inpaint > 0 else base

    def latent_identity(self) -> dict[str, Any]:
        identity = super().latent_identity()
        return {**identity, "first_last": "mask+latents"} if self.takes_first_last else identity

    def visit_conditions(self, x0: torch.Tensor, positions: torch.Tensor, seed: int) -> Conditions:
        """Each sample's mode (vidtune/models/conditioning.py); a sample drawing none is plain image-to-video."""
        if not self.modes_on:
            return super().visit_conditions(x0, positions, seed)
        return conditioning.draw_visit(self.config.conditioning, x0, positions, seed, self.extension_latent_frames)

    def given_region(self, conditions: Conditions, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """[B, 1, F, H, W]: what each sample's extension or inpainting keeps (1.0); nothing for the other modes,
        whose given frames the model generates (they stay in the loss)."""
        frames, height, width = shape[-3:]
        if conditioning.INPUT_MASK in conditions:
            inpaint = conditioning.mask_region(conditions[conditioning.INPUT_MASK], frames, height, width)
        else:
            modes = self.config.conditioning
            inpaint = conditioning.rectangle_region(modes.mask_rectangle, modes.mask_rectangle_generated,
                                                    frames, height, width)
        codes = conditions[conditioning.MODE].flatten()
        inpaint = inpaint.to(conditions[conditioning.LATENTS].device)
        region = conditioning.region(codes, shape, self.extension_latent_frames, inpaint)
        in_region = conditioning.is_mode(codes, REGION_MODES).to(region).view(-1, 1, 1, 1, 1)
        return region * in_region

    def mode_conditions(self, conditions: Conditions) -> Conditions:
        """The conditions with each sample's image condition of its drawn mode (unchanged without a draw)."""
        if conditioning.MODE not in conditions:
            return conditions
        codes = conditions[conditioning.MODE].flatten()
        condition = conditions["image_condition"]
        if FIRST_LAST_CONDITION in conditions:
            first_last = conditioning.is_mode(codes, ("first_last",)).to(condition.device).view(-1, 1, 1, 1, 1)
            condition = torch.where(first_last, conditions[FIRST_LAST_CONDITION].to(condition), condition)
        in_region = conditioning.is_mode(codes, REGION_MODES)
        if bool(in_region.any()):
            clean = conditions[conditioning.LATENTS]
            region = self.given_region(conditions, clean.shape)
            built = region_condition(region, clean, condition.shape[1] - clean.shape[1])
            condition = torch.where(in_region.to(condition.device).view(-1, 1, 1, 1, 1), built.to(condition),
                                    condition)
        return {**conditions, "image_condition": condition}

    def per_clip_error(self, squared_error: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        """What extension and inpainting keep is put back in place after sampling: out of the loss."""
        if conditioning.MODE in conditions:
            return conditioning.per_clip_error(squared_error, self.given_region(conditions, squared_error.shape))
        return super().per_clip_error(squared_error, conditions)

    # ----- sampling ------------------------------------------------------------------------------------------------
    @property
    def trains_region(self) -> bool:
        """The run trains extension or inpainting (which the base model never saw: only such a run samples them)."""
        return self.modes_on and any(mode in self.config.conditioning.enabled for mode in REGION_MODES)

    def region_pipeline_class(self) -> type:
        """The family's pipeline; its region subclass for a run that trains extension or inpainting."""
        return REGION_PIPELINES.get(self.pipeline_class, self.pipeline_class) if self.trains_region \
            else self.pipeline_class

    def check_given(self, given: Given) -> None:
        super().check_given(given)
        if given.mode in REGION_MODES and given.mode not in self.config.conditioning.enabled:
            flag = "--extend" if given.mode == "extension" else "--inpaint"
            raise ModelError(f"{self.name}: {flag} samples through the image condition a run learns with "
                             f"model.conditioning.{given.mode} (the base model never saw it), and this run trained "
                             f"without it.\nWhat to do: sample a run trained with model.conditioning.{given.mode}, "
                             "or sample from a first frame (--image).")

    def given_inputs(self, given: Given, frames: int, height: int, width: int) -> dict[str, Any]:
        """The pipeline's inputs of a mode: the first image (and `last_image`, first-last); the clip to extend or
        whose region is kept as `given_video` with its `given_region` on the latent grid, its first frame the
        pipeline's image."""
        if given.mode == "first_frame":
            return self.pipeline_inputs(given.frames)
        assert given.frames is not None
        inputs: dict[str, Any] = {"image": frames_to_pil(given.frames[:1])[0]}
        if given.mode == "first_last":
            assert given.last is not None
            return {**inputs, "last_image": frames_to_pil(given.last[-1:])[0]}
        spatial, temporal = int(self.compression[0]), self.temporal_ratio
        shape = ((frames - 1) // temporal + 1, height // spatial, width // spatial)
        count = given.frames.shape[0]
        if given.mode == "extension":
            if (count - 1) % temporal or count >= frames:
                raise ModelError(f"{self.name}: a clip to extend has k x {temporal} + 1 frames, fewer than the "
                                 f"{frames} sampled, not {count}.\nWhat to do: give "
                                 f"{(count - 1) // temporal * temporal + 1} frames, or sample more.")
            region = conditioning.region(torch.tensor([float(conditioning.code("extension"))]), (1, 1, *shape),
                                         (count - 1) // temporal + 1, torch.zeros(1, 1, *shape))
        else:
            if count != frames:
                raise ModelError(f"{self.name}: inpainting keeps a region of a clip of the {frames} frames sampled, "
                                 f"not {count}.\nWhat to do: give a clip of {frames} frames.")
            if given.mask is not None:
                region = conditioning.mask_region(given.mask[None, None], *shape)
            else:
                modes = self.config.conditioning
                region = conditioning.rectangle_region(modes.mask_rectangle, modes.mask_rectangle_generated, *shape)
        return {**inputs, "given_video": given.frames, "given_region": region}
