"""Wan 2.2's two experts on several processes on CPU (gloo). Under sharded training (FSDP2, DeepSpeed ZeRO-2) each
step trains one expert on every rank (`model.expert_routing: step`, their default): under FSDP two ranks with batch 1
train what one process trains with batch 2 and the same per-step routing; ZeRO-2 takes the experts and trains both.
Under DDP, control training: each rank's samples take their control latents to their own experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.datasets import control_dataset
from tests.helpers.distributed import (
    LORA_FILE,
    LORA_FILE_2,
    deepspeed_rank_main,
    rank_main,
    spawn_ranks,
    two_ranks_against_one_process,
)
from tests.helpers.wan22 import record_routing
from vidtune.models.tiny.wan22 import TWO_EXPERT_SHAPE, write_tiny_wan22
from vidtune.trainers import build_trainer

# Seed 0's per-step draws: step 0 trains the high-noise expert, steps 1 and 2 the low-noise one.
SEED, STEPS, EXPECTED_ROUTES = 0, 3, [(True, True), (False, False), (False, False)]
# Sharding changes the order of float additions (reduce-scatter instead of one process's sums), nothing else.
RTOL, ATOL = 1e-3, 1e-4


def _settings(folder: Path, **sections) -> dict:
    frames, height, width = TWO_EXPERT_SHAPE
    return {"family": "wan2.2", "model": {"pretrained": str(folder), **sections.pop("model", {})},
            "data": {"frames": frames, "height": height, "width": width},
            "training": {"steps": STEPS, "learning_rate": 1e-2, "seed": SEED, "sigma_sampling": "uniform",
                         "sigma_shift": 1.0},
            "lora": {"rank": 4, "alpha": 4}, **sections}


def _one_process_with_step_routing(make_config, tmp_path: Path, folder: Path, monkeypatch) -> list[float]:
    """The reference: one process, batch 2, `model.expert_routing: step` forced; checks that each step ran one
    expert, as the draws of seed 0 say."""
    routed = record_routing(monkeypatch)
    settings = _settings(folder, model={"expert_routing": "step"})
    settings["training"]["batch_size"] = 2
    config = make_config(output_dir=str(tmp_path / "single"), **settings)
    result = build_trainer(config).run()
    assert routed == EXPECTED_ROUTES, routed
    return result.losses


def _assert_same_adapters(tmp_path: Path, run: str) -> None:
    for name in (LORA_FILE, LORA_FILE_2):
        expected, trained = (load_file(tmp_path / folder / name) for folder in ("single", run))
        assert expected.keys() == trained.keys() and expected
        assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k), name  # both experts trained
        for key in expected:
            torch.testing.assert_close(trained[key], expected[key], rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_two_fsdp_ranks_train_two_experts_like_one_process_routed_per_step(make_config, tmp_path, monkeypatch):
    folder = write_tiny_wan22(tmp_path / "a14b", two_experts=True, boundary_ratio=0.5)
    # No model.expert_routing: under FSDP on two ranks it is `step`. A validation sample after the last step: rank 0
    # samples with both experts' gathered weights (the pipeline calls each expert itself).
    validation = {"enabled": True, "num_inference_steps": 2, "prompts": ["a red circle"]}
    runs = [("fsdp", make_config(output_dir=str(tmp_path / "fsdp"), **_settings(
        folder, parallel={"strategy": "fsdp"}, validation=validation, checkpoint={"every": 2})).to_dict(), {})]
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(rank_main, (2, runs, str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    losses = _one_process_with_step_routing(make_config, tmp_path, folder, monkeypatch)
    for result in ranks:
        assert "error" not in result["fsdp"], result["fsdp"]
        assert result["fsdp"]["losses"] == pytest.approx(losses, rel=1e-4)
    _assert_same_adapters(tmp_path, "fsdp")
    assert [p.name for p in (tmp_path / "fsdp" / "samples").glob("*.mp4")] == [f"step-{STEPS:08d}-0.mp4"]
    # The sharded checkpoint of step 2, resumed by one process with batch 2: the step's expert is drawn from the step
    # number, so step 3 trains the expert it trained on two ranks, and the run ends where theirs ended.
    settings = _settings(folder, model={"expert_routing": "step"}, parallel={"strategy": "fsdp"},
                         checkpoint={"resume": str(tmp_path / "fsdp" / "checkpoints" / "step-00000002")})
    settings["training"]["batch_size"] = 2
    resumed = build_trainer(make_config(output_dir=str(tmp_path / "resumed"), **settings)).run()
    assert resumed.first_step == 2 and resumed.losses == pytest.approx(losses[2:], rel=1e-4)
    for name in (LORA_FILE, LORA_FILE_2):
        expected, trained = load_file(tmp_path / "fsdp" / name), load_file(tmp_path / "resumed" / name)
        for key in expected:
            torch.testing.assert_close(trained[key], expected[key], rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_deepspeed_zero_2_trains_two_experts_routed_per_step(make_config, tmp_path, monkeypatch):
    """ZeRO-2 on two ranks takes both experts, each step one expert on both ranks. Its optimizer steps the flat
    partition of every trainable weight each step: an expert a step skipped gets a zero gradient, so its AdamW
    moments, weight decay and bias correction move on, where torch's AdamW (one process, DDP, FSDP) leaves a weight
    without gradient untouched. The losses agree until the first step after a skip; both adapters train."""
    folder = write_tiny_wan22(tmp_path / "a14b", two_experts=True, boundary_ratio=0.5)
    runs = [("zero2", make_config(output_dir=str(tmp_path / "zero2"), **_settings(
        folder, parallel={"strategy": "deepspeed", "zero_stage": 2})).to_dict(), {})]
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(deepspeed_rank_main, (2, runs, str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    losses = _one_process_with_step_routing(make_config, tmp_path, folder, monkeypatch)
    for result in ranks:
        assert "error" not in result["zero2"], result["zero2"]
        assert result["zero2"]["losses"] == ranks[0]["zero2"]["losses"]
        # Steps 0 and 1 agree: before step 1 the skipped low-noise expert's adapter moved only by the weight
        # decay of its lora_A, which cannot show while its lora_B is zero.
        assert result["zero2"]["losses"][:2] == pytest.approx(losses[:2], rel=1e-4)
    for name in (LORA_FILE, LORA_FILE_2):
        trained = load_file(tmp_path / "zero2" / name)
        assert trained.keys() == load_file(tmp_path / "single" / name).keys()
        assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k), name


@pytest.mark.slow
def test_two_ddp_ranks_train_two_experts_control_like_one_process(make_config, shapes_dataset, tmp_path):
    """control-lora on two experts under DDP: each rank routes its sample (and its control latents) to its expert,
    so a step may run a different expert on each rank; the adapters and both widened input layers are those one
    process trains with both samples in one batch (seed 1: in every step one rank runs the high-noise expert and
    the other the low-noise one, and the one process splits its batch between them)."""
    folder = write_tiny_wan22(tmp_path / "a14b", two_experts=True, boundary_ratio=0.5)
    settings = _settings(folder, data_root=control_dataset(shapes_dataset, tmp_path / "data")[0])
    settings["training"].update(algorithm="control-lora", seed=1, steps=2)
    two_ranks_against_one_process(make_config, tmp_path, settings, files=(LORA_FILE, LORA_FILE_2))
    for name in ("control_input.safetensors", "control_input_transformer_2.safetensors"):
        expected, trained = (load_file(tmp_path / run / name) for run in ("single", "ddp"))
        torch.testing.assert_close(trained["weight"], expected["weight"], rtol=RTOL, atol=ATOL)
        in_features = json.loads((tmp_path / "ddp" / "control.json").read_text())["in_features"]
        assert trained["weight"][:, in_features:].abs().max() > 0  # the control inputs trained (from zero)
