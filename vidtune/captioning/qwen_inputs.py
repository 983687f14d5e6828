"""The vision inputs of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) made from decoded frames with numpy.

transformers' video processors for these models need torchvision; this module does what they do with the frames
vidtune already decoded, so captioning runs without it: each frame resized to a multiple of `patch_size *
merge_size` within a pixel budget (`smart_resize`), scaled to [0, 1] and normalised with the model's mean and std,
frames grouped by `temporal_patch_size` (the last one repeated to fill a group) and cut into the flat patch rows
the vision tower reads, with the grid (t, h, w) the model needs to place them. A still is one frame, as its
image processor makes it. The text side (how many placeholder tokens stand for a video, Qwen3-VL's timestamps)
follows the models' processors (transformers `processing_qwen2_5_vl.py`, `processing_qwen3_vl.py`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Model types captioning knows, and whether their text gives each frame group its time (Qwen3-VL) or the model is
# told the seconds per temporal patch instead (Qwen2.5-VL; Qwen2-VL takes neither).
TIMESTAMPED = ("qwen3_vl", "qwen3_vl_moe")
SECONDS_PER_GRID = ("qwen2_5_vl",)
MODEL_TYPES = ("qwen2_vl", *SECONDS_PER_GRID, *TIMESTAMPED)

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VisionSettings:
    """What the vision tower expects of its input, from the model's preprocessor config."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    mean: tuple[float, float, float] = _CLIP_MEAN
    std: tuple[float, float, float] = _CLIP_STD
    min_pixels: int = 56 * 56

    @property
    def factor(self) -> int:
        """Frame sides are multiples of this (a merged patch)."""
        return self.patch_size * self.merge_size


def vision_settings(config: Mapping[str, Any]) -> VisionSettings:
    """The settings of a `preprocessor_config.json` (or `video_preprocessor_config.json`); defaults where unset."""
    default = VisionSettings()
    size = config.get("size") or {}
    min_pixels = config.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or default.min_pixels
    return VisionSettings(
        patch_size=int(config.get("patch_size", default.patch_size)),
        temporal_patch_size=int(config.get("temporal_patch_size", default.temporal_patch_size)),
        merge_size=int(config.get("merge_size", default.merge_size)),
        mean=tuple(float(value) for value in config.get("image_mean", default.mean)),
        std=tuple(float(value) for value in config.get("image_std", default.std)),
        min_pixels=int(min_pixels),
    )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) a frame is given: both multiples of `factor`, the aspect ratio kept as closely as
    possible, the area between `min_pixels` and `max_pixels` (Qwen2-VL's rule)."""
    rounded_height = max(factor, round(height / factor) * factor)
    rounded_width = max(factor, round(width / factor) * factor)
    if rounded_height * rounded_width > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        rounded_height = max(factor, math.floor(height / scale / factor) * factor)
        rounded_width = max(factor, math.floor(width / scale / factor) * factor)
    elif rounded_height * rounded_width < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        rounded_height = math.ceil(height * scale / factor) * factor
        rounded_width = math.ceil(width * scale / factor) * factor
    return rounded_height, rounded_width


def patch_rows(frames: Sequence[np.ndarray], settings: VisionSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Frames uint8 [H, W, 3], all of one size with sides multiples of `settings.factor`, as the vision tower's
    rows float32 [t * h * w, 3 * temporal_patch_size * patch_size**2] and the grid (t, h, w) in patches."""
    video = np.stack(frames).astype(np.float32) / 255.0  # [F, H, W, 3]
    video = (video - np.asarray(settings.mean, np.float32)) / np.asarray(settings.std, np.float32)
    video = video.transpose(0, 3, 1, 2)  # [F, 3, H, W]
    step = settings.temporal_patch_size
    if pad := -len(video) % step:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    count, channels, height, width = video.shape
    patch, merge = settings.patch_size, settings.merge_size
    grid = (count // step, height // patch, width // patch)
    if height % settings.factor or width % settings.factor:
        raise ValueError(f"frames of {height}x{width} are not multiples of {settings.factor}")
    rows = video.reshape(grid[0], step, channels, grid[1] // merge, merge, patch, grid[2] // merge, merge, patch)
    rows = rows.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # groups, merged rows / columns, then the patch's own pixels
    return np.ascontiguousarray(rows.reshape(math.prod(grid), channels * step * patch * patch)), grid


def placeholder_tokens(grid: tuple[int, int, int], settings: VisionSettings) -> int:
    """How many placeholder tokens stand for a grid (the vision tower merges `merge_size**2` patches into one)."""
    return math.prod(grid) // settings.merge_size ** 2


def group_times(times: Sequence[float], settings: VisionSettings) -> list[float]:
    """Qwen3-VL: the time of each temporal patch, the middle of its first and last frame (seconds)."""
    step = settings.temporal_patch_size
    padded = list(times) + [times[-1]] * (-len(times) % step)
    return [(padded[start] + padded[start + step - 1]) / 2 for start in range(0, len(padded), step)]


def video_text(model_type: str, grid: tuple[int, int, int], times: Sequence[float], settings: VisionSettings,
               video_token: str, vision_start: str, vision_end: str) -> str:
    """What stands in the prompt for one video's placeholder token: the token repeated once per merged patch;
    Qwen3-VL writes each temporal patch's time before its tokens, each group in its own vision markers."""
    if model_type not in TIMESTAMPED:
        return video_token * placeholder_tokens(grid, settings)
    per_group = grid[1] * grid[2] // settings.merge_size ** 2
    return "".join(f"<{time:.1f} seconds>{vision_start}{video_token * per_group}{vision_end}"
                   for time in group_times(times, settings))
