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
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from diffusers import WanVACEPipeline, WanVACETransformer3DModel
from torch import nn

from vidtune.algorithms import traits_of
from vidtune.config import Config
from vidtune.errors import ConfigError
from vidtune.export.comfyui import Rule
from vidtune.export.comfyui_models import ComfyUIModel, wan21_vace
from vidtune.models.defaults import WAN_VACE
from vidtune.models.spec import (
    ALL_LINEAR,
    ATTENTION_TARGETS,
    CONTROL_LATENTS,
    Conditions,
    Latents,
    frames_to_pil,
)
from vidtune.models.wan import WAN_FEED_FORWARD_TARGETS, EmbeddedPrompts, WanSpec

# The latents of the inactive video (a black clip when no mask is given), beside each clip's posterior.
INACTIVE_LATENTS = "vace_inactive"
# The LoRA presets that choose which stack adapts (the others adapt every block's layers, VACE blocks included).
MAIN_BLOCKS_PRESET = "main-blocks"
VACE_BLOCKS_PRESET = "vace-blocks"
# A block's attention and feed-forward layers, by their names inside a block.
BLOCK_LAYERS = tuple(f"{attention}.{target}" for attention in ("attn1", "attn2") for target in ATTENTION_TARGETS) + \
    WAN_FEED_FORWARD_TARGETS


class WanVACESpec(EmbeddedPrompts, WanSpec):
    """Wan VACE: Wan 2.1 with VACE blocks that follow each sample's control clip (see the module docstring).
    Prompts reach the pipeline as embeddings (WanVACEPipeline cleans text with ftfy unconditionally)."""

    name = "wan-vace"
    model_title: ClassVar[str] = "Wan VACE"
    pipeline_class = WanVACEPipeline
    denoiser_class = WanVACETransformer3DModel
    defaults = WAN_VACE
    reads_control_clip = True
    # The VACE blocks run first (their hints join the main blocks'), and are swapped like them.
    block_lists = ("vace_blocks", "blocks")

    def check_training(self, config: Config) -> None:
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

    def control_context(self, conditions: Conditions, like: torch.Tensor) -> torch.Tensor:
        """[inactive latents, reactive latents, mask] on the channels, as the pipeline hands its transformer. The
        reactive latents are the control clip's; without them (a bare forward) the pipeline's own default, a black
        control video, whose latents are the inactive ones."""
        inactive = conditions[INACTIVE_LATENTS].to(device=like.device, dtype=like.dtype)
        reactive = conditions.get(CONTROL_LATENTS)
        reactive = inactive if reactive is None else reactive.to(device=like.device, dtype=like.dtype)
        spatial = self.compression[0]
        # The all-white mask, 8 x 8 pixels a latent position folded into spatial^2 channels: ones.
        mask = inactive.new_ones(inactive.shape[0], spatial * spatial, *inactive.shape[2:])
        return torch.cat([inactive, reactive, mask], dim=1)

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
    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        """The control clip (`reference`, [F, 3, H, W] in [-1, 1]: validation gives the first sample's, `vidtune
        sample` its --control) as the pipeline's `video`, as pictures; without one the pipeline's black video."""
        return {} if reference is None else {"video": frames_to_pil(reference)}

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
