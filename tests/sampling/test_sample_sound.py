"""LTX-2 generates sound with its video: validation samples and `vidtune sample` write it as the mp4's sound track
(read back with PyAV); a family without sound writes none."""

from __future__ import annotations

from pathlib import Path

import av
import pytest
import torch

from tests.helpers.sound import assert_sound_track, read_sound, record_samples
from vidtune.cli import main as cli_main
from vidtune.models.ltx_2 import LTX2Spec
from vidtune.models.spec import GeneratedSample
from vidtune.trainers import build_trainer


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
    original = LTX2Spec.sample

    def sample(self, *args, **kwargs):
        sampled.append(original(self, *args, **kwargs))
        return sampled[-1]

    monkeypatch.setattr(LTX2Spec, "sample", sample)
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
