"""FSDP shards a denoiser block by block (`transformer_blocks`): for every family's released architecture, the
repeated blocks must hold nearly all of the weights, or one rank would gather a large unsharded remainder at once
(and the planner's per-rank figures would not hold)."""

from __future__ import annotations

import pytest

from vidtune.memory.architectures import architecture_folder, families, shipped_architectures
from vidtune.memory.meta import build_from_config
from vidtune.models.registry import get_spec_class
from vidtune.parallel.fsdp import transformer_blocks


def _one_hub_id_per_denoiser_class() -> list[str]:
    chosen: dict[str, str] = {}
    for hub_id in sorted(shipped_architectures()):
        denoiser_class = get_spec_class(families(hub_id)[0]).denoiser_class
        chosen.setdefault(denoiser_class.__name__, hub_id)
    return sorted(chosen.values())


@pytest.mark.parametrize("hub_id", _one_hub_id_per_denoiser_class())
def test_the_blocks_fsdp_shards_hold_nearly_all_weights(hub_id):
    spec_class = get_spec_class(families(hub_id)[0])
    folder, _ = architecture_folder(hub_id, spec_class.name)
    denoiser = build_from_config(spec_class.denoiser_class, folder / "transformer", None)
    spec = spec_class.__new__(spec_class)  # denoiser_parts reads only the denoiser
    blocks = [block for part in spec.denoiser_parts(denoiser).values() for block in transformer_blocks(part)]
    in_blocks = sum(p.numel() for block in blocks for p in block.parameters())
    total = sum(p.numel() for p in denoiser.parameters())
    assert len(blocks) >= 8 and in_blocks / total > 0.85, (len(blocks), in_blocks / total)
