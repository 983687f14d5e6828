"""memory.vae_tiling: every family's VAE encodes and decodes in tiles, and one clip at a time.

With the VAEs' default tiles (hundreds of pixels) the tiny clips fit one tile, and tiling changes nothing. With
small tiles (32 x 32 pixels, overlapping by half) a 64 x 64 clip really is cut into tiles: the result has the same
shape and is finite, but differs, and on these random-weight VAEs by a lot (each tile normalises with its own group
statistics, and their receptive fields reach past the overlap; docs/memory.md gives the numbers). What tiling itself
must get right (where tiles are cut, how their overlaps are blended and cropped) is checked exactly on VAEs made local,
whose every output depends only on its own patch.
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
               "tile_sample_stride_width": 16, "tile_overlap_factor_height": 0.5, "tile_overlap_factor_width": 0.5,
               # VAEs that take a minimum overlap (MiniMax H3's): half a tile too. Their default (64 pixels) is more
               # than a 32-pixel tile, and no count of such tiles covers a frame.
               "tile_sample_min_overlap_height": 16, "tile_sample_min_overlap_width": 16}


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


def _local(vae: torch.nn.Module) -> torch.nn.Module:
    """`vae` made local: each convolution keeps only its spatial centre tap (a strided one samples one pixel), and
    Wan's middle attention adds nothing (its output projection zeroed). Every latent then depends only on the
    pixels of its own patch, and every decoded pixel only on its own latent."""
    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)):
                height, width = module.weight.shape[-2:]
                centre = torch.zeros_like(module.weight)
                centre[..., height // 2, width // 2] = 1
                module.weight.mul_(centre)
            if type(module).__name__ == "WanAttentionBlock":
                module.proj.weight.zero_()
                module.proj.bias.zero_()
    return vae


# VAEs whose norms act per pixel (RMS over channels: LTX-Video, LTX-2, Wan 2.1 / 2.2). The others normalise over
# groups of channels and all pixels of a tile (GroupNorm), which no overlap makes equal to the whole clip's.
PER_PIXEL_NORM = ["ltx-video", "ltx-video-i2v", "ltx-2", "wan", "wan2.2"]


@pytest.mark.parametrize("family", PER_PIXEL_NORM)
def test_tiles_join_into_the_untiled_result_where_the_vae_is_local(tiny_model_dir, family):
    """What tiling itself does, apart from what a VAE sees across a tile's edge: with a VAE made local (`_local`),
    each tile computes exactly the untiled values of the latents and pixels it holds, so a tiled encode (through the
    spec, as precompute runs it) and decode must equal the untiled ones wherever the tiles are cut, blended and
    cropped right. A tile misplaced or cropped off by one latent, or overlap weights that do not sum to one, fail it
    (and the unchanged random VAEs fail it: their receptive fields reach past the overlap).
    Tolerance: the blend's weighted sum of two equal values rounds in float32; measured at most 3.4e-7 relative."""
    config = ModelConfig(name=family, pretrained=str(tiny_model_dir(family)))
    spec = get_spec_class(family)(config, vae_tiling=True)
    container = spec.load_vae(torch.device("cpu"))
    vae = _local(getattr(container, "vae", container))
    ratio = getattr(vae.config, "spatial_compression_ratio", None) or 8
    small_tiles = {**SMALL_TILES, "tile_latent_min_height": 32 // ratio, "tile_latent_min_width": 32 // ratio}
    accepted = inspect.signature(vae.enable_tiling).parameters
    decode_inputs = {"temb": torch.zeros(1)} if getattr(vae.config, "timestep_conditioning", False) else {}

    def tiling(on: bool) -> None:
        if on:
            vae.enable_tiling(**{k: v for k, v in small_tiles.items() if k in accepted})
        else:
            vae.disable_tiling()

    def encode(tiled: bool) -> dict[str, torch.Tensor]:
        tiling(tiled)
        torch.manual_seed(0)  # image-to-video families draw their first frame's noise
        with torch.no_grad():
            return spec.prepare_latents(container, _smooth_clip(TINY_SHAPES[family][0], 64, 64))

    def decode(latents: torch.Tensor, tiled: bool) -> torch.Tensor:
        tiling(tiled)
        with torch.no_grad():
            return vae.decode(latents, return_dict=False, **decode_inputs)[0]

    untiled, tiled = encode(tiled=False), encode(tiled=True)
    for key in untiled:
        if untiled[key].is_floating_point() and untiled[key].norm() > 0:
            assert _relative(tiled[key], untiled[key]) < 1e-6, key
        else:
            assert torch.equal(tiled[key], untiled[key]), key
    decoded = decode(untiled["latents_mean"], tiled=False)
    assert decoded.norm() > 0 and _relative(decode(untiled["latents_mean"], tiled=True), decoded) < 2e-6
