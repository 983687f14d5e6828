"""A source's role, loss weight and caption options in training: regularization samples' loss weighted and logged
apart, each source's own caption dropout, and a run with trigger words, shuffled tags and per-source dropout resuming
bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.datasets import captioned_dataset
from tests.helpers.runs import run_stopped_at
from vidtune.algorithms.losses import REGULARIZATION, clip_losses, noisy_inputs
from vidtune.evaluation import hold_out
from vidtune.trainers import build_trainer

LORA_FILE = "pytorch_lora_weights.safetensors"


def two_sources(shapes_dataset, tmp_path, first: dict, second: dict) -> dict:
    other = captioned_dataset(shapes_dataset, tmp_path / "second", ["a plain scene", "another plain scene"])
    return {"root": None, "datasets": [{"type": "pairs", "root": str(shapes_dataset), **first},
                                       {"type": "pairs", "root": str(other), **second}]}


def test_a_regularization_sources_loss_is_weighted_and_logged_apart(make_config, shapes_dataset, tmp_path):
    data = two_sources(shapes_dataset, tmp_path, {}, {"role": "regularization", "loss_weight": 0.25})
    config = make_config(data=data, training={"steps": 3, "batch_size": 3})
    trainer = build_trainer(config)
    checked, original = [], trainer.loss

    def check(context, batch):
        output = original(context, batch)
        with torch.no_grad():  # the same visit's unweighted errors, weighted here by hand
            errors = clip_losses(context, noisy_inputs(context, batch)).tolist()
        regularizes = [context.clips[int(index)].regularization for index in batch.indices]
        expected = [error * (0.25 if reg else 1.0) for error, reg in zip(errors, regularizes, strict=True)]
        assert float(output.total.detach()) == pytest.approx(sum(expected), rel=1e-5)
        share = sum(value for value, reg in zip(expected, regularizes, strict=True) if reg)
        assert float(output.parts[REGULARIZATION]) == pytest.approx(share, rel=1e-5, abs=1e-12)
        checked.append((sum(expected) / 3, share / 3, any(regularizes)))
        return output

    trainer.loss = check
    trainer.run()
    assert any(reg for _, _, reg in checked), "no regularization sample drawn"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row, (loss, share, _) in zip(rows, checked, strict=True):
        assert row["loss"] == pytest.approx(loss, rel=1e-5)
        assert row[REGULARIZATION] == pytest.approx(share, rel=1e-5, abs=1e-12)


def test_regularization_samples_are_never_held_out_nor_the_validation_prompt(make_config, shapes_dataset, tmp_path):
    from vidtune.data.sources import load_dataset
    from vidtune.training.validation import default_prompt

    data = two_sources(shapes_dataset, tmp_path, {"role": "regularization"}, {})
    config = make_config(data=data, validation={"eval_clips": 1})
    clips = load_dataset(config.data, progress=False)
    training, held = hold_out(clips, config)
    assert [clip.regularization for clip in held] == [False]
    assert default_prompt(training) in {"a plain scene", "another plain scene"}


def test_each_source_drops_its_captions_with_its_own_probability(make_config, shapes_dataset, tmp_path):
    data = two_sources(shapes_dataset, tmp_path, {"caption_dropout": 1.0}, {})
    trainer = build_trainer(make_config(data=data, training={"steps": 4, "batch_size": 2}))
    seen, original = [], trainer.loss

    def check(context, batch):
        conditions = noisy_inputs(context, batch).conditions
        for row, index in enumerate(batch.indices.tolist()):
            dropped = all(torch.equal(conditions[k][row], context.empty_caption[k][0]) for k in batch.conditions)
            kept = all(torch.equal(conditions[k][row], batch.conditions[k][row]) for k in batch.conditions)
            seen.append((context.clips[index].source_number, dropped, kept))
        return original(context, batch)

    trainer.loss = check
    trainer.run()
    assert {source for source, _, _ in seen} == {0, 1}
    assert all(dropped for source, dropped, _ in seen if source == 0)
    assert all(kept and not dropped for source, dropped, kept in seen if source == 1)


def test_trigger_shuffled_tags_and_source_dropout_resume_bit_for_bit(make_config, shapes_dataset, tmp_path):
    tags = captioned_dataset(shapes_dataset, tmp_path / "tags", ["red, ball, bouncing, fast, outdoors",
                                                               "blue, cube, spinning, slow, indoors"])
    data = {"root": None, "datasets": [
        {"type": "pairs", "root": str(tags), "trigger": "sks", "shuffle_tags": True, "keep_tokens": 1,
         "caption_dropout": 0.3, "weight": 2.0},
        {"type": "pairs", "root": str(shapes_dataset), "role": "regularization", "loss_weight": 0.5, "weight": 1.0}]}
    settings = {"data": data, "training": {"steps": 5, "batch_size": 2}, "checkpoint": {"every": 2}}
    reference = build_trainer(make_config(**settings, output_dir=str(tmp_path / "reference")))
    reference.run()

    stopped = build_trainer(make_config(**settings, output_dir=str(tmp_path / "stopped")))
    run_stopped_at(stopped, 3)
    settings["checkpoint"] = {"every": 2, "resume": "latest"}
    resumed = build_trainer(make_config(**settings, output_dir=str(tmp_path / "stopped")))
    resumed.run()
    a, b = load_file(tmp_path / "reference" / LORA_FILE), load_file(tmp_path / "stopped" / LORA_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [[json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("reference", "stopped")]
    assert [row["loss"] for row in rows[0]] == [row["loss"] for row in rows[1]]
    assert [row[REGULARIZATION] for row in rows[0]] == [row[REGULARIZATION] for row in rows[1]]
