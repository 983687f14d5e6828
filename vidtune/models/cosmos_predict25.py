"""Cosmos Predict 2.5 (NVIDIA): Qwen2.5-VL text encoder (Cosmos-Reason1), Wan 2.1's video VAE, and a DiT that takes a
condition-mask channel beside the latents.

One pipeline (Cosmos2_5_PredictBasePipeline) samples text-to-world, image-to-world and video-to-world; the mode is
which first latent frames it is given clean. Conventions taken from that pipeline (diffusers 0.42):
    text: the caption goes into a chat (the pipeline's system turn, then the caption as the user turn), is tokenised
        to `max_sequence_length` tokens (512, padded), and the hidden states of every Qwen layer after the embedding
        are each normalised over their features (mean 0, std 1) and concatenated: the transformer projects them
        (`crossattn_proj`); no text mask reaches the transformer;
    latents: the VAE posterior normalised per channel, (z - vae.config.latents_mean) / vae.config.latents_std;
    conditioning frames: the first K latent frames (K = 1 for an image, 2 for a video's last five frames) are the
        clip's own latents (the posterior mode), marked 1 in the condition-mask channel and told timestep 1e-4 (the
        pipeline's `conditional_frame_timestep`); the pipeline replaces the prediction there, so they stay out of
        the loss; every other frame is told its sigma itself (the transformer's timestep is sigma in [0, 1], one per
        latent frame) and a zero padding-mask channel follows;
    objective: flow matching (UniPCMultistepScheduler with flow_prediction and flow sigmas), target noise - x0.
The makers train the three modes together: a share of the samples gets 1 or 2 conditioning latent frames (the rest
none), drawn per visit. `cosmos-predict-2.5` trains that mix (`model.first_frame_conditioning`: the conditioned
share) and validates from text; `cosmos-predict-2.5-v2w` gives every sample its conditioning frames and validates
from the reference clip's first five frames (video-to-world), the same checkpoint and adapter either way.
"""

from __future__ import annotations

import functools
import importlib.util
import types
from pathlib import Path
from typing import Any, ClassVar

import diffusers.models.transformers.transformer_cosmos as transformer_cosmos
import torch
from diffusers import (
    AutoencoderKLWan,
    Cosmos2_5_PredictBasePipeline,
    CosmosTransformer3DModel,
    UniPCMultistepScheduler,
)
from torch import nn
from transformers import Qwen2_5_VLForConditionalGeneration

from vidtune.config import Config
from vidtune.errors import ConfigError, ModelError
from vidtune.models.conditioning import visit_generator
from vidtune.models.defaults import COSMOS_PREDICT_25
from vidtune.models.spec import (
    ALL_LINEAR,
    ATTENTION_TARGETS,
    Conditions,
    Latents,
    ModelSpec,
    TextComponents,
    frame_count_problem,
    raise_shape_problems,
    shape_rule,
    side_problems,
)
from vidtune.models.wan import wan_vae_compression
from vidtune.objectives import NUM_TRAIN_TIMESTEPS

DEFAULT_MAX_SEQUENCE_LENGTH = 512  # the pipeline's max_sequence_length
SYSTEM_PROMPT = "You are a helpful assistant who will provide prompts to an image generator."  # the pipeline's
CONDITIONAL_FRAME_TIMESTEP = 1e-4  # the pipeline's `conditional_frame_timestep` for the frames it is given
MAX_CONDITION_FRAMES = 2  # latent frames: 1 from an image, 2 from a video's last 4 * (2 - 1) + 1 = 5 frames
PIPELINE_SIDE_MULTIPLE = 16  # Cosmos2_5_PredictBasePipeline.check_inputs
COSMOS_FEED_FORWARD_TARGETS = ("ff.net.0.proj", "ff.net.2")
# Keys of the conditions: the clip's first latent frames, clean ([B, C, 2, H, W]), and how many of them each sample is
# given ([B] float: 0, 1 or 2).
CONDITION_LATENTS = "condition_latents"
CONDITION_FRAMES = "condition_frames"
TINY_MARKER = "vidtune_tiny.json"  # written beside a tiny test model (vidtune/models/tiny/common.py)


