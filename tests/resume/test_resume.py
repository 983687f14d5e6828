"""Checkpoints, resume and faults, in-process: what a resumed run accepts, signals, NaNs and a full disk.

The SIGKILL-and-resume checks with real processes are in tests/resume/test_kill_resume.py.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shlex
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file

from tests.helpers.runs import run_stopped_at
from vidtune import checkpoint
from vidtune.cli import main as cli_main
from vidtune.errors import CheckpointError, ConfigError, StorageError, TrainingError
from vidtune.metrics import plot_loss_curve, truncate_metrics
from vidtune.trainers import build_trainer
from vidtune.training.stop import StopSignals, TrainingInterrupted

LORA_FILE = "pytorch_lora_weights.safetensors"


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _names(out: Path) -> list[str]:
    return [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")]


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _on_call(trainer, number: int, action) -> None:
    """Run `action(loss)` on the `number`-th micro-batch loss (1-based); it returns the loss to use."""
    original, calls = trainer.loss, [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        output = original(*args, **kwargs)
        return dataclasses.replace(output, total=action(output.total)) if calls[0] == number else output

    trainer.loss = wrapped


def test_sigint_saves_at_the_step_and_resume_matches_an_uninterrupted_run(make_config, tmp_path, capsys):
    settings = {"training": {"steps": 5}, "checkpoint": {"every": 2}, "lora": {"dropout": 0.1}}
    reference = build_trainer(make_config(**settings, output_dir=str(tmp_path / "reference")))
    reference.run()

    out = tmp_path / "stopped"
    before = signal.getsignal(signal.SIGINT)
    trainer = build_trainer(make_config(**settings, output_dir=str(out)))

    def interrupt(loss):
        os.kill(os.getpid(), signal.SIGINT)
        return loss

    _on_call(trainer, 3, interrupt)
    with pytest.raises(TrainingInterrupted) as stopped:
        trainer.run()
    assert stopped.value.exit_code == 130
    assert "after step 3 of 5" in str(stopped.value) and "checkpoint.resume=latest" in str(stopped.value)
    assert signal.getsignal(signal.SIGINT) is before
    assert _names(out) == ["step-00000002", "step-00000003"] and _steps(out) == [1, 2, 3]
    assert not (out / LORA_FILE).exists()

    settings["checkpoint"] = {"every": 2, "resume": "latest"}
    resumed = build_trainer(make_config(**settings, output_dir=str(out)))
    result = resumed.run()
    assert "Resuming from" in capsys.readouterr().out
    assert result.final_step == 5 and _steps(out) == [1, 2, 3, 4, 5]
    # lora.dropout draws from the global RNG: equal weights also prove the RNGs were restored.
    _assert_same(load_file(out / LORA_FILE), load_file(tmp_path / "reference" / LORA_FILE))
    reference_rows = (tmp_path / "reference" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["loss"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [
        json.loads(r)["loss"] for r in reference_rows
    ]


@pytest.mark.parametrize("algorithm", ["lora", "full"])
def test_the_weights_average_resumes_bit_for_bit(make_config, tmp_path, algorithm):
    """training.ema_decay: the average is part of the state a checkpoint holds, so a stopped and resumed run ends
    with the same average (and weights) as one left alone."""
    settings = {"training": {"steps": 5, "algorithm": algorithm, "ema_decay": 0.8}, "checkpoint": {"every": 2},
                "lora": {"dropout": 0.1}}
    build_trainer(make_config(**settings, output_dir=str(tmp_path / "reference"))).run()
    out = tmp_path / "stopped"
    run_stopped_at(build_trainer(make_config(**settings, output_dir=str(out))), 3)
    assert checkpoint.load_ema(out / "checkpoints" / "step-00000003") is not None
    settings["checkpoint"] = {"every": 2, "resume": "latest"}
    build_trainer(make_config(**settings, output_dir=str(out))).run()
    names = ([LORA_FILE, "pytorch_lora_weights_ema.safetensors"] if algorithm == "lora" else
             [f"{folder}/diffusion_pytorch_model.safetensors" for folder in ("transformer", "transformer_ema")])
    for name in names:
        _assert_same(load_file(out / name), load_file(tmp_path / "reference" / name))
    assert not all(torch.equal(a, b) for a, b in zip(load_file(out / names[0]).values(),
                                                    load_file(out / names[1]).values(), strict=True))


def test_ema_decay_set_on_resuming_starts_the_average_there(make_config, tmp_path, capsys):
    out = str(tmp_path / "run")
    build_trainer(make_config(training={"steps": 2}, output_dir=out)).run()
    capsys.readouterr()
    trainer = build_trainer(make_config(training={"steps": 3, "ema_decay": 0.9}, output_dir=out,
                                        checkpoint={"resume": "latest"}))
    trainer.run()
    printed = capsys.readouterr().out
    assert "training.ema_decay: None -> 0.9" in printed
    assert "it starts from the restored weights" in printed
    assert (Path(out) / "pytorch_lora_weights_ema.safetensors").is_file()


def test_a_checkpoint_written_before_a_key_existed_resumes_with_its_default(make_config, tmp_path, capsys):
    out = tmp_path / "run"
    build_trainer(make_config(training={"steps": 2}, output_dir=str(out))).run()
    saved = out / "checkpoints" / "step-00000002" / "config.yaml"
    config = yaml.safe_load(saved.read_text())
    del config["lora"]["use_dora"], config["training"]["ema_decay"]  # keys later versions added
    saved.write_text(yaml.safe_dump(config))
    (saved.parent / "manifest.json").unlink()  # nor did such a checkpoint carry a digest manifest
    capsys.readouterr()
    result = build_trainer(make_config(training={"steps": 3}, output_dir=str(out),
                                       checkpoint={"resume": "latest"})).run()
    assert result.final_step == 3
    printed = capsys.readouterr().out
    assert "use_dora" not in printed and "ema_decay" not in printed
    assert "has no digest manifest (it was written by an earlier vidtune)" in printed


def test_a_second_signal_stops_at_once_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped, StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM and stop.exit_code == 143
        os.kill(os.getpid(), signal.SIGTERM)
    assert stopped.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(KeyboardInterrupt), StopSignals():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
    # Outside the main thread nothing is installed (signal.signal would fail there).
    errors = []
    thread = threading.Thread(target=lambda: errors.append(StopSignals().__enter__().received))
    thread.start()
    thread.join()
    assert errors == [None] and signal.getsignal(signal.SIGTERM) is before


def test_config_changes_refused_or_stated(make_config, tmp_path, capsys):
    out = str(tmp_path / "run")
    build_trainer(make_config(training={"steps": 2}, output_dir=out)).run()
    resume = {"resume": "latest"}
    refused = [
        ({"lora": {"rank": 8}}, "lora.rank: 16 -> 8"),
        ({"lora": {"target_modules": ["to_q"]}}, "lora.target_modules"),
        ({"training": {"steps": 2, "algorithm": "full"}}, "training.algorithm: 'lora' -> 'full'"),
        ({"model": {"pretrained": str(tmp_path / "other")}}, "model.pretrained"),
    ]
    for change, message in refused:
        with pytest.raises(ConfigError, match="Cannot resume from") as error:
            build_trainer(make_config(output_dir=out, checkpoint=resume, **change)).run()
        assert message in str(error.value)

    capsys.readouterr()
    trainer = build_trainer(make_config(training={"steps": 3, "learning_rate": 5e-4}, output_dir=out,
                                        checkpoint={"every": 0, "resume": "latest"}))
    trainer.run()
    printed = capsys.readouterr().out
    assert "training.learning_rate: 0.001 -> 0.0005" in printed and "training.steps: 2 -> 3" in printed
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert rows[1]["lr"] == 1e-3 and rows[2]["lr"] == 5e-4  # the new learning rate is the one applied


def test_a_used_output_dir_is_refused_without_resume(make_config, tmp_path):
    config = make_config(training={"steps": 2})
    build_trainer(config).run()
    out = Path(config.output_dir)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match="already holds a run") as error:
        build_trainer(config).run()
    assert "checkpoint.resume=latest" in str(error.value)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_latest_starts_a_new_run_but_never_over_final_weights(make_config, tmp_path, capsys):
    config = make_config(training={"steps": 1}, checkpoint={"resume": "latest"})
    assert build_trainer(config).run().final_step == 1  # nothing to resume: a job script can always pass it
    assert "Resuming" not in capsys.readouterr().out
    out = Path(config.output_dir)
    for folder in checkpoint.list_checkpoints(out / "checkpoints"):
        shutil.rmtree(folder)
    with pytest.raises(CheckpointError, match=r"holds pytorch_lora_weights\.safetensors but no checkpoint"):
        build_trainer(config).run()


def test_nonfinite_loss_stops_keeping_the_last_good_checkpoint(make_config, tmp_path):
    out = tmp_path / "nan"
    trainer = build_trainer(make_config(training={"steps": 4}, checkpoint={"every": 2}, output_dir=str(out)))
    _on_call(trainer, 3, lambda loss: loss * float("nan"))
    with pytest.raises(TrainingError, match="stopped at step 3: the loss was nan") as error:
        trainer.run()
    assert "step-00000002" in str(error.value)
    assert _names(out) == ["step-00000002"] and _steps(out) == [1, 2]
    weights, state = checkpoint.load(out / "checkpoints" / "step-00000002")
    assert state["step"] == 2 and all(torch.isfinite(w).all() for w in weights.values())


def test_nonfinite_steps_are_skipped_up_to_the_limit(make_config, tmp_path):
    out = tmp_path / "skip"
    trainer = build_trainer(make_config(training={"steps": 4, "skip_nonfinite_steps": 1}, output_dir=str(out)))
    _on_call(trainer, 3, lambda loss: loss * float("inf"))
    result = trainer.run()
    assert result.final_step == 4 and _steps(out) == [1, 2, 4]
    _, state = checkpoint.load(out / "checkpoints" / "step-00000004")
    assert state["nonfinite_skipped"] == 1
    assert all(torch.isfinite(w).all() for w in load_file(out / LORA_FILE).values())

    trainer = build_trainer(make_config(training={"steps": 5, "skip_nonfinite_steps": 1},
                                        output_dir=str(tmp_path / "limit")))
    for number in (2, 4):
        _on_call(trainer, number, lambda loss: loss * float("nan"))
    with pytest.raises(TrainingError, match=r"stopped at step 4: .*1 such steps were skipped already"):
        trainer.run()


# What each writer raises on a full disk (checked on a tiny tmpfs): safetensors its own error, torch.save a
# RuntimeError from its zip writer, and plain file writes OSError(ENOSPC).
FULL_DISK = {
    "save_file": SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
    "torch.save": RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
    "config": OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
}


@pytest.mark.parametrize("writer", sorted(FULL_DISK))
def test_a_failed_write_keeps_the_previous_checkpoint(make_config, tmp_path, monkeypatch, writer):
    out = tmp_path / "full-disk"
    config = make_config(training={"steps": 4}, checkpoint={"every": 2}, output_dir=str(out))
    real = {"save_file": checkpoint.save_file, "torch.save": torch.save, "config": checkpoint.write_resolved_config}
    calls = [0]

    def failing(obj, path, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:  # the second checkpoint: half a file, then the disk is full
            (Path(path) / "config.yaml" if writer == "config" else Path(path)).write_bytes(b"\0" * 100)
            raise FULL_DISK[writer]
        return real[writer](obj, path, *args, **kwargs)

    if writer == "torch.save":
        monkeypatch.setattr(torch, "save", failing)
    else:
        monkeypatch.setattr(checkpoint, "save_file" if writer == "save_file" else "write_resolved_config", failing)
    # What names the full disk (an OS error number) is said as such; torch.save's zip writer names none, and the
    # disk here is not full, so its error is quoted.
    expected = TrainingError if writer == "torch.save" else StorageError
    with pytest.raises(expected, match="Could not write the checkpoint of step 4") as error:
        build_trainer(config).run()
    monkeypatch.undo()
    if writer == "torch.save":
        assert str(FULL_DISK[writer]) in str(error.value) and "Is the disk full?" in str(error.value)
        assert "step-00000002 is intact" in str(error.value)
    else:
        assert "the disk is full" in str(error.value) and "step-00000002, is whole" in str(error.value)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"]  # nothing half-written
    weights, state = checkpoint.load(out / "checkpoints" / "step-00000002")
    assert state["step"] == 2 and weights
    resumed = make_config(training={"steps": 4}, checkpoint={"every": 2, "resume": "latest"}, output_dir=str(out))
    assert build_trainer(resumed).run().final_step == 4


def test_incomplete_folders_are_never_listed_or_loaded(make_config, tmp_path):
    config = make_config(training={"steps": 2})
    build_trainer(config).run()
    root = Path(config.output_dir) / "checkpoints"
    good = root / "step-00000002"
    half = root / "step-00000009"
    half.mkdir()
    (half / checkpoint.WEIGHTS).write_bytes((good / checkpoint.WEIGHTS).read_bytes())
    (root / ".incomplete-step-00000010-99999").mkdir()
    assert checkpoint.list_checkpoints(root) == [good]
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        build_trainer(make_config(checkpoint={"resume": str(half)}, output_dir=str(tmp_path / "x"))).run()
    with pytest.raises(FileNotFoundError):
        checkpoint.load(half)
    # A swap cut short (`.stale-` holds the only copy of a step) is finished; half-written folders go.
    os.replace(good, root / ".stale-step-00000002-99999")
    checkpoint.recover(root)
    assert checkpoint.list_checkpoints(root) == [good]
    assert not (root / ".incomplete-step-00000010-99999").exists()


def test_truncate_metrics_drops_later_and_cut_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n{"step": 3, "loss": 0.4}\n{"step": 4, "lo')
    truncate_metrics(path, 2)
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n'
    truncate_metrics(path, 0)
    assert path.read_text() == ""


@pytest.mark.parametrize("algorithm", ["lora", "full"])
def test_export_turns_a_checkpoint_into_the_final_weights(make_config, tmp_path, algorithm, capsys):
    config = make_config(training={"steps": 3, "algorithm": algorithm}, checkpoint={"every": 2, "keep": 3})
    result = build_trainer(config).run()
    run = Path(config.output_dir)
    relative = LORA_FILE if algorithm == "lora" else "transformer/diffusion_pytorch_model.safetensors"

    assert cli_main(["export", str(run / "checkpoints" / "step-00000003"), "--output", str(tmp_path / "e3")]) == 0
    _assert_same(load_file(tmp_path / "e3" / relative), load_file(result.weights_path.parent / relative))
    # A run folder means its newest checkpoint; an earlier checkpoint gives the earlier weights.
    assert cli_main(["export", str(run), "--output", str(tmp_path / "e-run")]) == 0
    _assert_same(load_file(tmp_path / "e-run" / relative), load_file(tmp_path / "e3" / relative))
    assert cli_main(["export", str(run / "checkpoints" / "step-00000002"), "--output", str(tmp_path / "e2")]) == 0
    step2, _ = checkpoint.load(run / "checkpoints" / "step-00000002")
    exported = load_file(tmp_path / "e2" / relative)
    if algorithm == "full":
        assert all(torch.equal(exported[k], v) for k, v in step2.items())
    else:
        assert not all(torch.equal(exported[k], v) for k, v in load_file(tmp_path / "e3" / relative).items())
    capsys.readouterr()
    assert cli_main(["export", str(run), "--output", str(tmp_path / "e3")]) == 2
    assert "already holds" in capsys.readouterr().err


def test_the_cli_hint_repeats_the_users_command_and_the_resumed_summary_counts_this_run(make_config, tmp_path,
                                                                                        capsys, monkeypatch):
    from vidtune.training import loop

    config = make_config(training={"steps": 5}, checkpoint={"every": 2})
    path = tmp_path / "my config.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    out = tmp_path / "the run"
    original, calls = loop.forward_backward, [0]

    def interrupt_on_third(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(loop, "forward_backward", interrupt_on_third)
    code = cli_main(["train", str(path), "lora.rank=4", f"output_dir={out}", "checkpoint.resume=latest"])
    err = capsys.readouterr().err
    assert code == 130
    expected = shlex.join(["vidtune", "train", str(path), "lora.rank=4", f"output_dir={out}",
                           "checkpoint.resume=latest"])
    assert err.strip().splitlines()[-1] == f"What to do: to continue, run {expected}"
    assert "CONFIG" not in err

    # The hint's own command continues the run; the summary counts the steps this process ran.
    monkeypatch.setattr(loop, "forward_backward", original)
    assert cli_main(shlex.split(expected)[1:]) == 0
    stdout = capsys.readouterr().out
    assert "Resumed from step 3: finished steps 4-5 (2 steps) in " in stdout
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()[3:]]
    assert f"Loss over these steps: first {losses[0]:.4f}, last {losses[-1]:.4f}" in stdout


def test_the_resume_command_under_torchrun_names_the_launcher(monkeypatch):
    from vidtune.cli import resume_command

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (resume_command("my.yaml", ["checkpoint.resume=old", "lora.rank=8"])
            == "torchrun --nproc_per_node 2 -m vidtune train my.yaml lora.rank=8 checkpoint.resume=latest")
    monkeypatch.setenv("WORLD_SIZE", "4")  # several machines: their own launcher options
    assert resume_command("my.yaml", []).startswith("torchrun [the same torchrun options] -m vidtune train my.yaml")


@pytest.mark.parametrize(("algorithm", "distillation", "weights"), [
    ("guidance-distillation", {"guidance_scale": 3.0}, LORA_FILE),
    ("guidance-distillation", {"student": "full"}, "transformer/diffusion_pytorch_model.safetensors"),
    ("step-distillation", {"student_steps": 2, "teacher_steps": 4}, LORA_FILE),
    ("step-distillation", {"student_steps": 2, "teacher_steps": 4, "window_start": "data"}, LORA_FILE),
], ids=["guidance-lora", "guidance-full", "steps-teacher-start", "steps-data-start"])
def test_distillation_resumes_bit_for_bit(make_config, tmp_path, algorithm, distillation, weights):
    """The teacher's draws (guidance scales, windows) come from each visit's generator, so a stopped and resumed
    distillation ends with the same weights and losses as one left alone."""
    settings = {"training": {"steps": 5, "algorithm": algorithm, "batch_size": 2}, "checkpoint": {"every": 2},
                "lora": {"dropout": 0.1}, "distillation": distillation, "data": {"caption_dropout": 0.3}}
    build_trainer(make_config(**settings, output_dir=str(tmp_path / "reference"))).run()
    out = tmp_path / "stopped"
    run_stopped_at(build_trainer(make_config(**settings, output_dir=str(out))), 3)
    settings["checkpoint"] = {"every": 2, "resume": "latest"}
    build_trainer(make_config(**settings, output_dir=str(out))).run()
    _assert_same(load_file(out / weights), load_file(tmp_path / "reference" / weights))
    losses = [[json.loads(r)["loss"] for r in (run / "metrics.jsonl").read_text().splitlines()]
              for run in (out, tmp_path / "reference")]
    assert losses[0] == losses[1] and len(losses[0]) == 5


def test_loss_png_is_drawn_from_a_metrics_file_a_kill_cut_short(tmp_path):
    """loss.png is written with every checkpoint: a last line cut short by a kill is skipped, not an error."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": step, "loss": 1.0 / step, "sigmas": [0.5], "sample_losses": [1.0 / step]} for step in (1, 2, 3)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 4, "lo')
    assert plot_loss_curve(path, tmp_path / "loss.png") == tmp_path / "loss.png"
    assert (tmp_path / "loss.png").stat().st_size > 0
