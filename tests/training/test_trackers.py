"""TensorBoard and Weights & Biases: what a run sends them, and a clear refusal when the package is missing."""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import pytest

from vidtune.errors import ConfigError
from vidtune.trainers import build_trainer

SETTINGS = {"training": {"steps": 3}, "validation": {"enabled": True, "every": 2, "num_inference_steps": 1}}


def _metrics(run) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_tensorboard_gets_every_step_and_the_validation_videos(make_config, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    build_trainer(make_config(**SETTINGS, logging={"tensorboard": True}, output_dir=str(run))).run()
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0, "scalars": 0}).Reload()
    metrics = _metrics(run)
    losses = {event.step: event.value for event in events.Scalars("train/loss")}
    assert losses.keys() == metrics.keys() == {1, 2, 3}
    for step, value in losses.items():
        assert value == pytest.approx(metrics[step]["loss"], rel=1e-6)
    for name in ("lr", "grad_norm", "seconds_per_step", "samples_per_second"):
        assert [event.step for event in events.Scalars(f"train/{name}")] == [1, 2, 3], name
    # The samples of step 2 (validation.every) and of the end, as animated GIFs of every frame.
    images = events.Images("samples/0")
    assert [image.step for image in images] == [2, 3]
    assert all(image.encoded_image_string.startswith(b"GIF8") for image in images)


class FakeWandb(types.ModuleType):
    """Stands in for the `wandb` package: records what a run sends it."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.logged: list[tuple[int, dict]] = []
        self.finished = 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, values, step):
                fake.logged.append((step, values))

            def finish(self):
                fake.finished += 1

        return Run()

    class Video:
        def __init__(self, path, format):
            self.path, self.format = path, format


def test_wandb_gets_the_config_every_step_and_the_validation_videos(make_config, tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = tmp_path / "run"
    config = make_config(**SETTINGS, logging={"wandb": {"project": "my-loras", "mode": "offline"}},
                         output_dir=str(run))
    build_trainer(config).run()
    assert len(fake.inits) == 1 and fake.finished == 1
    init = fake.inits[0]
    assert (init["project"], init["mode"], init["name"], init["dir"]) == ("my-loras", "offline", "run", str(run))
    assert init["config"]["training"]["steps"] == 3
    metrics = _metrics(run)
    steps = [(step, values) for step, values in fake.logged if "train/loss" in values]
    assert [step for step, _ in steps] == [1, 2, 3]
    assert all(values["train/loss"] == metrics[step]["loss"] for step, values in steps)
    assert all(values["train/samples_per_second"] > 0 for _, values in steps)
    videos = [(step, values["samples/0"]) for step, values in fake.logged if "samples/0" in values]
    assert [step for step, _ in videos] == [2, 3]
    assert all(video.path.endswith(".mp4") and video.format == "mp4" for _, video in videos)


def test_wandb_offline_run_with_the_real_package(make_config, tmp_path):
    run = tmp_path / "run"
    config = make_config(training={"steps": 2}, logging={"wandb": {"project": "vidtune-tests", "mode": "offline"}},
                         output_dir=str(run))
    build_trainer(config).run()
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb")), "no offline W&B run was written"


@pytest.mark.parametrize(("logging", "extra"), [({"tensorboard": True}, "tensorboard"),
                                                 ({"wandb": {"project": "p"}}, "wandb")])
def test_a_missing_tracker_package_is_refused_before_any_work(make_config, tmp_path, monkeypatch, logging, extra):
    real = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, extra, raising=False)  # imported by an earlier test
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == extra else real(name, *a))
    trainer = build_trainer(make_config(logging=logging, output_dir=str(tmp_path / "run")))
    with pytest.raises(ConfigError, match=rf"(?s)needs the {extra} package.*pip install 'vidtune\[{extra}\]'") as error:
        trainer.run()
    assert "What to do:" in str(error.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and trainer.context is None


def test_wandb_without_a_login_says_what_to_do(make_config, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # no stored login
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    trainer = build_trainer(make_config(logging={"wandb": {"project": "p"}}, output_dir=str(tmp_path / "run")))
    with pytest.raises(ConfigError, match=r"logging.wandb: Weights & Biases did not start.*wandb login"):
        trainer.run()
    assert trainer.context is None, "the refusal came after the model was loaded"
