"""The whole training state, in one object: what a checkpoint holds and what a resumed run restores.

- the trainable weights (read and written through the algorithm's own accessors),
- the optimizer, and its LR schedule (a pure function of the step and the config: rebuilt at the restored
  step, never loaded, so a changed learning rate or schedule simply applies from there on),
- the data position (samples consumed; the stream is seeded by position, see `vidtune.data.buckets`),
- the RNGs of every rank, and the number of non-finite steps skipped so far,
- with `training.ema_decay`, the moving average of the trained weights (`vidtune.ema`), updated with each
  applied optimizer step.

`save` writes it as a checkpoint: the strategy's checkpointer (`vidtune.parallel.checkpointers`) writes the weights,
optimizer state and average in its format, this state beside them (`vidtune.checkpoint` makes the folder atomic);
`read_checkpoint` checks a saved one fits the config and loads it; `restore` puts it back through the same
checkpointer. A run resumed this way continues bit for bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError
from torch import nn

from vidtune import checkpoint as checkpoints
from vidtune import parallel
from vidtune.checkpoint import SavedState
from vidtune.config import Config
from vidtune.ema import EMA
from vidtune.errors import CheckpointError, ConfigError, StorageError, TrainingError
from vidtune.optim import build_lr_scheduler, build_optimizer, group_settings
from vidtune.outputs import CHECKPOINTS
from vidtune.parallel.checkpointers import Record, TrainedParts
from vidtune.parallel.strategy import Strategy
from vidtune.resume import FIXED_KEYS, compare_configs, saved_config, whole_beside
from vidtune.storage.faults import storage_faults
from vidtune.storage.space import CheckpointSpace

T = TypeVar("T")
Weights = dict[str, torch.Tensor]


def read_checkpoint(folder: Path, config: Config, algorithm: str, fixed_keys: tuple[str, ...] = ()) -> SavedState:
    """Check that `folder` fits this config (refusing changes it cannot follow, stating the others) and load it."""
    changes = compare_configs(saved_config(folder), config, FIXED_KEYS + fixed_keys, folder)
    try:
        if checkpoints.is_sharded(folder):
            weights, ema_weights = None, None
            state = torch.load(folder / checkpoints.STATE, map_location="cpu", weights_only=True)
        else:
            weights, state = checkpoints.load(folder)
            ema_weights = checkpoints.load_ema(folder)
    except (OSError, RuntimeError, ValueError) as error:
        others = whole_beside(folder)
        instead = (f"resume from an earlier whole checkpoint: checkpoint.resume={others[0]}" if others
                   else "no other checkpoint beside it is whole: start a new run in another output_dir")
        raise CheckpointError(f"Could not read the checkpoint {folder}: {error}\nWhat to do: {instead}.") from None
    if (folder / checkpoints.ZERO_SHARDS).is_dir() and config.parallel.strategy != "deepspeed":
        raise CheckpointError(f"The checkpoint {folder} was written with parallel.strategy=deepspeed, whose "
                              "optimizer state only DeepSpeed reads. What to do: resume it with "
                              "parallel.strategy=deepspeed (on any number of processes), or start a new run "
                              f"from its weights (`vidtune export {folder} --output FOLDER`).")
    if state.get("algorithm", algorithm) != algorithm:
        raise ConfigError(f"Cannot resume from {folder}: it was written by training.algorithm="
                          f"{state['algorithm']}, this run uses {algorithm}.")
    if parallel.is_main():
        print(f"Resuming from {folder} (step {state['step']} of {config.training.steps}).", flush=True)
        if changes:
            print("Changed since that checkpoint:\n" + "\n".join(f"  - {line}" for line in changes), flush=True)
    return SavedState(folder, weights, state, ema_weights)


class TrainingState:
    """Optimizer, schedule, step, data position, skip count and weights' average of one run, and its
    checkpoints."""

    def __init__(self, config: Config, algorithm: str, parameters: list[nn.Parameter], num_clips: int,
                 get_weights: Callable[[], Weights], set_weights: Callable[[Weights], None],
                 ema: EMA | None = None, strategy: Strategy | None = None) -> None:
        self.config = config
        self.strategy = strategy or Strategy(config, torch.device("cpu"))
        self.algorithm = algorithm
        self.num_clips = num_clips
        self.get_weights = get_weights
        self.set_weights = set_weights
        self.ema = ema
        self.optimizer = build_optimizer(parameters, config)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config)
        self.step = 0
        self.samples_consumed = 0
        self.nonfinite_skipped = 0
        self.saved_step: int | None = None  # the step of the newest checkpoint of this run
        # The disk space its checkpoints and final files take (estimated, then measured with the first checkpoint).
        self.space: CheckpointSpace | None = None
        self.keep_steps: set[int] = set()  # checkpoints the pruning keeps beyond the newest (the best held-out score)
        # What writes the weights, optimizer state and average in the strategy's format, and reads them back.
        self.checkpointer = self.strategy.checkpointer()
        self.trained = TrainedParts(get_weights, set_weights, self.optimizer, ema)

    @property
    def learning_rate(self) -> float:
        # float(): torchao's optimizers keep the rate as a tensor (so a new rate does not recompile their step).
        return float(self.lr_scheduler.get_last_lr()[0])

    def apply_update(self, finite: bool) -> None:
        """The optimizer step and the weights' average (only for a finite step) and the schedule's step (always:
        it counts steps)."""
        if finite:
            self.strategy.optimizer_step(self.optimizer)
            if self.ema is not None:
                self.ema.update()
            self.lr_scheduler.step()
        else:
            with warnings.catch_warnings():  # "scheduler stepped before optimizer": intended here
                warnings.simplefilter("ignore", UserWarning)
                self.lr_scheduler.step()
        self.strategy.zero_grad(self.optimizer, applied=finite)

    # ----- checkpoints ----------------------------------------------------------------------------------------
    def save(self, root: Path) -> Path:
        """Write a checkpoint of this step under `root`. Under torchrun every rank calls it: each rank's RNG
        states are gathered (a resumed rank restores its own) and the strategy's checkpointer writes the weights,
        optimizer state and average (rank 0 alone, or every rank its shards), with this state beside them.

        A failed write (full disk, ...) stops the run; the checkpoints already written stay whole."""
        rng = dict(enumerate(parallel.gather_objects(checkpoints.rng_state())))
        record = Record(step=self.step, extra=self._extra(len(rng)), config=self.config,
                        keep=self.config.checkpoint.keep, protect=frozenset(self.keep_steps), rng=rng)
        what = f"the checkpoint of step {self.step}"
        try:
            with storage_faults(root / f"{checkpoints.PREFIX}{self.step:08d}", what):
                folder = self.checkpointer.save(root, record, self.trained)
        except StorageError as fault:  # a full disk, a read-only or vanished folder: said of the checkpoint
            raise fault.restated(what, root) from fault
        except (OSError, RuntimeError, SafetensorError) as error:
            # Anything else that stops a write: DCP's CheckpointException (a RuntimeError), a zip writer's error.
            raise self._write_failed(root, error) from error
        self.saved_step = self.step
        if self.space is not None and not self.space.measured and parallel.is_main():
            self.space = self.space.measure(folder)
        return folder

    def checkpoints_to_come(self) -> tuple[int, int]:
        """(checkpoints on disk now, checkpoints still to write: every `checkpoint.every` steps and one at the
        end), for the space they take."""
        every, steps = self.config.checkpoint.every, self.config.training.steps
        between = (steps - 1) // every - self.step // every if every else 0
        to_write = between + 1 if self.step < steps else 0
        return len(checkpoints.list_checkpoints(Path(self.config.output_dir) / CHECKPOINTS)), to_write

    def _extra(self, world: int) -> dict[str, Any]:
        """What a checkpoint holds beside the weights, optimizer and RNG states."""
        return {
            "samples_consumed": self.samples_consumed,
            "algorithm": self.algorithm,
            "num_samples": self.num_clips,
            "nonfinite_skipped": self.nonfinite_skipped,
            "world_size": world,
            **({"ema_updates": self.ema.updates} if self.ema is not None else {}),
        }

    def _write_failed(self, root: Path, error: Exception) -> TrainingError:
        previous = checkpoints.latest(root)
        kept = (f"The previous checkpoint {previous} is intact; free some space (or fix the folder) and "
                "continue from it with checkpoint.resume=latest." if previous
                else "No earlier checkpoint exists.")
        return TrainingError(f"Could not write the checkpoint of step {self.step} under {root}: "
                             f"{error}\nIs the disk full? {kept}")

    def restore(self, saved: SavedState, device: torch.device) -> None:
        """Weights, optimizer, schedule, data position and skip count of `saved`; the RNGs follow with the data
        stream (`resume_stream`). The config's learning rate, schedule and optimizer settings (betas, eps, weight
        decay, as the chosen optimizer takes them) apply from here on."""
        state = saved.state
        self._say_what_differs(state)
        try:
            ema_weights = self.checkpointer.restore(saved, self.trained, device)
            self._restore_ema(saved, ema_weights, device)
        except (KeyError, ValueError, RuntimeError) as error:
            raise CheckpointError(f"The checkpoint {saved.folder} does not fit this model: {error}") from None
        # The loaded optimizer state would otherwise bring back the hyper-parameters it was saved with.
        learning_rate, settings = self.config.training.learning_rate, group_settings(self.config)
        for group in self.optimizer.param_groups:
            group.update(initial_lr=learning_rate, **settings)
            if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers: the rate must stay a tensor
                group["lr"].fill_(learning_rate)
            else:
                group["lr"] = learning_rate
        self.step = saved.step
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.config, completed_steps=self.step)
        self.samples_consumed = int(state["samples_consumed"])
        self.nonfinite_skipped = int(state.get("nonfinite_skipped", 0))
        self.saved_step = self.step

    def _restore_ema(self, saved: SavedState, ema_weights: Weights | None, device: torch.device) -> None:
        """The weights' average of the checkpoint (`ema_weights`, as its checkpointer read it) into this run's."""
        if self.ema is None:
            return
        if ema_weights is None:
            # training.ema_decay was set on resuming: the average starts from the restored weights.
            self.ema.shadow = {name: p.detach().clone() for name, p in self.ema.parameters.items()}
            if parallel.is_main():
                print("The checkpoint has no moving average of the weights (training.ema_decay was not set): it "
                      "starts from the restored weights.", flush=True)
            return
        with self.ema.applied():  # loading writes into the average
            self.set_weights({key: value.to(device) for key, value in ema_weights.items()})
        self.ema.updates = int(saved.state.get("ema_updates", 0))

    def _say_what_differs(self, state: dict[str, Any]) -> None:
        if not parallel.is_main():
            return
        saved_clips = state.get("num_samples", self.num_clips)
        if saved_clips != self.num_clips:
            print(f"The dataset changed since that checkpoint: {saved_clips} clips -> {self.num_clips} (the data "
                  "order from here on differs from an uninterrupted run).", flush=True)
        saved_world, world = int(state.get("world_size", 1)), parallel.world_size()
        if saved_world != world:
            per_step = self.config.training.batch_size * self.config.training.gradient_accumulation * world
            print(f"The number of processes changed since that checkpoint: {saved_world} -> {world} (a step now "
                  f"takes {per_step} samples; the data each process reads and its random draws differ from an "
                  "uninterrupted run).", flush=True)


def resume_stream(stream: Iterator[T], saved: SavedState) -> Iterator[T]:
    """The data stream of a resumed run, with this rank's RNGs restored at the exact point they were saved.

    Starting a DataLoader draws its base seed from the global RNG, as it did when the run began: the first
    batch is taken first, then the saved RNGs are restored, so the steps that follow draw what they would have.
    A rank the checkpoint has no RNG state for (the run now has more processes) keeps its fresh ones."""
    first = next(stream)
    restore_rng(saved)
    yield first
    yield from stream


def restore_rng(saved: SavedState) -> None:
    """This rank's RNG states from a checkpoint, where it has them."""
    rng, rank = saved.state["rng"], parallel.rank()
    if "python" in rng or rank in rng:
        checkpoints.restore_rng_state(rng, rank)
