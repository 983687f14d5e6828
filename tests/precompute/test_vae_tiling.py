"""memory.vae_tiling: every family's VAE encodes and decodes in tiles, and one clip at a time.

With the VAEs' default tiles (hundreds of pixels) the tiny clips fit one tile, and tiling changes nothing. With
small tiles (32 x 32 pixels, overlapping by half) a 64 x 64 clip really is cut into tiles: the result has the same
shape and is finite, but differs, and on these random-weight VAEs by a lot (each tile normalises with its own group
statistics; docs/memory.md gives the numbers), so closeness is not asserted here: it holds only for trained VAEs.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from vidtune.config import ModelConfig
from vidtune.models.registry import SPECS, get_spec_class
from vidtune.models.tiny import TINY_SHAPES
from vidtune.precompute import build_plan
from vidtune.precompute.encode import build_spec, load_clips

SMALL_TILES = {"tile_sample_min_height": 32, "tile_sample_min_width": 32, "tile_sample_stride_height": 16,
               "tile_sample_stride_width": 16, "tile_overlap_factor_height": 0.5, "tile_overlap_factor_width": 0.5}


def _smooth_clip(frames: int, height: int, width: int) -> torch.Tensor:
    """[1, F, 3, H, W] in [-1, 1]: moving gradients, more like footage than noise is."""
    t = torch.arange(frames).view(frames, 1, 1, 1)
    y = torch.linspace(0, math.pi, height).view(1, 1, height, 1)
    x = torch.linspace(0, math.pi, width).view(1, 1, 1, width)
    channel = torch.arange(3).view(1, 3, 1, 1)
    return (torch.sin(x * (1 + channel) + 0.3 * t) * torch.cos(y - 0.2 * t)).unsqueeze(0)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("family", sorted(SPECS))
def test_vae_tiling_is_on_and_tiles(tiny_model_dir, family):
    config = ModelConfig(name=family, pretrained=str(tiny_model_dir(family)))
    spec = get_spec_class(family)(config, vae_tiling=True)
    container = spec.load_vae(torch.device("cpu"))
    vae = getattr(container, "vae", container)  # image-to-video families hold the VAE in a container
    assert vae.use_tiling and vae.use_slicing
    frames = TINY_SHAPES[family][0]

    # VAEs that count tiles in latents too (HunyuanVideo 1.5's) get the same small tiles in their units.
    ratio = getattr(vae.config, "spatial_compression_ratio", None) or 8
    small_tiles = {**SMALL_TILES, "tile_latent_min_height": 32 // ratio, "tile_latent_min_width": 32 // ratio,
                   "tile_overlap_factor": 0.5}
    # VAEs conditioned on the decode timestep (LTX-Video 0.9.5+) decode clean latents at timestep 0.
    decode_inputs = {"temb": torch.zeros(1)} if getattr(vae.config, "timestep_conditioning", False) else {}

    def encode(clip: torch.Tensor, tiles: dict | None) -> dict[str, torch.Tensor]:
        if tiles is None:
            vae.disable_tiling()
        else:
            accepted = inspect.signature(vae.enable_tiling).parameters
            vae.enable_tiling(**{k: v for k, v in tiles.items() if k in accepted})
        torch.manual_seed(0)  # image-to-video families draw their first frame's noise
        with torch.no_grad():
            return spec.prepare_latents(container, clip)

    # A clip within one default tile: exactly the untiled latents.
    small = _smooth_clip(frames, *TINY_SHAPES[family][1:])
    default, untiled = encode(small, {}), encode(small, None)
    assert all(torch.equal(default[key], untiled[key]) for key in untiled)

    # A clip of four overlapping small tiles: encoded and decoded in tiles.
    clip = _smooth_clip(frames, 64, 64)
    tiled, untiled = encode(clip, small_tiles), encode(clip, None)
    latents = untiled["latents_mean"]
    with torch.no_grad():
        decoded = vae.decode(latents, return_dict=False, **decode_inputs)[0]
        accepted = inspect.signature(vae.enable_tiling).parameters
        vae.enable_tiling(**{k: v for k, v in small_tiles.items() if k in accepted})
        decoded_tiled = vae.decode(latents, return_dict=False, **decode_inputs)[0]
    for key in untiled:
        assert tiled[key].shape == untiled[key].shape and torch.isfinite(tiled[key]).all()
    assert decoded_tiled.shape == decoded.shape and torch.isfinite(decoded_tiled).all()
    encode_difference = _relative(tiled["latents_mean"], latents)
    decode_difference = _relative(decoded_tiled, decoded)
    print(f"{family}: relative difference, encode {encode_difference:.2f}, decode {decode_difference:.2f}")
    assert encode_difference > 0 and decode_difference > 0, "the clip was not tiled"


def test_the_cache_keys_latents_by_vae_tiling(make_config):
    """Tiled latents differ: they get their own keys; the captions' keys stay."""
    def plan_for(config):
        spec = build_spec(config)
        return build_plan(config, spec, load_clips(config, spec, progress=False))

    plain = plan_for(make_config(precompute={"enabled": True}))
    tiled = plan_for(make_config(precompute={"enabled": True}, memory={"vae_tiling": True}))
    assert not set(plain.latent_keys) & set(tiled.latent_keys)
    assert plain.condition_keys == tiled.condition_keys
