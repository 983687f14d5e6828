"""SkyReels V2 (Skywork): Wan 2.1's architecture, VAE and UMT5 text encoder, trained further by Skywork.

`skyreels-v2` is text-to-video (SkyReelsV2Pipeline), `skyreels-v2-i2v` image-to-video
(SkyReelsV2ImageToVideoPipeline), `skyreels-v2-df` the diffusion-forcing models (SkyReelsV2DiffusionForcingPipeline;
its image-to-video and video-to-video pipelines take the same transformer, so what it trains serves them too).
Their conventions are Wan 2.1's (vidtune/models/wan.py), which these classes inherit: the same caption embeddings,
latent normalisation (`latents_mean` / `latents_std` of the VAE config), flow matching read from the UniPC scheduler,
and for image-to-video the same mask channels + first-frame latents concatenated to the input and CLIP image tokens.
What differs:
    the transformer class, SkyReelsV2Transformer3DModel (Wan's module names, so the LoRA targets and the ComfyUI
        names are Wan's; ComfyUI loads SkyReels V2 checkpoints as Wan models);
    the pipelines clean prompts with `ftfy` unconditionally, so sampling hands them embeddings (`EmbeddedPrompts`);
    the image encoder may be a CLIPVisionModelWithProjection and its processor a CLIPProcessor (the classes the
        image-to-video pipeline declares; the checkpoint's model_index.json says which);
    the published recipe: 24 fps, 97 frames of 544x960 (540P), guidance 6 (text) / 5 (image).
Diffusion forcing gives each latent frame its own noise level: the pipeline calls the transformer with a timestep per
latent frame ([B, F]) and `enable_diffusion_forcing=True`, and (the 1.3B model, `inject_sample_info`) a frame-rate
class, 0 for 16 fps and 1 for any other. Training draws a level per frame, non-decreasing along the clip
(`training.frame_noise`, vidtune/objectives.py), as SkyReels V2's diffusion forcing was trained; the pipeline's
synchronous sampling (`ar_step` 0, its default) gives all frames one level, its asynchronous one (`ar_step` > 0) later
blocks more noise.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from diffusers import (
    SkyReelsV2DiffusionForcingPipeline,
    SkyReelsV2DiffusionForcingVideoToVideoPipeline,
    SkyReelsV2ImageToVideoPipeline,
    SkyReelsV2Pipeline,
    SkyReelsV2Transformer3DModel,
)
from torch import nn
from transformers import CLIPImageProcessor, CLIPProcessor, CLIPVisionModel, CLIPVisionModelWithProjection

from vidtune.algorithms import traits_of
from vidtune.config import Config
from vidtune.errors import ConfigError, ModelError
from vidtune.models import conditioning
from vidtune.models.conditioning import Given
from vidtune.models.defaults import SKYREELS_V2, SKYREELS_V2_DF
from vidtune.models.spec import Conditions, StepCallback, frames_to_pil
from vidtune.models.wan import EmbeddedPrompts, WanImageToVideoSpec, WanSpec


class SkyReelsV2Spec(EmbeddedPrompts, WanSpec):
    name = "skyreels-v2"
    pipeline_class = SkyReelsV2Pipeline
    denoiser_class = SkyReelsV2Transformer3DModel
    defaults = SKYREELS_V2
    validation_guidance_scale = 6.0  # SkyReelsV2Pipeline's default and the README's for text-to-video
    model_title = "SkyReels V2"

    def comfyui_workflow(self) -> None:
        """No workflow yet: Comfy-Org publishes no repackaged SkyReels V2 files whose names a workflow could load.
        The LoRA file for ComfyUI is still written (docs/comfyui.md)."""
        return None

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        super().check_video_shape(frames, height, width)
        self.check_no_sample_info()  # read with the shape rules: before anything loads

    def check_no_sample_info(self) -> None:
        """A transformer with a frame-rate embedding (`inject_sample_info`, the diffusion-forcing 1.3B model) needs the
        `fps` input that only the diffusion-forcing pipeline gives it."""
        if self.load_config(self.denoiser_class, "transformer").get("inject_sample_info"):
            raise ModelError(
                f"{self.describe_file('transformer', 'config.json')}: inject_sample_info is true, which the "
                f"diffusion-forcing SkyReels V2 checkpoints have; {self.name} samples with "
                f"{self.pipeline_class.__name__}, which gives the transformer no frame rate.\nWhat to do: point "
                "model.pretrained at a SkyReels V2 text-to-video or image-to-video checkpoint "
                "(Skywork/SkyReels-V2-T2V-14B-540P-Diffusers, Skywork/SkyReels-V2-I2V-14B-540P-Diffusers, ...)."
            )


class SkyReelsV2ImageToVideoSpec(WanImageToVideoSpec, SkyReelsV2Spec):
    """SkyReels V2 image-to-video: Wan 2.1 image-to-video's conditioning with SkyReels V2's transformer."""

    name = "skyreels-v2-i2v"
    pipeline_class = SkyReelsV2ImageToVideoPipeline
    validation_guidance_scale = 5.0  # the README's and SkyReelsV2ImageToVideoPipeline's default
    image_encoder_classes: ClassVar[tuple[type, ...]] = (CLIPVisionModelWithProjection, CLIPVisionModel)
    image_processor_classes: ClassVar[tuple[type, ...]] = (CLIPImageProcessor, CLIPProcessor)


class SkyReelsV2DiffusionForcingSpec(SkyReelsV2Spec):
    """SkyReels V2 diffusion forcing: a timestep per latent frame (see the module's docstring)."""

    name = "skyreels-v2-df"
    pipeline_class = SkyReelsV2DiffusionForcingPipeline
    defaults = SKYREELS_V2_DF
    frame_timesteps = True
    # The 1.3B model embeds a frame-rate class: each clip's own rate reaches `forward`, as the pipeline's `fps`.
    frame_rate_conditioned = True
    # Video extension as SkyReelsV2DiffusionForcingVideoToVideoPipeline continues a clip: the given frames' latents
    # in place of the first latent frames at timestep 0 (its prefix latents, `addnoise_condition` 0), out of the loss.
    conditioning_modes = ("extension",)
    conditioning_refusal = ("its pipelines continue a clip (SkyReelsV2DiffusionForcingVideoToVideoPipeline) or start "
                            "from text; no last frame and no mask")

    def check_no_sample_info(self) -> None:
        """The diffusion-forcing pipeline gives a transformer with `inject_sample_info` its frame rate."""

    def check_training(self, config: Config) -> None:
        if traits_of(config).control and self.sample_info:
            # `forward` runs such a model one sample at a time, and a control input is appended to the whole batch.
            raise ConfigError(
                f"training.algorithm={config.training.algorithm}: {self.describe_file('transformer', 'config.json')} "
                "has inject_sample_info (the 1.3B diffusion-forcing model), whose frame-rate embedding diffusers "
                "applies to one sample at a time, so vidtune runs it sample by sample, which a control input cannot "
                "follow.\nWhat to do: train a LoRA or a full fine-tune of it, or control-train a 14B "
                "diffusion-forcing model."
            )

    @functools.cached_property
    def frames_per_token(self) -> int:
        return self.patch_sizes[0]

    @functools.cached_property
    def sample_info(self) -> bool:
        """The transformer embeds the frame-rate class (`inject_sample_info`: SkyReels-V2-DF-1.3B)."""
        return bool(self.load_config(self.denoiser_class, "transformer").get("inject_sample_info"))

    def lora_exclude_modules(self) -> list[str]:
        """The frame-rate projection of a model with `inject_sample_info`: ComfyUI's Wan model has no such layer."""
        return ["fps_projection.net.0.proj", "fps_projection.net.2"] if self.sample_info else []

    @staticmethod
    def frame_rate_classes(rates: torch.Tensor) -> list[int]:
        """The transformer's frame-rate classes, as the pipeline computes them from its `fps`: 0 for 16, else 1."""
        return [0 if round(float(rate)) == 16 else 1 for rate in rates]

    # ----- video extension ---------------------------------------------------------------------------------------
    @property
    def extension_latent_frames(self) -> int:
        """Latent frames of the `extension_frames` given frames (the pipeline's `overlap_history` latent frames)."""
        return (self.config.conditioning.extension_frames - 1) // self.compression[1] + 1

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        super().check_video_shape(frames, height, width)
        problems = conditioning.extension_problems(self.config.conditioning, self.compression[1], frames,
                                                   "SkyReelsV2DiffusionForcingVideoToVideoPipeline's prefix")
        if problems:
            raise ConfigError("model.conditioning does not fit the clips:\n" + "\n".join(f"  - {p}" for p in problems)
                              + "\nWhat to do: fix model.conditioning as said above.")

    def visit_conditions(self, x0: torch.Tensor, positions: torch.Tensor, seed: int) -> Conditions:
        """With `model.conditioning.extension`, which samples continue their first frames (the others: text)."""
        if not self.config.conditioning.enabled:
            return super().visit_conditions(x0, positions, seed)
        return conditioning.draw_visit(self.config.conditioning, x0, positions, seed, self.extension_latent_frames)

    def given_region(self, conditions: Conditions, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """[B, 1, F, H, W]: the first latent frames of each sample drawing extension (1.0)."""
        device = conditions[conditioning.LATENTS].device
        return conditioning.region(conditions[conditioning.MODE], shape, self.extension_latent_frames,
                                   torch.zeros(1, 1, *shape[-3:], device=device))

    def per_clip_error(self, error: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        """The given frames are the pipeline's prefix, not a prediction: out of the loss."""
        if conditioning.MODE in conditions:
            return conditioning.per_clip_error(error, self.given_region(conditions, error.shape))
        return super().per_clip_error(error, conditions)

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        batch, frames = noisy_latents.shape[0], noisy_latents.shape[2] // self.frames_per_token
        timesteps = timesteps.to(noisy_latents.device)
        if timesteps.ndim == 1:  # one level for the clip: every frame gets it (the pipeline's synchronous steps)
            timesteps = timesteps[:, None].expand(batch, frames)
        if conditioning.MODE in conditions:  # the given frames clean, at timestep 0 (the pipeline's prefix)
            given = self.given_region(conditions, noisy_latents.shape)
            noisy_latents = conditioning.give(noisy_latents, conditions[conditioning.LATENTS], given)
            kept = given[:, 0, :: self.frames_per_token, 0, 0].to(timesteps.device)
            timesteps = torch.where(kept > 0, torch.zeros_like(timesteps), timesteps)
        text = conditions["prompt_embeds"].to(noisy_latents.dtype)
        rates = self.frame_rate_classes(self.frame_rates(conditions, batch))
        # diffusers 0.42 adds the frame-rate embedding of a diffusion-forcing step correctly for one sample only
        # (the pipeline's batch): a model with it runs each sample alone.
        chunks = [slice(i, i + 1) for i in range(batch)] if self.sample_info else [slice(0, batch)]
        return torch.cat([denoiser(
            hidden_states=noisy_latents[chunk],
            timestep=timesteps[chunk],
            encoder_hidden_states=text[chunk],
            enable_diffusion_forcing=True,
            fps=rates[chunk],
            return_dict=False,
        )[0] for chunk in chunks])

    def prompt_inputs(self, pipeline: Any, prompt: str, guidance_scale: float) -> dict[str, Any]:
        # The pipeline's `prompt` has no default: given as None beside the embeddings.
        return {"prompt": None, **super().prompt_inputs(pipeline, prompt, guidance_scale)}

    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        """The frame rate (the pipeline's `fps`, of which the transformer sees the class) and synchronous sampling
        (`ar_step` 0, the pipeline's default: every frame at one level, as validation compares with training)."""
        return {"fps": round(float(self.frame_rate)), "ar_step": 0}

    def given_inputs(self, given: Given, frames: int, height: int, width: int) -> dict[str, Any]:
        """SkyReelsV2DiffusionForcingVideoToVideoPipeline's inputs continuing `given.frames`: the clip as `video`,
        all of it the prefix (`overlap_history`), in one window of the sampled frames (`base_num_frames`)."""
        assert given.frames is not None
        count, temporal = given.frames.shape[0], self.compression[1]
        if (count - 1) % temporal or count >= frames:
            raise ModelError(f"{self.name}: a clip to extend has k x {temporal} + 1 frames, fewer than the {frames} "
                             f"sampled, not {count}.\nWhat to do: give {(count - 1) // temporal * temporal + 1} "
                             "frames, or sample more.")
        return {**self.pipeline_inputs(), "video": frames_to_pil(given.frames), "overlap_history": count,
                "base_num_frames": frames}

    def call_pipeline(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                      num_inference_steps: int, guidance_scale: float, generator: torch.Generator, output_type: str,
                      reference: torch.Tensor | None = None, callback: StepCallback | None = None,
                      given: Given | None = None) -> Any:
        """Extension: the video-to-video pipeline on the same components. Its video output is the given clip
        followed by the whole window (the given frames again, decoded); the sample is the window."""
        if given is None:
            return super().call_pipeline(pipeline, prompt, frames, height, width, num_inference_steps,
                                         guidance_scale, generator, output_type, reference, callback)
        continuing = SkyReelsV2DiffusionForcingVideoToVideoPipeline(**pipeline.components)
        continuing.set_progress_bar_config(**getattr(pipeline, "_progress_bar_config", {}))
        result = super().call_pipeline(continuing, prompt, frames, height, width, num_inference_steps,
                                       guidance_scale, generator, output_type, reference, callback, given)
        if output_type != "latent":
            assert given.frames is not None
            result.frames = result.frames[:, given.frames.shape[0]:]
        return result
