"""The entry point of a training run: `Trainer(config).run() -> TrainResult` (`vidtune.trainers.build_trainer`).

A trainer holds what a config decides before anything is read: the family's spec, the algorithm's part
(`vidtune.algorithms`: what trains and what is saved) and its loss (`vidtune.algorithms.losses`). `run` sets the run
up in one pass (`vidtune.training.setup.set_up` -> a frozen `TrainingContext`, kept as `context`) and hands it to the
loop (`vidtune.training.loop.train`).
"""

from __future__ import annotations

from vidtune import parallel
from vidtune.algorithms.build import build_part, build_spec
from vidtune.algorithms.distillation import validation_config
from vidtune.algorithms.losses import LossFunction, loss_function
from vidtune.algorithms.part import AlgorithmPart
from vidtune.config import Config
from vidtune.models.spec import ModelSpec
from vidtune.parallel.deepspeed import process_group as deepspeed_process_group
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
            return train(self.set_up())
