"""Checkpointers (vidtune/parallel/checkpointers.py), in one process: each writes the trained weights, optimizer state
and weights' average of a step in its strategy's format and restores them exactly; a sharded checkpoint is read by
every checkpointer; the training state goes through the strategy's checkpointer and asks nothing else about it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from vidtune import checkpoint as checkpoints
from vidtune import parallel
from vidtune.config import load_config
from vidtune.ema import EMA
from vidtune.errors import CheckpointError, StorageError
from vidtune.parallel.checkpointers import Checkpointer, Record, ShardedCheckpointer, TrainedParts
from vidtune.parallel.fsdp import FullyShardedStrategy
from vidtune.parallel.strategy import Strategy
from vidtune.state import TrainingState, read_checkpoint

CPU = torch.device("cpu")
ALGORITHM = "lora"


def config(strategy: str = "auto", *overrides: str):
    return load_config(None, ["model.name=ltx-video", "model.pretrained=some/model", "data.root=clips",
                              "training.learning_rate=0.1", f"parallel.strategy={strategy}", *overrides])


class Run:
    """A small model trained a few Adam steps, with the average of its weights: what a checkpoint holds."""

    def __init__(self, strategy: Strategy, seed: int, steps: int = 3) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        parameters = list(self.model.parameters())
        strategy.prepare(self.model, parameters)
        self.optimizer = torch.optim.AdamW(parameters, lr=0.1)
        self.ema = EMA(dict(self.model.named_parameters()), decay=0.5)
        for _ in range(steps):
            self.model(torch.randn(3, 4)).square().mean().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.ema.update()
        self.parts = TrainedParts(self.weights, self.set_weights, self.optimizer, self.ema)

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                parameter.copy_(weights[name])


def record(step: int = 3) -> Record:
    return Record(step=step, extra={"samples_consumed": 6, "algorithm": ALGORITHM}, config=config(), keep=2,
                  protect=frozenset(), rng={0: checkpoints.rng_state()})


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[key], b[key]) for key in a), [key for key in a if not torch.equal(a[key], b[key])]


def assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    first, second = a.state_dict()["state"], b.state_dict()["state"]
    assert first.keys() == second.keys() and first
    for index in first:
        assert first[index].keys() == second[index].keys()
        assert all(torch.equal(torch.as_tensor(first[index][k]), torch.as_tensor(second[index][k]))
                   for k in first[index]), index


def save(strategy: Strategy, root: Path, seed: int = 0) -> tuple[Run, Path]:
    run = Run(strategy, seed)
    return run, strategy.checkpointer().save(root, record(), run.parts)


@pytest.mark.parametrize(("strategy_class", "checkpointer_class", "files", "absent"), [
    (Strategy, Checkpointer, [checkpoints.WEIGHTS, checkpoints.EMA_WEIGHTS], checkpoints.SHARDS),
    (FullyShardedStrategy, ShardedCheckpointer, [f"{checkpoints.SHARDS}/.metadata"], checkpoints.WEIGHTS),
])
def test_each_checkpointer_restores_exactly_what_it_saved(tmp_path, strategy_class, checkpointer_class, files,
                                                          absent):
    strategy = strategy_class(config(), CPU)
    assert type(strategy.checkpointer()) is checkpointer_class
    run, folder = save(strategy, tmp_path)
    assert folder == tmp_path / "step-00000003" and checkpoints.is_complete(folder)
    assert all((folder / name).is_file() for name in files) and not (folder / absent).exists()

    other = strategy_class(config(), CPU)
    fresh = Run(other, seed=1, steps=1)  # other weights, optimizer state and average
    saved = read_checkpoint(folder, config(), ALGORITHM)
    assert saved.sharded == (checkpointer_class is ShardedCheckpointer)
    average = other.checkpointer().restore(saved, fresh.parts, CPU)
    assert_same(fresh.weights(), run.weights())
    assert_same_optimizer(fresh.optimizer, run.optimizer)
    assert_same(average, run.ema.shadow)
    # Its own tensors: reading it wrote nothing into this run's average, which the training state sets from it.
    assert all(tensor.data_ptr() != fresh.ema.shadow[key].data_ptr() for key, tensor in average.items())


def test_a_sharded_checkpoint_is_read_by_the_whole_file_checkpointer(tmp_path):
    run, folder = save(FullyShardedStrategy(config("fsdp"), CPU), tmp_path)
    strategy = Strategy(config(), CPU)
    fresh = Run(strategy, seed=1, steps=1)
    average = strategy.checkpointer().restore(read_checkpoint(folder, config(), ALGORITHM), fresh.parts, CPU)
    assert_same(fresh.weights(), run.weights())
    assert_same_optimizer(fresh.optimizer, run.optimizer)
    assert_same(average, run.ema.shadow)


def test_the_sharded_checkpointer_on_several_processes_refuses_a_whole_file_checkpoint(tmp_path, monkeypatch):
    _, folder = save(Strategy(config(), CPU), tmp_path)
    strategy = FullyShardedStrategy(config("fsdp"), CPU)
    fresh = Run(strategy, seed=1, steps=1)
    before = fresh.weights()
    before = {key: value.clone() for key, value in before.items()}
    monkeypatch.setattr(parallel, "is_distributed", lambda: True)
    with pytest.raises(CheckpointError, match=r"written with parallel.strategy=ddp.*What to do"):
        strategy.checkpointer().restore(read_checkpoint(folder, config(), ALGORITHM), fresh.parts, CPU)
    assert_same(fresh.weights(), before)  # nothing was read


class Recording(Checkpointer):
    """A checkpointer that writes nothing and notes what the training state handed it (in its strategy's `calls`)."""

    def save(self, root, record, parts):
        self.strategy.calls.append(("save", record, parts))
        if record.step == 13:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return root / "written"

    def restore(self, saved, parts, device):
        self.strategy.calls.append(("restore", saved, parts))
        return {name: torch.full_like(value, 7.0) for name, value in parts.get_weights().items()}


class OwnFormat(Strategy):
    name = "own-format"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.calls: list[tuple] = []

    def checkpointer(self) -> Checkpointer:
        return Recording(self)


def test_the_training_state_saves_and_restores_through_its_strategys_checkpointer(tmp_path):
    settings = config("auto", "checkpoint.keep=5")
    strategy = OwnFormat(settings, CPU)
    run = Run(strategy, seed=0, steps=0)
    state = TrainingState(settings, ALGORITHM, list(run.model.parameters()), 4, run.weights, run.set_weights,
                          run.ema, strategy)
    state.step, state.samples_consumed, state.keep_steps = 12, 24, {4}
    assert state.save(tmp_path) == tmp_path / "written" and state.saved_step == 12
    (kind, written, parts), = strategy.calls
    assert kind == "save" and parts.optimizer is state.optimizer and parts.ema is run.ema
    assert (written.step, written.keep, set(written.protect), sorted(written.rng)) == (12, 5, {4}, [0])
    assert written.extra["samples_consumed"] == 24 and written.extra["algorithm"] == ALGORITHM

    # A failed write stops the run with a message for people; the newest checkpoint stays the one before.
    state.step = 13
    with pytest.raises(StorageError, match=rf"the checkpoint of step 13 in {tmp_path}: the disk is full"):
        state.save(tmp_path)
    assert state.saved_step == 12

    saved = checkpoints.SavedState(tmp_path, None, {"step": 12, "samples_consumed": 24, "ema_updates": 5})
    state.restore(saved, CPU)
    assert strategy.calls[-1][:2] == ("restore", saved) and state.step == 12 and state.samples_consumed == 24
    # The average the checkpointer read went into the run's average.
    assert all(torch.equal(shadow, torch.full_like(shadow, 7.0)) for shadow in run.ema.shadow.values())
    assert run.ema.updates == 5
