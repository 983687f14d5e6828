"""DeepSpeed ZeRO with real processes on CPU (gloo), as its launcher or torchrun runs them.

Two ranks with batch 1 under ZeRO 2 and 3 must train what one process trains with batch 2 (LoRA and full
fine-tuning: the same logged losses and gradient norms, the weights within float32 rounding), and a run stopped
after a DeepSpeed checkpoint and resumed on two ranks must end bit for bit where the uninterrupted one does. A
checkpoint resumed on another number of processes (2 -> 1, 1 -> 2) continues at its data position and ends where
the run on one number of processes ends, within float32 rounding.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers.datasets import control_dataset
from tests.helpers.distributed import deepspeed_rank_main, free_port, spawn_ranks
from vidtune import checkpoint
from vidtune.config import build_config
from vidtune.data.video import ClipWindow, read_clip
from vidtune.errors import CheckpointError, StorageError
from vidtune.models.tiny import TINY_SHAPES
from vidtune.trainers import build_trainer

LORA_FILE = "pytorch_lora_weights.safetensors"
FULL_FILE = "transformer/diffusion_pytorch_model.safetensors"
STEPS = 3
# Two ranks reduce the gradients in another order than one process sums them: float32 rounding, amplified a little
# by Adam's division by the root of the second moment.
RTOL, ATOL = 1e-3, 1e-4


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _assert_close_weights(trained: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert trained.keys() == expected.keys() and expected
    for key in expected:
        torch.testing.assert_close(trained[key], expected[key], rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_zero_2_and_3_on_two_ranks_train_what_one_process_trains_with_twice_the_batch(make_config, tmp_path,
                                                                                       capsys):
    def config(name: str, stage: int, **sections) -> dict:
        sections["training"] = {"steps": STEPS, "learning_rate": 1e-2, **sections.get("training", {})}
        sections["parallel"] = {"strategy": "deepspeed", "zero_stage": stage}
        return make_config(output_dir=str(tmp_path / name), **sections).to_dict()

    every = {"every": 2, "keep": 2}
    samples = {"enabled": True, "every": 2, "num_inference_steps": 2, "prompts": ["a red circle"]}
    full = {"training": {"algorithm": "full", "steps": 2}}
    # LoRA dropout draws from each rank's global RNG: a bitwise resume needs every rank's RNG state back.
    four = {"training": {"steps": 4}, "lora": {"dropout": 0.1}}
    # One process with batch 2 under ZeRO-2 writes the checkpoint of step 2 that two ranks then continue (1 -> 2).
    build_trainer(build_config(config("grown", 2, training={"steps": 2, "batch_size": 2}, checkpoint=every))).run()
    runs = [
        ("zero2", config("zero2", 2, checkpoint=every, validation=samples), {}),
        ("zero3", config("zero3", 3, checkpoint=every, validation=samples), {}),
        ("grown", config("grown", 2, checkpoint={**every, "resume": "latest"}), {}),
        ("zero2-full", config("zero2-full", 2, **full), {}),
        ("zero3-full", config("zero3-full", 3, **full), {}),
        ("reference", config("reference", 3, checkpoint=every, **four), {}),
        # SIGTERM reaches rank 1 only, during step 3: both ranks stop after step 3 and save it.
        ("stopped", config("stopped", 3, checkpoint=every, **four), {"stop_on": (1, 3)}),
        ("resumed", config("stopped", 3, checkpoint={**every, "resume": "latest"}, **four), {}),
    ]
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(deepspeed_rank_main, (2, runs, str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for result in ranks:
        for name, outcome in result.items():
            assert "error" not in outcome, f"{name}: {outcome['error']}"

    # One process, batch 2: the same samples, the same noise, the same steps.
    single = build_trainer(make_config(training={"steps": STEPS, "batch_size": 2, "learning_rate": 1e-2},
                                       output_dir=str(tmp_path / "single"))).run()
    build_trainer(make_config(training={"algorithm": "full", "steps": 2, "batch_size": 2, "learning_rate": 1e-2},
                              output_dir=str(tmp_path / "single-full"))).run()
    single_rows = _metrics(tmp_path / "single")
    for name in ("zero2", "zero3"):
        _assert_close_weights(load_file(tmp_path / name / LORA_FILE), load_file(tmp_path / "single" / LORA_FILE))
        for result in ranks:
            assert result[name]["losses"] == pytest.approx(single.losses, rel=1e-5)
            assert result[name]["positions"] in ([0, 2, 4], [1, 3, 5])
        rows = _metrics(tmp_path / name)
        assert [row["step"] for row in rows] == [1, 2, 3]
        assert [row["loss"] for row in rows] == pytest.approx([row["loss"] for row in single_rows], rel=1e-5)
        # Adam hides a wrong gradient scale in the weights; the gradient norm (before clipping) does not.
        assert [row["grad_norm"] for row in rows] == pytest.approx([row["grad_norm"] for row in single_rows],
                                                                   rel=1e-4)
    trained = load_file(tmp_path / "zero2" / LORA_FILE)
    assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k)
    for name in ("zero2-full", "zero3-full"):
        _assert_close_weights(load_file(tmp_path / name / FULL_FILE), load_file(tmp_path / "single-full" / FULL_FILE))

    # Validation samples under ZeRO-3 (from a plain copy given the gathered weights) are those of ZeRO-2 (the
    # trained module itself), after step 2 (between steps) and at the end.
    frames, height, width = TINY_SHAPES["ltx-video"]
    window = ClipWindow(frames, height, width)
    videos = {(run, step): read_clip(tmp_path / run / "samples" / f"step-0000000{step}-0.mp4", window)
              for run in ("zero2", "zero3") for step in (2, 3)}
    for step in (2, 3):
        apart = (videos["zero3", step] - videos["zero2", step]).abs().mean()
        # A training step changes the samples more than the two strategies' rounding does (the weights themselves
        # are compared above). Measured at step 2: 0.011 apart on pixels in [0, 1], 4.3x that from a step.
        assert apart < 0.02 and (videos["zero3", 3] - videos["zero3", 2]).abs().mean() > 3 * apart

    # A DeepSpeed checkpoint: the gathered weights (what `vidtune export` reads), each rank's RNGs and DeepSpeed's
    # own shards of the weights and optimizer state, one per rank.
    folder = tmp_path / "zero2" / "checkpoints" / "step-00000003"
    weights, state = checkpoint.load(folder)
    assert len(weights) == len(trained) and any(v.abs().max() > 0 for k, v in weights.items() if "lora_B" in k)
    assert sorted(state["rng"]) == [0, 1] and state["world_size"] == 2 and state["samples_consumed"] == STEPS * 2
    shards = sorted(p.name for p in (folder / checkpoint.ZERO_SHARDS / "state").iterdir())
    assert [name for name in shards if "optim_states" in name] == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert not any(p.name.startswith(".zero-") for p in (tmp_path / "zero2" / "checkpoints").iterdir())

    # ZeRO-3, stopped on one rank after step 3 and resumed on two: bitwise the run that never stopped.
    stopped_dir = tmp_path / "stopped"
    for result in ranks:
        assert result["stopped"]["exit_code"] == 143
        assert result["resumed"]["positions"] == result["reference"]["positions"][3:]
    assert [p.name for p in checkpoint.list_checkpoints(stopped_dir / "checkpoints")] == ["step-00000003",
                                                                                           "step-00000004"]
    resumed, reference = load_file(stopped_dir / LORA_FILE), load_file(tmp_path / "reference" / LORA_FILE)
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[key], reference[key]) for key in reference)
    assert [row["loss"] for row in _metrics(stopped_dir)] == [row["loss"] for row in _metrics(tmp_path / "reference")]

    # Another number of processes: the shards are re-cut through DeepSpeed's universal checkpoint. The two-rank
    # checkpoints of step 2 (ZeRO 2 and 3), continued by one process with batch 2 (the same samples per step),
    # announce the change and end where the two-rank runs ended; the staging folder of the conversion is gone.
    for stage in (2, 3):
        capsys.readouterr()
        out_dir = tmp_path / f"zero{stage}-on-one"
        resumed = build_trainer(make_config(
            training={"steps": STEPS, "batch_size": 2, "learning_rate": 1e-2},
            parallel={"strategy": "deepspeed", "zero_stage": stage}, output_dir=str(out_dir),
            checkpoint={"resume": str(tmp_path / f"zero{stage}" / "checkpoints" / "step-00000002")})).run()
        said = capsys.readouterr().out
        assert "The number of processes changed since that checkpoint: 2 -> 1" in said
        assert "re-cutting the checkpoint's ZeRO shards for 1 process" in said
        assert resumed.first_step == 2 and resumed.losses == pytest.approx(single.losses[2:], rel=1e-5)
        _assert_close_weights(load_file(out_dir / LORA_FILE), load_file(tmp_path / f"zero{stage}" / LORA_FILE))
        assert [p.name for p in (out_dir / "checkpoints").iterdir()] == ["step-00000003"]
    # The one-process checkpoint continued by two ranks (1 -> 2): each reads its share of the next samples, and
    # the run ends where one process with batch 2 ends.
    for rank, result in enumerate(ranks):
        assert result["grown"]["positions"] == [4 + rank]
        assert result["grown"]["losses"] == pytest.approx(single.losses[2:], rel=1e-5)
    assert [row["loss"] for row in _metrics(tmp_path / "grown")] == pytest.approx(single.losses, rel=1e-5)
    _assert_close_weights(load_file(tmp_path / "grown" / LORA_FILE), load_file(tmp_path / "single" / LORA_FILE))


@pytest.mark.slow
def test_the_deepspeed_launcher_runs_the_vidtune_command(make_config, tmp_path):
    """`deepspeed --module vidtune train CONFIG` (the launcher passes --local_rank=N before the command): ZeRO 1 with
    the optimizer state in CPU memory. Its checkpoint refuses, plainly, to resume in one process."""
    config = make_config(training={"steps": 2}, checkpoint={"every": 1},
                         parallel={"strategy": "deepspeed", "zero_stage": 1, "offload": "optimizer"},
                         output_dir=str(tmp_path / "run"))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    # The `deepspeed` command's own module, wherever pip put its console scripts.
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                str(free_port()), "--module", "vidtune", "train", str(path)]
    result = subprocess.run(launcher, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "run" / LORA_FILE).is_file()
    assert [row["step"] for row in _metrics(tmp_path / "run")] == [1, 2]
    _, state = checkpoint.load(tmp_path / "run" / "checkpoints" / "step-00000002")
    assert state["world_size"] == 2
    with pytest.raises(CheckpointError, match=r"written with parallel.strategy=deepspeed.*What to do: resume it"):
        build_trainer(build_config({**config.to_dict(), "parallel": {"strategy": "ddp"},
                                    "checkpoint": {"resume": "latest"}})).run()

    # The same command in one process continues the two processes' checkpoint (ZeRO-1 with the optimizer state in
    # CPU memory, re-cut for one rank), saying so.
    more = [sys.executable, "-m", "vidtune", "train", str(path), "training.steps=3", "checkpoint.resume=latest"]
    result = subprocess.run(more, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "The number of processes changed since that checkpoint: 2 -> 1" in result.stdout
    assert [row["step"] for row in _metrics(tmp_path / "run")] == [1, 2, 3]
    _, state = checkpoint.load(tmp_path / "run" / "checkpoints" / "step-00000003")
    assert state["world_size"] == 1 and state["samples_consumed"] == 2 * 2 + 1


@pytest.mark.slow
def test_control_and_distillation_on_two_ranks_train_what_one_process_trains_with_twice_the_batch(
        make_config, shapes_dataset, tmp_path):
    """Control: the widened input layer, trained as part of the full model, sharded by ZeRO-3 with the rest, its
    control latents fed by a hook on the engine's module. Step distillation: the frozen teacher (the student's
    base, adapters off) beside the LoRA student, under ZeRO 2 and 3. Two ranks with batch 1 give the losses and
    weights of one process with batch 2 and no DeepSpeed."""
    data_root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    settings = {
        "control": {"training": {"algorithm": "control-full", "steps": 2, "learning_rate": 1e-2},
                    "data_root": data_root},
        "distillation": {"training": {"algorithm": "step-distillation", "steps": 2, "learning_rate": 1e-2},
                         "distillation": {"student_steps": 2, "teacher_steps": 4}},
    }
    runs = [(f"{name}-zero{stage}", make_config(
        output_dir=str(tmp_path / f"{name}-zero{stage}"), parallel={"strategy": "deepspeed", "zero_stage": stage},
        **settings[name]).to_dict(), {}) for name, stage in (("control", 3), ("distillation", 2), ("distillation", 3))]
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(deepspeed_rank_main, (2, runs, str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    single = {name: build_trainer(make_config(output_dir=str(tmp_path / name), **{
        **values, "training": {**values["training"], "batch_size": 2}})).run() for name, values in settings.items()}

    files = {"control": (FULL_FILE, "control_input.safetensors"), "distillation": (LORA_FILE,)}
    for run, _, _ in runs:
        name = run.split("-")[0]
        for result in ranks:
            assert "error" not in result[run], result[run]
            assert result[run]["losses"] == pytest.approx(single[name].losses, rel=1e-5)
        for file in files[name]:
            _assert_close_weights(load_file(tmp_path / run / file), load_file(tmp_path / name / file))
    # Trained, not just equal: the student's adapter moved, and so did the control weights of the input layer.
    adapter = load_file(tmp_path / "distillation-zero3" / LORA_FILE)
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)
    widened = load_file(tmp_path / "control-zero3" / "control_input.safetensors")["weight"]
    assert widened[:, widened.shape[1] // 2:].abs().max() > 0  # the control inputs' columns, appended at zero


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("stage", "offload"), [(2, "optimizer"), (3, "none"), (3, "all")])
@pytest.mark.parametrize("algorithm", ["lora", "full"])
def test_deepspeed_on_cuda_in_one_process(make_config, stage, offload, algorithm):
    """bf16 base weights, autocast, gradient checkpointing and validation samples under DeepSpeed on a GPU."""
    config = make_config(
        model={"dtype": "bfloat16"},
        training={"algorithm": algorithm, "steps": 3, "device": "cuda", "precision": "bf16",
                  "gradient_checkpointing": True},
        validation={"enabled": True, "num_inference_steps": 2},
        parallel={"strategy": "deepspeed", "zero_stage": stage, "offload": offload},
    )
    result = build_trainer(config).run()
    assert len(result.losses) == 3 and all(math.isfinite(loss) for loss in result.losses)
    assert result.weights_path.exists() and result.sample_paths


@pytest.mark.parametrize("stage", [2, 3])
def test_a_nonfinite_step_is_discarded_in_one_process(make_config, tmp_path, monkeypatch, stage):
    """One process (a process group of one): an infinite loss at step 3 changes nothing, DeepSpeed's step discards
    its gradients, and the run goes on (`training.skip_nonfinite_steps`)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    out = tmp_path / "skip"
    trainer = build_trainer(make_config(training={"steps": 4, "skip_nonfinite_steps": 1, "learning_rate": 1e-2},
                                        checkpoint={"every": 1, "keep": 4},
                                        parallel={"strategy": "deepspeed", "zero_stage": stage},
                                        output_dir=str(out)))
    original, calls = trainer.loss, [0]

    def infinite_third(context, batch):
        calls[0] += 1
        output = original(context, batch)
        return dataclasses.replace(output, total=output.total * float("inf")) if calls[0] == 3 else output

    trainer.loss = infinite_third
    linear = torch.nn.functional.linear
    result = trainer.run()
    # ZeRO-3's process-wide replacement of F.linear is undone after the run (later models compute as before).
    assert torch.nn.functional.linear is linear
    assert result.final_step == 4 and [row["step"] for row in _metrics(out)] == [1, 2, 4]
    saved = {step: checkpoint.load(out / "checkpoints" / f"step-0000000{step}") for step in (2, 3, 4)}
    assert saved[4][1]["nonfinite_skipped"] == 1
    before, skipped, after = (saved[step][0] for step in (2, 3, 4))
    assert all(torch.equal(skipped[key], before[key]) for key in before)
    assert any(not torch.equal(after[key], before[key]) for key in before)
    assert all(torch.isfinite(weight).all() for weight in after.values())


