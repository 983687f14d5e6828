"""Under torchrun each rank precomputes its own share: no duplicates, no gaps, and every rank reads it all.

Two real processes on CPU, talking over gloo, with the environment torchrun sets (RANK, WORLD_SIZE, ...).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import spawn_ranks
from vidtune.config import build_config
from vidtune.precompute import precompute


def _free_port() -> int:
    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        return handle.getsockname()[1]


def _rank_main(rank: int, world: int, ports: tuple[int, int], config: dict, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(ports[0]), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    config = build_config(config)
    first = precompute(config, progress=False)  # creates (and removes) a gloo group from the environment
    plan = first.plan
    readable = {kind: sum(1 for key in keys if plan.cache.read(kind, key)) for kind, keys in
                (("conditions", plan.conditions), ("latents", plan.latents))}
    # A training script that already set up torch.distributed: precompute uses its group.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=world)
    second = precompute(config, progress=False)
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "first": first.line(), "second": second.line(), "computed": first.computed_keys,
        "all": {"conditions": list(plan.conditions), "latents": list(plan.latents)}, "readable": readable,
        "workers": [w.name for w in first.workers if w.items],
    }))


@pytest.mark.slow
def test_two_ranks_share_the_work(config_for, tmp_path):
    config = config_for().to_dict()
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(_rank_main, (2, (_free_port(), _free_port()), config, str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for result in ranks:
        # Counts are of the whole dataset, the same on every rank.
        assert result["first"] == "conditions: 4 computed, 0 reused; latents: 4 computed, 0 reused"
        assert result["second"] == "conditions: 0 computed, 4 reused; latents: 0 computed, 4 reused"
        assert result["readable"] == {"conditions": 4, "latents": 4}  # every rank reads every entry
        assert result["all"] == ranks[0]["all"]
    for kind in ("conditions", "latents"):
        shares = [set(result["computed"][kind]) for result in ranks]
        assert shares[0] and shares[1], "a rank did nothing"
        assert not shares[0] & shares[1], "two ranks computed the same entry"
        assert shares[0] | shares[1] == set(ranks[0]["all"][kind]), "an entry was computed by no rank"
