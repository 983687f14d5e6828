"""What every part of a model family's spec shares: its name, its settings, the classes it is made of, and the
tensor conventions between the parts.

Latent conventions shared by every spec:
    `prepare_latents` returns {"latents_mean", "latents_std"}: the VAE posterior, already normalised
    exactly as the family's pipeline normalises latents, in the VAE's own layout [B, C, F, H, W].
    A training latent is drawn as mean + std * eps each step (see `draw_latent`). Other keys it
    returns are conditions derived from the video (first-frame latents, image embeddings).
    Noise, noisy latents, predictions and targets all live in that same layout; `forward` does any
    packing/patching the denoiser needs and returns the prediction unpacked.
"""

from __future__ import annotations

from abc import ABC
from typing import Any, ClassVar

import torch
from PIL import Image

from vidtune.config import Config, ModelConfig
from vidtune.data.video import frames_to_uint8
from vidtune.models.defaults import FamilyDefaults

Conditions = dict[str, torch.Tensor]
Latents = dict[str, torch.Tensor]

# Keys of `prepare_latents` that describe the posterior; any other key it returns is a video-derived
# condition (e.g. an image-to-video first-frame latent) and is handed to `forward` with the text ones.
POSTERIOR_KEYS = ("latents_mean", "latents_std")
# Control training: the key of a batch's control latents (the control clips' posterior means, [B, C, F, H, W]).
CONTROL_LATENTS = "control_latents"
# The key of a clip's control clip pixels ([B, 3, F, H, W] in [-1, 1]) among the inputs `encode_inputs` receives, for
# the input kinds a family encodes with its control clip (`Encoding.inputs_with_control`).
CONTROL_INPUT = "control"
# `training.masked_loss`: the key of each clip's loss weights on the latent grid ([B, 1, F, H, W] in [0, 1], from its
# `mask` input), which `Denoising.clip_error` weights each clip's error by.
LOSS_MASK = "loss_mask"
# With it, `training.masked_loss_area: frame`: the weighted error is averaged over the whole frame, not the mask's area.
LOSS_MASK_BY_FRAME = "loss_mask_by_frame"
# The key of each clip's frame rate [B, 1] (float64, frames per second) that families which tell their denoiser a
# frame rate (`ModelSpec.frame_rate_conditioned`) find beside the latents: the rate the clip's frames play at.
FRAME_RATE = "frame_rate"


def draw_latent(latents: Latents, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one latent from the stored posterior (mean + std * eps), per step, so clips keep their noise."""
    mean, std = latents["latents_mean"], latents["latents_std"]
    eps = torch.randn(mean.shape, generator=generator, dtype=torch.float32, device="cpu")
    return mean + std * eps.to(device=mean.device, dtype=mean.dtype)


def frames_to_pil(frames: torch.Tensor) -> list[Image.Image]:
    """[B, 3, H, W] in [-1, 1] -> RGB images, as a user would hand them to a pipeline or an image encoder."""
    return [Image.fromarray(array) for array in frames_to_uint8(frames)]


class SpecBase(ABC):
    """The state every part reads: the family's name and recipe, the classes of its components and pipeline, and
    the run settings a spec is built with. A spec holds no per-run state beyond these."""

    name: ClassVar[str]
    # The clip shape, frame rate and noise levels of the family's published recipe, for the keys a config leaves
    # unset (vidtune/models/defaults.py; the table in docs/models.md). These are vidtune's generic ones.
    defaults: ClassVar[FamilyDefaults] = FamilyDefaults(frames=49, height=512, width=768, fps=25.0)
    # The denoiser is told the frame rate of its input (LTX): each clip's own rate reaches `forward` (`FRAME_RATE`).
    frame_rate_conditioned: ClassVar[bool] = False
    # Share of training samples given their first latent frame clean (`model.first_frame_conditioning`'s default;
    # None: the family cannot take it). See vidtune/models/first_frame.py.
    first_frame_conditioning: ClassVar[float | None] = None
    # Conditioning modes beside first-frame conditioning that the family trains and samples (`model.conditioning`;
    # vidtune/models/conditioning.py); any other is refused before loading, saying `conditioning_refusal`.
    conditioning_modes: ClassVar[tuple[str, ...]] = ()
    # The family reads `model.animate_*` (Wan Animate's mode and segments); any other refuses them before loading.
    takes_animate_settings: ClassVar[bool] = False
    conditioning_refusal: ClassVar[str] = "its pipeline takes a text prompt, or a first image, only"
    # Why the denoiser's frozen weights cannot be stored in float8 (`memory.base_weights: fp8`, refused with it and
    # never suggested by `vidtune plan`); None: they can.
    float8_refusal: ClassVar[str | None] = None
    # diffusers / transformers classes of the components, used by the default loaders, and the family's pipeline
    # (its `save_lora_weights` writes the LoRA format the family's tools read).
    pipeline_class: ClassVar[Any]
    text_encoder_class: ClassVar[Any] = None
    vae_class: ClassVar[Any]
    denoiser_class: ClassVar[Any]
    scheduler_class: ClassVar[Any]

    def __init__(self, config: ModelConfig, frame_rate: float = 25.0, text_encoder_weights: str = "auto",
                 vae_tiling: bool = False, base_weights: str = "auto") -> None:
        self.config = config
        self.frame_rate = frame_rate
        self.text_encoder_weights = text_encoder_weights  # memory.text_encoder_weights
        self.vae_tiling = vae_tiling  # memory.vae_tiling
        self.base_weights = base_weights  # memory.base_weights: a float8 single file's weights stay float8 for `fp8`

    def check_training(self, config: Config) -> None:
        """Refuse, before any long work, run settings the model cannot take (e.g. an algorithm that cannot train a
        two-expert model); by default everything goes."""
        return None
