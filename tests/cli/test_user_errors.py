"""Mistakes a user can make end as a VidtuneError naming the file or key, never as a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, IPNDMScheduler

from vidtune.config import ModelConfig, TrainingConfig
from vidtune.errors import SchedulerError, VidtuneError
from vidtune.models.registry import get_spec_class
from vidtune.models.tiny import TINY_SHAPES
from vidtune.objectives import DDPM, FlowMatching, objective_from_scheduler

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def edit_scheduler(tiny: Path, folder: Path, **changes) -> Path:
    """A copy of a tiny model folder whose scheduler/scheduler_config.json has `changes`."""
    model = shutil.copytree(tiny, folder)
    path = model / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return model


def _model_config(family: str, pretrained: Path) -> ModelConfig:
    return ModelConfig(name=family, pretrained=str(pretrained))


def test_supported_schedulers_still_give_their_objective():
    assert isinstance(objective_from_scheduler(FlowMatchEulerDiscreteScheduler()), FlowMatching)
    assert isinstance(objective_from_scheduler(DDIMScheduler(prediction_type="v_prediction")), DDPM)


@pytest.mark.parametrize("scheduler", [IPNDMScheduler(), DDIMScheduler(prediction_type="sample")],
                         ids=["no-objective", "prediction-type"])
def test_a_scheduler_without_an_objective_is_a_plain_error(scheduler):
    with pytest.raises(SchedulerError) as raised:
        objective_from_scheduler(scheduler, source="model.pretrained: /models/x/scheduler/scheduler_config.json")
    message = str(raised.value)
    assert message.startswith("model.pretrained: /models/x/scheduler/scheduler_config.json: ")
    assert type(scheduler).__name__ in message and "Supported: flow matching" in message
    assert isinstance(raised.value, VidtuneError)


def test_the_spec_names_its_scheduler_config(tiny_model_dir, tmp_path):
    model = edit_scheduler(tiny_model_dir("wan"), tmp_path / "wan", _class_name="NoSuchScheduler")
    spec = get_spec_class("wan")(_model_config("wan", model))
    with pytest.raises(SchedulerError) as raised:
        spec.objective(TrainingConfig())
    config_file = (model / "scheduler" / "scheduler_config.json").resolve()
    assert f"model.pretrained: {config_file}: _class_name 'NoSuchScheduler'" in str(raised.value)
    # A diffusers class that is not a scheduler is refused the same way, not loaded.
    model = edit_scheduler(tiny_model_dir("wan"), tmp_path / "wan-2", _class_name="WanPipeline")
    with pytest.raises(SchedulerError, match="'WanPipeline' is not a diffusers scheduler"):
        get_spec_class("wan")(_model_config("wan", model)).objective(TrainingConfig())


def test_train_with_an_unsupported_prediction_type_exits_2_with_the_file(tmp_path, tiny_model_dir, shapes_dataset):
    model = edit_scheduler(tiny_model_dir("cogvideox"), tmp_path / "model", prediction_type="sample")
    frames, height, width = TINY_SHAPES["cogvideox"]
    config = {
        "model": {"name": "cogvideox", "pretrained": str(model)},
        "data": {"root": str(shapes_dataset), "frames": frames, "height": height, "width": width, "num_workers": 0},
        "training": {"steps": 2, "device": "cpu", "precision": "fp32"},
        "validation": {"enabled": False},
        "logging": {"progress": False},
        "output_dir": str(tmp_path / "run"),
    }
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "vidtune", "train", str(path)], capture_output=True, text=True,
                            env=ENV, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    config_file = (model / "scheduler" / "scheduler_config.json").resolve()
    assert f"error: model.pretrained: {config_file}: " in result.stderr
    assert "prediction_type 'sample'" in result.stderr and "Supported:" in result.stderr


def _config_file(tmp_path: Path, tiny: Path, root: Path, family: str = "ltx-video") -> Path:
    frames, height, width = TINY_SHAPES[family]
    config = {
        "model": {"name": family, "pretrained": str(tiny)},
        "data": {"root": str(root), "frames": frames, "height": height, "width": width, "num_workers": 0},
        "training": {"steps": 2, "device": "cpu", "precision": "fp32"},
        "validation": {"enabled": False},
        "logging": {"progress": False},
        "precompute": {"cache_dir": str(tmp_path / "cache")},
        "output_dir": str(tmp_path / "run"),
    }
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(("argv", "expected"), [
    (["precompute", "{config}", "precompute.cache_dir={file}"], "precompute.cache_dir: {file} is a file, not a folder"),
    (["precompute", "{config}", "precompute.vae_devices=[gpu0]"], "precompute.vae_devices='gpu0' is not a device"),
    (["precompute", "{config}", "precompute.text_device=cuda:{gpus}"], "precompute.text_device=cuda:{gpus}: this "
                                                                       "machine has"),
    (["train", "{config}", "training.device=gpu"], "training.device='gpu' is not a device"),
    (["cache", "info", "--cache-dir", "{tmp}/missing"], "The cache folder {tmp}/missing does not exist"),
    (["data", "check", "{config}", "--overview", "{file}/overview.png"], "--overview: cannot write the overview "
                                                                         "{file}/overview.png"),
    (["data", "check", "{config}", "--overview", "{tmp}/sheet.png", "--report", "{file}/report.json"],
     "--report: cannot write the report {file}/report.json"),
    (["quickstart", "--output", "{file}"], "--output: cannot create the folder {file}"),
    (["train", "{config}", "model.name=cogvideox"], "model.pretrained: {ltx}/vae/config.json names "
     "AutoencoderKLLTXVideo, but model.name=cogvideox needs AutoencoderKLCogVideoX; it fits model.name=ltx-video"),
], ids=["cache-dir-is-a-file", "no-such-device", "no-such-gpu", "training-device", "missing-cache", "overview",
        "report", "quickstart-output", "folder-of-another-family"])
def test_settings_that_cannot_work_exit_2_naming_the_key(argv, expected, tmp_path, tiny_model_dir, shapes_dataset,
                                                         capsys):
    from vidtune.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    values = {"config": _config_file(tmp_path, tiny_model_dir("ltx-video"), shapes_dataset), "file": blocker,
              "tmp": tmp_path, "gpus": torch.cuda.device_count(), "ltx": tiny_model_dir("ltx-video").resolve()}
    code = main([arg.format(**values) for arg in argv])
    error = capsys.readouterr().err
    assert code == 2, error
    assert f"error: {expected.format(**values)}" in error
    assert not (tmp_path / "run").exists()


def test_a_full_disk_during_precompute_exits_2_naming_the_cache(tmp_path, tiny_model_dir, shapes_dataset, monkeypatch,
                                                                capsys):
    from vidtune.cli import main
    from vidtune.precompute import cache as cache_module

    write = cache_module.atomic_write_bytes

    def full_disk(path, data, durable=True):
        if path.suffix == ".safetensors":
            raise OSError(28, "No space left on device")
        write(path, data, durable)

    monkeypatch.setattr(cache_module, "atomic_write_bytes", full_disk)
    code = main(["precompute", str(_config_file(tmp_path, tiny_model_dir("ltx-video"), shapes_dataset))])
    error = capsys.readouterr().err
    assert code == 2, error
    assert f"error: precompute.cache_dir: could not write the cache entry {tmp_path / 'cache'}" in error
    assert "(No space left on device)" in error
