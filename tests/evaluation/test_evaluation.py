"""The held-out score (validation.eval_clips, sources marked `eval: true`): fixed inputs, so it moves only with the
weights; logged per noise level and in total; plotted; the best checkpoint named and kept; resumes bit for bit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.datasets import control_dataset
from tests.helpers.runs import run_stopped_at
from vidtune import checkpoint
from vidtune.data.synthetic import render_shapes_dataset
from vidtune.errors import ConfigError
from vidtune.evaluation import HeldOutSet, Score, plot_eval_curve
from vidtune.models.tiny import TINY_SHAPES
from vidtune.trainers import build_trainer
from vidtune.training.held_out import held_out_losses

LORA_FILE = "pytorch_lora_weights.safetensors"
EVAL = {"eval_clips": 1, "eval_noise_levels": [0.2, 0.5, 0.8]}


def eval_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "eval_loss" in row]


def loss_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row]


def score_now(trainer) -> Score:
    """The held-out score of the trainer's weights as they are, as the run takes it."""
    with torch.no_grad():
        context = trainer.context
        return context.held_out.set.score(context.objective, held_out_losses(context), context.device,
                                          every_rank=False)


@pytest.mark.parametrize("algorithm", ["lora", "full"])
def test_the_same_weights_score_the_same_and_other_weights_score_otherwise(algorithm, make_config, tmp_path):
    trainer = build_trainer(make_config(training={"steps": 2, "algorithm": algorithm}, validation=EVAL))
    result = trainer.run()
    rows = eval_rows(result.output_dir)
    assert [row["step"] for row in rows] == [0, 2]
    assert list(rows[-1]["eval_loss_by_noise"]) == ["0.2", "0.5", "0.8"]
    assert rows[-1]["eval_loss"] == pytest.approx(sum(rows[-1]["eval_loss_by_noise"].values()) / 3)
    assert rows[0]["eval_loss"] != rows[1]["eval_loss"]  # two steps of training moved it

    # Evaluated again (twice) with the same weights: the very numbers the run logged at its last step.
    first, second = score_now(trainer), score_now(trainer)
    assert first == second
    assert first.total == rows[-1]["eval_loss"]
    assert {f"{k:g}": v for k, v in first.by_level.items()} == rows[-1]["eval_loss_by_noise"]

    # Other weights, another score.
    trained = [p for p in trainer.context.denoiser.parameters() if p.requires_grad]
    with torch.no_grad():
        trained[0].add_(0.05)
    assert score_now(trainer).total != first.total


def test_the_eval_curve_is_drawn_from_the_second_score_on(tmp_path):
    metrics, picture = tmp_path / "metrics.jsonl", tmp_path / "eval_loss.png"
    rows = [{"step": step, "eval_loss": 1.0 / (step + 1), "eval_loss_by_noise": {"0.5": 1.0 / (step + 1)},
             "eval_checkpoint": step > 0, "eval_best_step": step or None} for step in (0, 2)]
    metrics.write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n" + json.dumps(rows[0]) + "\n")
    assert plot_eval_curve(metrics, picture) is None and not picture.exists()  # one score: no curve yet
    with metrics.open("a") as handle:
        handle.write(json.dumps(rows[1]) + "\n")
    assert plot_eval_curve(metrics, picture) == picture and picture.stat().st_size > 10_000


def test_the_held_out_clip_is_not_trained_on(make_config, capsys):
    trainer = build_trainer(make_config(training={"steps": 1}, validation=EVAL))
    trainer.run()
    assert [clip.index for clip in trainer.context.clips] == [0, 1, 2]
    context = trainer.context
    assert len(context.eval_clips) == 1 and context.eval_clips[0].video not in {c.video for c in context.clips}
    assert "Held-out score: 1 sample (videos.txt line 3), not trained on" in capsys.readouterr().out


