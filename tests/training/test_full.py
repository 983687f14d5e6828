"""The full fine-tune trainer: what it trains (patterns), and a result the family's own classes load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import LTXVideoTransformer3DModel

from vidtune.algorithms.full import select_trainable
from vidtune.errors import ConfigError
from vidtune.trainers import build_trainer


def test_frozen_patterns_stay_put_and_the_result_loads_into_the_pipeline(make_config, tiny_model_dir):
    frozen = ["transformer_blocks.0.*", "proj_out.*"]
    config = make_config(training={"algorithm": "full", "steps": 2, "learning_rate": 1e-2},
                         full={"frozen_patterns": frozen})
    trainer = build_trainer(config)
    result = trainer.run()
    base = LTXVideoTransformer3DModel.from_pretrained(tiny_model_dir("ltx-video") / "transformer")
    before = dict(base.named_parameters())
    after = dict(trainer.context.denoiser.named_parameters())

    frozen_names = [n for n in after if n.startswith(("transformer_blocks.0.", "proj_out."))]
    assert frozen_names and all(not after[n].requires_grad for n in frozen_names)
    assert all(torch.equal(after[n], before[n]) for n in frozen_names)
    trained = [n for n in after if n not in frozen_names]
    assert all(after[n].requires_grad for n in trained)
    assert sum(not torch.equal(after[n], before[n]) for n in trained) >= len(trained) - 2

    out = Path(config.output_dir) / "transformer"
    assert result.weights_path == out and (out / "config.json").is_file()
    loaded = LTXVideoTransformer3DModel.from_pretrained(out)
    assert all(torch.equal(p, after[n]) for n, p in loaded.named_parameters())
    # The family's pipeline samples with it, and `model.subfolders.transformer` points a spec at it.
    pipeline = trainer.spec.pipeline(trainer.context.text, trainer.context.vae, loaded)
    pipeline.set_progress_bar_config(disable=True)
    frames = trainer.spec.sample(pipeline, "a red circle", frames=config.data.frames, height=config.data.height,
                                 width=config.data.width, num_inference_steps=2, guidance_scale=1.0,
                                 generator=torch.Generator().manual_seed(0)).frames
    assert frames.shape == (config.data.frames, 3, config.data.height, config.data.width)
    assert torch.isfinite(frames).all()
    respec = build_trainer(make_config(model={"subfolders": {"transformer": str(out)}})).spec
    assert all(torch.equal(p, after[n]) for n, p in respec.load_denoiser(torch.device("cpu")).named_parameters())


def test_trainable_patterns_select_and_bad_patterns_are_named():
    names = ["proj_in.weight", "transformer_blocks.0.attn1.to_q.weight", "transformer_blocks.1.attn1.to_q.weight",
             "transformer_blocks.1.ff.net.2.weight"]
    assert select_trainable(names, ["*"], []) == set(names)
    assert select_trainable(names, ["transformer_blocks.*.attn1.*"], ["transformer_blocks.0.*"]) == {
        "transformer_blocks.1.attn1.to_q.weight"
    }
    with pytest.raises(ConfigError, match=r"full.frozen_patterns: 'blocks.\*'"):
        select_trainable(names, ["*"], ["blocks.*"])
    with pytest.raises(ConfigError, match="leave no parameter to train"):
        select_trainable(names, ["proj_in.*"], ["proj_*"])


def test_a_pattern_that_matches_nothing_fails_before_training(make_config):
    config = make_config(training={"algorithm": "full"}, full={"trainable_patterns": ["attn9.*"]})
    with pytest.raises(ConfigError, match=r"full\.trainable_patterns: 'attn9"):
        build_trainer(config).run()
    assert not (Path(config.output_dir) / "checkpoints").exists()
