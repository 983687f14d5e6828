"""Wan VACE (Alibaba's all-in-one video creation and editing model): Wan 2.1 with a control branch.

`wan-vace` is the VACE 1.3B / 14B checkpoints (`WanVACETransformer3DModel`, sampled with `WanVACEPipeline`): Wan
2.1's text-to-video transformer plus `vace_blocks`, a second stack of Wan blocks that reads a control context and
adds a hint to the main block it is paired with (`vace_layers`). Everything else is Wan 2.1's (`WanSpec`): UMT5
captions, the VAE and its per-channel normalisation, flow matching.

The control context, as `WanVACEPipeline.prepare_video_latents` / `prepare_masks` build it from a control video
`video`, a `mask` (white: generate, black: keep) and reference images: the normalised VAE latents of the
*inactive* video (video x (1 - mask)) and of the *reactive* one (video x mask) on the channels, then the mask at
the latent resolution, each 8 x 8 pixel block folded into 64 channels (the VAE's spatial ratio squared); reference
images add latent frames in front. A training sample is a (control clip, target clip) pair read from the data
sources (`controls.txt`, `control_column`); without a mask the pipeline's mask is all white, so the inactive video
is black (its latents: the VAE's encoding of a black clip, which `prepare_latents` adds to every clip's latents as
`vace_inactive`) and the reactive one the control clip itself (the control latents the data path encodes), with a
mask of ones: exactly what the pipeline gives the transformer when it samples from that control video.

A clip may also have a `mask` and `reference_images` (per-clip inputs, vidtune/data/inputs.py). The mask (a clip, or
a still for every frame) splits the control clip as the pipeline splits it: its inactive and reactive latents are
encoded from the control clip's pixels with the mask applied (the mask's cache entry is keyed by the control clip
too), and the mask itself is folded onto the latent grid (`prepare_masks`). Each reference image is encoded alone
(its posterior's mode, normalised) and put in front of the control context as the pipeline puts it (the last image
first), with zero reactive latents and a zero mask; the clip's clean latents get the same reference latents in front
(DiffSynth-Studio's training does so: diffsynth/pipelines/wan_video.py, `WanVideoUnit_InputVideoEmbedder`), which is
what the pipeline denoises at those positions before it drops them.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from diffusers import WanVACEPipeline, WanVACETransformer3DModel
from torch import nn

from vidtune.algorithms import traits_of
from vidtune.config import Config
from vidtune.data.inputs import input_key
from vidtune.errors import ConfigError, ModelError
from vidtune.export.comfyui import Rule
from vidtune.export.comfyui_models import ComfyUIModel, wan21_vace
from vidtune.export.comfyui_workflow import ModelFiles, WorkflowLayout, wan_vace_parts
from vidtune.models.defaults import WAN_VACE
from vidtune.models.spec import (
    ALL_LINEAR,
    ATTENTION_TARGETS,
    CONTROL_INPUT,
    CONTROL_LATENTS,
    Conditions,
    Latents,
    frames_to_pil,
)
from vidtune.models.spec.sampling import step_callback
from vidtune.models.wan import WAN_FEED_FORWARD_TARGETS, WAN_TEXT_ENCODERS, EmbeddedPrompts
from vidtune.models.wan22 import Wan22Spec

# The latents of the inactive video (a black clip when no mask is given), beside each clip's posterior.
INACTIVE_LATENTS = "vace_inactive"
# A clip with a mask: its control clip's [inactive, reactive] latents split by the mask [B, 2C, F', H', W'], and the
# mask folded onto the latent grid [B, spatial^2, F', H', W'] (encoded with the mask input).
MASKED_CONTROL = "vace_masked_control"
FOLDED_MASK = "vace_mask"
# A clip with reference images: their latents [B, C, N, H', W'], in the order the pipeline puts them in front.
REFERENCE_LATENTS = input_key("reference_images")
# The LoRA presets that choose which stack adapts (the others adapt every block's layers, VACE blocks included).
MAIN_BLOCKS_PRESET = "main-blocks"
VACE_BLOCKS_PRESET = "vace-blocks"
# A block's attention and feed-forward layers, by their names inside a block.
BLOCK_LAYERS = tuple(f"{attention}.{target}" for attention in ("attn1", "attn2") for target in ATTENTION_TARGETS) + \
    WAN_FEED_FORWARD_TARGETS


class WanVACESpec(EmbeddedPrompts, Wan22Spec):
    """Wan VACE: Wan 2.1 with VACE blocks that follow each sample's control clip (see the module docstring).
    Prompts reach the pipeline as embeddings (WanVACEPipeline cleans text with ftfy unconditionally).

    A folder whose model_index.json names a `transformer_2` and a `boundary_ratio` is Wan 2.2 VACE-Fun A14B
    (alibaba-pai's, in diffusers' layout): two experts of Wan 2.1 VACE 14B's shape, each with its VACE blocks,
    handled as Wan 2.2 A14B's (`model.experts`, `model.expert_routing`, one adapter file per expert: see
    vidtune/models/wan22.py). WanVACEPipeline takes no per-token timesteps, so Wan 2.2's 5B (TI2V) layout has no VACE
    model it can load: `expand_timesteps` is refused by name."""

    name = "wan-vace"
    model_title: ClassVar[str] = "Wan VACE"
    published_guidance: ClassVar[dict[str, float]] = {"ti2v": 5.0, "two_experts": 5.0}  # WanVACEPipeline's default
    pipeline_class = WanVACEPipeline
    denoiser_class = WanVACETransformer3DModel
    defaults = WAN_VACE
    reads_control_clip = True
    inputs_with_control = ("mask",)  # the mask splits the control clip into its inactive and reactive parts
    sampling_inputs = ("mask", "reference_images")
    # The VACE blocks run first (their hints join the main blocks'), and are swapped like them.
    block_lists = ("vace_blocks", "blocks")

    def comfyui_workflow(self) -> WorkflowLayout | None:
        """Comfy-Org's repackaged Wan 2.1 VACE (`video_wan_vace_14B_v2v`), 1.3B or 14B by size, following the run's
        validation control video. None for Wan 2.2 VACE-Fun's two experts: Comfy-Org publishes no files of it to
        name (its ComfyUI LoRA files are still written)."""
        if self.two_experts:
            return None
        large = self.load_config(self.denoiser_class, "transformer")["num_layers"] > 30
        files = ModelFiles((f"wan2.1_vace_{'14B' if large else '1.3B'}_fp16.safetensors",), WAN_TEXT_ENCODERS, "wan",
                           "wan_2.1_vae.safetensors")
        return WorkflowLayout(files, wan_vace_parts)

    @functools.cached_property
    def pipeline_config(self) -> dict[str, Any]:
        """model_index.json (`boundary_ratio` and `transformer_2` of a Wan 2.2 VACE-Fun A14B folder); without one,
        one transformer (Wan 2.1 VACE)."""
        return self.model_index

    def check_source(self) -> None:
        super().check_source()
        if self.expand_timesteps:
            raise ConfigError(
                f"model.pretrained={self.config.pretrained}: its model_index.json sets expand_timesteps (one timestep "
                "per latent token, Wan 2.2's 5B / TI2V layout), which WanVACEPipeline does not take: no 5B VACE model "
                "loads in it.\nWhat to do: train Wan 2.1 VACE (1.3B / 14B) or Wan 2.2 VACE-Fun A14B (e.g. "
                "linoyts/Wan2.2-VACE-Fun-14B-diffusers) with model.name wan-vace, or the 5B model as wan2.2."
            )

    def check_training(self, config: Config) -> None:
        super().check_training(config)  # two experts: Wan 2.2's refusals
        if traits_of(config).control:
            raise ConfigError(
                f"training.algorithm={config.training.algorithm}: {self.name} follows its control clip through its "
                "own VACE blocks; a widened input layer would be a second, untrained control path.\nWhat to do: "
                "train it with training.algorithm lora (lora.target_modules: vace-blocks, main-blocks, attention, "
                "...) or full (full.trainable_patterns ['vace_blocks.*', 'vace_patch_embedding.*'] trains the "
                "VACE branch alone); the control clips come from controls.txt / control_column as for control runs."
            )

    # ----- the transformer's shape ---------------------------------------------------------------------
    @functools.cached_property
    def vace_layout(self) -> tuple[int, int]:
        """(main blocks, VACE blocks) of the transformer, read from its config."""
        config = self.load_config(self.denoiser_class, "transformer")
        return int(config.get("num_layers", 40)), len(config.get("vace_layers", [0, 5, 10, 15, 20, 25, 30, 35]))

    @property
    def lora_presets(self) -> dict[str, tuple[str, ...]]:  # type: ignore[override]
        """Wan's presets (every block's layers, VACE blocks included: peft matches name suffixes), and one per stack:
        `main-blocks` adapts the main blocks' attention and feed-forward only (the VACE branch stays the published
        one), `vace-blocks` the VACE blocks' only (DiffSynth-Studio's VACE LoRA, `--lora_base_model vace`), with
        their input / output projections. Full module names, so that neither stack's names reach the other."""
        main, vace = self.vace_layout
        return {
            "attention": ATTENTION_TARGETS,
            "attention+ffn": ATTENTION_TARGETS + WAN_FEED_FORWARD_TARGETS,
            ALL_LINEAR: (ALL_LINEAR,),
            MAIN_BLOCKS_PRESET: tuple(f"blocks.{n}.{layer}" for n in range(main) for layer in BLOCK_LAYERS),
            VACE_BLOCKS_PRESET: ("vace_blocks.0.proj_in",
                                 *(f"vace_blocks.{n}.{layer}" for n in range(vace)
                                   for layer in (*BLOCK_LAYERS, "proj_out"))),
        }

    # ----- tensors -------------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        """Wan's posterior, and the inactive latents of the control context: a black clip of the same shape
        encoded and normalised as `WanVACEPipeline.prepare_video_latents` does (the posterior's mode)."""
        latents = super().prepare_latents(vae, videos)
        black = self.vae_posterior(vae, torch.zeros_like(videos[:1])).mean
        inactive = self.normalise(vae, black).expand(videos.shape[0], *black.shape[1:])
        return {**latents, INACTIVE_LATENTS: inactive.to(latents["latents_mean"].dtype).contiguous()}

    # ----- per-clip inputs: the mask and reference images --------------------------------------------------------
    def optional_inputs(self, config: Config) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*super().optional_inputs(config), "mask", "reference_images")))

    def input_identity(self, kind: str) -> dict[str, Any]:
        # The mask is encoded with the control clip, the images as the pipeline encodes them: their own versions.
        identity = super().input_identity(kind)
        if kind == "mask":
            return {**identity, "vace": "masked control latents and folded mask, 1"}
        return {**identity, "vace": "reference latents, last first, 1"} if kind == "reference_images" else identity

    def encode_inputs(self, vae: nn.Module | None, inputs: dict[str, Any], latents: Latents) -> dict[str, torch.Tensor]:
        """Every family's mask on the latent grid (for `training.masked_loss`), and: with a mask, the control clip
        (`inputs[CONTROL_INPUT]`) split by it and the folded mask (`masked_control`); the reference images' latents
        (`reference_latents`)."""
        inputs = dict(inputs)
        control = inputs.pop(CONTROL_INPUT, None)
        encoded: dict[str, torch.Tensor] = {}
        if "reference_images" in inputs:
            encoded[REFERENCE_LATENTS] = self.reference_latents(self._vae(vae), inputs.pop("reference_images"))
        if "mask" in inputs:
            if control is None:
                raise ValueError(f"encode_inputs: {self.name} encodes a mask with its clip's control clip; pass it "
                                 "as inputs[CONTROL_INPUT]")
            video, folded = self.masked_control(self._vae(vae), control, inputs["mask"])
            encoded.update({MASKED_CONTROL: video, FOLDED_MASK: folded})
        return {**super().encode_inputs(vae, inputs, latents), **encoded}

    @staticmethod
    def _vae(vae: nn.Module | None) -> nn.Module:
        if vae is None:
            raise ValueError("encode_inputs: a Wan VACE mask or reference image is VAE-encoded; pass the VAE")
        return vae

    def _mode_latents(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels [B, 3, F, H, W] in [-1, 1] -> their posterior's mode, normalised (the pipeline's
        `retrieve_latents(..., sample_mode="argmax")` then `(z - mean) / std`), float on the CPU."""
        posterior = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist
        return self.normalise(vae, posterior.mode().float()).cpu()

    @torch.no_grad()
    def masked_control(self, vae: nn.Module, control: torch.Tensor, mask: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Control clips [B, 3, F, H, W] and their masks ([B, 3, F or 1, H, W], in [-1, 1]; white: generate) ->
        ([inactive, reactive] latents [B, 2C, F', H', W'], the folded mask [B, spatial^2, F', H', W']), as
        `WanVACEPipeline.prepare_video_latents` and `prepare_masks` make them from the same tensors."""
        weights = mask.float().add(1.0).div(2.0).clamp(0.0, 1.0)  # the pipeline's (mask + 1) / 2
        weights = weights.expand(-1, -1, control.shape[2], -1, -1) if weights.shape[2] == 1 else weights
        if weights.shape[2] != control.shape[2] or weights.shape[-2:] != control.shape[-2:]:
            raise ValueError(f"{self.name}: a mask of shape {tuple(mask.shape)} does not cover its control clip "
                             f"{tuple(control.shape)}")
        binary = (weights > 0.5).to(control.dtype)
        pixels = control.float()
        inactive = self._mode_latents(vae, pixels * (1.0 - binary))
        reactive = self._mode_latents(vae, pixels * binary)
        return torch.cat([inactive, reactive], dim=1), self.folded_mask(weights)

    def folded_mask(self, weights: torch.Tensor) -> torch.Tensor:
        """Mask weights [B, C, F, H, W] in [0, 1] -> their first channel, each spatial x spatial pixel block folded into
        spatial^2 channels, resampled to the latent frames by nearest-exact interpolation (`prepare_masks`)."""
        spatial, temporal, patch = self.compression
        batch, _, frames, height, width = weights.shape
        rows = height // (spatial * patch[1]) * patch[1]
        columns = width // (spatial * patch[2]) * patch[2]
        folded = weights[:, 0, :, : rows * spatial, : columns * spatial]
        folded = folded.reshape(batch, frames, rows, spatial, columns, spatial).permute(0, 3, 5, 1, 2, 4)
        folded = folded.flatten(1, 2)  # [B, spatial^2, F, H', W']
        size = ((frames + temporal - 1) // temporal, rows, columns)
        return nn.functional.interpolate(folded, size=size, mode="nearest-exact").contiguous()

    @torch.no_grad()
    def reference_latents(self, vae: nn.Module, images: list[list[torch.Tensor]]) -> torch.Tensor:
        """Each sample's reference images (a list of [3, 1, H, W] in [-1, 1]) -> [B, C, N, H', W']: each image encoded
        alone, the last one first (the pipeline puts each next image in front of the ones before)."""
        per_sample = [torch.cat([self._mode_latents(vae, image[None]) for image in reversed(list(sample))], dim=2)
                      for sample in images]
        counts = sorted({int(sample.shape[2]) for sample in per_sample})
        if len(counts) > 1:
            raise ValueError(f"a batch's clips have {counts} reference images: give each clip of a run the same "
                             "number, or train with training.batch_size=1")
        return torch.cat(per_sample)

    def training_latents(self, latents: Latents) -> Latents:
        """With reference images, the clean latents a clip trains on start with their latents (no spread: encoded
        by their mode), and a masked loss's weights with zeros there (the references are given, not learnt)."""
        references = latents.get(REFERENCE_LATENTS)
        if references is None:
            return latents
        mean, std = latents["latents_mean"], latents["latents_std"]
        references = references.to(device=mean.device, dtype=mean.dtype)
        found = {**latents, "latents_mean": torch.cat([references, mean], dim=2),
                 "latents_std": torch.cat([torch.zeros_like(references), std], dim=2)}
        mask = latents.get(input_key("mask"))
        if mask is not None:
            found[input_key("mask")] = torch.cat([mask.new_zeros(*mask.shape[:2], references.shape[2],
                                                                 *mask.shape[3:]), mask], dim=2)
        return found

    def control_context(self, conditions: Conditions, like: torch.Tensor) -> torch.Tensor:
        """[inactive latents, reactive latents, mask] on the channels, as the pipeline hands its transformer. Without
        a mask, the reactive latents are the control clip's and the mask ones (the pipeline's all-white mask); without
        a control clip either (a bare forward), the pipeline's own default, a black control video, whose latents are
        the inactive ones. With a mask, the control clip split by it and the folded mask; reference images' latents
        go in front, with zero reactive latents and a zero mask."""
        inactive = conditions[INACTIVE_LATENTS].to(device=like.device, dtype=like.dtype)
        video = conditions.get(MASKED_CONTROL)
        if video is None:
            reactive = conditions.get(CONTROL_LATENTS)
            reactive = inactive if reactive is None else reactive.to(device=like.device, dtype=like.dtype)
            video = torch.cat([inactive, reactive], dim=1)
        video = video.to(device=like.device, dtype=like.dtype)
        spatial = self.compression[0]
        mask = conditions.get(FOLDED_MASK)
        # Without one, the all-white mask, spatial x spatial pixels a latent position folded into its channels: ones.
        mask = inactive.new_ones(inactive.shape[0], spatial * spatial, *inactive.shape[2:]) if mask is None else \
            mask.to(device=like.device, dtype=like.dtype)
        references = conditions.get(REFERENCE_LATENTS)
        if references is not None:
            references = references.to(device=like.device, dtype=like.dtype)
            video = torch.cat([torch.cat([references, torch.zeros_like(references)], dim=1), video], dim=2)
            mask = torch.cat([mask.new_zeros(*mask.shape[:2], references.shape[2], *mask.shape[3:]), mask], dim=2)
        return torch.cat([video, mask], dim=1)

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        return denoiser(
            hidden_states=noisy_latents,
            timestep=timesteps.to(noisy_latents.device),
            encoder_hidden_states=conditions["prompt_embeds"].to(noisy_latents.dtype),
            control_hidden_states=self.control_context(conditions, noisy_latents),
            return_dict=False,
        )[0]

    # ----- sampling ------------------------------------------------------------------------------------
    def pipeline(self, text: Any, vae: nn.Module, denoiser: nn.Module) -> Any:
        """WanVACEPipeline with the denoiser, or both experts and the boundary (Wan 2.2 VACE-Fun A14B)."""
        experts = self.pipeline_experts(denoiser)
        experts.pop("expand_timesteps", None)  # one transformer: Wan 2.1 VACE (5B layouts are refused)
        return WanVACEPipeline(tokenizer=text["tokenizer"], text_encoder=text["text_encoder"], vae=vae,
                               scheduler=self.load_scheduler(), **experts)

    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        """The control clip (`reference`, [F, 3, H, W] in [-1, 1]: validation gives the first sample's, `vidtune
        sample` its --control) as the pipeline's `video`, as pictures; without one the pipeline's black video."""
        return {} if reference is None else {"video": frames_to_pil(reference)}

    def call_pipeline(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                      num_inference_steps: int, guidance_scale: float, generator: torch.Generator, output_type: str,
                      reference: torch.Tensor | None = None, callback: Any = None,
                      inputs: dict[str, torch.Tensor] | None = None) -> Any:
        """The pipeline call with the control clip as `video`, and the sample's `mask` ([3, F or 1, H, W]) and
        `reference_images` ([3, N, H, W], each image already fitted to the sample's size as training fits it) as
        pictures. With reference images, its "latent" output starts with their positions, as training's latents."""
        return pipeline(
            **self.prompt_inputs(pipeline, prompt, guidance_scale),
            num_frames=frames,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            max_sequence_length=self.max_sequence_length,
            generator=generator,
            output_type=output_type,
            **self.guidance_inputs(guidance_scale),
            **self.pipeline_inputs(reference),
            **self.input_pictures(inputs or {}, frames, reference),
            **step_callback(callback),
        )

    def input_pictures(self, inputs: dict[str, torch.Tensor], frames: int, reference: torch.Tensor | None
                       ) -> dict[str, Any]:
        """The pipeline's `mask` (one picture a frame) and `reference_images` from a sample's inputs."""
        pictures: dict[str, Any] = {}
        mask = inputs.get("mask")
        if mask is not None:
            if reference is None:
                raise ModelError(f"{self.name}: a mask splits the control clip, and this sample has none.\nWhat to "
                                 "do: give the sample a control clip (controls.txt, control_column, --control).")
            if mask.ndim != 4 or mask.shape[0] != 3 or 1 < mask.shape[1] < frames:
                raise ModelError(f"{self.name}: the mask has shape {tuple(mask.shape)}; it needs [3, F, H, W] with "
                                 f"one frame or at least {frames} (the sample's).\nWhat to do: give a mask still, or a "
                                 "mask clip as long as the sample.")
            mask = mask.expand(-1, frames, -1, -1) if mask.shape[1] == 1 else mask[:, :frames]
            pictures["mask"] = frames_to_pil(mask.transpose(0, 1))
        images = inputs.get("reference_images")
        if images is not None:
            pictures["reference_images"] = frames_to_pil(images.transpose(0, 1))
        return pictures

    # ----- ComfyUI ------------------------------------------------------------------------------------
    def comfyui_lora_rules(self) -> list[Rule]:
        """Wan 2.1's names, and the VACE blocks' under the original checkpoint's names (Wan-Video's VACE model,
        ComfyUI's `VaceWanModel`): Wan block names under `vace_blocks.N`, `proj_in` = `before_proj`, `proj_out` =
        `after_proj` (diffusers' single-file converter renames them so)."""
        projections = {r"to_q": "q", r"to_k": "k", r"to_v": "v", r"to_out\.0": "o"}
        vace = [Rule(rf"vace_blocks\.(\d+)\.{attention}\.{ours}", rf"vace_blocks.\1.{theirs}.{original}")
                for attention, theirs in (("attn1", "self_attn"), ("attn2", "cross_attn"))
                for ours, original in projections.items()]
        return [
            *super().comfyui_lora_rules(),
            *vace,
            Rule(r"vace_blocks\.(\d+)\.ffn\.net\.0\.proj", r"vace_blocks.\1.ffn.0"),
            Rule(r"vace_blocks\.(\d+)\.ffn\.net\.2", r"vace_blocks.\1.ffn.2"),
            Rule(r"vace_blocks\.(\d+)\.proj_in", r"vace_blocks.\1.before_proj"),
            Rule(r"vace_blocks\.(\d+)\.proj_out", r"vace_blocks.\1.after_proj"),
        ]

    def comfyui_model(self) -> ComfyUIModel:
        return wan21_vace(self.load_config(self.denoiser_class, "transformer"))