def test_guidance_distillation_of_a_full_student_under_zero_3_trains_what_it_trains_without(make_config, tmp_path,
                                                                                             monkeypatch):
    """The algorithm with a second model (the frozen teacher beside the sharded student), one process: DeepSpeed's
    ZeRO-3 gives the losses and weights of the run without it."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    settings = {"training": {"algorithm": "guidance-distillation", "steps": 2, "learning_rate": 1e-2},
                "distillation": {"student": "full"}}
    plain = build_trainer(make_config(**settings, output_dir=str(tmp_path / "plain"))).run()
    zero3 = build_trainer(make_config(**settings, parallel={"strategy": "deepspeed", "zero_stage": 3},
                                      output_dir=str(tmp_path / "zero3"))).run()
    assert zero3.losses == pytest.approx(plain.losses, rel=1e-5)
    _assert_close_weights(load_file(tmp_path / "zero3" / FULL_FILE), load_file(tmp_path / "plain" / FULL_FILE))


def test_accumulation_under_zero_2_equals_twice_the_batch(make_config, tmp_path, monkeypatch):
    """One process, batch 1 × accumulation 2 under ZeRO-2 (gradients reduced on the last micro-batch only, the
    loss scaled once, by vidtune) trains what batch 2 trains without DeepSpeed."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    plain = build_trainer(make_config(training={"steps": 2, "batch_size": 2, "learning_rate": 1e-2},
                                      output_dir=str(tmp_path / "plain"))).run()
    zero2 = build_trainer(make_config(training={"steps": 2, "gradient_accumulation": 2, "learning_rate": 1e-2},
                                      parallel={"strategy": "deepspeed", "zero_stage": 2},
                                      output_dir=str(tmp_path / "zero2"))).run()
    assert zero2.losses == pytest.approx(plain.losses, rel=1e-5)
    assert [row["grad_norm"] for row in _metrics(tmp_path / "zero2")] == pytest.approx(
        [row["grad_norm"] for row in _metrics(tmp_path / "plain")], rel=1e-4)
    _assert_close_weights(load_file(tmp_path / "zero2" / LORA_FILE), load_file(tmp_path / "plain" / LORA_FILE))


