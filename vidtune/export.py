"""`vidtune export`: turn a checkpoint into what a finished run writes (LoRA adapter or transformer folder, and
with `training.ema_decay` the weights' moving average beside it).

A run stopped early (Ctrl+C, a preempted node, a crash) is then still usable: the result is the same file
or folder `save_final` writes at the end of a run, from the checkpoint's own config.
"""

from __future__ import annotations

import os
from pathlib import Path

from vidtune import checkpoint as checkpoints
from vidtune.config import load_config
from vidtune.outputs import FINAL_OUTPUTS
from vidtune.resume import CheckpointError, find_checkpoint


def export_checkpoint(checkpoint: str | os.PathLike[str], output: str | os.PathLike[str],
                      overwrite: bool = False) -> Path:
    """Write the final weights of `checkpoint` (a checkpoint folder, or a run folder: its newest) into `output`."""
    from vidtune.trainers import build_trainer

    folder = find_checkpoint(checkpoint)
    output = Path(output)
    existing = [name for name in FINAL_OUTPUTS if (output / name).exists()]
    if existing and not overwrite:
        raise CheckpointError(f"{output} already holds {', '.join(existing)}; nothing was written. Choose another "
                              "--output, or add --overwrite to replace it.")
    config = load_config(folder / checkpoints.CONFIG, [f"output_dir={output}"])
    trainer = build_trainer(config)
    try:
        weights, _ = checkpoints.load(folder)
        ema = checkpoints.load_ema(folder)
    except (OSError, RuntimeError, ValueError) as error:
        raise CheckpointError(f"Could not read the checkpoint {folder}: {error}") from None
    output.mkdir(parents=True, exist_ok=True)
    return trainer.export_weights(weights, output, ema)
