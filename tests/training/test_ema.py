"""`training.ema_decay` in a run: saved beside the weights, used for validation, exported from checkpoints.

Its bitwise resume is checked in tests/resume/test_resume.py and tests/resume/test_kill_resume.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vidtune import checkpoint
from vidtune.cli import main as cli_main
from vidtune.trainers import build_trainer
from vidtune.training import validation

FINAL = {"lora": ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_ema.safetensors"),
         "full": ("transformer/diffusion_pytorch_model.safetensors",
                  "transformer_ema/diffusion_pytorch_model.safetensors")}


@pytest.mark.parametrize("algorithm", ["lora", "full"])
def test_the_average_is_saved_beside_the_weights_and_validation_samples_with_it(make_config, tmp_path, monkeypatch,
                                                                                 algorithm):
    config = make_config(training={"steps": 3, "algorithm": algorithm, "learning_rate": 1e-2, "ema_decay": 0.5},
                         checkpoint={"every": 1, "keep": 5}, validation={"enabled": True, "num_inference_steps": 1})
    trainer = build_trainer(config)
    # What validation samples with: the trainable weights as they are while it renders.
    seen = []
    monkeypatch.setattr(validation, "render_samples", lambda *args, **kwargs: seen.append(
        {k: v.detach().clone() for k, v in trainer.part.state_dict().items()}) or [])
    result = trainer.run()
    out = Path(config.output_dir)
    plain, averaged = (load_file(out / name) for name in FINAL[algorithm])
    assert plain.keys() == averaged.keys()
    assert any(not torch.equal(plain[k], averaged[k]) for k in plain), "the average equals the weights"

    # The average of the checkpointed steps, by its formula: (weights at step n), decay min(0.5, (1+n)/(10+n)).
    steps = [checkpoint.load(folder)[0] for folder in checkpoint.list_checkpoints(out / "checkpoints")]
    first_ema = checkpoint.load_ema(out / "checkpoints" / "step-00000001")
    expected = dict(first_ema)
    for n, weights in enumerate(steps[1:], start=1):
        decay = min(0.5, (1 + n) / (10 + n))
        expected = {k: torch.lerp(expected[k], weights[k], 1 - decay) for k in expected}
    final_ema = checkpoint.load_ema(out / "checkpoints" / "step-00000003")
    for key in expected:
        torch.testing.assert_close(final_ema[key], expected[key], rtol=0, atol=1e-7)
    # Validation sampled with the average, and the weights were back afterwards (the final file is them).
    assert len(seen) == 1 and all(torch.equal(seen[0][k], final_ema[k].to(seen[0][k])) for k in final_ema)
    assert all(torch.equal(trainer.part.state_dict()[k].cpu(), steps[-1][k]) for k in steps[-1])
    assert result.final_step == 3


@pytest.mark.parametrize("algorithm", ["lora", "full"])
def test_export_writes_the_checkpoints_average_too(make_config, tmp_path, algorithm):
    config = make_config(training={"steps": 2, "algorithm": algorithm, "ema_decay": 0.5}, checkpoint={"every": 1})
    build_trainer(config).run()
    out = Path(config.output_dir)
    assert cli_main(["export", str(out), "--output", str(tmp_path / "exported")]) == 0
    for name in FINAL[algorithm]:
        written, final = load_file(tmp_path / "exported" / name), load_file(out / name)
        assert written.keys() == final.keys() and all(torch.equal(written[k], final[k]) for k in final), name
