"""A DeepSpeed checkpoint resumed on another number of processes.

ZeRO's shards are cut for the number of processes that wrote them: flat slices of every parameter group, one per
rank. DeepSpeed's universal checkpoint is the same state per parameter and whole (the fp32 weight, Adam's two
moments and its step count, one folder per parameter), so any number of ranks can cut their shards from it.
Resuming on another number of processes therefore goes: rank 0 converts the checkpoint's shards into that form
(`deepspeed.checkpoint.ds_to_universal`) in a staging folder beside the run's checkpoints (a filesystem every rank
reads, as for the checkpoints themselves), every rank loads its new shards from there, and the staging folder goes.
The checkpoint itself is not changed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
from pathlib import Path
from typing import Any

from vidtune import parallel
from vidtune.errors import TrainingError


def to_universal(shards: Path, target: Path) -> None:
    """Convert the ZeRO shards of one checkpoint tag (`shards`: the folder of DeepSpeed's files) into DeepSpeed's
    universal checkpoint at `target` (created; its `zero/` holds one folder per trained parameter)."""
    from deepspeed.checkpoint import ds_to_universal

    arguments = argparse.Namespace(
        input_folder=str(shards), output_folder=str(target),
        # In this process: the converter's worker pool would fork a process that may hold a CUDA context, which
        # CUDA does not support; one process reads the shards and writes each parameter's files in turn.
        num_extract_workers=1, num_merge_workers=1,
        keep_temp_folder=False, strict=True,
        # vidtune's checkpoints carry no "universal checkpoint info" (a Megatron-style client state); the
        # converter adds the default one, which is what a model without tensor or pipeline parallelism has.
        inject_missing_state=True,
    )
    said = io.StringIO()
    try:
        # The converter prints its progress for a command line; here it is one step of starting the run.
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            ds_to_universal.main(arguments)
    except (AssertionError, OSError, RuntimeError, ValueError, KeyError) as error:
        raise TrainingError(
            f"Could not convert the DeepSpeed checkpoint {shards} for another number of processes: "
            f"{type(error).__name__}: {error}\n{said.getvalue()[-2000:]}\nWhat to do: resume it on as many processes "
            "as wrote it, or start a new run from its weights (`vidtune export CHECKPOINT --output FOLDER`)."
        ) from None


def load_resharded(engine: Any, shards: Path, staging_root: Path) -> Any:
    """Load the checkpoint whose ZeRO shards (written by another number of processes) are in `shards` into
    `engine`, through a universal checkpoint staged under `staging_root`. Every rank calls it; returns what
    `engine.load_checkpoint` does (None: nothing loaded)."""
    staging = staging_root / f".universal-{shards.parent.parent.name}"
    tag = shards.name

    def convert() -> None:
        shutil.rmtree(staging, ignore_errors=True)  # a run stopped while converting left it
        staging.mkdir(parents=True)
        print(f"DeepSpeed: re-cutting the checkpoint's ZeRO shards for {parallel.world_size()} process(es) "
              "(through DeepSpeed's universal checkpoint format).", flush=True)
        to_universal(shards, staging / tag)

    parallel.on_main(convert)
    # DeepSpeed reads whether to load the universal form from its config when `load_checkpoint` runs; it is set
    # for this one load only, so that the engine's own checkpoints (same world size) load as usual.
    config = engine._config
    config.load_universal_checkpoint = True
    try:
        loaded, _ = engine.load_checkpoint(str(staging), tag=tag, load_module_strict=False,
                                           load_optimizer_states=True, load_lr_scheduler_states=False)
    finally:
        config.load_universal_checkpoint = False
        parallel.barrier()  # every rank has read its shards before the staging folder goes
        parallel.on_main(lambda: shutil.rmtree(staging, ignore_errors=True))
    return loaded