def _nearest_resize(tensor: torch.Tensor, size: list[int], interpolation: Any = None) -> torch.Tensor:
    """torchvision's `resize` of a tensor with nearest interpolation, which is torch's nearest `interpolate`."""
    return torch.nn.functional.interpolate(tensor, size=list(size), mode="nearest")


if not hasattr(transformer_cosmos, "transforms"):
    # diffusers' Cosmos transformer needs torchvision only to resize its padding mask (nearest); vidtune does not
    # depend on torchvision, so without it the transformer gets the same resize from torch.
    transformer_cosmos.transforms = types.SimpleNamespace(
        functional=types.SimpleNamespace(resize=_nearest_resize),
        InterpolationMode=types.SimpleNamespace(NEAREST="nearest"),
    )


class UncheckedTinySamples:
    """The safety checker a tiny test model's pipeline gets: its random weights sample noise, which NVIDIA's guardrail
    (a separate set of models) has nothing to judge in. Every released checkpoint gets the guardrail itself."""

    def to(self, *args: Any, **kwargs: Any) -> UncheckedTinySamples:
        return self

    def check_text_safety(self, prompt: str) -> bool:
        return True


def condition_draw(probability: float, x0: torch.Tensor, positions: torch.Tensor, seed: int) -> torch.Tensor:
    """[B] float: how many first latent frames each sample of a batch (clean latents `x0` [B, C, F, H, W], stream
    `positions`) is given: with `probability` 1 or 2 (evenly, as the makers' `conditional_frames_probs`), else 0;
    never all of a clip's frames. Drawn from the visit's own generator, so a resumed run draws the same."""
    counts = []
    for position in positions.tolist():
        generator = visit_generator(seed, int(position))
        given, two = torch.rand(2, generator=generator).tolist()
        counts.append(0.0 if given >= probability else (2.0 if two < 0.5 else 1.0))
    return torch.tensor(counts, dtype=torch.float32).clamp(max=float(max(x0.shape[2] - 1, 0))).to(x0.device)


