"""What the families that train sound with the picture share (LTX-2, MiniMax H3): the keys their `prepare_latents`
and `stream_noise` put beside the video latents, which clips have sound, and each clip's audio noise level and noise,
drawn apart from the video's from the clip's own generator."""

from __future__ import annotations

import torch

from vidtune.objectives import Objective

# `prepare_latents`'s key of the clip's audio latents, normalised as the family's pipeline normalises them.
AUDIO_LATENTS = "audio_latents"
# `prepare_latents`'s key of which clips have sound [B, 1] (1.0, else 0.0: the clip trains video only).
AUDIO_PRESENT = "audio_present"
# `stream_noise`'s keys: each clip's audio sigma [B] and audio noise (the audio latents' shape), drawn apart from the
# video's.
AUDIO_SIGMAS = "audio_sigmas"
AUDIO_NOISE = "audio_noise"


def heard(conditions: dict[str, torch.Tensor], batch: int) -> torch.Tensor:
    """[B] bool: which clips have sound (all of them where the conditions do not say: the pipeline's case)."""
    if AUDIO_PRESENT not in conditions:
        return torch.ones(batch, dtype=torch.bool)
    return conditions[AUDIO_PRESENT].flatten().float() > 0.5  # bool, or 0.0 / 1.0 in caches written before


def draw_audio_noise(objective: Objective, latents: dict[str, torch.Tensor], generators: list[torch.Generator],
                     tokens: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each clip's audio sigma, drawn from `objective`'s distribution with the audio's own token count, and its audio
    noise, both from the clip's generator after the video's draws: (the conditions `forward` reads, the sigmas by
    metrics name, NaN for a clip without sound)."""
    clean_audio = latents[AUDIO_LATENTS]
    sigmas, noise = [], []
    for generator in generators:
        sigmas.append(objective.sample_noise_levels(1, generator, tokens))
        noise.append(torch.randn(clean_audio.shape[1:], generator=generator))
    sigmas = torch.cat(sigmas)
    present = heard(latents, len(generators)).cpu()
    return ({AUDIO_SIGMAS: sigmas, AUDIO_NOISE: torch.stack(noise).to(clean_audio.device)},
            {AUDIO_SIGMAS: torch.where(present, sigmas, torch.full_like(sigmas, float("nan")))})


def keyed_noise(timesteps: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Noise for each clip's audio latents where no `stream_noise` drew it (held-out scores, distillation), from a
    generator keyed by the clip's timestep: the trainer draws that timestep from the clip's own visit generator, so a
    resumed or re-batched run draws the same noise."""
    noise = []
    for timestep in timesteps.detach().double().cpu().tolist():
        generator = torch.Generator().manual_seed(int(timestep * 1_000_000) % 2**63)
        noise.append(torch.randn(like.shape[1:], generator=generator))
    return torch.stack(noise).to(like)
