"""Generated sound: recording what a spec generates, and reading an mp4's sound track back with PyAV."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np

from vidtune.models.spec import GeneratedSample

AAC_FRAME = 1024  # samples per AAC frame: the last one is padded with silence


def record_samples(spec) -> list[GeneratedSample]:
    """Every sample `spec.sample` returns from now on (what validation and `vidtune sample` write)."""
    made: list[GeneratedSample] = []
    original = spec.sample

    def sample(*args, **kwargs):
        made.append(original(*args, **kwargs))
        return made[-1]

    spec.sample = sample
    return made


def read_sound(path: Path) -> tuple[np.ndarray, int] | None:
    """The mp4's sound track decoded ([channels, samples] float, its rate), or None when it has none."""
    with av.open(str(path)) as container:
        if not container.streams.audio:
            return None
        rate = container.streams.audio[0].rate
        chunks = [frame.to_ndarray() for frame in container.decode(audio=0)]
    return np.concatenate(chunks, axis=1), rate


def below(waveform: np.ndarray, rate: int, highest_hz: float) -> np.ndarray:
    """`waveform` [channels, samples] without its content above `highest_hz`."""
    spectrum = np.fft.rfft(waveform, axis=1)
    spectrum[:, np.fft.rfftfreq(waveform.shape[1], 1.0 / rate) > highest_hz] = 0
    return np.fft.irfft(spectrum, n=waveform.shape[1], axis=1)


def assert_sound_track(path: Path, generated: GeneratedSample, frames: int, fps: float,
                       highest_hz: float | None = None) -> None:
    """`path`'s sound is `generated`'s: its rate and channels, its length (up to the padding of the last AAC frame),
    the clip's duration within 60 ms (the causal audio decoder gives 3 mel frames less), and its waveform (below
    `highest_hz` where given: AAC drops much of the highest band of a random model's noise-like sound)."""
    sound = read_sound(path)
    assert sound is not None, f"{path} has no sound track"
    decoded, rate = sound
    audio = generated.audio.numpy()
    assert rate == generated.sample_rate and decoded.shape[0] == audio.shape[0] == 2
    assert audio.shape[1] <= decoded.shape[1] < audio.shape[1] + AAC_FRAME
    assert abs(decoded.shape[1] / rate - frames / fps) < 0.06
    # AAC is lossy: the decoded waveform follows the generated one closely, not exactly (and is not silence).
    heard = decoded[:, : audio.shape[1]]
    assert np.abs(audio).max() > 0.05
    if highest_hz is not None:
        heard, audio = below(heard, rate, highest_hz), below(audio, rate, highest_hz)
    assert np.sqrt(np.mean((heard - audio) ** 2)) < 0.25 * np.sqrt(np.mean(audio**2))


def add_tone(path: Path, hz: float = 1000.0, rate: int = 48000) -> None:
    """Rewrite the clip at `path` with a stereo tone of `hz` as its sound track, as long as its frames."""
    from vidtune.data.video import probe_video, read_frames, write_video

    info = probe_video(path)
    frames = np.stack(read_frames(path, list(range(info.num_frames))))
    wave = 0.5 * np.sin(2 * np.pi * hz * np.arange(round(info.num_frames / info.fps * rate)) / rate)
    write_video(path, frames, info.fps, audio=np.stack([wave, 0.7 * wave]).astype(np.float32), sample_rate=rate)
