"""LTX-2 generates sound with its video: validation samples and `vidtune sample` write it as the mp4's sound track
(read back with PyAV); a family without sound writes none."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest
import torch

from vidtune.cli import main as cli_main
from vidtune.models.ltx_2 import LTX2Spec
from vidtune.models.spec import GeneratedSample
from vidtune.trainers import build_trainer

AAC_FRAME = 1024  # samples per AAC frame: the last one is padded with silence


def record_samples(spec) -> list[GeneratedSample]:
    """Every sample `spec.generate_sample` returns from now on (what validation and `vidtune sample` write)."""
    made: list[GeneratedSample] = []
    original = spec.generate_sample

    def generate_sample(*args, **kwargs):
        made.append(original(*args, **kwargs))
        return made[-1]

    spec.generate_sample = generate_sample
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


def test_ltx_2_validation_and_vidtune_sample_write_the_generated_sound(make_config, tmp_path, capsys, monkeypatch):
    config = make_config("ltx-2", training={"steps": 1},
                         validation={"enabled": True, "num_inference_steps": 2, "prompts": ["a tone"]})
    frames, fps = config.data.frames, config.frame_rate
    trainer = build_trainer(config)
    validated = record_samples(trainer.spec)
    trainer.run()
    videos = sorted((Path(config.output_dir) / "samples").glob("*.mp4"))
    assert len(videos) == len(validated) == 1
    assert_sound_track(videos[0], validated[0], frames, fps)
    with av.open(str(videos[0])) as container:  # the frames are written as before
        assert len(list(container.decode(video=0))) == frames

    # `vidtune sample`, in-process: the run's pipeline (its adapter loaded, the vocoder beside it), at another length.
    sampled: list[GeneratedSample] = []
    original = LTX2Spec.generate_sample

    def generate_sample(self, *args, **kwargs):
        sampled.append(original(self, *args, **kwargs))
        return sampled[-1]

    monkeypatch.setattr(LTX2Spec, "generate_sample", generate_sample)
    out, longer = tmp_path / "sample.mp4", frames + 8
    assert cli_main(["sample", config.output_dir, "--prompt", "a tone", "--steps", "2", "--frames", str(longer),
                     "--output", str(out), "--device", "cpu"]) == 0
    assert len(sampled) == 1
    assert_sound_track(out, sampled[0], longer, fps)
    assert f"{out.resolve()} (with the sampled sound; + sample.png contact sheet" in capsys.readouterr().out


def test_a_family_without_sound_writes_no_sound_track(make_config, tmp_path, capsys):
    config = make_config("ltx-video", training={"steps": 1},
                         validation={"enabled": True, "num_inference_steps": 1, "prompts": ["a red circle"]})
    trainer = build_trainer(config)
    validated = record_samples(trainer.spec)
    trainer.run()
    assert len(validated) == 1 and validated[0].audio is None
    videos = sorted((Path(config.output_dir) / "samples").glob("*.mp4"))
    assert len(videos) == 1 and read_sound(videos[0]) is None
    with av.open(str(videos[0])) as container:
        assert len(list(container.decode(video=0))) == config.data.frames
    out = tmp_path / "sample.mp4"
    assert cli_main(["sample", config.output_dir, "--prompt", "x", "--steps", "1", "--output", str(out),
                     "--device", "cpu"]) == 0
    assert read_sound(out) is None and f"{out.resolve()} (+ sample.png contact sheet" in capsys.readouterr().out



def test_a_samples_sound_needs_its_rate():
    frames = torch.zeros(2, 3, 8, 8)
    assert GeneratedSample(frames).audio is None
    with pytest.raises(ValueError, match="sample rate"):
        GeneratedSample(frames, torch.zeros(2, 100))
    with pytest.raises(ValueError, match="sample rate"):
        GeneratedSample(frames, torch.zeros(2, 100), 0)