def test_scoring_leaves_training_alone_and_a_resumed_run_scores_like_one_left_alone(make_config, tmp_path):
    """LoRA dropout draws from the global RNG: equal weights with and without scoring prove that scoring draws
    nothing from the training RNGs; a stopped and resumed run logs the scores of the uninterrupted one."""
    settings = {"training": {"steps": 5}, "checkpoint": {"every": 2}, "lora": {"dropout": 0.1}}
    scored = {**settings, "validation": {**EVAL, "train_on_eval_clips": True}}
    reference = build_trainer(make_config(**scored, output_dir=str(tmp_path / "reference"))).run()
    plain = build_trainer(make_config(**settings, output_dir=str(tmp_path / "plain"))).run()
    assert reference.losses == plain.losses
    reference_weights, plain_weights = load_file(reference.weights_path), load_file(plain.weights_path)
    assert all(torch.equal(reference_weights[key], plain_weights[key]) for key in plain_weights)
    assert [row["step"] for row in eval_rows(reference.output_dir)] == [0, 2, 4, 5]

    out = tmp_path / "stopped"
    run_stopped_at(build_trainer(make_config(**scored, output_dir=str(out))), 3)
    # The stop's checkpoint (step 3) is written at once, unscored.
    assert [row["step"] for row in eval_rows(out)] == [0, 2]
    scored["checkpoint"] = {"every": 2, "resume": "latest"}
    resumed = build_trainer(make_config(**scored, output_dir=str(out))).run()
    assert eval_rows(out) == eval_rows(reference.output_dir)
    assert loss_rows(out) == [{**row, "seconds_per_step": row_out["seconds_per_step"]} for row, row_out in
                              zip(loss_rows(reference.output_dir), loss_rows(out), strict=True)]
    assert resumed.best_checkpoint == out / "checkpoints" / reference.best_checkpoint.name


def test_the_score_falls_on_a_clip_the_run_overfits(make_config, tmp_path):
    one_clip = render_shapes_dataset(tmp_path / "one", num_clips=1, num_frames=33, height=48, width=48, fps=24, seed=3)
    config = make_config(data_root=one_clip, training={"steps": 30, "learning_rate": 3e-3},
                         lora={"rank": 8}, checkpoint={"every": 10},
                         validation={**EVAL, "train_on_eval_clips": True})
    result = build_trainer(config).run()
    rows = eval_rows(result.output_dir)
    assert [row["step"] for row in rows] == [0, 10, 20, 30]
    assert rows[-1]["eval_loss"] < 0.9 * rows[0]["eval_loss"]
    assert all(rows[-1]["eval_loss_by_noise"][level] < rows[0]["eval_loss_by_noise"][level]
               for level in rows[0]["eval_loss_by_noise"])
    assert (result.output_dir / "eval_loss.png").stat().st_size > 10_000


def test_the_best_checkpoint_is_named_and_outlives_the_pruning(make_config, monkeypatch, capsys):
    """Scores 5, 3, 1, 2, 4 at steps 0, 2, 4, 6, 8: step 4 is the best checkpoint, kept beside the newest one."""
    totals = iter([5.0, 3.0, 1.0, 2.0, 4.0])
    monkeypatch.setattr(HeldOutSet, "score", lambda self, *args, **kwargs: Score(next(totals), {0.5: 0.0}))
    config = make_config(training={"steps": 8}, checkpoint={"every": 2, "keep": 1}, validation=EVAL)
    result = build_trainer(config).run()
    root = result.output_dir / "checkpoints"
    assert [path.name for path in checkpoint.list_checkpoints(root)] == ["step-00000004", "step-00000008"]
    assert result.best_checkpoint == root / "step-00000004"
    assert "Best checkpoint: step 4 (1.0000)" in result.held_out
    assert f"vidtune export {root / 'step-00000004'}" in result.held_out
    rows = eval_rows(result.output_dir)
    assert [(row["step"], row["eval_checkpoint"], row["eval_best_step"]) for row in rows] == [
        (0, False, None), (2, True, 2), (4, True, 4), (6, True, 4), (8, True, 4)]
    assert "best checkpoint so far: step 4 (1.0000)" in capsys.readouterr().out
    assert (result.output_dir / "eval_loss.png").is_file() and (result.output_dir / "loss.png").is_file()


