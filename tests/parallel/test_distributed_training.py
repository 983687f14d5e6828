"""Data-parallel training with real processes on CPU (gloo), as torchrun runs it.

Two ranks with batch 1 must train what one process trains with batch 2, each rank reading its own stream
positions, rank 0 alone writing the outputs; a stop requested on one rank stops both after the same step, and a
resumed two-rank run ends bit for bit where the uninterrupted one does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers.datasets import control_dataset
from tests.helpers.distributed import (
    LORA_FILE,
    LORA_FILE_2,
    rank_main,
    spawn_ranks,
    two_ranks_against_one_process,
)
from tests.helpers.wan22 import record_routing
from vidtune import checkpoint
from vidtune.export.comfyui_workflow import workflow_file
from vidtune.models.tiny.wan22 import TWO_EXPERT_SHAPE, write_tiny_wan22
from vidtune.outputs import comfyui_lora_weights
from vidtune.trainers import build_trainer

STEPS = 3


def _adapter(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / LORA_FILE)


@pytest.mark.slow
def test_two_ranks_train_what_one_process_trains_with_twice_the_batch(make_config, tmp_path):
    def config(name: str, **sections) -> dict:
        sections["training"] = {"steps": STEPS, "learning_rate": 1e-2, **sections.get("training", {})}
        return make_config(output_dir=str(tmp_path / name), **sections).to_dict()

    # LoRA dropout draws from each rank's global RNG: a bitwise resume needs every rank's RNG state back.
    every = {"every": 2, "keep": 2}
    four = {"training": {"steps": 4}, "lora": {"dropout": 0.1}}
    full = {"training": {"algorithm": "full", "steps": 2}}
    runs = [
        ("ddp", config("ddp", checkpoint=every), {}),
        ("full", config("full", **full), {}),
        ("cached", config("cached", precompute={"enabled": True, "batch_size": 1,
                                                     "cache_dir": str(tmp_path / "cache")}), {}),
        ("reference", config("reference", checkpoint=every, **four), {}),
        # SIGTERM reaches rank 1 only, during step 2: both ranks must stop after step 2 and save it.
        ("stopped", config("stopped", checkpoint=every, **four), {"stop_on": (1, 2)}),
        ("resumed", config("stopped", checkpoint={**every, "resume": "latest"}, **four), {}),
        ("unused", config("unused"), {"unused": True}),
    ]
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(rank_main, (2, runs, str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]

    # One process, batch 2: the same samples, the same noise, the same steps.
    single = make_config(training={"steps": STEPS, "batch_size": 2, "learning_rate": 1e-2},
                         output_dir=str(tmp_path / "single"))
    single_result = build_trainer(single).run()
    ddp_dir = tmp_path / "ddp"

    # (a) The same adapter and the same (rank-averaged) losses, on both ranks.
    expected, trained = _adapter(tmp_path / "single"), _adapter(ddp_dir)
    assert expected.keys() == trained.keys() and expected
    for key in expected:
        torch.testing.assert_close(trained[key], expected[key], rtol=1e-3, atol=1e-4)
    assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k)
    for result in ranks:
        assert result["ddp"]["losses"] == pytest.approx(single_result.losses, rel=1e-4)
        assert result["ddp"]["weights"] == str(ddp_dir / LORA_FILE)

    # Training from the cache, which the ranks filled together (one clip per VAE call, as on the fly), gives the
    # same adapter.
    cached = _adapter(tmp_path / "cached")
    assert all(torch.equal(cached[key], trained[key]) for key in trained)

    # (b) Disjoint positions, together 0 .. steps * batch * world - 1.
    seen = [result["ddp"]["positions"] for result in ranks]
    assert seen == [[0, 2, 4], [1, 3, 5]]
    assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == list(range(STEPS * 2))

    # (c) One set of outputs: rank 0's, each step logged once; checkpoints hold both ranks' RNGs.
    expected = ["checkpoints", "config.yaml", "dataset_overview.png", "loss.png", "metrics.jsonl", LORA_FILE,
                comfyui_lora_weights(ddp_dir.name), workflow_file(ddp_dir.name)]
    assert sorted(p.name for p in ddp_dir.iterdir()) == sorted(expected)
    rows = [json.loads(line) for line in (ddp_dir / "metrics.jsonl").read_text().splitlines()]
    single_rows = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [row["loss"] for row in rows] == pytest.approx(single_result.losses, rel=1e-4)
    # Adam hides a wrong gradient scale in the weights; the gradient norm (before clipping) does not.
    assert [row["grad_norm"] for row in rows] == pytest.approx([row["grad_norm"] for row in single_rows], rel=1e-4)
    assert sorted(p.name for p in (ddp_dir / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    _, state = checkpoint.load(ddp_dir / "checkpoints" / "step-00000003")
    assert sorted(state["rng"]) == [0, 1] and state["world_size"] == 2
    assert state["samples_consumed"] == STEPS * 2
    assert not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"])

    # A stop asked of one rank stops both after the same step, with a checkpoint there; resuming it with two
    # ranks gives bitwise the adapter of the run that never stopped.
    stopped_dir = tmp_path / "stopped"
    for result in ranks:
        assert result["stopped"]["exit_code"] == 143 and "stopped after step 2 of 4" in result["stopped"]["message"]
        assert result["resumed"]["positions"] == result["reference"]["positions"][2:]
    assert [p.name for p in checkpoint.list_checkpoints(stopped_dir / "checkpoints")] == ["step-00000002",
                                                                                           "step-00000004"]
    resumed, reference = _adapter(stopped_dir), _adapter(tmp_path / "reference")
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[key], reference[key]) for key in reference)
    assert [json.loads(line)["loss"] for line in (stopped_dir / "metrics.jsonl").read_text().splitlines()] == \
        [json.loads(line)["loss"] for line in (tmp_path / "reference" / "metrics.jsonl").read_text().splitlines()]

    # Full fine-tuning: the same equality as LoRA's.
    single_full = make_config(training={"algorithm": "full", "steps": 2, "batch_size": 2, "learning_rate": 1e-2},
                              output_dir=str(tmp_path / "single-full"))
    build_trainer(single_full).run()
    weights = "transformer/diffusion_pytorch_model.safetensors"
    expected, trained = load_file(tmp_path / "single-full" / weights), load_file(tmp_path / "full" / weights)
    assert expected.keys() == trained.keys() and expected
    for key in expected:
        torch.testing.assert_close(trained[key], expected[key], rtol=1e-3, atol=1e-4)

    # A trainable parameter outside the loss is named after the first step, on every rank (DDP would fail later
    # with a message about buckets).
    for result in ranks:
        assert "take no part in the loss, e.g. never_used" in result["unused"]["error"]


@pytest.mark.slow
def test_torchrun_runs_the_vidtune_command(make_config, tmp_path):
    config = make_config(training={"steps": 2}, output_dir=str(tmp_path / "run"))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def torchrun() -> subprocess.CompletedProcess:
        # --standalone: torchrun picks a free port itself (no window for another process to take it).
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "-m", "vidtune", "train", str(path)]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)

    result = torchrun()
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "run"
    expected = ["checkpoints", "config.yaml", "dataset_overview.png", "loss.png", "metrics.jsonl", LORA_FILE,
                comfyui_lora_weights(out.name), workflow_file(out.name)]
    assert sorted(p.name for p in out.iterdir()) == sorted(expected)
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert result.stdout.count("Finished 2 steps") == 1  # the summary, from rank 0

    # An error rank 0 finds (here: the output_dir holds a run) stops every rank, none is left waiting.
    again = torchrun()
    assert again.returncode != 0
    assert again.stderr.count(f"output_dir {out} already holds a run") == 2, again.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["guidance-distillation", "step-distillation", "control-lora"])
def test_two_ranks_train_each_algorithm_like_one_process_with_twice_the_batch(make_config, shapes_dataset,
                                                                               tmp_path, algorithm):
    """Distillation: the teacher runs on the unwrapped denoiser (its adapters off, no gradients), the student
    through DistributedDataParallel. Control: the widened input layer trains beside the adapter, its control
    latents fed by a hook on the wrapped module. Two ranks give the weights of one process with their two
    samples."""
    settings = {"training": {"algorithm": algorithm, "steps": 2, "learning_rate": 1e-2},
                "distillation": {"student_steps": 2, "teacher_steps": 4}}
    if algorithm == "control-lora":
        settings["data_root"], _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    two_ranks_against_one_process(make_config, tmp_path, settings)
    if algorithm == "control-lora":
        expected, trained = (load_file(tmp_path / run / "control_input.safetensors") for run in ("single", "ddp"))
        torch.testing.assert_close(trained["weight"], expected["weight"], rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_two_ranks_with_an_int8_base_train_what_one_process_trains_with_twice_the_batch(make_config, tmp_path):
    """memory.base_weights=int8 under DDP: the quantized frozen weights are each rank's own (quantized the same
    way from the same file), the fp32 adapter is averaged as usual."""
    settings = {"training": {"steps": 2, "learning_rate": 1e-2}, "memory": {"base_weights": "int8"}}
    # The int8 kernel rounds a batch of two a little otherwise than two of one: measured up to 1.1e-4.
    two_ranks_against_one_process(make_config, tmp_path, settings, atol=3e-4)


@pytest.mark.slow
def test_two_ranks_train_two_experts_like_one_process_with_twice_the_batch(make_config, tmp_path, monkeypatch):
    """Wan 2.2 A14B-like, a LoRA per expert: each sample's noise level picks its expert, so a step may run one
    expert on one rank and the other on the other (DDP finds the parameters a rank left out), or only one expert
    on both. Either way two ranks train the adapters one process trains with both samples in one batch."""
    folder = write_tiny_wan22(tmp_path / "a14b", two_experts=True, boundary_ratio=0.5)
    frames, height, width = TWO_EXPERT_SHAPE
    settings = {"family": "wan2.2", "model": {"pretrained": str(folder)},
                "data": {"frames": frames, "height": height, "width": width},
                # Gradient checkpointing, as 14B experts train: diffusers' non-reentrant checkpoints let DDP find the
                # unused expert.
                "training": {"steps": 3, "learning_rate": 1e-2, "seed": 8, "sigma_sampling": "uniform",
                             "sigma_shift": 1.0, "gradient_checkpointing": True},
                "lora": {"rank": 4, "alpha": 4}}
    # Which expert each sample of the one process's forwards ran on: every kind of step must be among them.
    routed = record_routing(monkeypatch)
    two_ranks_against_one_process(make_config, tmp_path, settings, files=(LORA_FILE, LORA_FILE_2))
    # Seed 8's noise levels: one step split between the experts, one all high-noise, one all low-noise.
    assert routed == [(True, False), (True, True), (False, False)], routed


@pytest.mark.slow
def test_two_ranks_with_an_fp8_base_train_what_one_process_trains_with_twice_the_batch(make_config, tmp_path):
    """memory.base_weights=fp8 under DDP: each rank stores the frozen weights in float8 (layerwise casting, set up
    after the weights load and before DDP wraps the denoiser) and computes in fp32; the adapter is averaged as
    usual. The fp8 weights are the same on both ranks and in the single process (rounded from the same file), so
    only the batch's arithmetic differs."""
    settings = {"training": {"steps": 2, "learning_rate": 1e-2}, "memory": {"base_weights": "fp8"}}
    # Measured: the adapters differ by at most 1.5e-5 (the helper's bound: rtol 1e-3, atol 1e-4).
    two_ranks_against_one_process(make_config, tmp_path, settings)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_with_an_nf4_base_train_what_one_gpu_trains_with_twice_the_batch(make_config, tmp_path):
    """memory.base_weights=nf4 (bitsandbytes 4-bit, QLoRA) under DDP with NCCL, one GPU a rank: the quantized frozen
    weights are each rank's own, the fp32 adapter is averaged. The 4-bit kernels round a batch of two otherwise
    than two of one; the tolerance is a bound chosen above int8's CPU measurement, not a measured CUDA figure."""
    settings = {"training": {"steps": 2, "learning_rate": 1e-2, "device": "cuda"},
                "memory": {"base_weights": "nf4"}}
    two_ranks_against_one_process(make_config, tmp_path, settings, atol=1e-3)