class CosmosPredict25Spec(ModelSpec):
    name = "cosmos-predict-2.5"
    validation_guidance_scale = 7.0  # the pipeline's default guidance_scale
    # The makers' share of samples given conditioning frames ({0: 0.5, 1: 0.25, 2: 0.25}).
    first_frame_conditioning = 0.5
    defaults = COSMOS_PREDICT_25
    pipeline_class = Cosmos2_5_PredictBasePipeline
    text_encoder_class = Qwen2_5_VLForConditionalGeneration
    vae_class = AutoencoderKLWan
    denoiser_class = CosmosTransformer3DModel
    scheduler_class = UniPCMultistepScheduler
    # A Linear over (1, 2, 2) patches, channels outermost; the transformer appends its condition mask and padding
    # mask after the control's channels.
    control_input_layer = "patch_embed.proj"
    control_channels_before_own = 2
    lora_presets: ClassVar[dict[str, tuple[str, ...]]] = {
        "attention": ATTENTION_TARGETS,
        "attention+ffn": ATTENTION_TARGETS + COSMOS_FEED_FORWARD_TARGETS,
        ALL_LINEAR: (ALL_LINEAR,),
    }

    # diffusers' Cosmos converter is registered for the class, for Cosmos 1.0 and 2.0 files: see single_file_problem.
    loads_single_file = True

    def native_max_sequence_length(self) -> int:
        return DEFAULT_MAX_SEQUENCE_LENGTH

    def single_file_problem(self, config: dict[str, Any]) -> str | None:
        """diffusers' single-file converter for CosmosTransformer3DModel recognises Cosmos 1.0 and Predict 2 files
        (its model types stop at 2.0); vidtune has not checked it against Cosmos Predict 2.5's files."""
        return ("diffusers' single-file converter for Cosmos (CosmosTransformer3DModel) recognises Cosmos 1.0 and "
                "Cosmos Predict 2 files; vidtune does not read Cosmos Predict 2.5 files through it, as nothing checks "
                "that it converts their text projection (crossattn_proj) and blocks alike.")

    # ----- shape rules, read from the VAE / transformer configs (no weights needed) --------------------
    @functools.cached_property
    def compression(self) -> tuple[int, int, tuple[int, int, int]]:
        """(VAE spatial ratio, VAE temporal ratio, transformer patch size (t, h, w)): Wan 2.1's VAE."""
        return wan_vae_compression(self)

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        spatial, temporal, patch = self.compression
        side = max(spatial * patch[1], PIPELINE_SIDE_MULTIPLE)
        raise_shape_problems("Cosmos Predict 2.5", [frame_count_problem(frames, temporal, patch[0]),
                                                    *side_problems(height, width, side)],
                             self, shape_rule(temporal, patch[0], side))

    # ----- text ----------------------------------------------------------------------------------------
    def condition_identity(self) -> dict[str, Any]:
        return {**super().condition_identity(), "system_prompt": SYSTEM_PROMPT}

    @torch.no_grad()
    def prepare_conditions(self, text: TextComponents, captions: list[str]) -> Conditions:
        """Every Qwen layer's hidden states after the embedding, each normalised over its features and concatenated,
        as Cosmos2_5_PredictBasePipeline.encode_prompt computes them."""
        tokenizer, text_encoder = text["tokenizer"], text["text_encoder"]
        ids = []
        for caption in captions:
            chat = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]},
                    {"role": "user", "content": [{"type": "text", "text": caption}]}]
            tokens = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=False,
                                                   add_vision_id=False, max_length=self.max_sequence_length,
                                                   truncation=True, padding="max_length")
            tokens = tokens["input_ids"] if not isinstance(tokens, list) and "input_ids" in tokens else tokens
            # One conversation's ids; some tokenizer loads answer it as a batch of one.
            ids.append(torch.as_tensor(tokens, dtype=torch.long).reshape(-1))
        hidden = text_encoder(torch.stack(ids).to(text_encoder.device), output_hidden_states=True).hidden_states
        layers = [(state - state.mean(dim=-1, keepdim=True)) / (state.std(dim=-1, keepdim=True) + 1e-8)
                  for state in hidden[1:]]
        return {"prompt_embeds": torch.cat(layers, dim=-1)}

    # ----- latents --------------------------------------------------------------------------------------
    def latent_identity(self) -> dict[str, Any]:
        return {**super().latent_identity(), "condition_latents": MAX_CONDITION_FRAMES}

    @torch.no_grad()
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        """The posterior normalised as the pipeline denormalises before decoding, and the clip's first latent frames
        (the posterior mode): what the pipeline encodes from a video's or image's conditioning frames (the VAE is
        causal, so the first latent frames are those frames' alone)."""
        channels = vae.config.z_dim
        std = torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1)
        posterior = self.vae_posterior(vae, videos)
        latents = self.normalised_posterior(posterior, (1.0 / std).to(posterior.mean), mean.to(posterior.mean))
        latents[CONDITION_LATENTS] = latents["latents_mean"][:, :, :MAX_CONDITION_FRAMES].clone()
        return latents

    # ----- conditioning frames and the denoiser's call ------------------------------------------------------
    def visit_conditions(self, x0: torch.Tensor, positions: torch.Tensor, seed: int) -> Conditions:
        """How many first latent frames each sample is given clean this visit (`model.first_frame_conditioning`:
        the share given 1 or 2)."""
        if self.first_frame_probability <= 0:
            return {}
        return {CONDITION_FRAMES: condition_draw(self.first_frame_probability, x0, positions, seed)}

    def condition_frames(self, conditions: Conditions, latents: torch.Tensor) -> torch.Tensor:
        """[B] float: the conditioning latent frames of each sample (none without a draw, e.g. at validation)."""
        if CONDITION_FRAMES not in conditions:
            return torch.zeros(latents.shape[0], device=latents.device)
        return conditions[CONDITION_FRAMES].float().flatten().to(latents.device)

    @staticmethod
    def frame_mask(counts: torch.Tensor, frames: int) -> torch.Tensor:
        """[B, 1, F, 1, 1] float: 1 on each sample's first `counts` latent frames (the pipeline's cond_indicator)."""
        return (torch.arange(frames, device=counts.device)[None, :] < counts[:, None]).float().view(
            counts.shape[0], 1, frames, 1, 1)

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        """The pipeline's transformer call: given frames replaced by the clip's clean latents, the condition mask
        beside the latents, timestep sigma per latent frame (1e-4 on given frames), a zero padding mask."""
        batch, _, frames, height, width = noisy_latents.shape
        dtype, device = noisy_latents.dtype, noisy_latents.device
        indicator = self.frame_mask(self.condition_frames(conditions, noisy_latents), frames)
        hidden_states = noisy_latents
        if CONDITION_LATENTS in conditions:  # blended whether or not a frame is given: no branch on tensor values
            clean = conditions[CONDITION_LATENTS].to(device=device, dtype=dtype)
            clean = torch.cat([clean, clean.new_zeros(batch, clean.shape[1], frames - clean.shape[2], height, width)],
                              dim=2) if clean.shape[2] < frames else clean[:, :, :frames]
            hidden_states = indicator.to(dtype) * clean + (1.0 - indicator.to(dtype)) * noisy_latents
        sigmas = timesteps.to(device=device, dtype=torch.float32) / NUM_TRAIN_TIMESTEPS
        sigmas = sigmas.view(batch, 1, -1, 1, 1).expand(batch, 1, frames, 1, 1)
        timestep = indicator * CONDITIONAL_FRAME_TIMESTEP + (1.0 - indicator) * sigmas
        return denoiser(
            hidden_states=hidden_states,
            condition_mask=indicator.expand(batch, 1, frames, height, width).to(dtype),
            timestep=timestep,
            encoder_hidden_states=conditions["prompt_embeds"].to(dtype),
            padding_mask=noisy_latents.new_zeros(1, 1, height, width),
            return_dict=False,
        )[0]

    def input_channels(self, denoiser: nn.Module) -> int:
        """The patch embedding's channels: the latents, the condition mask (`in_channels` counts both) and the
        padding mask the transformer adds."""
        return int(denoiser.config.in_channels) + int(bool(denoiser.config.concat_padding_mask))

    def per_clip_error(self, error: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        """Each clip's mean squared error over the frames it predicts: given frames stay out (the pipeline replaces
        the prediction there)."""
        predicted = 1.0 - self.frame_mask(self.condition_frames(conditions, error), error.shape[2])
        per_frame = error.mean(dim=(1, 3, 4))
        weights = predicted.view(error.shape[0], error.shape[2]).to(per_frame)
        return (per_frame * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)

    # ----- ComfyUI ------------------------------------------------------------------------------------
    def comfyui_absent(self) -> str:
        return ("ComfyUI's core has a Cosmos Predict 2 model (comfy/ldm/cosmos/predict2.py) but, in the version read "
                "for vidtune, not the text projection (`crossattn_proj`) Cosmos Predict 2.5 adds, so there is no "
                "ComfyUI layout to write its file for. The run's diffusers adapter file loads with "
                "Cosmos2_5_PredictBasePipeline's load_lora_weights, and with `vidtune sample`.")

    # ----- pipeline and outputs ----------------------------------------------------------------------
    def safety_checker(self) -> Any:
        """NVIDIA's guardrail, which the pipeline runs on every prompt and sample (its license asks for it):
        `cosmos_guardrail`'s CosmosSafetyChecker. A tiny test model (random weights) gets a stand-in."""
        if self.is_tiny_model():
            return UncheckedTinySamples()
        self.check_guardrail()
        from cosmos_guardrail import CosmosSafetyChecker

        return CosmosSafetyChecker()

    def is_tiny_model(self) -> bool:
        pretrained = self.config.pretrained
        return bool(pretrained) and (Path(pretrained) / TINY_MARKER).is_file()

    @staticmethod
    def check_guardrail(key: str = "") -> None:
        """A ModelError (a ConfigError naming `key`, before a run) when `cosmos_guardrail` is not installed."""
        if importlib.util.find_spec("cosmos_guardrail") is not None:
            return
        message = (
            "Cosmos Predict 2.5 samples (validation, `vidtune sample`) go through NVIDIA's guardrail, which "
            "Cosmos2_5_PredictBasePipeline runs on every prompt and video; the `cosmos_guardrail` package is not "
            "installed.\nWhat to do: pip install cosmos_guardrail (vidtune's `cosmos` extra; it downloads "
            "nvidia/Cosmos-Guardrail1 on first use), or set validation.enabled: false to train without samples."
        )
        raise ConfigError(f"{key}: {message}") if key else ModelError(message)

    def check_training(self, config: Config) -> None:
        """A run that samples (validation) needs the guardrail: refused before anything loads, not at its end."""
        super().check_training(config)
        if config.validation.enabled and not self.is_tiny_model():
            self.check_guardrail("validation.enabled")

    def pipeline(self, text: TextComponents, vae: nn.Module, denoiser: nn.Module) -> Any:
        return self.pipeline_class(tokenizer=text["tokenizer"], text_encoder=text["text_encoder"], vae=vae,
                                   transformer=denoiser, scheduler=self.load_scheduler(),
                                   safety_checker=self.safety_checker())


class CosmosPredict25VideoToWorldSpec(CosmosPredict25Spec):
    """Cosmos Predict 2.5 from a video: every sample is given its first 1 or 2 latent frames (evenly, as the makers'
    conditioned samples), and samples continue the `reference` clip's first five frames (two latent frames, the
    pipeline's video-to-world default; validation gives the first dataset clip)."""

    name = "cosmos-predict-2.5-v2w"
    image_to_video = True
    first_frame_conditioning = None  # always conditioned: no share to choose

    def visit_conditions(self, x0: torch.Tensor, positions: torch.Tensor, seed: int) -> Conditions:
        return {CONDITION_FRAMES: condition_draw(1.0, x0, positions, seed)}

    def condition_frames(self, conditions: Conditions, latents: torch.Tensor) -> torch.Tensor:
        """Without a draw (held-out score), the pipeline's video-to-world: two latent frames (never a whole clip)."""
        if CONDITION_FRAMES in conditions:
            return super().condition_frames(conditions, latents)
        count = float(min(MAX_CONDITION_FRAMES, max(latents.shape[2] - 1, 0)))
        return torch.full((latents.shape[0],), count, device=latents.device)

    def reference_frame_count(self, frames: int) -> int:
        _, temporal, _ = self.compression
        return min(frames, temporal * (MAX_CONDITION_FRAMES - 1) + 1)

    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        """The reference clip's first five frames as the pipeline's `video` ([1, 3, F, H, W] in [-1, 1], which it
        takes as already preprocessed), two conditioning latent frames (one from a one-frame reference)."""
        clip = self.given_reference(reference)
        _, temporal, _ = self.compression
        count = 2 if clip.shape[0] >= temporal + 1 else 1
        video = clip[: temporal * (count - 1) + 1].permute(1, 0, 2, 3).unsqueeze(0)
        return {"video": video, "num_latent_conditional_frames": count}
