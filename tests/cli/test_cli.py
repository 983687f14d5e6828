"""The `vidtune` command as a user runs it: real subprocesses, real exit codes, plain messages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def vidtune(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vidtune", *args], capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=600)


@pytest.mark.slow
def test_quickstart_runs_end_to_end(tmp_path):
    out = tmp_path / "qs"
    result = vidtune("quickstart", "--output", str(out), "training.steps=10", "checkpoint.every=5",
                     "validation.num_inference_steps=3")
    assert result.returncode == 0, result.stderr[-3000:]
    run = out / "run"
    assert (run / "pytorch_lora_weights.safetensors").stat().st_size > 0
    assert (run / "loss.png").is_file() and (run / "metrics.jsonl").is_file()
    assert list((run / "samples").glob("*.mp4")) and list((run / "samples").glob("*.png"))
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 10
    assert "pytorch_lora_weights.safetensors" in result.stdout
    # No engine's guess about the machine as the first words a creator reads; the noise in the samples explained.
    assert "Setting accelerator to CPU" not in result.stdout + result.stderr
    assert "the tiny model has random weights" in result.stdout
    # The written config is a normal one: the user can train on it again.
    config = yaml.safe_load((out / "quickstart.yaml").read_text())
    assert config["model"]["name"] == "ltx-video"
    assert (out / "quickstart.yaml").read_text().startswith("# Run with: vidtune train")
    # Where its tiny model and clips are, and the exact command to train the tiny model on one's own clips.
    assert f"tiny model   {out / 'tiny-ltx-video'}" in result.stdout and f"clips        {out / 'data'}" in result.stdout
    assert (f"vidtune train {out / 'quickstart.yaml'} data.root=/path/to/your/clips output_dir=my-first-run"
            in result.stdout)

    # Its config again: the refusal names a fresh output_dir to use.
    again = vidtune("train", str(out / "quickstart.yaml"))
    assert again.returncode == 2
    assert f"add output_dir={run}-2" in again.stderr and "checkpoint.resume=latest" in again.stderr
    # A shape the tiny model refuses: the rule is the tiny model's own, and the published one is shown beside it.
    shape = vidtune("train", str(out / "quickstart.yaml"), "data.frames=10", f"output_dir={tmp_path / 'other'}")
    assert shape.returncode == 2
    assert (f"does not fit the ltx-video model at {out / 'tiny-ltx-video'} (its rule, read from its own configs: "
            "frames 4k+1, sides multiples of 4)") in shape.stderr
    assert "the published LTX-Video checkpoints need frames 8k+1, sides multiples of 32" in shape.stderr


def test_a_second_quickstart_keeps_the_first_run(tmp_path, monkeypatch, capsys):
    from vidtune import quickstart

    trained: list[str] = []

    class Recorder:
        def __init__(self, config):
            trained.append(config.output_dir)

        def run(self):
            Path(trained[-1]).mkdir(parents=True)
            (Path(trained[-1]) / "metrics.jsonl").write_text("{}\n")

    monkeypatch.setattr(quickstart, "build_trainer", Recorder)
    monkeypatch.setattr(quickstart, "prepare_quickstart",
                        lambda folder, run: _write_config(folder, tmp_path / "m", tmp_path / "d", output_dir=str(run)))
    (tmp_path / "m" / "transformer").mkdir(parents=True)
    (tmp_path / "d").mkdir()
    quickstart.run_quickstart(tmp_path)
    quickstart.run_quickstart(tmp_path)
    assert [Path(path).name for path in trained] == ["run", "run-2"]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()  # the first run is still there
    assert f"An earlier quickstart run is in {tmp_path / 'run'} (kept)" in capsys.readouterr().out


def _write_config(tmp_path: Path, tiny: Path, root: Path, **extra) -> Path:
    config = {
        "model": {"name": "ltx-video", "pretrained": str(tiny)},
        "data": {"root": str(root), "frames": 9, "height": 32, "width": 32, "num_workers": 0},
        "training": {"steps": 2, "device": "cpu", "precision": "fp32"},
        "validation": {"enabled": False},
        "output_dir": str(tmp_path / "run"),
        **extra,
    }
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_bad_dataset_exits_nonzero_with_every_bad_line_and_trains_nothing(tmp_path, tiny_model_dir, shapes_dataset):
    root = tmp_path / "data"
    root.mkdir()
    clips = sorted((shapes_dataset / "clips").glob("*.mp4"))
    (root / "videos.txt").write_text(f"{clips[0]}\nmissing.mp4\n{clips[1]}\n")
    (root / "prompts.txt").write_text("a red circle\n\n")
    path = _write_config(tmp_path, tiny_model_dir("ltx-video"), root)
    result = vidtune("train", str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "missing.mp4" in result.stderr and "line 2" in result.stderr
    assert "prompts.txt" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_bad_config_value_and_unknown_key(tmp_path, tiny_model_dir, shapes_dataset):
    path = _write_config(tmp_path, tiny_model_dir("ltx-video"), shapes_dataset)
    result = vidtune("train", str(path), "training.stepz=3", "lora.rank=0")
    assert result.returncode == 2
    assert "training.stepz: unknown key. Did you mean 'steps'?" in result.stderr
    assert "lora.rank" in result.stderr and "greater than 0" in result.stderr


def test_wrong_model_path_and_wrong_frame_count(tmp_path, tiny_model_dir, shapes_dataset):
    path = _write_config(tmp_path, tmp_path / "no-model-here", shapes_dataset)
    result = vidtune("train", str(path))
    assert result.returncode == 2 and "does not exist" in result.stderr and "model.pretrained" in result.stderr

    path = _write_config(tmp_path, tiny_model_dir("ltx-video"), shapes_dataset)
    result = vidtune("train", str(path), "data.frames=10")
    assert result.returncode == 2
    assert "data.frames=10" in result.stderr and "9 or 13" in result.stderr


def test_data_check_writes_overview(tmp_path, tiny_model_dir, shapes_dataset):
    path = _write_config(tmp_path, tiny_model_dir("ltx-video"), shapes_dataset)
    result = vidtune("data", "check", str(path), "--overview", str(tmp_path / "overview.png"))
    assert result.returncode == 0, result.stderr
    assert "4 samples" in result.stdout
    assert (tmp_path / "overview.png").stat().st_size > 1000


def test_hub_id_without_network_fails_within_seconds_saying_what_to_do(tmp_path, shapes_dataset):
    """The README's config on a machine without network: one plain message in seconds, not 30 s of retries."""
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "ltx-video", "pretrained": "Lightricks/LTX-Video"},
                                    "data": {"root": str(shapes_dataset)}, "output_dir": str(tmp_path / "run")}))
    # No HF_HUB_OFFLINE, and a hub endpoint where nothing answers: no network, on any machine.
    env = {key: value for key, value in ENV.items() if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_CACHE=str(tmp_path / "hub-cache"))
    result = subprocess.run([sys.executable, "-m", "vidtune", "train", str(path)], capture_output=True, text=True,
                            env=env, timeout=30)
    assert result.returncode == 2, result.stderr
    assert "cannot reach the Hugging Face hub (http://127.0.0.1:9) to get Lightricks/LTX-Video" in result.stderr
    assert "What to do:" in result.stderr and "hf download Lightricks/LTX-Video" in result.stderr
    assert "does not appear to have a file" not in result.stderr and "Retrying" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 2, result.stderr  # the message, no library lines
    assert not (tmp_path / "run").exists()


