"""Stopping a run the way a user does (Ctrl-C), at a chosen micro-batch."""

from __future__ import annotations

import os
import signal

import pytest

from vidtune.trainers.stop import TrainingInterrupted


def run_stopped_at(trainer, number: int) -> None:
    """Run `trainer` with a SIGINT during its `number`-th micro-batch: the run saves a checkpoint at that step and
    stops with TrainingInterrupted."""
    original, calls = trainer.compute_loss, [0]

    def interrupting(*args, **kwargs):
        calls[0] += 1
        if calls[0] == number:
            os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    trainer.compute_loss = interrupting
    with pytest.raises(TrainingInterrupted):
        trainer.run()
