"""A torch Dataset of (clip, caption) samples, decoded on demand."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from vidtune.data.sources import Sample
from vidtune.data.video import ClipTooShortError, VideoDecodeError, read_clip


class VideoCaptionDataset(Dataset):
    """Yields {"video": float32 [F, 3, H, W] in [-1, 1], "caption": str, "index": int}.

    Clips should be checked with `validate_clips` first; a failure here still names the line to fix.
    """

    def __init__(
        self, samples: Sequence[Sample], num_frames: int, height: int, width: int, fps: float | None = None
    ) -> None:
        self.samples = list(samples)
        self.num_frames = num_frames
        self.height = height
        self.width = width
        self.fps = fps

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: int) -> dict[str, Any]:
        sample = self.samples[item]
        try:
            video = read_clip(sample.video, self.num_frames, self.height, self.width, fps=self.fps)
        except (VideoDecodeError, ClipTooShortError) as error:
            # Raised in a worker mid-training: say which line, since the user only knows their text files.
            where = f"{sample.source} line {sample.line}"
            raise VideoDecodeError(sample.video, error.reason, where=where) from error
        return {"video": video, "caption": sample.caption, "index": sample.index}


def collate_samples(batch: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack videos to [B, F, 3, H, W]; captions stay a list; indices become a LongTensor."""
    if not batch:
        raise ValueError("cannot collate an empty batch")
    return {
        "video": torch.stack([item["video"] for item in batch]),
        "caption": [item["caption"] for item in batch],
        "index": torch.tensor([item["index"] for item in batch], dtype=torch.long),
    }
