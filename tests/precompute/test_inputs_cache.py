"""Per-clip inputs in the precompute cache: each under its own identity, beside its clip's latents."""

from __future__ import annotations

import torch

from tests.helpers.datasets import write_mask
from vidtune.batches import CachedBatches, EncodedBatches
from vidtune.precompute import precompute
from vidtune.trainers import build_trainer


def _masked(config_for, dataset, **sections):
    for number in range(4):
        write_mask(dataset / f"mask{number}.png", 48, 48, white=(0.0, 0.0, 0.25 * (number + 1), 1.0))
    (dataset / "masks.txt").write_text("".join(f"mask{number}.png\n" for number in range(4)))
    training = {"masked_loss": True, **sections.pop("training", {})}
    entry = {"type": "pairs", "root": str(dataset), "inputs": {"mask": "masks.txt"}}
    return config_for(data={"root": None, "datasets": [entry]}, training=training, **sections)


def test_changing_a_mask_computes_only_that_mask_again(config_for, dataset):
    config = _masked(config_for, dataset)
    first = precompute(config, progress=False)
    assert (first.latents_computed, first.inputs_computed) == (4, 4)
    write_mask(dataset / "mask2.png", 48, 48, white=(0.5, 0.5, 1.0, 1.0))
    second = precompute(config, progress=False)
    assert (second.conditions_computed, second.latents_computed) == (0, 0)
    assert (second.inputs_computed, second.inputs_reused) == (1, 3)
    assert "inputs: 1 computed, 3 reused" in second.line()


def test_a_batch_with_masks_from_the_cache_equals_the_batch_computed_on_the_fly(config_for, dataset, tmp_path):
    batches = []
    for enabled in (False, True):
        config = _masked(config_for, dataset, precompute={"enabled": enabled, "batch_size": 1},
                         output_dir=str(tmp_path / f"run-{enabled}"))
        trainer = build_trainer(config)
        trainer.set_up()
        source = trainer.context.source
        assert isinstance(source, CachedBatches if enabled else EncodedBatches)
        batches.append(next(source.batches(0)).latents)
    live, cached = batches
    assert live.keys() == cached.keys() and "input_mask" in live
    for key in live:
        assert torch.equal(live[key], cached[key]), key
    assert live["input_mask"].shape[:2] == (1, 1) and live["input_mask"].shape[2:] == live["latents_mean"].shape[2:]


def test_same_losses_with_masks_from_the_cache_and_on_the_fly(config_for, dataset, tmp_path):
    losses = []
    for enabled in (False, True):
        config = _masked(config_for, dataset, training={"steps": 3, "seed": 5},
                         precompute={"enabled": enabled, "batch_size": 1}, output_dir=str(tmp_path / f"r-{enabled}"))
        losses.append(build_trainer(config).run().losses)
    assert losses[0] == losses[1]
