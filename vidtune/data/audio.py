"""A clip's sound, for families whose models hear it (LTX-2): the audio of a video window, decoded with PyAV and
resampled to the model's rate and channels, and the log-mel spectrogram its audio VAE encodes.

Only specs that name an `AudioFormat` (`ModelSpec.audio_format`) get audio; every other family decodes none. The
window's audio starts at the time of its first video frame and lasts as long as its frames at the frame rate they
play at (the rate the model is told for the clip: `data.fps`, which the frames are resampled to, else the clip's own
rate, or `model.frame_rate`; see `ModelSpec.clip_frame_rate`).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import av
import numpy as np
import torch

from vidtune.data.sources import Clip
from vidtune.data.video import (
    VideoDecodeError,
    _check_file,
    _damaged_reason,
    _start_seconds,
    _stream_fps,
    _video_stream,
    is_image_path,
)

# PyAV's channel layouts by channel count (what the resampler downmixes or upmixes to).
LAYOUTS = {1: "mono", 2: "stereo"}
# Bump when `decode_audio` or `log_mel_spectrogram` change what they return for the same arguments.
AUDIO_VERSION = 1


@dataclass(frozen=True)
class AudioFormat:
    """The sound a model's audio encoder takes: samples per second and channels (1 mono, 2 stereo), and the frame
    rate the model is told its frames play at, which sets how long a window of frames lasts."""

    sample_rate: int
    channels: int
    frame_rate: float

    def __post_init__(self) -> None:
        if self.channels not in LAYOUTS:
            raise ValueError(f"audio channels must be 1 or 2, not {self.channels}")
        if self.sample_rate <= 0 or self.frame_rate <= 0:
            raise ValueError(f"audio sample rate and frame rate must be positive, not {self.sample_rate}, "
                             f"{self.frame_rate}")

    def samples(self, num_frames: int) -> int:
        """Samples of a window of `num_frames` frames."""
        return round(num_frames / self.frame_rate * self.sample_rate)

    def describe(self) -> dict[str, float | int]:
        return {"sample_rate": self.sample_rate, "channels": self.channels, "frame_rate": self.frame_rate,
                "version": AUDIO_VERSION}


class ClipAudio(NamedTuple):
    """One window's sound: float32 [channels, samples]; zeros (silence) when the clip has no audio track."""

    waveform: torch.Tensor
    present: bool  # False: the clip has no audio track (or is a still)


@dataclass
class AudioBatch:
    """The sound of a batch of windows of one length."""

    waveforms: torch.Tensor  # [B, channels, samples]; zeros where a clip has no audio track
    present: torch.Tensor  # [B] bool: which clips have an audio track
    frame_rate: float | None = None  # the rate the windows' frames play at (None: the model's `frame_rate`)

    @classmethod
    def stack(cls, items: Sequence[ClipAudio]) -> AudioBatch:
        return cls(torch.stack([item.waveform for item in items]),
                   torch.tensor([item.present for item in items], dtype=torch.bool))

    def select(self, picks: list[int] | slice) -> AudioBatch:
        return AudioBatch(self.waveforms[picks], self.present[picks], self.frame_rate)


def decode_audio(path: str | os.PathLike[str], num_frames: int, start: int, audio: AudioFormat) -> np.ndarray | None:
    """The sound of a video window, float32 [channels, samples] resampled to `audio`, or None when the file has no
    audio track (or is a still).

    It starts at the window's first frame (source frame `start`, the frame `decode_clip` reads first) and lasts
    `num_frames / audio.frame_rate` seconds: the window's length when its frames are read at the frame rate the
    model is told (`data.fps` keeps the two equal). Where the track ends before the window's end (or starts after
    its start), the missing part is silence."""
    path = Path(path)
    if is_image_path(path):
        return None
    _check_file(path)
    try:
        with av.open(str(path)) as container:
            video = _video_stream(container, path)
            if not container.streams.audio:
                return None
            source_fps = _stream_fps(video)
            if start and source_fps <= 0:
                raise VideoDecodeError(path, "it does not say its frame rate, so its sound cannot be matched to its "
                                             "frames. Export it again (for example as .mp4 at a fixed frame rate).")
            begin = _start_seconds(video) + (start / source_fps if start else 0.0)
            return _decode_span(container, container.streams.audio[0], begin, audio.samples(num_frames), audio)
    except av.FFmpegError as error:
        raise VideoDecodeError(path, _damaged_reason(error)) from error


def _decode_span(container: av.container.InputContainer, stream: av.audio.stream.AudioStream, begin: float,
                 count: int, audio: AudioFormat) -> np.ndarray:
    """`count` samples from time `begin` (seconds, the container's clock), decoding no further than needed."""
    if begin > 0:
        container.seek(int(begin / stream.time_base), stream=stream, backward=True)
    resampler = av.AudioResampler(format="fltp", layout=LAYOUTS[audio.channels], rate=audio.sample_rate)
    chunks: list[np.ndarray] = []
    first_time: float | None = None
    have = 0
    for packet in container.demux(stream):
        for frame in packet.decode():  # the final empty packet flushes the decoder
            if first_time is None:
                first_time = float(frame.time) if frame.time is not None else begin
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray())
                have += chunks[-1].shape[1]
        if first_time is not None and have >= round((begin - first_time) * audio.sample_rate) + count:
            break  # the window is complete: nothing more to decode
    else:
        chunks.extend(out.to_ndarray() for out in resampler.resample(None))  # what the resampler still holds
    decoded = np.concatenate(chunks, axis=1) if chunks else np.zeros((audio.channels, 0), np.float32)
    # Sample k of `decoded` plays at first_time + k / rate; the window's first sample may lie before or after it.
    skip = round((begin - (begin if first_time is None else first_time)) * audio.sample_rate)
    window = np.zeros((audio.channels, count), np.float32)
    source_from, target_from = max(skip, 0), max(-skip, 0)
    length = max(0, min(decoded.shape[1] - source_from, count - target_from))
    window[:, target_from : target_from + length] = decoded[:, source_from : source_from + length]
    return window


