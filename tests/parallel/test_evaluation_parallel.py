"""The held-out score under torchrun, with real processes on CPU (gloo): DDP shares the (clip, noise level) pairs
out over the ranks and sums them; FSDP (whose forwards are collectives) scores every pair on every rank. Either way
the score is the one process's with twice the batch, logged once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.distributed import rank_main, spawn_ranks
from vidtune.config import build_config
from vidtune.trainers import build_trainer

EVAL = {"eval_clips": 2, "eval_noise_levels": [0.2, 0.5, 0.8]}


def eval_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "eval_loss" in row]


@pytest.mark.slow
def test_two_ranks_score_what_one_process_scores_with_twice_the_batch(make_config, tmp_path):
    def settings(name: str, batch_size: int, **sections) -> dict:
        training = {"steps": 2, "learning_rate": 1e-2, "batch_size": batch_size, **sections.pop("training", {})}
        return make_config(output_dir=str(tmp_path / name), training=training, checkpoint={"every": 1},
                           validation=EVAL, **sections).to_dict()

    runs = [
        ("ddp", settings("ddp", 1), {}),
        ("fsdp", settings("fsdp", 1, parallel={"strategy": "fsdp"}, training={"ema_decay": 0.5}), {}),
    ]
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(rank_main, (2, runs, str(out)), nprocs=2)
    for rank in range(2):
        results = json.loads((out / f"rank{rank}.json").read_text())
        assert all("losses" in result for result in results.values()), results

    for name, single in (("ddp", {}), ("fsdp", {"training": {"ema_decay": 0.5}})):
        reference = build_trainer(build_config(settings(f"single-{name}", 2, **single)))
        expected = eval_rows(reference.run().output_dir)
        scored = eval_rows(tmp_path / name)
        assert [row["step"] for row in scored] == [row["step"] for row in expected] == [0, 1, 2]
        for row, single_row in zip(scored, expected, strict=True):
            assert row["eval_loss"] == pytest.approx(single_row["eval_loss"], rel=1e-4)
            for level, value in single_row["eval_loss_by_noise"].items():
                assert row["eval_loss_by_noise"][level] == pytest.approx(value, rel=1e-4)
        assert (tmp_path / name / "eval_loss.png").is_file()


@pytest.mark.slow
def test_zero_2_and_3_on_two_ranks_score_what_one_process_scores(make_config, tmp_path):
    """DeepSpeed: ZeRO-2 shares the pairs out like DDP; ZeRO-3 (whose forwards gather the weights) scores every pair
    on every rank."""
    from tests.helpers.distributed import deepspeed_rank_main

    def settings(name: str, batch_size: int, **sections) -> dict:
        return make_config(output_dir=str(tmp_path / name), training={"steps": 2, "learning_rate": 1e-2,
                                                                      "batch_size": batch_size},
                           checkpoint={"every": 1}, validation=EVAL, **sections).to_dict()

    runs = [(f"zero{stage}", settings(f"zero{stage}", 1, parallel={"strategy": "deepspeed", "zero_stage": stage}), {})
            for stage in (2, 3)]
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(deepspeed_rank_main, (2, runs, str(out)), nprocs=2)
    for rank in range(2):
        results = json.loads((out / f"rank{rank}.json").read_text())
        assert all("losses" in result for result in results.values()), results
    expected = eval_rows(build_trainer(build_config(settings("single", 2))).run().output_dir)
    for name in ("zero2", "zero3"):
        scored = eval_rows(tmp_path / name)
        assert [row["step"] for row in scored] == [0, 1, 2]
        for row, single_row in zip(scored, expected, strict=True):
            assert row["eval_loss"] == pytest.approx(single_row["eval_loss"], rel=1e-4)
