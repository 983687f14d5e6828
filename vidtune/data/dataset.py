"""A torch Dataset of the samples (clip or still, and caption), decoded on demand at the batch schedule's keys."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from vidtune.data.audio import AudioFormat, ClipAudio, as_clip_audio, decode_audio
from vidtune.data.buckets import Shape, visit_start
from vidtune.data.captions import visit_untriggered
from vidtune.data.frame_store import FrameStore
from vidtune.data.input_files import control_window, frames_tensor, input_reads, read_input
from vidtune.data.inputs import INPUT_KINDS
from vidtune.data.sources import Clip
from vidtune.data.video import ClipTooShortError, ClipWindow, VideoDecodeError, decode_clip, frames_to_tensor
from vidtune.processors import ProcessorChoice, apply_processor

Key = tuple[int, int, int]  # (stream position, sample index, bucket): see vidtune.data.buckets.ScheduleSampler


class VideoCaptionDataset(Dataset):
    """At a key, yields {"video": float32 [F, 3, H, W] in [-1, 1] of the sample's bucket, "caption": str (as
    this visit reads it: `vidtune.data.captions`), "untriggered": str (the same without the source's trigger),
    "index": int, "position": int}, and with `audio` (a family that hears its clips) the window's sound: "audio"
    float32 [channels, samples] (silence without a track) and "audio_present", and with `frame_rates` (a family that
    tells its denoiser the rate) the sample's "frame_rate", which also sets how long its sound lasts. The window's
    start is drawn per
    visit (`data.frame_sampling`) from the position's own generator, so it is the same whatever worker decodes it,
    and after a resume.

    Samples come from `load_dataset` (each with its probe and bucket); a failure here still names the line to fix.
    """

    def __init__(self, clips: Sequence[Clip], shapes: Sequence[Shape], fps: float | None = None,
                 resize: str = "crop", frame_sampling: str = "start", seed: int = 0,
                 processor: ProcessorChoice | None = None, store: FrameStore | None = None,
                 audio: AudioFormat | None = None, frame_rates: Sequence[float | None] | None = None,
                 inputs: Sequence[str] = ()) -> None:
        self.clips = list(clips)
        self.shapes = list(shapes)
        self.fps = fps
        self.resize = resize
        self.frame_sampling = frame_sampling
        self.seed = seed
        self.processor = processor  # control training: the control clip computed from the clip
        self.store = store  # decoded windows kept for later visits (data.frame_store_mib)
        self.audio = audio  # the sound's format, for a family that trains on it (None: no sound decoded)
        self.frame_rates = None if frame_rates is None else list(frame_rates)  # per sample, in `clips` order
        self.inputs = tuple(inputs)  # the input kinds read where a clip has them (vidtune/data/inputs.py)

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, key: Key) -> dict[str, Any]:
        position, index, bucket = key
        clip = self.clips[index]
        frames, height, width = self.shapes[bucket]
        start = 0
        if clip.info is not None and not clip.is_image:
            start = visit_start(clip.info, frames, self.fps, self.frame_sampling, self.seed, position)
        # The caption as this visit reads it: tags shuffled afresh (`shuffle_tags`), then the trigger added.
        untriggered = visit_untriggered(clip.style, clip.untriggered, self.seed, position)
        item = {"video": self.read(clip, clip.video, frames, height, width, start),
                "caption": clip.style.with_trigger(untriggered), "untriggered": untriggered,
                "index": clip.index, "position": position, "bucket": bucket, "start": start}
        audio = self.audio
        rate = None if self.frame_rates is None else self.frame_rates[index]
        if rate is not None:
            item["frame_rate"] = rate
            audio = None if audio is None else replace(audio, frame_rate=rate)
        if audio is not None:
            item["audio"], item["audio_present"] = self.read_audio(clip, frames, start, audio)
        if self.processor is not None:
            item["control"] = apply_processor(self.processor[0], dict(self.processor[1]), item["video"])
        elif clip.control is not None:  # control training: the control clip at the same times, crop and size
            item["control"] = self.read(clip, clip.control, frames, height, width, start)
        kinds = [kind for kind in self.inputs if kind in clip.inputs or (kind == "mask" and clip.mask_rect)]
        if kinds:  # each input with the clip's own window: the same times, crop and resize
            window = ClipWindow(frames, height, width, self.fps, start, self.resize)
            item["inputs"] = {kind: self.read_input(clip, kind, window) for kind in kinds}
        return item

    def read_input(self, clip: Clip, kind: str, window: ClipWindow) -> torch.Tensor | list[torch.Tensor]:
        """One input of the clip for its window (kept in the frame store like the clip's frames)."""
        if self.store is None:
            return read_input(clip, kind, window)
        try:
            read = [frames_tensor(self.store.frames(("input", kind, one.path, repr(one.describe())), one.frames))
                    for one in input_reads(clip, kind, window)]
        except (VideoDecodeError, ClipTooShortError) as error:
            raise VideoDecodeError(getattr(error, "path", clip.video), error.reason,
                                   where=f"the {kind} of {clip.where}") from error
        return read if INPUT_KINDS[kind].media == "images" else read[0]

    def read(self, clip: Clip, path: Path, frames: int, height: int, width: int, start: int) -> torch.Tensor:
        window = ClipWindow(frames, height, width, self.fps, start, self.resize)
        if path == clip.control:  # a control clip of another frame rate: its frames at the clip's times
            window = control_window(clip, window)

        def decode() -> np.ndarray:
            return decode_clip(path, window)

        try:
            if self.store is None:
                return frames_to_tensor(decode())
            return frames_to_tensor(self.store.frames((str(path), window), decode))
        except (VideoDecodeError, ClipTooShortError) as error:
            # Raised in a worker mid-training: say which line, since the user only knows their own files.
            raise VideoDecodeError(path, error.reason, where=clip.where) from error

    def read_audio(self, clip: Clip, frames: int, start: int, audio: AudioFormat) -> ClipAudio:
        """The window's sound, kept in the frame store beside its frames (an empty array: the clip has none)."""

        def decode() -> np.ndarray:
            decoded = decode_audio(clip.video, frames, start, audio)
            return np.zeros(0, np.float32) if decoded is None else decoded

        try:
            if self.store is None:
                decoded = decode()
            else:
                decoded = self.store.frames(("audio", str(clip.video), frames, start, audio), decode)
        except (VideoDecodeError, ClipTooShortError) as error:
            raise VideoDecodeError(clip.video, error.reason, where=clip.where) from error
        return as_clip_audio(decoded if decoded.size else None, frames, audio)


def collate_samples(batch: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack videos to [B, F, 3, H, W]; captions stay a list; indices and positions become LongTensors."""
    if not batch:
        raise ValueError("cannot collate an empty batch")
    extras = {"control": torch.stack([item["control"] for item in batch])} if "control" in batch[0] else {}
    if "audio" in batch[0]:
        extras["audio"] = torch.stack([item["audio"] for item in batch])
        extras["audio_present"] = torch.tensor([item["audio_present"] for item in batch], dtype=torch.bool)
    if "frame_rate" in batch[0]:
        extras["frame_rate"] = torch.tensor([item["frame_rate"] for item in batch], dtype=torch.float64)
    kinds = [sorted(item.get("inputs", {})) for item in batch]
    if any(found != kinds[0] for found in kinds):
        where = "; ".join(f"sample {item['index']}: {', '.join(found) or 'none'}" for item, found in zip(batch, kinds,
                                                                                                       strict=True))
        raise ValueError(f"a batch's samples have different inputs ({where}): an optional input must be given for "
                         "every clip or none, or train with training.batch_size=1")
    if kinds[0]:  # per kind, one value per sample (shapes may differ: a still mask beside a clip's)
        extras["inputs"] = {kind: [item["inputs"][kind] for item in batch] for kind in kinds[0]}
    return {
        **extras,
        "video": torch.stack([item["video"] for item in batch]),
        "caption": [item["caption"] for item in batch],
        "untriggered": [item.get("untriggered", item["caption"]) for item in batch],
        "index": torch.tensor([item["index"] for item in batch], dtype=torch.long),
        "position": torch.tensor([item.get("position", -1) for item in batch], dtype=torch.long),
        # The window each sample is: which bucket's shape, from which frame.
        "bucket": torch.tensor([item.get("bucket", 0) for item in batch], dtype=torch.long),
        "start": torch.tensor([item.get("start", 0) for item in batch], dtype=torch.long),
    }
