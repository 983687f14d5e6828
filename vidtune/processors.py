"""Control processors: a control clip computed from each target clip on the fly (`control.processor`).

A processor maps a clip [F, 3, H, W] in [-1, 1] to its control clip of the same shape and range. It runs where
the target is decoded (the data loader's workers, or the precompute stage), so its output is keyed in the cache
by the target clip's content, the preprocessing and the processor's identity (`processor_identity`). Adding one
is a function here, its name in `PROCESSORS` and in the `control.processor` choices of vidtune/config/schema.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from vidtune.algorithms import traits_of
from vidtune.data.video import is_image_path
from vidtune.errors import ConfigError

Processor = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]


def opencv() -> Any:
    try:
        import cv2
    except ImportError:
        raise ConfigError("control.processor: canny needs OpenCV, which is not installed.\nWhat to do: pip install "
                          "'vidtune[canny]' (opencv-python-headless).") from None
    return cv2


def canny(video: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
    """OpenCV's Canny edges of each frame's grey image (thresholds `canny_low`, `canny_high`), white on black, as an
    RGB clip in [-1, 1]."""
    cv2 = opencv()
    pixels = ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    edges = [cv2.Canny(cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2GRAY), options["canny_low"],
                       options["canny_high"]) for frame in pixels]
    grey = torch.from_numpy(np.stack(edges)).float().div_(127.5).sub_(1.0)
    return grey[:, None].expand(-1, 3, -1, -1).contiguous()


PROCESSORS: dict[str, Processor] = {"canny": canny}


def processor_options(control: Any) -> dict[str, Any]:
    """The options of the config's `control.processor` (its own keys of the `control` section)."""
    if control.processor == "canny":
        return {"canny_low": control.canny_low, "canny_high": control.canny_high}
    return {}


ProcessorChoice = tuple[str, tuple[tuple[str, Any], ...]]  # (name, sorted options): hashable, picklable


def configured_processor(config: Any) -> ProcessorChoice | None:
    """The processor a control run computes its control clips with, or None (control clips are read)."""
    if not traits_of(config).control or config.control.processor is None:
        return None
    return config.control.processor, tuple(sorted(processor_options(config.control).items()))


def processor_identity(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """What a processed clip depends on besides the clip and its preprocessing: part of its cache key."""
    version = {"canny": opencv().__version__}.get(name, "")
    return {"name": name, "options": options, "library": version}


def apply_processor(name: str, options: dict[str, Any], video: torch.Tensor) -> torch.Tensor:
    return PROCESSORS[name](video, options)


def control_downscale(config: Any) -> int:
    """How many times smaller than its clip a control clip is read (the same frames and framing): in-context
    training's `control.reference_downscale_factor`, else 1."""
    return config.control.reference_downscale_factor if traits_of(config).in_context else 1


def with_reference_controls(config: Any, clips: list[Any]) -> list[Any]:
    """In-context training: a clip without a control clip whose `reference` input (the per-clip inputs: a
    `references.txt` list, `<stem>.reference.mp4` beside it, a column) names a video takes it as its control clip,
    so both ways of giving a reference train alike. Other runs: the clips as they are."""
    if not traits_of(config).in_context:
        return clips
    taken = []
    for clip in clips:
        if clip.control is None and "reference" in clip.inputs and not is_image_path(clip.inputs["reference"][0]):
            # Its probe goes with it: a reference of another frame rate is read at the clip's times.
            probes = {**clip.input_info, "control": clip.input_info["reference"]} \
                if "reference" in clip.input_info else clip.input_info
            clip = replace(clip, control=clip.inputs["reference"][0], input_info=probes)
        taken.append(clip)
    return taken
