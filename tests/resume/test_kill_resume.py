"""Real processes killed mid-run: SIGKILL after a checkpoint, then `checkpoint.resume=latest`, must end with
bitwise the same weights as the same run left alone; SIGTERM saves a checkpoint and exits 143."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers.datasets import control_dataset
from vidtune import checkpoint
from vidtune.models.tiny import TINY_SHAPES

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
LORA = ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_ema.safetensors")
TRANSFORMER = ("transformer/diffusion_pytorch_model.safetensors", "transformer_ema/diffusion_pytorch_model.safetensors")
# Every algorithm: (its final weights, their moving average), and the settings it adds.
ALGORITHMS = {
    "lora": (*LORA, {}),
    "full": (*TRANSFORMER, {}),
    "control-lora": (*LORA, {}),
    "guidance-distillation": (*LORA, {"distillation": {"guidance_scale": 3.0}}),
    "step-distillation": (*LORA, {"distillation": {"student_steps": 2, "teacher_steps": 4}}),
}
STEPS, EVERY = 8, 4


def _config(tmp_path: Path, tiny: Path, data: Path, algorithm: str) -> Path:
    frames, height, width = TINY_SHAPES["ltx-video"]
    if algorithm.startswith("control-"):
        data, _, _ = control_dataset(data, tmp_path / "control-data")
    config = {
        "model": {"name": "ltx-video", "pretrained": str(tiny)},
        "data": {"root": str(data), "frames": frames, "height": height, "width": width, "num_workers": 0},
        # The weights' moving average is part of the state too: it must resume bit for bit as well.
        "training": {"algorithm": algorithm, "steps": STEPS, "batch_size": 1, "learning_rate": 1e-3, "seed": 0,
                     "precision": "fp32", "device": "cpu", "ema_decay": 0.9},
        **ALGORITHMS[algorithm][2],
        # Dropout draws from the global torch RNG: equal weights also prove the RNG state was restored.
        "lora": {"rank": 4, "alpha": 4, "dropout": 0.1},
        "optimizer": {"lr_scheduler": "cosine", "warmup_steps": 2},
        "checkpoint": {"every": EVERY, "keep": 2},
        "validation": {"enabled": False},
        "logging": {"progress": False},
    }
    path = tmp_path / f"{algorithm}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _start(config: Path, out: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "vidtune", "train", str(config), f"output_dir={out}", *overrides],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )


def _finish(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def _wait_for_checkpoint(process: subprocess.Popen, out: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not checkpoint.list_checkpoints(out / "checkpoints"):
        assert process.poll() is None, f"the run ended before its first checkpoint:\n{process.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_sigkill_after_a_checkpoint_then_resume_gives_bitwise_the_same_weights(
    algorithm, tmp_path, tiny_model_dir, shapes_dataset
):
    config = _config(tmp_path, tiny_model_dir("ltx-video"), shapes_dataset, algorithm)
    final, final_ema, _ = ALGORITHMS[algorithm]
    reference_dir, killed_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    # Both start together (same command, same environment); one is killed once its first checkpoint exists.
    reference = _start(config, reference_dir)
    victim = _start(config, killed_dir)
    _wait_for_checkpoint(victim, killed_dir)
    victim.send_signal(signal.SIGKILL)
    code, _, _ = _finish(victim)
    assert code == -signal.SIGKILL
    at_kill = [p.name for p in checkpoint.list_checkpoints(killed_dir / "checkpoints")]
    rows_at_kill = len((killed_dir / "metrics.jsonl").read_text().splitlines())
    assert not (killed_dir / final).exists() and checkpoint.step_of(Path(at_kill[-1])) < STEPS

    code, stdout, stderr = _finish(_start(config, killed_dir, "checkpoint.resume=latest"))
    assert code == 0, stderr[-3000:]
    assert f"Resuming from {killed_dir / 'checkpoints' / at_kill[-1]}" in stdout
    code, _, stderr = _finish(reference)
    assert code == 0, stderr[-3000:]

    resumed, uninterrupted = load_file(killed_dir / final), load_file(reference_dir / final)
    assert resumed.keys() == uninterrupted.keys() and resumed
    differing = [key for key in resumed if not torch.equal(resumed[key], uninterrupted[key])]
    assert not differing, f"{len(differing)} tensors differ, e.g. {differing[:3]}"
    resumed_ema, uninterrupted_ema = (load_file(folder / final_ema) for folder in (killed_dir, reference_dir))
    assert resumed_ema.keys() == resumed.keys()
    differing = [key for key in resumed_ema if not torch.equal(resumed_ema[key], uninterrupted_ema[key])]
    assert not differing, f"{len(differing)} tensors of the weights' average differ, e.g. {differing[:3]}"
    # The log is whole too: each step once, the same losses.
    rows = [json.loads(line) for line in (killed_dir / "metrics.jsonl").read_text().splitlines()]
    reference_rows = [json.loads(line) for line in (reference_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == [r["loss"] for r in reference_rows]
    print(f"\n{algorithm}: {STEPS} steps, checkpoint every {EVERY}; SIGKILL with {at_kill} on disk and "
          f"{rows_at_kill} metric rows written; resumed from {at_kill[-1]}; {len(resumed)} final tensors and "
          "their moving average bitwise equal (torch.equal) to the uninterrupted run")


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_at_the_step_and_exits_143(tmp_path, tiny_model_dir, shapes_dataset):
    config = _config(tmp_path, tiny_model_dir("ltx-video"), shapes_dataset, "lora")
    out = tmp_path / "run"
    process = _start(config, out, "checkpoint.every=1")
    _wait_for_checkpoint(process, out)
    process.send_signal(signal.SIGTERM)
    code, _, stderr = _finish(process)
    assert code == 143, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "SIGTERM received: stopped after step" in stderr and "checkpoint.resume=latest" in stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    newest = checkpoint.latest(out / "checkpoints")
    assert checkpoint.step_of(newest) == steps[-1] < STEPS  # saved at the step it stopped after
    assert not (out / LORA[0]).exists()
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
