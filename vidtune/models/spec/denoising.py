"""Denoising and its loss: the denoiser's call on noisy latents, each clip's error, the objective its scheduler
implies, the conditions drawn per visit (first-frame conditioning), the noise of other streams, and how control
latents reach the denoiser's input."""

from __future__ import annotations

import functools
from abc import abstractmethod
from typing import ClassVar

import torch
from torch import nn

from vidtune.config import TrainingConfig
from vidtune.errors import ConfigError
from vidtune.models import first_frame
from vidtune.models.spec.base import FRAME_RATE, LOSS_MASK, LOSS_MASK_BY_FRAME, Conditions, Latents
from vidtune.models.spec.loading import Loading
from vidtune.objectives import Objective, objective_from_scheduler


class Denoising(Loading):
    """The denoiser's call and the training error. It extends Loading: it reads the denoiser's config and the
    scheduler."""

    # Control training (`training.algorithm: control-*`, see vidtune/control.py): the denoiser's input projection,
    # widened to take the control latents; None with `control_refusal` saying why the family cannot.
    control_input_layer: ClassVar[str | None] = None
    control_refusal: ClassVar[str] = "its spec names no input projection to widen."
    # The input projection is a Linear over patches read with the channels innermost (Kandinsky 5: position after
    # position, each one's channels together), not outermost: the control's channels then arrive among each
    # position's, and the widened layer's inputs are put back in its order (base inputs, then the control's).
    control_channels_innermost: ClassVar[bool] = False
    # In-context training (`training.algorithm: in-context-lora`): the family's pipeline that samples with reference
    # clips whose tokens join the sequence (LTX2InContextPipeline); None: the family cannot train in context.
    in_context_pipeline_class: ClassVar[type | None] = None
    # Input channels the denoiser appends to `hidden_states` itself, inside its forward (Cosmos: its condition mask and
    # padding mask), so they reach a channels-outermost input Linear after the control's channels: the widened
    # layer's inputs are then put back in its order (base inputs, then the control's).
    control_channels_before_own: ClassVar[int] = 0
    # The denoiser's transformer blocks, in forward order: the attribute names of its block lists
    # (`memory.blocks_to_swap` swaps the last N of them; see vidtune/offload.py).
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    # The denoiser takes a timestep per latent frame ([B, F]; diffusion forcing), so `training.frame_noise` may draw
    # a noise level per frame. `forward` then receives [B, F] timesteps, or [B] ones (held-out score, distillation's
    # synchronous paths) to give every frame.
    frame_timesteps: ClassVar[bool] = False

    @abstractmethod
    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor: ...

    def training_error(self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor,
                       timesteps: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Each clip's error [B] for the loss: `forward`, then `per_clip_error` against the video target. A family
        whose denoiser also predicts other streams (LTX-2's audio) adds their errors here, so trainers stay unaware."""
        prediction = self.forward(denoiser, conditions, noisy_latents, timesteps)
        return self.clip_error((prediction.float() - target).pow(2), conditions)

    def clip_error(self, squared_error: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        """Each clip's error [B] of the video: `per_clip_error`, or with a loss mask (`LOSS_MASK`, on the latent
        grid: `training.masked_loss`) its weighted mean, sum(mask x error) / sum(mask) over what `per_clip_error`
        counts, so an all-white mask gives the plain error bit for bit and black elements give no gradient. With
        `LOSS_MASK_BY_FRAME` the weighted error's mean over the whole frame instead (a small mask then weighs less)."""
        mask = conditions.get(LOSS_MASK)
        if mask is None:
            return self.per_clip_error(squared_error, conditions)
        weights = mask.to(squared_error).expand_as(squared_error)
        if LOSS_MASK_BY_FRAME in conditions:
            return self.per_clip_error(squared_error * weights, conditions)
        # The mask's mean over the counted elements, by the family's own rule (a first frame left out stays out).
        area = self.per_clip_error(weights, conditions).clamp_min(torch.finfo(squared_error.dtype).tiny)
        return self.per_clip_error(squared_error * (weights / area.view(-1, *([1] * (weights.ndim - 1)))), conditions)

    def per_clip_error(self, error: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        """Each clip's mean of the squared error [B, C, F, H, W] (a family leaves out what its pipeline does not
        predict, e.g. a first frame given as a condition)."""
        return error.flatten(1).mean(dim=1)

    def objective(self, training: TrainingConfig) -> Objective:
        """The training objective implied by the family's scheduler (override only to add to it)."""
        return objective_from_scheduler(
            self.load_scheduler(),
            sampling=training.sigma_sampling,
            logit_mean=training.logit_mean,
            logit_std=training.logit_std,
            shift=training.sigma_shift,
            source=self.describe_file("scheduler", "scheduler_config.json"),
            stretch=training.sigma_stretch,
            uniform_fraction=training.sigma_uniform_fraction,
            weighting=training.loss_weighting,
            frame_noise=self.checked_frame_noise(training),
        )

    def checked_frame_noise(self, training: TrainingConfig) -> str:
        """`training.frame_noise`, refused unless the denoiser is told a timestep per latent frame."""
        if training.frame_noise != "shared" and not self.frame_timesteps:
            raise ConfigError(
                f"training.frame_noise={training.frame_noise}: {self.name}'s denoiser is told one timestep per clip, "
                "so every latent frame of a clip shares its noise level.\nWhat to do: remove training.frame_noise "
                "(or set it to shared); per-frame noise levels train a diffusion-forcing model (skyreels-v2-df)."
            )
        return training.frame_noise

    # ----- token counts, frame rates, per-visit conditions and other streams ----------------------------------
    @functools.cached_property
    def patch_sizes(self) -> tuple[int, int, int]:
        """(temporal, height, width) patch of the denoiser, from its config: `patch_size` and `patch_size_t`, or a
        (t, h, w) `patch_size` (Wan)."""
        config = self.load_config(self.denoiser_class, "transformer")
        patch = config.get("patch_size") or 1
        if isinstance(patch, list | tuple):
            return int(patch[0]), int(patch[1]), int(patch[2])
        return int(config.get("patch_size_t") or 1), int(patch), int(patch)

    def token_count(self, latent_shape: tuple[int, ...] | torch.Size) -> int:
        """The denoiser's video tokens for one clip's latents of `latent_shape` ([C, F, H, W]): what noise levels
        drawn by token count (`token_shifted_logit_normal`) depend on."""
        patch_t, patch_h, patch_w = self.patch_sizes
        frames, height, width = (int(size) for size in latent_shape[-3:])
        return -(-frames // patch_t) * (height // patch_h) * (width // patch_w)

    def frame_rates(self, conditions: Conditions, batch: int) -> torch.Tensor:
        """[B] float64: each sample's frame rate (`FRAME_RATE` beside its latents; `frame_rate` without it, as in
        sampling-time checks that pass tensors directly)."""
        if FRAME_RATE in conditions:
            return conditions[FRAME_RATE].detach().double().flatten().cpu()
        return torch.full((batch,), float(self.frame_rate), dtype=torch.float64)

    @property
    def first_frame_probability(self) -> float:
        """`model.first_frame_conditioning`, else the family's default (0 for a family without it)."""
        chosen = self.config.first_frame_conditioning
        return float(self.first_frame_conditioning or 0.0) if chosen is None else float(chosen)

    def visit_conditions(self, x0: torch.Tensor, positions: torch.Tensor, seed: int) -> Conditions:
        """Conditions drawn per visit from the clean latents `x0` [B, C, F, H, W] (the trainer adds them to the
        batch's): by default, first-frame conditioning when the family takes it and its probability is above 0."""
        if self.first_frame_conditioning is None or self.first_frame_probability <= 0:
            return {}
        return first_frame.draw(self.first_frame_probability, x0, positions, seed)

    def stream_noise(self, objective: Objective, latents: Latents,
                     generators: list[torch.Generator]) -> tuple[Conditions, dict[str, torch.Tensor]]:
        """The noise of the streams a family's denoiser takes beside the video (LTX-2's audio), drawn for each clip
        of a micro-batch from its visit's generator after the video's draws: (what `forward` reads from the
        conditions, each stream's noise levels by metrics name). By default none."""
        return {}, {}

    # ----- control ------------------------------------------------------------------------------------------
    def input_channels(self, denoiser: nn.Module) -> int:
        """Channels of the denoiser's `hidden_states` (latents and any condition channels), which the control
        input layer reads."""
        return int(denoiser.config.in_channels)

    def control_channels(self, denoiser: nn.Module) -> int:
        """Channels of a control latent: the VAE's latent channels, which the denoiser predicts."""
        config = denoiser.config
        return int(config.out_channels or config.in_channels)

    def pack_control(self, control: torch.Tensor, denoiser: nn.Module,
                     hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A control latent [B, C, F, H, W] in the layout of the denoiser's `hidden_states` (`hidden`: with the
        tokens a call adds beside the clip's, e.g. a keyframe's, which take a zero control), and the dimension its
        channels are on (the control is concatenated last there). By default the VAE's layout, channels 1."""
        return control, 1

    def in_context_conditions(self, conditions: Conditions, reference: torch.Tensor, with_audio: bool) -> Conditions:
        """The conditions with each sample's reference latents [B, C, F, H', W'] (its control clip's, H' and W' the
        clip's over `control.reference_downscale_factor`) for `forward` to place beside the noisy tokens, clean and
        out of the loss; `with_audio` False: every sample trains its video alone (a family with sound)."""
        raise ConfigError(f"training.algorithm: {self.name} cannot train in context (it has no pipeline that samples "
                          "with reference tokens).\nWhat to do: use control-lora, or an LTX-2 model.")
