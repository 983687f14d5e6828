"""`memory.vae_tiling`: the VAE encodes and decodes in overlapping tiles, and one clip of a batch at a time.

Every family's VAE has diffusers' tiling and slicing (`enable_tiling`, `enable_slicing`): LTX-Video, CogVideoX,
HunyuanVideo, Mochi and Wan. Tiles are blended where they overlap, so tiled latents and frames differ slightly from
untiled ones (docs/memory.md gives the measured differences); the precompute cache therefore keys latents by the
setting. The tile sizes are the VAE's defaults (e.g. 512 x 512 pixels for LTX-Video), so clips smaller than one
tile are encoded exactly as without tiling.
"""

from __future__ import annotations

from typing import Any

from vidtune.errors import ConfigError


def enable_vae_tiling(vae: Any) -> None:
    """Tiling and slicing on `vae` (a diffusers video autoencoder)."""
    if not (hasattr(vae, "enable_tiling") and hasattr(vae, "enable_slicing")):
        raise ConfigError(
            f"memory.vae_tiling: the VAE {type(vae).__name__} has no tiled encoding.\n"
            "What to do: set memory.vae_tiling=false."
        )
    vae.enable_tiling()
    vae.enable_slicing()
