"""A torch Dataset of the clips (video and caption), decoded on demand."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from vidtune.data.sources import Clip
from vidtune.data.video import ClipTooShortError, VideoDecodeError, read_clip


class VideoCaptionDataset(Dataset):
    """Yields {"video": float32 [F, 3, H, W] in [-1, 1], "caption": str, "index": int}.

    Clips should be checked with `validate_clips` first; a failure here still names the line to fix.
    """

    def __init__(
        self, clips: Sequence[Clip], num_frames: int, height: int, width: int, fps: float | None = None
    ) -> None:
        self.clips = list(clips)
        self.num_frames = num_frames
        self.height = height
        self.width = width
        self.fps = fps

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, item: int) -> dict[str, Any]:
        clip = self.clips[item]
        try:
            video = read_clip(clip.video, self.num_frames, self.height, self.width, fps=self.fps)
        except (VideoDecodeError, ClipTooShortError) as error:
            # Raised in a worker mid-training: say which line, since the user only knows their text files.
            where = f"{clip.source} line {clip.line}"
            raise VideoDecodeError(clip.video, error.reason, where=where) from error
        return {"video": video, "caption": clip.caption, "index": clip.index}


def collate_samples(batch: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack videos to [B, F, 3, H, W]; captions stay a list; indices become a LongTensor."""
    if not batch:
        raise ValueError("cannot collate an empty batch")
    return {
        "video": torch.stack([item["video"] for item in batch]),
        "caption": [item["caption"] for item in batch],
        "index": torch.tensor([item["index"] for item in batch], dtype=torch.long),
    }
