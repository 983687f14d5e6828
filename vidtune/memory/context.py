"""The planner's account of context parallelism (`parallel.context`, vidtune/parallel/context.py).

Each rank of a data group holds 1 / degree of a sample's tokens through the blocks, so the traced step's
activations divide by the degree. What does not divide is added:
- the gathered output: the prediction is whole on every rank (`proj_out` is gathered), with the target and the
  error beside it, in fp32;
- the communication buffers of one attention layer at a time: Ulysses sends and receives the query, key, value and
  output of the local tokens (all heads) in its all-to-alls; ring gathers the keys and values of the whole sequence
  for this rank's heads (diffusers rotates them by one all-gather), and its backward passes the key / value
  gradients of a chunk round.
"""

from __future__ import annotations

import math
from typing import Any

from vidtune.config import Config

GATHERED = "gathered output (context)"
BUFFERS = "context communication buffers"


def split_activations(training: dict[str, int], config: Config, world_size: int, denoiser_config: Any,
                      latent_shape: tuple[int, ...], element_bytes: int) -> dict[str, int]:
    """Per-device bytes of `training` (the traced step's accounting) when each sample's tokens are split over
    `parallel.context`'s degree; as it is without context parallelism (or with fewer GPUs than the degree)."""
    context = config.parallel.context
    degree = context.degree
    if degree <= 1 or world_size < degree:
        return training
    batch = config.training.batch_size
    tokens = token_count(denoiser_config, latent_shape)
    hidden = int(denoiser_config.get("num_attention_heads") or 1) * int(denoiser_config.get("attention_head_dim") or 1)
    local = batch * math.ceil(tokens / degree) * hidden * element_bytes  # one [B, S / degree, hidden] tensor
    ulysses = 2 * 4 * local if context.ulysses > 1 else 0  # q, k, v, out: sent and received
    ring = (2 * local * context.ring + 2 * 2 * local) if context.ring > 1 else 0  # whole K, V; K, V gradients
    split = dict(training)
    split["activations"] = math.ceil(training["activations"] / degree)
    split[GATHERED] = 3 * batch * math.prod(latent_shape[1:]) * 4
    split[BUFFERS] = ulysses + ring
    return split


def token_count(denoiser_config: Any, latent_shape: tuple[int, ...]) -> int:
    """The denoiser's video tokens for latents of `latent_shape` ([B, C, F, H, W]), from its patch sizes."""
    patch = denoiser_config.get("patch_size") or 1
    if isinstance(patch, list | tuple):
        patch_t, patch_h, patch_w = (int(p) for p in patch)
    else:
        patch_t, patch_h, patch_w = int(denoiser_config.get("patch_size_t") or 1), int(patch), int(patch)
    frames, height, width = (int(size) for size in latent_shape[-3:])
    return -(-frames // patch_t) * (height // patch_h) * (width // patch_w)


def context_choices(config: Config, world_size: int, heads: int) -> list[list[str]]:
    """The context degrees `world_size` GPUs allow (divisors > 1, smallest first), as overrides: Ulysses where it
    divides the attention heads (one all-to-all pair per layer), else ring."""
    choices = []
    for degree in range(2, world_size + 1):
        if world_size % degree:
            continue
        split = "ulysses" if heads % degree == 0 else "ring"
        choices.append([f"parallel.context.{split}={degree}"])
    return choices
