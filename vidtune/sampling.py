"""Samples: videos generated with trained weights through the family's own diffusers pipeline.

Validation during a run calls `render_samples` with everything it needs given explicitly (the spec, the
loaded components, the settings and, for image-to-video families, the clip to start from); nothing here
knows about trainers. Each sample is an mp4, a PNG contact sheet to judge it without a player, and its prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from vidtune.config import Config
from vidtune.data.sources import Clip
from vidtune.data.video import frames_to_uint8, read_clip, write_video
from vidtune.files import atomic_path, atomic_write_text
from vidtune.models.spec import ModelSpec, TextComponents


@dataclass(frozen=True)
class SampleSettings:
    """What to sample and how: prompts, shape, steps, guidance, seed, and the frame rate of the mp4s."""

    prompts: tuple[str, ...]
    frames: int
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    frame_rate: float

    @classmethod
    def from_config(cls, config: Config, spec: ModelSpec, default_prompt: str) -> SampleSettings:
        """The `validation` section, falling back to the training shape, the family's recommended guidance
        and `default_prompt` (the first caption of the dataset)."""
        options = config.validation
        return cls(
            prompts=tuple(options.prompts or [default_prompt]),
            frames=options.frames or config.data.frames,
            height=options.height or config.data.height,
            width=options.width or config.data.width,
            num_inference_steps=options.num_inference_steps,
            guidance_scale=(spec.validation_guidance_scale if options.guidance_scale is None
                            else options.guidance_scale),
            seed=options.seed,
            frame_rate=config.frame_rate,
        )


def reference_clip(spec: ModelSpec, clips: Sequence[Clip], settings: SampleSettings) -> torch.Tensor | None:
    """Image-to-video families start from a first frame: that of the first dataset clip ([1, 3, H, W])."""
    if not spec.image_to_video:
        return None
    return read_clip(clips[0].video, 1, settings.height, settings.width)


@torch.no_grad()
def render_samples(
    spec: ModelSpec,
    text: TextComponents,
    vae: nn.Module,
    denoiser: nn.Module,
    settings: SampleSettings,
    folder: Path,
    name: str,
    *,
    reference: torch.Tensor | None = None,
    bf16: bool = False,
) -> list[Path]:
    """One sample per prompt, written as `folder/{name}-{number}.mp4` (+ .png contact sheet, + .txt prompt).

    The denoiser is put in eval mode for sampling and back in the mode it had."""
    folder.mkdir(parents=True, exist_ok=True)
    was_training = denoiser.training
    denoiser.eval()
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    device = next(denoiser.parameters()).device
    written = []
    try:
        for number, prompt in enumerate(settings.prompts):
            generator = torch.Generator().manual_seed(settings.seed + number)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                frames = spec.generate(pipeline, prompt, frames=settings.frames, height=settings.height,
                                       width=settings.width, num_inference_steps=settings.num_inference_steps,
                                       guidance_scale=settings.guidance_scale, generator=generator,
                                       reference=reference)
            pixels = frames_to_uint8(frames)
            video_path = folder / f"{name}-{number}.mp4"
            write_video(video_path, pixels, fps=settings.frame_rate)
            write_contact_sheet(pixels, video_path.with_suffix(".png"))
            atomic_write_text(video_path.with_suffix(".txt"), prompt + "\n")
            written.append(video_path)
    finally:
        denoiser.train(was_training)
    return written


def write_contact_sheet(frames: np.ndarray, path: Path, columns: int = 8) -> Path:
    """A PNG grid of up to `columns` evenly spaced frames, so a sample can be judged without a player."""
    count = min(columns, len(frames))
    picks = np.linspace(0, len(frames) - 1, count).round().astype(int)
    height, width = frames.shape[1:3]
    sheet = Image.new("RGB", (width * count, height))
    for slot, index in enumerate(picks):
        sheet.paste(Image.fromarray(frames[index]), (slot * width, 0))
    with atomic_path(path) as temporary:
        sheet.save(temporary, format="PNG")
    return path
