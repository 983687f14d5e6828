"""What a conditioning mode's sample is given (`Given`, vidtune/models/conditioning.py): in validation, taken from
the run's first clip in the mode `model.conditioning` validates with; in `vidtune sample`, from the files the user
names (--image, --last-frame, --extend, --inpaint, --mask)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from vidtune.config import Config
from vidtune.data.sources import Clip
from vidtune.data.video import ClipWindow, is_image_path, read_clip, read_image
from vidtune.errors import VidtuneError
from vidtune.models import conditioning
from vidtune.models.conditioning import Given, ModeName
from vidtune.models.spec import ModelSpec


def validation_mode(spec: ModelSpec, config: Config) -> ModeName | None:
    """The mode validation samples with: `model.conditioning.validation_mode`, else the largest share (None: a
    family or run without modes beside the first frame)."""
    modes = config.model.conditioning
    if not spec.conditioning_modes or not modes.enabled:
        return None
    if modes.validation_mode is not None:
        return modes.validation_mode
    shares = conditioning.shares(modes, spec.first_frame_probability)
    return max(shares, key=lambda mode: shares[mode])


def from_clip(mode: ModeName, clip: torch.Tensor, extension_frames: int, mask: torch.Tensor | None = None) -> Given:
    """A mode's inputs taken from one clip [F, 3, H, W]: its first frame, its first `extension_frames` frames, its
    last frame, or (inpainting) the whole clip with `mask` (None: the configured rectangle)."""
    if mode == "first_frame":
        return Given(mode, frames=clip[:1])
    if mode == "extension":
        return Given(mode, frames=clip[:extension_frames])
    if mode == "last_frame":
        return Given(mode, last=clip[-1:])
    if mode == "first_last":
        return Given(mode, frames=clip[:1], last=clip[-1:])
    return Given(mode, frames=clip, mask=mask)


def validation_given(spec: ModelSpec, config: Config, clips: Sequence[Clip], frames: int, height: int,
                     width: int) -> Given | None:
    """The first clip's inputs in the validation mode (None: no mode beside the first frame is trained)."""
    mode = validation_mode(spec, config)
    if mode is None:
        return None
    clip = read_clip(clips[0].video, ClipWindow(frames, height, width, fps=config.data.fps))
    masks = clips[0].inputs.get("mask", ()) if mode == "inpaint" else ()
    mask = read_mask(masks[0], height, width, frames, "the first clip's mask") if masks else None
    return from_clip(mode, clip, config.model.conditioning.extension_frames, mask)


def read_flag_clip(flag: str, path: Path, frames: int, height: int, width: int) -> torch.Tensor:
    """`frames` frames of the clip (or picture, for one frame) a flag names, [F, 3, H, W] in [-1, 1], read as
    training reads clips."""
    if not path.is_file():
        raise VidtuneError(f"{flag}: {path}: no such file.\nWhat to do: give the file's path.")
    try:
        if is_image_path(path):
            return read_image(path, height, width)
        return read_clip(path, ClipWindow(frames, height, width))
    except VidtuneError as error:
        raise VidtuneError(f"{flag}: {error}") from None


def read_mask(path: Path, height: int, width: int, frames: int = 1, flag: str = "--mask") -> torch.Tensor:
    """A mask picture or clip as [1 or F, H, W] in [0, 1] (white: generated, black: kept), resized and cropped as
    clips are."""
    pictures = read_flag_clip(flag, path, frames, height, width)
    return ((pictures.mean(dim=1) + 1.0) / 2.0).clamp(0.0, 1.0)


def given_from_files(spec: ModelSpec, config: Config, frames: int, height: int, width: int, *,
                     image: Path | None = None, last_frame: Path | None = None, extend: Path | None = None,
                     inpaint: Path | None = None, mask: Path | None = None) -> Given | None:
    """The mode the sampling flags name, with their pictures (None: none of the mode flags, so a first frame,
    if any, is the plain image-to-video reference). One mode a sample: --image with --last-frame is first-last."""
    named = [flag for flag, value in (("--extend", extend), ("--inpaint", inpaint)) if value is not None]
    if last_frame is not None:
        named.append("--image with --last-frame" if image is not None else "--last-frame")
    if mask is not None and inpaint is None:
        raise VidtuneError("--mask: the mask says which region of the --inpaint clip is generated.\n"
                           "What to do: give --inpaint CLIP with it.")
    if len(named) > 1 or (named and image is not None and last_frame is None):
        flags = named + (["--image"] if image is not None and last_frame is None else [])
        raise VidtuneError(f"{' and '.join(flags)}: a sample takes one conditioning mode.\n"
                           "What to do: keep one of them.")
    if not named:
        return None
    if extend is not None:
        count = config.model.conditioning.extension_frames
        given = Given("extension", frames=read_flag_clip("--extend", extend, count, height, width))
    elif inpaint is not None:
        clip = read_flag_clip("--inpaint", inpaint, frames, height, width)
        given = Given("inpaint", frames=clip, mask=read_mask(mask, height, width, frames) if mask is not None else None)
    else:
        assert last_frame is not None
        last = read_flag_clip("--last-frame", last_frame, 1, height, width)
        first = read_flag_clip("--image", image, 1, height, width) if image is not None else None
        given = Given("first_last" if first is not None else "last_frame", frames=first, last=last)
    spec.check_given(given)
    return given
