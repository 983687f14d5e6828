"""`training.preserve_base`: the adapter learns to leave the base model's prediction unchanged on captions without the
trigger word (ai-toolkit's differential output preservation), from the cache and on the fly alike."""

from __future__ import annotations

import pytest
import torch

from vidtune.algorithms.losses import PRESERVATION, noisy_inputs, predict
from vidtune.errors import ConfigError
from vidtune.trainers import build_trainer


def with_trigger(shapes_dataset, **source) -> dict:
    return {"datasets": [{"type": "pairs", "root": str(shapes_dataset), "trigger": "sks", **source}], "root": None}


def base_change(trainer) -> float:
    """Mean squared change the trained adapter makes to the base model's prediction on each clip's caption without
    the trigger, at the noisy latents of the run's first visits."""
    context = trainer.context
    stream = context.source.batches(0)
    changes = []
    with torch.no_grad():
        for _ in range(len(context.clips)):
            batch = next(stream)
            inputs = noisy_inputs(context, batch)
            caption = context.clips[int(batch.indices[0])].untriggered
            conditions = {**{k: v for k, v in inputs.conditions.items() if k not in batch.conditions},
                          **context.source.prompt(caption)}
            with context.part.teacher() as base:
                before = predict(context, base, conditions, inputs.noisy, inputs.timesteps, None)
            after = predict(context, context.denoiser, conditions, inputs.noisy, inputs.timesteps, None)
            changes.append(float((after - before).pow(2).mean()))
    return sum(changes) / len(changes)


def test_preserving_the_base_keeps_its_prediction_on_captions_without_the_trigger(make_config, shapes_dataset,
                                                                                  tmp_path):
    def run(preserve, name):
        config = make_config(data=with_trigger(shapes_dataset),
                             training={"steps": 24, "learning_rate": 2e-2, "preserve_base": preserve},
                             lora={"rank": 4, "alpha": 4}, output_dir=str(tmp_path / name))
        trainer = build_trainer(config)
        trainer.run()
        return base_change(trainer)

    free = run(None, "free")
    preserved = run({"weight": 4.0}, "preserved")
    print(f"change of the base prediction on captions without the trigger: {free:.3e} without preserve_base, "
          f"{preserved:.3e} with weight 4 ({preserved / free:.2f} of it)")
    assert free > 0
    assert preserved < 0.5 * free


def test_the_first_losses_are_the_same_from_the_cache_and_on_the_fly(make_config, shapes_dataset, tmp_path):
    def first_losses(enabled, name, **extra):
        config = make_config(data=with_trigger(shapes_dataset),
                             training={"steps": 2, "batch_size": 2, "preserve_base": {"weight": 0.5, **extra}},
                             precompute={"enabled": enabled, "cache_dir": str(tmp_path / "cache")},
                             output_dir=str(tmp_path / name))
        trainer = build_trainer(config)
        outputs, original = [], trainer.loss

        def keep(context, batch):
            outputs.append(original(context, batch))
            return outputs[-1]

        trainer.loss = keep
        trainer.run()
        return outputs

    for extra in ({}, {"prompts": ["a dog running", "a red car"]}):
        live = first_losses(False, f"live{len(extra)}", **extra)
        cached = first_losses(True, f"cached{len(extra)}", **extra)
        for step, (a, b) in enumerate(zip(live, cached, strict=True)):
            print(f"step {step + 1}: loss on the fly {float(a.total.detach()):.6f}, from the cache "
                  f"{float(b.total.detach()):.6f}; preservation part {float(a.parts[PRESERVATION]):.3e}")
            torch.testing.assert_close(b.total, a.total, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(b.parts[PRESERVATION], a.parts[PRESERVATION], rtol=1e-5, atol=1e-9)
        # The adapter starts as the base model (its B matrices 0): the preservation loss counts once it has trained.
        assert float(live[0].parts[PRESERVATION]) == 0 and float(live[1].parts[PRESERVATION]) > 0


def test_preserve_base_is_refused_without_an_adapter_or_without_preservation_captions(make_config, shapes_dataset):
    with pytest.raises(ConfigError, match=r"training\.preserve_base works with training\.algorithm=lora only: full"):
        make_config(data=with_trigger(shapes_dataset), training={"algorithm": "full", "preserve_base": {"weight": 1}})
    with pytest.raises(ConfigError, match=r"training\.preserve_base has no preservation captions"):
        make_config(training={"preserve_base": {"weight": 1}})
    make_config(training={"preserve_base": {"weight": 1, "prompts": ["a dog"]}})  # given prompts need no trigger
