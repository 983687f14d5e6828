"""The set-up run: one frozen context with nothing left None, the strategy chosen once, and what a run may go without
held as objects that say so."""

from __future__ import annotations

import dataclasses

import pytest

from vidtune.algorithms.lora import LoRAPart
from vidtune.trainers import build_trainer
from vidtune.training import setup
from vidtune.training.context import Average, NoAverage
from vidtune.training.held_out import HeldOut, NoHeldOut


def _fields(context) -> dict:
    return {field.name: getattr(context, field.name) for field in dataclasses.fields(context)}


def test_set_up_gives_a_frozen_context_with_nothing_none_and_chooses_the_strategy_once(make_config, monkeypatch):
    chosen = []
    choose = setup.choose_strategy

    def counted(*args, **kwargs):
        chosen.append(args)
        return choose(*args, **kwargs)

    monkeypatch.setattr(setup, "choose_strategy", counted)
    trainer = build_trainer(make_config(training={"steps": 1}))
    context = trainer.set_up()
    assert len(chosen) == 1
    assert [name for name, value in _fields(context).items() if value is None] == []
    assert isinstance(context.part, LoRAPart) and context.part.denoiser is context.denoiser
    assert isinstance(context.average, NoAverage) and isinstance(context.held_out, NoHeldOut)
    assert context.block_swaps == () and context.empty_caption == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.denoiser = None  # type: ignore[misc]


def test_what_a_run_asks_for_is_there_and_the_loop_reads_it(make_config):
    trainer = build_trainer(make_config(training={"steps": 2, "ema_decay": 0.9}, validation={"eval_clips": 1},
                                        precompute={"enabled": True}))
    result = trainer.run()
    context = trainer.context
    assert isinstance(context.average, Average) and isinstance(context.held_out, HeldOut)
    assert context.state.step == result.final_step == 2
    assert [row["step"] for row in context.held_out.history.rows] == [0, 2]
    assert not context.encoders.loaded  # trained from the cache, no validation samples: never loaded
