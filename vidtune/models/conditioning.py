"""Conditioning modes in training: what part of a clip a sample is given clean, and what it learns.

Image-to-video sampling hands the denoiser some latents clean with timestep 0 on their tokens (a first frame, the
first frames of a clip to extend, the kept region of a clip to inpaint) or as extra tokens at a frame (a keyframe:
the last frame). Training teaches each mode with a share of the samples (`model.conditioning`): per sample one
uniform draw from a generator of the visit's stream position picks a mode or none, so a resumed or re-batched run
draws the same modes. The given latents replace the noisy ones (`give`), their tokens run at timestep 0
(`token_mask`), and they stay out of the loss (`per_clip_error`). First-frame conditioning
(vidtune/models/first_frame.py) is the first of these modes.

A region is [B, 1, F, H, W] on the latent grid: 1.0 where the latent is given clean, 0.0 where it is learnt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from vidtune.config import ConditioningConfig

ModeName = Literal["first_frame", "extension", "last_frame", "first_last", "inpaint"]
# In draw order: a sample's uniform draw u picks the first mode whose cumulative share exceeds u (first-frame first,
# so a run with first-frame conditioning alone draws exactly the samples it always drew).
MODES: tuple[ModeName, ...] = ("first_frame", "extension", "last_frame", "first_last", "inpaint")
NONE = 0  # the code of an unconditioned sample; mode i of MODES has code i + 1
# Modes given as the last frame's extra tokens (a keyframe at the clip's last frame), not in place.
LAST_FRAME_MODES: tuple[ModeName, ...] = ("last_frame", "first_last")
# Modes that give the first latent frame in place.
FIRST_FRAME_MODES: tuple[ModeName, ...] = ("first_frame", "first_last")

# Keys of the conditions `draw` adds: each sample's mode code [B] (float) and its clean latents [B, C, F, H, W].
MODE = "conditioning_mode"
LATENTS = "conditioning_latents"
# The mask of the per-clip inputs layer on the latent grid ([B, 1, F, H, W] in [0, 1]; 1: generated), when a run
# reads masks; inpainting then keeps the cells the mask leaves wholly black.
INPUT_MASK = "input_mask"


def code(mode: ModeName) -> int:
    return MODES.index(mode) + 1


def visit_generator(seed: int, position: int) -> torch.Generator:
    """The draw of one visit: its own generator, so it never shares draws with the visit's noise or noise level."""
    return torch.Generator().manual_seed((seed * 1_000_039 + position * 15_485_863 + 2_027) % 2**63)


def uniform_draws(positions: torch.Tensor, seed: int) -> list[float]:
    """One uniform number per sample of a batch, from its stream position alone."""
    return [float(torch.rand(1, generator=visit_generator(seed, int(position)))) for position in positions.tolist()]


def shares(config: ConditioningConfig, first_frame: float) -> dict[ModeName, float]:
    """Each mode's share of the samples: the configured ones, first-frame's being what they leave of
    `first_frame` (model.first_frame_conditioning; e.g. 1.0 for ltx-video-i2v: every other sample)."""
    others = {mode: float(getattr(config, mode)) for mode in MODES[1:]}
    return {"first_frame": max(0.0, min(first_frame, 1.0 - sum(others.values()))), **others}


def draw_modes(mode_shares: dict[ModeName, float], positions: torch.Tensor, seed: int,
               allowed: dict[ModeName, bool]) -> torch.Tensor:
    """[B] float mode codes (NONE: unconditioned), one uniform draw per sample; a mode a clip cannot take (`allowed`
    false, e.g. extension of a clip no longer than the given frames) leaves that sample unconditioned."""
    codes = []
    for u in uniform_draws(positions, seed):
        chosen, bound = NONE, 0.0
        for mode in MODES:
            bound += mode_shares.get(mode, 0.0)
            if u < bound:
                chosen = code(mode) if allowed.get(mode, True) else NONE
                break
        codes.append(float(chosen))
    return torch.tensor(codes, dtype=torch.float32)


def draw_visit(config: ConditioningConfig, x0: torch.Tensor, positions: torch.Tensor, seed: int,
               extension_latent_frames: int, first_frame: float = 0.0) -> dict[str, torch.Tensor]:
    """The conditions of a visit's drawn modes: each sample's code (`MODE`) and its clean latents (`LATENTS`); a
    still takes no mode but inpainting, a clip no longer than the extension's given latent frames no extension."""
    frames = x0.shape[2]
    allowed: dict[ModeName, bool] = {mode: frames > 1 for mode in MODES}
    allowed["extension"] = extension_latent_frames < frames
    allowed["inpaint"] = True
    codes = draw_modes(shares(config, first_frame), positions, seed, allowed)
    return {MODE: codes.to(x0.device), LATENTS: x0}


def extension_problems(config: ConditioningConfig, temporal: int, frames: int, takes: str) -> list[str]:
    """What keeps `extension_frames` from clips of `frames` frames when the given frames fill whole latent frames of
    a VAE compressing time `temporal` times (`takes`: who says so, e.g. the pipeline)."""
    if config.extension <= 0:
        return []
    problems = []
    count = config.extension_frames
    if (count - 1) % temporal:
        problems.append(f"model.conditioning.extension_frames={count}: {takes} takes a clip of k x {temporal} + 1 "
                        f"frames; use {(count - 1) // temporal * temporal + 1} or "
                        f"{-(-(count - 1) // temporal) * temporal + 1}")
    if frames > 1 and count >= frames:
        problems.append(f"model.conditioning.extension_frames={count} gives all {frames} frames of a clip "
                        "(data.frames): nothing is left to learn; give fewer frames")
    return problems