def read_audio(path: str | os.PathLike[str], num_frames: int, start: int, audio: AudioFormat) -> ClipAudio:
    """`decode_audio` as a `ClipAudio`: silence, marked absent, for a clip without an audio track."""
    return as_clip_audio(decode_audio(path, num_frames, start, audio), num_frames, audio)


def as_clip_audio(decoded: np.ndarray | None, num_frames: int, audio: AudioFormat) -> ClipAudio:
    if decoded is None:
        return ClipAudio(torch.zeros(audio.channels, audio.samples(num_frames)), False)
    return ClipAudio(torch.from_numpy(np.ascontiguousarray(decoded, dtype=np.float32)), True)


# --------------------------------------------------------------------------------------------------
# Log-mel spectrograms


def hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    """Slaney's mel scale: linear below 1 kHz (3 mel per 200 Hz), logarithmic above."""
    linear = hz / (200.0 / 3.0)
    logarithmic = 15.0 + torch.log(hz.clamp(min=1e-10) / 1000.0) / (math.log(6.4) / 27.0)
    return torch.where(hz >= 1000.0, logarithmic, linear)


def mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    linear = mel * (200.0 / 3.0)
    logarithmic = 1000.0 * torch.exp((math.log(6.4) / 27.0) * (mel - 15.0))
    return torch.where(mel >= 15.0, logarithmic, linear)


@functools.lru_cache(maxsize=8)
def mel_filterbank(sample_rate: int, n_fft: int, mel_bins: int) -> torch.Tensor:
    """[n_fft // 2 + 1, mel_bins]: triangular filters evenly spaced on Slaney's mel scale from 0 Hz to the Nyquist
    frequency, each scaled to unit area (Slaney normalisation), as LTX-2's audio processing uses them."""
    frequencies = torch.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1, dtype=torch.float64)
    edges = mel_to_hz(torch.linspace(0.0, float(hz_to_mel(torch.tensor(sample_rate / 2.0, dtype=torch.float64))),
                                     mel_bins + 2, dtype=torch.float64))
    widths = edges[1:] - edges[:-1]
    distances = edges[None, :] - frequencies[:, None]  # [frequencies, mel_bins + 2]
    rising = -distances[:, :-2] / widths[:-1]
    falling = distances[:, 2:] / widths[1:]
    filters = torch.clamp(torch.minimum(rising, falling), min=0.0)
    return (filters * (2.0 / (edges[2:] - edges[:-2]))).float()


def log_mel_spectrogram(waveforms: torch.Tensor, sample_rate: int, n_fft: int, hop_length: int, mel_bins: int,
                        floor: float = 1e-5) -> torch.Tensor:
    """[B, channels, samples] -> [B, channels, frames, mel_bins]: the magnitude STFT (Hann window of `n_fft`,
    centred frames: 1 + samples // hop_length of them), the mel filterbank, then log(max(mel, floor)). Silence gives
    log(floor) in every bin. Computed in float32 whatever the input's dtype."""
    batch, channels, samples = waveforms.shape
    flat = waveforms.reshape(batch * channels, samples).float()
    window = torch.hann_window(n_fft, device=flat.device)
    # Reflection needs more samples than half a window; a shorter sound is padded with silence instead.
    pad_mode = "reflect" if samples > n_fft // 2 else "constant"
    spectrum = torch.stft(flat, n_fft, hop_length=hop_length, win_length=n_fft, window=window, center=True,
                          pad_mode=pad_mode, return_complex=True).abs()  # [B * channels, n_fft // 2 + 1, frames]
    mel = mel_filterbank(sample_rate, n_fft, mel_bins).to(flat.device).T @ spectrum
    log_mel = torch.log(mel.clamp(min=floor))
    return log_mel.reshape(batch, channels, mel_bins, -1).transpose(-1, -2)


def has_sound(clip: Clip) -> bool:
    """Whether a (checked) clip has an audio track: a video file with one, never a still."""
    return clip.info is not None and not clip.is_image and clip.info.has_audio


def sound_line(family: str, clips: Sequence[Clip]) -> str:
    """One line for a run's log: how many clips train with their sound, and that the others train video only."""
    heard = sum(1 for clip in clips if has_sound(clip))
    line = f"{family}: {heard} of {len(clips)} samples have an audio track and train sound and video together"
    if heard == len(clips):
        return line + "."
    return line + (f"; {len(clips) - heard} without one train video only (the video does not attend to the audio "
                   "stream).")
