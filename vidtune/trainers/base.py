"""The entry point of a training run: `Trainer(config).run() -> TrainResult` (`vidtune.trainers.build_trainer`).

A trainer holds what a config decides before anything is read: the family's spec, the algorithm's part
(`vidtune.algorithms`: what trains and what is saved) and its loss (`vidtune.algorithms.losses`). `run` sets the run
up in one pass (`vidtune.training.setup.set_up` -> a frozen `TrainingContext`, kept as `context`) and hands it to the
loop (`vidtune.training.loop.train`).
"""

from __future__ import annotations

from pathlib import Path

from vidtune import checkpoint as checkpoints
from vidtune import parallel
from vidtune.algorithms.build import build_part, build_spec
from vidtune.algorithms.distillation import validation_config
from vidtune.algorithms.losses import LossFunction, loss_function
from vidtune.algorithms.part import AlgorithmPart
from vidtune.config import Config
from vidtune.errors import StorageError
from vidtune.models.spec import ModelSpec
from vidtune.outputs import checkpoints_root
from vidtune.parallel.deepspeed import process_group as deepspeed_process_group
from vidtune.storage.space import human_size
from vidtune.training.context import Inputs, TrainingContext
from vidtune.training.loop import TrainResult, train
from vidtune.training.setup import check_inputs, set_up

__all__ = ["TrainResult", "Trainer"]


class Trainer:
    """One run of a config. `loss` may be replaced before `run` (e.g. to watch each micro-batch)."""

    def __init__(self, config: Config) -> None:
        self.config = validation_config(config)  # a distilled student is sampled without guidance
        self.device = parallel.resolve_device(self.config.training.device)
        self.spec: ModelSpec = build_spec(self.config)
        self.part: AlgorithmPart = build_part(self.config, self.spec)
        self.loss: LossFunction = loss_function(self.part.traits, config.training.preserve_base is not None)
        self.context: TrainingContext | None = None  # the run, once `set_up` has run

    def check_inputs(self) -> Inputs:
        """The checks set-up starts with (model folder, settings, every sample), without loading any model."""
        return check_inputs(self.config, self.spec, self.part, self.device)

    def set_up(self) -> TrainingContext:
        """Check, load and restore everything the run needs (`vidtune.training.setup`), before any step."""
        self.context = set_up(self.config, self.spec, self.part, self.loss, self.device)
        return self.context

    def run(self) -> TrainResult:
        """Set up and train until `training.steps` or a stop signal; the final files are written by rank 0."""
        # Under torchrun: this run's process group (or the one already set up), taken down at the end.
        deepspeed = self.config.parallel.strategy == "deepspeed"
        with deepspeed_process_group(self.device) if deepspeed else parallel.process_group(self.device):
            try:
                return train(self.set_up())
            except StorageError as fault:
                raise self.storage_fault(fault) from fault

    def storage_fault(self, fault: StorageError) -> StorageError:
        """A disk fault during the run, with what the run knows: how much space it still needs, and that what it
        wrote before is whole (the newest checkpoint, checked against its manifest's sizes)."""
        state = self.context.state if self.context is not None else None
        output_dir, notes, advice = Path(self.config.output_dir), [], fault.advice
        if fault.full and state is not None and state.space is not None:
            to_come = state.checkpoints_to_come()
            notes.append(f"This run needs {state.space.describe(*to_come)}.")
            if fault.folder is not None and output_dir.absolute() in (fault.folder, *fault.folder.parents):
                # The checkpoints must stay where checkpoint.resume=latest looks for them.
                advice = (f"free at least {human_size(state.space.needed(*to_come))} on the disk of {output_dir} "
                          "(or move that folder to a bigger disk and set output_dir to its new place)")
        newest, _ = checkpoints.newest_intact(checkpoints_root(self.config.output_dir), digests=False)
        if newest is not None:
            notes.append(f"Nothing written earlier was lost: the newest checkpoint, {newest.folder}, is whole.")
            then = "then continue the run from it with checkpoint.resume=latest"
        else:
            notes.append("Nothing written earlier was lost (no checkpoint was written yet).")
            then = "then run it again"
        return fault.with_notes(*notes, advice=f"{advice}; {then}")
