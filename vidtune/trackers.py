"""Experiment trackers beside metrics.jsonl: TensorBoard and Weights & Biases, each imported only when chosen.

Every logged step sends the loss, learning rate, gradient norm, seconds per step and samples per second; every
validation sends its videos (TensorBoard: an animated GIF per sample in the Images tab, which is how TensorBoard
shows videos; W&B: the mp4 itself); every held-out score (`vidtune.evaluation`) sends its values under `eval/`.
Only rank 0 tracks. A package that is missing is reported before any long work, with the pip extra to install.
"""

from __future__ import annotations

import importlib.util
import io
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vidtune import outputs
from vidtune.config import Config
from vidtune.data.video import probe_video, read_frames
from vidtune.errors import ConfigError

# config key -> (module that must import, pip extra that installs it)
PACKAGES = {"logging.tensorboard": ("tensorboard", "tensorboard"), "logging.wandb": ("wandb", "wandb")}


class Tracker(ABC):
    @abstractmethod
    def log_metrics(self, step: int, values: dict[str, float], section: str = "train") -> None:
        """`values` under `section/` (`train`: each logged step; `eval`: the held-out score)."""

    @abstractmethod
    def log_samples(self, step: int, videos: list[Path], fps: float) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


def chosen(config: Config) -> list[str]:
    """The tracker keys a config turns on."""
    keys = []
    if config.logging.tensorboard:
        keys.append("logging.tensorboard")
    if config.logging.wandb is not None:
        keys.append("logging.wandb")
    return keys


def check_trackers(config: Config) -> None:
    """Refuse, before any long work, a tracker whose package is not installed."""
    missing = [(key, *PACKAGES[key]) for key in chosen(config) if not _installed(PACKAGES[key][0])]
    if missing:
        lines = "\n".join(f"  - {key} needs the {module} package, which is not installed" for key, module, _ in missing)
        extras = ",".join(extra for _, _, extra in missing)
        off = " / ".join(f"{key}={'null' if key == 'logging.wandb' else 'false'}" for key, _, _ in missing)
        raise ConfigError(f"A tracker the config chose cannot start:\n{lines}\n"
                          f"What to do: pip install 'vidtune[{extras}]', or turn it off ({off}).")


def _installed(module: str) -> bool:
    return module in sys.modules or importlib.util.find_spec(module) is not None


def open_trackers(config: Config, output_dir: Path, first_step: int) -> list[Tracker]:
    """The trackers a config chose (call on rank 0 only). `first_step`: where this process starts, so a resumed
    run's TensorBoard events replace those a killed run wrote after its checkpoint."""
    trackers: list[Tracker] = []
    if config.logging.tensorboard:
        trackers.append(TensorBoardTracker(output_dir / outputs.TENSORBOARD, first_step))
    if config.logging.wandb is not None:
        trackers.append(WandbTracker(config, output_dir))
    return trackers


class TensorBoardTracker(Tracker):
    def __init__(self, folder: Path, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events at or after it from an earlier (killed) run of this folder are dropped on resume.
        self.writer = SummaryWriter(str(folder), purge_step=first_step + 1 if first_step else None)

    def log_metrics(self, step: int, values: dict[str, float], section: str = "train") -> None:
        for name, value in values.items():
            self.writer.add_scalar(f"{section}/{name}", value, step)
        self.writer.flush()

    def log_samples(self, step: int, videos: list[Path], fps: float) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        for number, video in enumerate(videos):
            frames = read_frames(video, list(range(probe_video(video).num_frames)))
            height, width = frames[0].shape[:2]
            image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=_gif(frames, fps))
            summary = Summary(value=[Summary.Value(tag=f"samples/{number}", image=image)])
            # SummaryWriter.add_video needs moviepy to encode; the GIF summary it would write is built here instead.
            self.writer._get_file_writer().add_summary(summary, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, config: Config, output_dir: Path) -> None:
        import wandb

        options = config.logging.wandb
        self.wandb = wandb
        try:
            self.run = wandb.init(project=options.project, name=options.name or output_dir.name, mode=options.mode,
                                  dir=str(output_dir), config=config.to_dict())
        except (wandb.errors.UsageError, wandb.errors.CommError) as error:  # no login, no network, no such entity
            raise ConfigError(f"logging.wandb: Weights & Biases did not start a run: {error}\n"
                              "What to do: log in with `wandb login` (or set WANDB_API_KEY), or set "
                              "logging.wandb.mode=offline and upload later with `wandb sync`.") from None

    def log_metrics(self, step: int, values: dict[str, float], section: str = "train") -> None:
        self.run.log({f"{section}/{name}": value for name, value in values.items()}, step=step)

    def log_samples(self, step: int, videos: list[Path], fps: float) -> None:
        self.run.log({f"samples/{number}": self.wandb.Video(str(video), format="mp4")
                      for number, video in enumerate(videos)}, step=step)

    def close(self) -> None:
        self.run.finish()


def _gif(frames: list[np.ndarray], fps: float) -> bytes:
    images = [Image.fromarray(frame) for frame in frames]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)
    return buffer.getvalue()


def step_values(loss: float, lr: float, grad_norm: float | None, seconds: float, samples: int) -> dict[str, Any]:
    """What a tracker records of one step (`samples`: the samples all ranks took in it)."""
    values = {"loss": loss, "lr": lr, "seconds_per_step": seconds, "samples_per_second": samples / seconds}
    if grad_norm is not None:
        values["grad_norm"] = grad_norm
    return values