def is_mode(codes: torch.Tensor, modes: tuple[ModeName, ...]) -> torch.Tensor:
    """[B] bool: which samples' mode is one of `modes`."""
    wanted = torch.tensor([code(mode) for mode in modes], dtype=codes.dtype, device=codes.device)
    return (codes.flatten()[:, None] == wanted[None]).any(dim=1)


def rectangle_region(rectangle: tuple[float, float, float, float], generated: Literal["inside", "outside"],
                     frames: int, height: int, width: int) -> torch.Tensor:
    """[1, 1, F, H, W] given region of a rectangle (left, top, right, bottom as fractions of the frame): with
    `generated` inside (inpainting), every latent cell the rectangle touches is learnt; outside (outpainting),
    only the cells wholly inside it are given."""
    left, top, right, bottom = rectangle
    rows = torch.arange(height, dtype=torch.float64)
    columns = torch.arange(width, dtype=torch.float64)
    # Cell [i, i + 1) overlaps [a * size, b * size) when it starts before the end and ends after the start.
    touches_rows = (rows < bottom * height) & (rows + 1 > top * height)
    touches_columns = (columns < right * width) & (columns + 1 > left * width)
    inside_rows = (rows >= top * height) & (rows + 1 <= bottom * height)
    inside_columns = (columns >= left * width) & (columns + 1 <= right * width)
    if generated == "inside":
        given = ~(touches_rows[:, None] & touches_columns[None, :])
    else:
        given = inside_rows[:, None] & inside_columns[None, :]
    return given.float().expand(frames, height, width).reshape(1, 1, frames, height, width).clone()


def mask_region(mask: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
    """[B, 1, F, H, W] given region of a mask in [0, 1] (1: generated; [B, 1, F', H', W'] at any resolution, F'
    1 for a still mask): the latent cells the mask leaves wholly black are given."""
    mask = mask.float()
    if mask.shape[2] not in (1, frames):
        mask = F.adaptive_max_pool3d(mask, (frames, mask.shape[3], mask.shape[4]))
    generated = F.adaptive_max_pool3d(mask, (mask.shape[2], height, width))
    return (generated <= 0).float().expand(-1, -1, frames, -1, -1).clone()


def region(codes: torch.Tensor, shape: torch.Size | tuple[int, ...], extension_latent_frames: int,
           inpaint_region: torch.Tensor) -> torch.Tensor:
    """[B, 1, F, H, W] given region of each sample (latent `shape` [B, C, F, H, W]) by its mode: the first latent
    frame (first-frame, first-last), the first `extension_latent_frames` (extension), `inpaint_region` ([1 or B, 1,
    F, H, W]; inpainting); nothing for unconditioned and last-frame samples (the last frame is extra tokens)."""
    batch, _, frames, height, width = shape
    codes = codes.flatten().to(inpaint_region.device)
    given = inpaint_region.new_zeros(batch, 1, frames, height, width)
    first = is_mode(codes, FIRST_FRAME_MODES).view(-1, 1, 1, 1)
    given[:, :, 0] = first.to(given.dtype).expand(-1, 1, height, width)
    extension = is_mode(codes, ("extension",)).view(-1, 1, 1, 1, 1).to(given.dtype)
    span = given.new_zeros(1, 1, frames, 1, 1)
    span[:, :, :extension_latent_frames] = 1.0
    given = torch.maximum(given, extension * span)
    inpaint = is_mode(codes, ("inpaint",)).view(-1, 1, 1, 1, 1).to(given.dtype)
    return torch.maximum(given, inpaint * inpaint_region.to(given.dtype).expand(batch, -1, -1, -1, -1))


def give(noisy_latents: torch.Tensor, clean: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """The noisy latents with the given region's clean latents in place."""
    given = given.to(noisy_latents.dtype)
    return given * clean.to(noisy_latents) + (1.0 - given) * noisy_latents


def per_clip_error(squared_error: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """Each clip's mean squared error [B] over what it learns: the given region ([B, 1, F, H, W]) left out."""
    learnt = (1.0 - given.to(squared_error)).expand_as(squared_error)
    return (squared_error * learnt).flatten(1).sum(dim=1) / learnt.flatten(1).sum(dim=1).clamp(min=1.0)


@dataclass(frozen=True)
class Given:
    """What a sample is given in sampling (validation, `vidtune sample`): its mode and pictures, [F, 3, H, W] in
    [-1, 1]. `frames`: the first frame (first_frame, first_last), the clip to extend (extension) or the clip whose
    kept region is given (inpaint); `last`: the last frame (last_frame, first_last); `mask`: [1 or F, H, W] in
    [0, 1], 1 where the sample is generated (inpaint; None: the configured rectangle)."""

    mode: ModeName
    frames: torch.Tensor | None = None
    last: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Given(mode={self.mode!r}): the mode is one of {', '.join(MODES)}")
        if self.mode in LAST_FRAME_MODES and self.last is None:
            raise ValueError(f"Given(mode={self.mode!r}) needs the last frame")
        if self.mode != "last_frame" and self.frames is None:
            raise ValueError(f"Given(mode={self.mode!r}) needs its frames")

