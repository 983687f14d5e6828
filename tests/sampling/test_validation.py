"""Validation samples: at a size the run trains, said and shown as they go, stopped by Ctrl-C like training, and
drawn for a person to read (prompt and step on each sheet, every validation side by side)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import av
import pytest
import yaml
from PIL import Image

from vidtune.cli import print_summary
from vidtune.sampling import SampleSettings, sheet_caption
from vidtune.sheets import sample_files
from vidtune.trainers import build_trainer

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(sys.path)}


def _frames(path: Path) -> tuple[int, int, int]:
    with av.open(str(path)) as container:
        decoded = list(container.decode(video=0))
    return len(decoded), decoded[0].height, decoded[0].width


def test_with_buckets_validation_samples_the_first_video_bucket_and_says_so(make_config, capsys):
    # data.frames / height / width are not what trains once data.buckets is set: the samples must not take them.
    config = make_config(data={"frames": 17, "height": 64, "width": 64, "buckets": [[1, 32, 32], [9, 32, 32]]},
                         training={"steps": 2}, validation={"enabled": True, "every": 1, "num_inference_steps": 2,
                                                            "prompts": ["a red circle", "a blue square"]})
    result = build_trainer(config).run()
    out = capsys.readouterr().out
    assert ("Validation at step 1: 2 samples at 9x32x32 (frames x height x width, from the first bucket of "
            "data.buckets with more than one frame), 2 denoising steps each.") in out, out
    assert [_frames(path) for path in result.sample_paths] == [(9, 32, 32), (9, 32, 32)]
    # The summary's list: both validations, by step then prompt; the final ones are the last two.
    run = Path(config.output_dir)
    assert [path.name for path in result.every_sample] == ["step-00000001-0.mp4", "step-00000001-1.mp4",
                                                           "step-00000002-0.mp4", "step-00000002-1.mp4"]
    assert result.every_sample == sample_files(run / "samples")
    by_step = run / "samples_by_step.png"
    assert f"every validation side by side: {by_step}" in out
    with Image.open(by_step) as sheet:  # two columns of steps, each at least one 160 px cell wide
        assert sheet.width >= 2 * 160
    print_summary(result, 1.0)
    summary = capsys.readouterr().out
    assert f"  by step      {by_step} (every validation side by side)" in summary
    assert [line.split()[1] for line in summary.splitlines() if line.startswith("  sample ")] == \
        [str(path) for path in result.every_sample]
    # validation.frames / height / width win over the buckets.
    shaped = make_config(data={"buckets": [[9, 32, 32]]}, training={"steps": 1},
                         validation={"enabled": True, "num_inference_steps": 1, "frames": 5, "height": 32,
                                     "width": 64}, output_dir=str(run.parent / "shaped"))
    assert [_frames(path) for path in build_trainer(shaped).run().sample_paths] == [(5, 32, 64)]
    assert "(frames x height x width, from validation.frames / height / width)" in capsys.readouterr().out


def test_a_sample_contact_sheet_is_a_captioned_grid(tmp_path):
    import numpy as np

    from vidtune.sheets import contact_sheet

    frames = np.zeros((17, 32, 48, 3), np.uint8)
    plain = contact_sheet(frames)
    captioned = contact_sheet(frames, ["a red circle moving left " * 6, "step 40, seed 0"])
    # 8 frames in 2 rows of 4, each grown to a readable 160 px; the caption adds lines above them.
    assert plain.width == 4 * 160 + 5 * 6 and plain.height > 2 * (160 * 32 // 48)
    assert captioned.width == plain.width and captioned.height >= plain.height + 3 * 16
    top = np.asarray(captioned)[: captioned.height - plain.height]
    assert top.std() > 0  # text is drawn there
    settings = SampleSettings(("a red circle",), 17, 32, 48, 30, 3.0, 0, 24.0)
    assert sheet_caption("a red circle", settings, 5, step=40) == [
        "a red circle", "step 40, seed 5, 17x32x48 (frames x height x width), 30 denoising steps, guidance 3"]


def _write_config(tmp_path: Path, tiny: Path, data: Path, **sections) -> Path:
    config = {
        "model": {"name": "ltx-video", "pretrained": str(tiny)},
        # Buckets only: data.frames is the family's default (49x512x768), which the samples must not take.
        "data": {"root": str(data), "buckets": [[9, 32, 32], [1, 32, 32]], "num_workers": 0},
        "training": {"steps": 3, "batch_size": 1, "learning_rate": 1e-3, "seed": 0, "precision": "fp32",
                     "device": "cpu"},
        "checkpoint": {"every": 1, "keep": 5},
        "logging": {"progress": True},
        "output_dir": str(tmp_path / "run"),
        **sections,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# `vidtune train` whose denoising steps take half a second each (as a large model's do): a first Ctrl-C is then
# still waiting for the step to end when a second one comes.
SLOW_STEPS = """
import contextlib, sys, time
import vidtune.sampling as sampling
plain = sampling.stoppable

