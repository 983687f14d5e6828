"""MiniMax H3 calls its transformer once per clip of a micro-batch (each clip its own packed caption / sound / video
sequence): under DDP and FSDP two ranks still train what one process trains with twice the batch."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import two_ranks_against_one_process


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_train_a_family_called_once_per_clip_like_one_process(make_config, tmp_path, strategy):
    settings = {"family": "minimax-h3", "parallel": {"strategy": strategy},
                "training": {"steps": 2, "batch_size": 2, "learning_rate": 1e-2, "seed": 0}}
    ranks = two_ranks_against_one_process(make_config, tmp_path, settings)
    assert all(len(result["losses"]) == 2 for result in ranks)