def test_control_lora_under_zero_3_validates_between_steps_and_trains_what_it_trains_without(
        make_config, shapes_dataset, tmp_path, monkeypatch):
    """Control training widens the input layer and hooks the control latents into it. Under ZeRO-3 the validation
    samples come from a copy set up the same way, after which training goes on with its own hook: the losses are
    those of the run without DeepSpeed."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    settings = {"training": {"algorithm": "control-lora", "steps": 2, "learning_rate": 1e-2}, "data_root": root}
    plain = build_trainer(make_config(**settings, output_dir=str(tmp_path / "plain"))).run()
    zero3 = build_trainer(make_config(**settings, parallel={"strategy": "deepspeed", "zero_stage": 3},
                                      validation={"enabled": True, "every": 1, "num_inference_steps": 2},
                                      output_dir=str(tmp_path / "zero3"))).run()
    assert zero3.losses == pytest.approx(plain.losses, rel=1e-5)
    assert [path.name for path in zero3.sample_paths] == ["step-00000002-0.mp4"]
    assert (tmp_path / "zero3" / "samples" / "step-00000001-0.mp4").is_file()


def test_a_failed_write_of_the_engine_shards_keeps_the_previous_checkpoint(make_config, tmp_path, monkeypatch):
    """One process: the disk fills while DeepSpeed writes its shards of the second checkpoint. The run stops with a
    message saying so; the first checkpoint is intact, nothing half-written is left, and the run resumes from it."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    out = tmp_path / "full-disk"
    settings = {"training": {"steps": 4, "learning_rate": 1e-2}, "parallel": {"strategy": "deepspeed", "zero_stage": 2},
                "output_dir": str(out)}
    real, calls = DeepSpeedEngine.save_checkpoint, [0]

    def filling_the_disk(self, save_dir, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            (Path(save_dir) / "half-written").write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, save_dir, *args, **kwargs)

    monkeypatch.setattr(DeepSpeedEngine, "save_checkpoint", filling_the_disk)
    with pytest.raises(StorageError, match=r"Could not write the checkpoint of step 4 .*: the disk is full") as error:
        build_trainer(make_config(checkpoint={"every": 2}, **settings)).run()
    monkeypatch.undo()
    assert "the newest checkpoint, " in str(error.value) and "step-00000002, is whole" in str(error.value)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"]
    resumed = build_trainer(make_config(checkpoint={"every": 2, "resume": "latest"}, **settings)).run()
    assert resumed.first_step == 2 and resumed.final_step == 4


def test_a_save_removes_what_a_killed_save_left(make_config, tmp_path, monkeypatch):
    """A run killed while saving leaves its staging folder of ZeRO shards (`.zero-<step>`, as large as the shards);
    the next save removes it, whichever step it was for."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    out = tmp_path / "run"
    left = out / "checkpoints" / ".zero-00000007"
    (left / "global_step7").mkdir(parents=True)
    (left / "global_step7" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"partial")
    build_trainer(make_config(training={"steps": 1}, checkpoint={"every": 1},
                              parallel={"strategy": "deepspeed", "zero_stage": 2}, output_dir=str(out))).run()
    assert not left.exists()
    assert not list((out / "checkpoints").glob(".zero-*"))
    assert checkpoint.load(out / "checkpoints" / "step-00000001")[1]["step"] == 1
