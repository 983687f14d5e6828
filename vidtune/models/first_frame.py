"""First-frame conditioning of the LTX families in training: a sample given its first latent frame clean.

Image-to-video sampling hands the denoiser the first frame's latent clean, with timestep 0 on its tokens. Lightricks'
trainers teach that with a share of the training samples (`first_frame_conditioning_p` / a `first_frame` condition's
`probability`): the sample's own first latent frame replaces its noisy one, its tokens get timestep 0, and they stay
out of the loss. The draw is per sample, from a generator of the visit's stream position, so a resumed or re-batched
run draws the same samples (the first of the conditioning modes, vidtune/models/conditioning.py, which share the
draw); the LTX VAEs are causal in time, so the clip's first latent frame is what encoding the
first frame alone gives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vidtune.models.conditioning import uniform_draws

if TYPE_CHECKING:
    from vidtune.models.spec import Conditions

# Keys of the conditions `draw` adds: which samples are given their first frame ([B] float, 1.0: given) and the clean
# first latent frames [B, C, 1, H, W].
GIVEN = "first_frame_given"
LATENTS = "first_frame_latents"


def draw(probability: float, x0: torch.Tensor, positions: torch.Tensor, seed: int) -> Conditions:
    """Which samples of a batch (clean latents `x0` [B, C, F, H, W], their stream `positions`) are given their first
    latent frame: each with `probability`, never a one-latent-frame clip (nothing after it to predict)."""
    given = torch.tensor([u < probability for u in uniform_draws(positions, seed)], dtype=torch.float32)
    if x0.shape[2] < 2:
        given.zero_()
    return {GIVEN: given.to(x0.device), LATENTS: x0[:, :, :1]}


def given_mask(conditions: Conditions, batch: int, device: torch.device) -> torch.Tensor:
    """[B] float: 1.0 where a sample is given its first frame (none without a draw, e.g. at validation)."""
    if GIVEN not in conditions:
        return torch.zeros(batch, device=device)
    return conditions[GIVEN].float().flatten().to(device)


def give(noisy_latents: torch.Tensor, conditions: Conditions) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents with the clean first frame where given, [B] given mask)."""
    given = given_mask(conditions, noisy_latents.shape[0], noisy_latents.device)
    if not bool(given.any()):
        return noisy_latents, given
    mask = given.view(-1, 1, 1, 1, 1).to(noisy_latents.dtype)
    first = conditions[LATENTS].to(noisy_latents)
    first = mask * first + (1.0 - mask) * noisy_latents[:, :, :1]
    return torch.cat([first, noisy_latents[:, :, 1:]], dim=2), given


def token_timesteps(timesteps: torch.Tensor, given: torch.Tensor, tokens_per_frame: int, tokens: int) -> torch.Tensor:
    """[B, tokens] timesteps (tokens run frame by frame): 0 on the first frame's tokens of the samples given it."""
    per_token = timesteps.to(given.device).float()[:, None].expand(-1, tokens).clone()
    per_token[:, :tokens_per_frame] *= (1.0 - given)[:, None]
    return per_token.to(timesteps.dtype)


def per_clip_error(squared_error: torch.Tensor, conditions: Conditions) -> torch.Tensor:
    """Each clip's mean squared error [B] over what it predicts: without the first latent frame where it is given."""
    given = given_mask(conditions, squared_error.shape[0], squared_error.device)
    whole = squared_error.flatten(1).mean(dim=1)
    if not bool(given.any()):
        return whole
    rest = squared_error[:, :, 1:].flatten(1).mean(dim=1)
    return torch.where(given > 0, rest, whole)