def test_cached_hub_model_offline_runs_without_library_warnings(tmp_path, tiny_model_dir, shapes_dataset):
    from tests.helpers.hub import fake_hub_cache

    fake_hub_cache(tmp_path / "hub-cache", "someone/tiny-ltx", tiny_model_dir("ltx-video"))
    path = _write_config(tmp_path, "someone/tiny-ltx", shapes_dataset)
    env = {**ENV, "HF_HUB_CACHE": str(tmp_path / "hub-cache")}
    result = subprocess.run([sys.executable, "-m", "vidtune", "data", "check", str(path)], capture_output=True,
                            text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr and "warn" not in result.stderr, result.stderr

    missing = subprocess.run([sys.executable, "-m", "vidtune", "data", "check", str(path),
                              "model.pretrained=someone/not-cached"], capture_output=True, text=True, env=env,
                             timeout=600)
    assert missing.returncode == 2
    assert "someone/not-cached is not in this machine's hub cache" in missing.stderr


def test_relative_paths_in_a_config_work_from_another_folder(tmp_path, tiny_model_dir, shapes_dataset):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copytree(shapes_dataset, project / "clips")
    shutil.copytree(tiny_model_dir("ltx-video"), project / "model")
    (project / "my.yaml").write_text(yaml.safe_dump({
        "model": {"name": "ltx-video", "pretrained": "model"},
        "data": {"root": "clips", "frames": 9, "height": 32, "width": 32},
        "output_dir": "runs/first",
    }))
    result = vidtune("data", "check", "../project/my.yaml", cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    assert (project / "runs" / "first" / "dataset_overview.png").is_file()
    assert not (elsewhere / "runs").exists()


@pytest.mark.parametrize("case", ["no config", "missing file", "bad key on the command line", "unknown model",
                                  "no model folder", "not cached offline", "no data folder", "missing clip",
                                  "shape", "used output_dir"])
def test_every_error_says_what_where_and_what_to_do(case, tmp_path, tiny_model_dir, shapes_dataset, capsys,
                                                    monkeypatch):
    from huggingface_hub import constants

    from vidtune.cli import main

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    data = tmp_path / "data"
    data.mkdir()
    (data / "videos.txt").write_text("clips/missing.mp4\n")
    (data / "prompts.txt").write_text("a caption\n")
    path = _write_config(tmp_path, tiny_model_dir("ltx-video"), shapes_dataset)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "pytorch_lora_weights.safetensors").write_bytes(b"")  # what a finished run leaves
    args, where = {
        "no config": (["train"], "No config given"),
        "missing file": (["train", str(tmp_path / "nope.yaml")], str(tmp_path / "nope.yaml")),
        "bad key on the command line": (["train", str(path), "lora.rnak=4"], "On the command line:\n  - lora.rnak"),
        "unknown model": (["data", "check", str(path), "model.name=ltx"], "model.name: unknown model 'ltx'"),
        "no model folder": (["data", "check", str(path), f"model.pretrained={tmp_path / 'm'}"], "model.pretrained"),
        "not cached offline": (["data", "check", str(path), "model.pretrained=someone/model"], "someone/model"),
        "no data folder": (["data", "check", str(path), f"data.root={tmp_path / 'd'}"], str(tmp_path / "d")),
        "missing clip": (["data", "check", str(path), f"data.root={data}"], "videos.txt line 1"),
        "shape": (["data", "check", str(path), "data.frames=10"], "data.frames=10"),
        "used output_dir": (["train", str(path)], f"output_dir {tmp_path / 'run'} already holds a run"),
    }[case]
    # `vidtune data check` answers a problem with the data (not with the command) by its exit status 1.
    data_problem = case in ("no data folder", "missing clip", "shape")
    assert main(args) == (1 if data_problem else 2)
    err = capsys.readouterr().err
    opening = "training would stop:" if data_problem else "\nerror: "
    assert opening in err, err
    err = err[err.index(opening):]  # (a fixture's progress bar may come first)
    assert where in err, err
    assert err.strip().splitlines()[-1].startswith("What to do: "), err


def test_deepspeeds_guess_about_the_machine_is_not_shown():
    """accelerate imports DeepSpeed whenever a model is saved (the quickstart's first step); on a machine without
    a GPU its import warns "Setting accelerator to CPU", which would be the first line a creator reads."""
    pytest.importorskip("deepspeed")
    code = ("import vidtune\nfrom deepspeed.accelerator import get_accelerator\nprint(get_accelerator()._name)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**ENV, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("cpu")
    assert "Setting accelerator to CPU" not in result.stdout + result.stderr
