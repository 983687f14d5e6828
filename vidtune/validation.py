"""What people look at after a run: sample videos from the family's own pipeline, and the loss curve."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

from vidtune.data.video import read_clip, write_video

if TYPE_CHECKING:
    from vidtune.trainers.base import Trainer


def frames_to_uint8(frames: torch.Tensor) -> np.ndarray:
    """[F, 3, H, W] in [-1, 1] -> [F, H, W, 3] uint8."""
    pixels = ((frames.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).cpu().numpy()


def write_contact_sheet(frames: np.ndarray, path: Path, columns: int = 8) -> Path:
    """A PNG grid of up to `columns` evenly spaced frames, so a sample can be judged without a player."""
    count = min(columns, len(frames))
    picks = np.linspace(0, len(frames) - 1, count).round().astype(int)
    height, width = frames.shape[1:3]
    sheet = Image.new("RGB", (width * count, height))
    for slot, index in enumerate(picks):
        sheet.paste(Image.fromarray(frames[index]), (slot * width, 0))
    temporary = path.with_name(path.name + ".tmp.png")
    sheet.save(temporary)
    os.replace(temporary, path)
    return path


@torch.no_grad()
def render_validation_samples(trainer: Trainer, step: int) -> list[Path]:
    """Sample each validation prompt with the trained denoiser; write mp4 + PNG contact sheet."""
    config = trainer.config
    options = config.validation
    prompts = options.prompts or [trainer.samples[0].caption]
    folder = trainer.output_dir / "samples"
    folder.mkdir(parents=True, exist_ok=True)
    trainer.denoiser.eval()
    pipeline = trainer.spec.pipeline(trainer.text, trainer.vae, trainer.denoiser)
    pipeline.set_progress_bar_config(disable=True)
    height, width = options.height or config.data.height, options.width or config.data.width
    if trainer.spec.image_to_video:
        # Image-to-video families sample from a first frame: that of the first dataset clip.
        trainer.spec.set_reference_video(read_clip(trainer.samples[0].video, 1, height, width))
    written = []
    for number, prompt in enumerate(prompts):
        generator = torch.Generator().manual_seed(options.seed + number)
        with torch.autocast(trainer.device.type, dtype=torch.bfloat16, enabled=trainer.use_bf16):
            frames = trainer.spec.generate(
                pipeline,
                prompt,
                frames=options.frames or config.data.frames,
                height=height,
                width=width,
                num_inference_steps=options.num_inference_steps,
                guidance_scale=(
                    trainer.spec.validation_guidance_scale if options.guidance_scale is None else options.guidance_scale
                ),
                generator=generator,
            )
        pixels = frames_to_uint8(frames)
        video_path = folder / f"step-{step:08d}-{number}.mp4"
        write_video(video_path, pixels, fps=config.frame_rate)
        write_contact_sheet(pixels, video_path.with_suffix(".png"))
        (video_path.with_suffix(".txt")).write_text(prompt + "\n", encoding="utf-8")
        written.append(video_path)
    trainer.denoiser.train()
    return written


def plot_loss_curve(metrics_path: Path, output: Path) -> Path | None:
    """loss.png: raw loss per step and a moving average, from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not metrics_path.is_file():
        return None
    rows = [json.loads(line) for line in metrics_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        return None
    steps = np.array([row["step"] for row in rows])
    losses = np.array([row["loss"] for row in rows])
    window = max(1, len(losses) // 20)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    figure, axis = plt.subplots(figsize=(8, 4.5), dpi=100)
    axis.plot(steps, losses, color="#9bbbd4", linewidth=0.8, label="loss")
    axis.plot(steps[window - 1 :], smooth, color="#1f4e79", linewidth=2, label=f"mean of {window}")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("loss")
    axis.set_title("Training loss")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    temporary = output.with_name(output.name + ".tmp.png")
    figure.savefig(temporary)
    plt.close(figure)
    os.replace(temporary, output)
    return output
