"""A clip's sound: the window's audio decoded with PyAV at the model's rate and channels, and the log-mel spectrogram
(real mp4 files with an AAC track, CPU only)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from vidtune.data.audio import (
    AudioFormat,
    decode_audio,
    hz_to_mel,
    log_mel_spectrogram,
    mel_filterbank,
    mel_to_hz,
    read_audio,
)
from vidtune.data.video import probe_video, write_video

SOURCE_RATE = 48000
TONE_HZ = 440.0


def tone(seconds: float, hz: float = TONE_HZ, rate: int = SOURCE_RATE, amplitude: float = 0.5) -> np.ndarray:
    return (amplitude * np.sin(2 * np.pi * hz * np.arange(round(seconds * rate)) / rate)).astype(np.float32)


def clip_with_sound(path: Path, frames: int = 48, fps: float = 24.0, sound: np.ndarray | None = None) -> Path:
    """Black frames with `sound` ([channels, samples] at 48 kHz; default a 440 Hz tone, quieter on the right)."""
    if sound is None:
        wave = tone(frames / fps)
        sound = np.stack([wave, 0.5 * wave])
    return write_video(path, np.zeros((frames, 16, 16, 3), np.uint8), fps, audio=sound, sample_rate=SOURCE_RATE)


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a, b)[0, 1])


def test_the_window_sound_starts_at_its_first_frame_at_the_models_rate(tmp_path: Path) -> None:
    path = clip_with_sound(tmp_path / "tone.mp4")
    assert probe_video(path).has_audio
    stereo = AudioFormat(16000, 2, 24.0)
    sound = decode_audio(path, 9, 24, stereo)  # frames 24..32: 1.0 s to 1.375 s
    assert sound is not None and sound.shape == (2, 6000) and sound.dtype == np.float32
    expected = 0.5 * np.sin(2 * np.pi * TONE_HZ * (1.0 + np.arange(6000) / 16000))
    assert correlation(sound[0], expected) > 0.99  # in phase: starts at 1.0 s to within a fraction of a period
    assert correlation(sound[0], np.roll(expected, 9)) < correlation(sound[0], expected)  # 9 samples: 1/4 period
    assert np.abs(sound[1]).max() == pytest.approx(0.5 * np.abs(sound[0]).max(), rel=0.05)  # channels kept apart
    mono = decode_audio(path, 9, 24, AudioFormat(16000, 1, 24.0))
    assert mono is not None and mono.shape == (1, 6000)
    # Mixed down as FFmpeg does: (left + right) / sqrt(2).
    np.testing.assert_allclose(mono[0], sound.sum(axis=0) / math.sqrt(2), atol=0.02)


def test_the_window_lasts_its_frames_at_the_frame_rate_the_model_is_told(tmp_path: Path) -> None:
    """A 30 fps clip read from source frame 15 starts at 0.5 s; 12 frames at 24 fps last 0.5 s."""
    path = clip_with_sound(tmp_path / "tone30.mp4", frames=60, fps=30.0)
    sound = decode_audio(path, 12, 15, AudioFormat(8000, 1, 24.0))
    assert sound is not None and sound.shape == (1, 4000)
    expected = np.sin(2 * np.pi * TONE_HZ * (0.5 + np.arange(4000) / 8000))
    assert correlation(sound[0], expected) > 0.99


def test_past_the_end_of_the_track_is_silence_and_no_track_is_none(tmp_path: Path) -> None:
    short = np.stack([tone(0.5)])  # a track of 0.5 s under 2 s of frames
    path = clip_with_sound(tmp_path / "short.mp4", sound=short)
    sound = decode_audio(path, 24, 0, AudioFormat(16000, 1, 24.0))  # 1 s
    assert sound is not None and sound.shape == (1, 16000)
    assert np.abs(sound[0, :7000]).min() < 0.01 < np.abs(sound[0, :7000]).max()
    assert np.abs(sound[0, 9000:]).max() < 1e-3
    silent = write_video(tmp_path / "silent.mp4", np.zeros((12, 16, 16, 3), np.uint8), 24)
    assert not probe_video(silent).has_audio
    assert decode_audio(silent, 12, 0, AudioFormat(16000, 2, 24.0)) is None
    missing = read_audio(silent, 12, 0, AudioFormat(16000, 2, 24.0))
    assert not missing.present and missing.waveform.shape == (2, 8000) and not missing.waveform.any()


def test_slaney_mel_scale() -> None:
    hz = torch.tensor([0.0, 200.0, 1000.0, 6400.0], dtype=torch.float64)
    torch.testing.assert_close(hz_to_mel(hz), torch.tensor([0.0, 3.0, 15.0, 42.0], dtype=torch.float64))
    torch.testing.assert_close(mel_to_hz(hz_to_mel(hz)), hz)
    filters = mel_filterbank(16000, 1024, 64)
    assert filters.shape == (513, 64) and filters.min() >= 0
    # Slaney normalisation: every triangle has unit area in Hz (its height is 2 / its width).
    area = filters.sum(dim=0) * (16000 / 1024)
    torch.testing.assert_close(area[1:-1], torch.ones(62), rtol=0.05, atol=0.0)


def test_a_tones_mel_peak_lands_in_its_bin_and_silence_gives_the_floor() -> None:
    rate, n_fft, hop, bins = 16000, 1024, 160, 64
    filters = mel_filterbank(rate, n_fft, bins)
    for hz in (300.0, 1000.0, 3000.0):
        wave = torch.from_numpy(tone(1.0, hz, rate)).view(1, 1, -1).repeat(1, 2, 1)
        log_mel = log_mel_spectrogram(wave, rate, n_fft, hop, bins)
        assert log_mel.shape == (1, 2, 1 + rate // hop, bins)
        expected_bin = int(filters[round(hz * n_fft / rate)].argmax())
        peaks = log_mel[0, 0, 5:-5].argmax(dim=-1)
        assert set(peaks.tolist()) <= {expected_bin - 1, expected_bin, expected_bin + 1}
        assert peaks.mode().values == expected_bin
    silence = log_mel_spectrogram(torch.zeros(2, 1, 3200), rate, n_fft, hop, bins)
    assert silence.shape == (2, 1, 21, bins)
    assert torch.equal(silence, torch.full_like(silence, math.log(1e-5)))
    # Louder sound, higher log-mel; a sound shorter than half a window still gives its frames.
    quiet = log_mel_spectrogram(0.1 * torch.from_numpy(tone(0.2, 1000.0, rate)).view(1, 1, -1), rate, n_fft, hop, bins)
    loud = log_mel_spectrogram(torch.from_numpy(tone(0.2, 1000.0, rate)).view(1, 1, -1), rate, n_fft, hop, bins)
    torch.testing.assert_close(loud[..., 20], quiet[..., 20] + math.log(10.0), rtol=0, atol=1e-3)
    assert log_mel_spectrogram(torch.ones(1, 1, 300), rate, n_fft, hop, bins).shape == (1, 1, 2, bins)


def test_the_dataset_gives_each_window_its_sound_and_the_frame_store_keeps_it(tmp_path: Path) -> None:
    from vidtune.data.dataset import VideoCaptionDataset, collate_samples
    from vidtune.data.frame_store import FrameStore
    from vidtune.data.sources import Clip

    paths = [clip_with_sound(tmp_path / "tone.mp4"),
             write_video(tmp_path / "silent.mp4", np.zeros((48, 16, 16, 3), np.uint8), 24)]
    clips = [Clip(path, "c", number, number + 1, info=probe_video(path), bucket=0) for number, path in enumerate(paths)]
    audio = AudioFormat(16000, 2, 24.0)
    store = FrameStore.create(8, num_workers=0)
    stored = VideoCaptionDataset(clips, [(9, 16, 16)], store=store, audio=audio)
    plain = VideoCaptionDataset(clips, [(9, 16, 16)], audio=audio)
    for _ in range(2):
        batch = collate_samples([stored[(0, index, 0)] for index in range(2)])
        expected = collate_samples([plain[(0, index, 0)] for index in range(2)])
        assert torch.equal(batch["audio"], expected["audio"]) and batch["audio"].shape == (2, 2, 6000)
        assert batch["audio_present"].tolist() == [True, False]
    assert batch["audio"][0].abs().max() > 0.3 and not batch["audio"][1].any()
    assert (store.misses, store.hits) == (4, 4)  # frames and sound of two windows, each decoded once
    # Families without sound read none.
    assert "audio" not in VideoCaptionDataset(clips, [(9, 16, 16)])[(0, 0, 0)]