def test_the_command_names_the_best_checkpoint(make_config, tmp_path, capsys):
    from vidtune.cli import main

    config = make_config(training={"steps": 2}, checkpoint={"every": 1}, validation=EVAL)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    assert main(["train", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Best checkpoint: step" in out and "eval curve" in out


def test_the_cache_and_on_the_fly_encoding_give_the_same_score(make_config, tmp_path):
    rows = {}
    for name, precompute in (("fly", {}), ("cache", {"enabled": True, "cache_dir": str(tmp_path / "cache")})):
        config = make_config(training={"steps": 1}, precompute=precompute, validation=EVAL,
                             output_dir=str(tmp_path / name))
        rows[name] = eval_rows(build_trainer(config).run().output_dir)
    assert [row["step"] for row in rows["cache"]] == [0, 1]
    for cached, fly in zip(rows["cache"], rows["fly"], strict=True):
        assert cached["eval_loss"] == pytest.approx(fly["eval_loss"], rel=1e-5)


def test_a_source_marked_eval_is_held_out_whole(make_config, shapes_dataset, tmp_path):
    held_out = render_shapes_dataset(tmp_path / "held", num_clips=2, num_frames=33, height=48, width=48, fps=24,
                                     seed=7)
    config = make_config(data={"root": None, "datasets": [{"type": "pairs", "root": str(shapes_dataset)},
                                                          {"type": "pairs", "root": str(held_out), "eval": True}]},
                         training={"steps": 1})
    trainer = build_trainer(config)
    trainer.run()
    assert len(trainer.context.clips) == 4 and len(trainer.context.eval_clips) == 2
    assert all(held_out in clip.video.parents for clip in trainer.context.eval_clips)
    assert len(eval_rows(trainer.context.output_dir)) == 2


def test_control_training_scores_with_each_clip_s_control(make_config, shapes_dataset, tmp_path):
    root, _, _ = control_dataset(shapes_dataset, tmp_path / "control")
    trainer = build_trainer(make_config(data_root=root, training={"steps": 2, "algorithm": "control-lora"},
                                        validation=EVAL))
    trainer.run()
    assert trainer.context.eval_clips[0].control is not None
    first = score_now(trainer)
    assert first.total == eval_rows(trainer.context.output_dir)[-1]["eval_loss"]
    # The control latents reach the denoiser: another control clip gives another score.
    _, latents = trainer.context.held_out.set.items[0]
    latents["control_latents"] = latents["control_latents"].flip(-1)
    assert score_now(trainer).total != first.total


@pytest.mark.parametrize("algorithm", ["guidance-distillation", "step-distillation"])
def test_distillation_refuses_a_held_out_score_before_any_work(algorithm, make_config, tmp_path):
    trainer = build_trainer(make_config(training={"algorithm": algorithm}, validation=EVAL))
    with pytest.raises(ConfigError, match=r"validation\.eval_clips: the held-out score is the denoising loss"):
        trainer.run()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("family", sorted(TINY_SHAPES))
def test_every_family_scores_the_same_weights_alike(family, make_config):
    """Each family's own inputs reach the score: first frames (image-to-video), LTX-2's sound, DDPM timesteps
    (CogVideoX), Mochi's inverted timesteps."""
    trainer = build_trainer(make_config(family, training={"steps": 1},
                                        validation={"eval_clips": 1, "eval_noise_levels": [0.3, 0.8]}))
    trainer.run()
    rows = eval_rows(trainer.context.output_dir)
    assert [row["step"] for row in rows] == [0, 1]
    assert all(math.isfinite(value) for row in rows for value in row["eval_loss_by_noise"].values())
    assert score_now(trainer).total == rows[-1]["eval_loss"]


def test_training_from_the_cache_loads_the_encoders_once_for_its_clips_and_the_held_out_ones(make_config, tmp_path,
                                                                                              monkeypatch):
    from vidtune.models.spec import ModelSpec

    loads = []
    for name in ("load_text", "load_vae"):
        original = getattr(ModelSpec, name)
        monkeypatch.setattr(ModelSpec, name, lambda self, *args, _original=original, _name=name, **kwargs: (
            loads.append(_name), _original(self, *args, **kwargs))[1])
    config = make_config(training={"steps": 1}, validation=EVAL,
                         precompute={"enabled": True, "cache_dir": str(tmp_path / "cache")})
    build_trainer(config).run()
    assert sorted(loads) == ["load_text", "load_vae"]
