"""In-context reference tokens for LTX-2's transformer, placed as diffusers' LTX2InContextPipeline places them.

The reference clip's latents are packed like the video's and appended after the video's tokens (and after nothing
else: training has no keyframe tokens). Their rotary positions are the transformer's own grid at the reference's
latent size (`rope.prepare_video_coords`, the same frame rate as the video), with the height and width coordinates
multiplied by the downscale factor, so a reference read at 1/N of the size covers the same picture area as the
video ("overlap", ltx-trainer's default reference layout). Their timestep is 0 (a reference of strength 1: clean);
attention between the video and the reference is full (the pipeline's `conditioning_attention_strength` 1). The
denoiser's prediction for them is dropped: they are never in the loss.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from vidtune.errors import ConfigError


def downscale_factor(target: tuple[int, int], reference: tuple[int, int]) -> int:
    """The whole factor between the video's latent (height, width) and the reference's, alike on both axes."""
    factor = target[0] // max(reference[0], 1)
    if factor < 1 or reference[0] * factor != target[0] or reference[1] * factor != target[1]:
        raise ConfigError(f"control.reference_downscale_factor: the reference's latent grid {reference[0]}x"
                          f"{reference[1]} is not the video's {target[0]}x{target[1]} over a whole factor.\nWhat to "
                          "do: choose a factor that divides data.height and data.width into multiples of the VAE's "
                          "spatial compression (times the patch size).")
    return factor


def reference_coords(denoiser: nn.Module, reference: torch.Tensor, factor: int, fps: Any) -> torch.Tensor:
    """[B, 3, reference tokens, 2] rotary coordinates of reference latents [B, C, F, H', W'] (see the module)."""
    config = denoiser.config
    batch, _, frames, height, width = reference.shape
    coords = denoiser.rope.prepare_video_coords(batch, frames // config.patch_size_t, height // config.patch_size,
                                                width // config.patch_size, reference.device, fps=fps)
    if factor != 1:
        coords[:, 1:] = coords[:, 1:] * factor
    return coords


def append_reference(denoiser: nn.Module, tokens: torch.Tensor, timesteps: torch.Tensor, reference: torch.Tensor,
                     shape: tuple[int, int, int], fps: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(the video's tokens with the reference's after them, per-token timesteps with 0 on the reference's, the
    denoiser's `video_coords` for the whole sequence). `shape`: the video's latent (frames, height, width);
    `timesteps`: [B] or per token [B, video tokens]; `fps`: as the denoiser is told it."""
    from diffusers import LTX2Pipeline

    config = denoiser.config
    patch, patch_t = config.patch_size, config.patch_size_t
    frames, height, width = shape
    factor = downscale_factor((height, width), tuple(reference.shape[-2:]))
    reference_tokens = LTX2Pipeline._pack_latents(reference, patch, patch_t)
    batch = tokens.shape[0]
    video_coords = denoiser.rope.prepare_video_coords(batch, frames // patch_t, height // patch, width // patch,
                                                      tokens.device, fps=fps)
    coords = torch.cat([video_coords, reference_coords(denoiser, reference, factor, fps).to(video_coords)], dim=2)
    if timesteps.ndim == 1:
        timesteps = timesteps[:, None].expand(-1, tokens.shape[1])
    clean = torch.zeros(batch, reference_tokens.shape[1], dtype=timesteps.dtype, device=timesteps.device)
    return (torch.cat([tokens, reference_tokens], dim=1), torch.cat([timesteps, clean], dim=1),
            {"video_coords": coords})


def pipeline_like(pipeline_class: type, pipeline: Any) -> Any:
    """A `pipeline_class` over `pipeline`'s components (those its constructor takes): the same modules, shared."""
    taken = inspect.signature(pipeline_class.__init__).parameters
    return pipeline_class(**{name: module for name, module in pipeline.components.items() if name in taken})
