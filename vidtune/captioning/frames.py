"""The frames a captioning model sees of a clip: sampled at a stated rate, at most a stated count, decoded straight
to the model's size (only the frames used are decoded)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from vidtune.captioning.qwen_inputs import VisionSettings, smart_resize
from vidtune.captioning.vlm import Media
from vidtune.data.video import is_image_path, probe_image, probe_video, read_frames


def frame_indices(num_frames: int, source_fps: float, fps: float, max_frames: int) -> list[int]:
    """Source frames sampled at `fps` from the clip's start (at least one); when that makes more than `max_frames`,
    `max_frames` spread evenly over the whole clip instead, its first and last frame included."""
    if num_frames <= 1 or source_fps <= 0:
        return [0]
    count = max(1, math.floor(num_frames / source_fps * fps))
    if count <= max_frames:
        indices = [min(num_frames - 1, round(step * source_fps / fps)) for step in range(count)]
    else:
        indices = [round(value) for value in np.linspace(0, num_frames - 1, max_frames)]
    return sorted(set(indices))


def read_media(path: Path, settings: VisionSettings, fps: float, max_frames: int, max_pixels: int) -> Media:
    """The frames of a clip or still as the model reads them; raises VideoDecodeError for a file that does not
    decode."""
    if is_image_path(path):
        info = probe_image(path)
        indices, source_fps = [0], 0.0
    else:
        info = probe_video(path)
        indices, source_fps = frame_indices(info.num_frames, info.fps, fps, max_frames), info.fps
    size = smart_resize(info.height, info.width, settings.factor, settings.min_pixels, max_pixels)
    frames = read_frames(path, indices, size=size, resize="stretch")
    times = [index / source_fps for index in indices] if source_fps > 0 else [0.0] * len(indices)
    return Media(frames=frames, times=times, is_image=is_image_path(path))