@contextlib.contextmanager
def slow(pipeline, stop):
    with plain(pipeline, stop):
        hook = pipeline.transformer.register_forward_hook(lambda *_: time.sleep(0.5))
        try:
            yield
        finally:
            hook.remove()

sampling.stoppable = slow
from vidtune.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _start(config: Path, slow: bool = False) -> tuple[subprocess.Popen, queue.Queue]:
    command = ["-c", SLOW_STEPS] if slow else ["-m", "vidtune"]
    process = subprocess.Popen([sys.executable, *command, "train", str(config)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=ENV)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    return process, lines


def _read_until(stream, text: str, process: subprocess.Popen, seconds: float = 60) -> str:
    """What `stream` printed up to and including the line holding `text`."""
    seen: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    process.kill()
    pytest.fail(f"never printed {text!r}: {''.join(seen)[-2000:]}")


def _wait_for(lines: queue.Queue, text: str, process: subprocess.Popen, seconds: float = 180) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            seen.append(lines.get(timeout=1))
        except queue.Empty:
            if process.poll() is not None:
                break
            continue
        if text in seen[-1]:
            return seen
    process.kill()
    pytest.fail(f"never printed {text!r}; stdout: {''.join(seen)[-2000:]}; stderr: {process.stderr.read()[-2000:]}")


def test_ctrl_c_during_validation_stops_it_and_saves_like_during_training(tmp_path, tiny_model_dir,
                                                                          shapes_dataset):
    # Many denoising steps: the samples would take minutes if Ctrl-C did not stop them.
    config = _write_config(tmp_path, tiny_model_dir("ltx-video"), shapes_dataset,
                           validation={"enabled": True, "every": 1, "num_inference_steps": 20000})
    process, lines = _start(config)
    _wait_for(lines, "Validation at step 1: 1 sample at 9x32x32", process)
    time.sleep(1.0)  # into the denoising steps
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    code = process.wait(timeout=120)
    stderr = process.stderr.read()
    assert code == 130, stderr[-3000:]
    assert time.monotonic() - started < 60
    assert "SIGINT: stopping the validation samples, then saving a checkpoint of step 1. Send Ctrl+C again" in stderr
    assert "stopped after step 1 of 3" in stderr and "checkpoint.resume=latest" in stderr
    assert f"To look at what it learned so far: vidtune sample {tmp_path / 'run/checkpoints/step-00000001'}" in stderr
    assert "sample 1/1" in stderr  # the denoising bar
    run = tmp_path / "run"
    assert (run / "checkpoints" / "step-00000001").is_dir() and (run / "loss.png").is_file()
    assert not (run / "pytorch_lora_weights.safetensors").exists()


def test_a_second_ctrl_c_during_the_final_validation_quits_at_once(tmp_path, tiny_model_dir, shapes_dataset):
    config = _write_config(tmp_path, tiny_model_dir("ltx-video"), shapes_dataset, training={
        "steps": 1, "batch_size": 1, "learning_rate": 1e-3, "seed": 0, "precision": "fp32", "device": "cpu"},
        validation={"enabled": True, "num_inference_steps": 20000})
    process, lines = _start(config, slow=True)
    _wait_for(lines, "Validation at step 1", process)
    time.sleep(2.0)
    process.send_signal(signal.SIGINT)
    # The second Ctrl-C once the first is handled (two signals before the handler runs are one to Python).
    first_said: list[str] = []
    first_said.append(_read_until(process.stderr, "Send Ctrl+C again", process))
    process.send_signal(signal.SIGINT)
    code = process.wait(timeout=60)
    stderr = first_said[0] + process.stderr.read()
    assert code == 130, stderr[-3000:]
    assert "SIGINT: stopping the validation samples (the trained weights are saved). Send Ctrl+C again" in stderr
    assert "Interrupted at once" in stderr
    assert (tmp_path / "run" / "pytorch_lora_weights.safetensors").is_file()
