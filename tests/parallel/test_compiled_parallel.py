"""training.compile under torchrun: compiled blocks train under DDP and under FSDP2 what one eager process
trains with the two ranks' samples (the equality the eager two-rank tests check, with compiled blocks)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.distributed import LORA_FILE, rank_main, spawn_ranks
from vidtune.trainers import build_trainer

# The eager two-rank tests' bounds: ranks change the order of float additions (gradient averaging, sharding);
# compiled blocks add inductor's reordering (1e-7 relative in fp32, tests/training/test_compile.py).
RTOL, ATOL = 1e-3, 1e-4
STEPS = 3


@pytest.mark.slow
def test_compiled_blocks_train_under_ddp_and_fsdp_what_one_eager_process_trains(make_config, tmp_path):
    training = {"steps": STEPS, "learning_rate": 1e-2, "compile": True}
    runs = [(strategy, make_config(output_dir=str(tmp_path / strategy), training=training,
                                   parallel={"strategy": strategy}).to_dict(), {})
            for strategy in ("ddp", "fsdp")]
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(rank_main, (2, runs, str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]

    single = build_trainer(make_config(training={"steps": STEPS, "batch_size": 2, "learning_rate": 1e-2},
                                       output_dir=str(tmp_path / "single"))).run()
    expected = load_file(tmp_path / "single" / LORA_FILE)
    for strategy in ("ddp", "fsdp"):
        for result in ranks:
            assert "error" not in result[strategy], result[strategy]
            assert result[strategy]["losses"] == pytest.approx(single.losses, rel=1e-4)
        trained = load_file(tmp_path / strategy / LORA_FILE)
        assert trained.keys() == expected.keys() and any(v.abs().max() > 0 for k, v in trained.items()
                                                          if "lora_B" in k)
        for key in expected:
            torch.testing.assert_close(trained[key], expected[key], rtol=RTOL, atol=ATOL)
        rows = [json.loads(line) for line in (tmp_path / strategy / "metrics.jsonl").read_text().splitlines()]
        assert rows[0]["compile_seconds"] > 0 and all("compile_seconds" not in row for row in rows[1:])
