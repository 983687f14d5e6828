"""What `vidtune sample PATH` samples: a run, any of its checkpoints, or a `vidtune export` folder, as a folder of
final weights that `vidtune.sampling.load_pipeline` reads. It sits above the export command (a checkpoint is
exported to sample it), which sits above the trainers."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vidtune import checkpoint as checkpoints
from vidtune import outputs
from vidtune.export.command import export_checkpoint
from vidtune.resume import find_checkpoint


def has_final_weights(folder: Path) -> bool:
    return any((folder / name).exists() for name in outputs.FINAL_OUTPUTS)


@dataclass(frozen=True)
class SampleSource:
    """What `vidtune sample PATH` samples: `folder` holds config.yaml and the weights (a run's, an export's, or a
    checkpoint's exported to a temporary folder); `home` is where its samples go; `checkpoint`: the checkpoint
    folder, when one is sampled."""

    folder: Path
    home: Path
    checkpoint: Path | None = None


@contextlib.contextmanager
def sample_source(path: Path) -> Iterator[SampleSource]:
    """A run folder (its final weights; a run that did not finish: its newest checkpoint), a checkpoint folder
    (checkpoints/step-XXXXXXXX, of a finished run or not) or a `vidtune export` folder, as a folder
    `load_pipeline` reads. A checkpoint's weights are exported (as `vidtune export` does) into a temporary folder,
    removed afterwards."""
    path = path.expanduser()
    if has_final_weights(path) or not path.is_dir():
        yield SampleSource(path, path)
        return
    is_checkpoint = checkpoints.is_complete(path)
    if not is_checkpoint and checkpoints.latest(path) is None and checkpoints.latest(outputs.checkpoints_root(path)) \
            is None:
        yield SampleSource(path, path)  # load_pipeline says what is missing
        return
    folder = find_checkpoint(path)
    # Samples of a run's checkpoint go to the run's samples folder.
    home = folder.parent.parent if folder.parent.name == outputs.CHECKPOINTS else path
    with tempfile.TemporaryDirectory(prefix="vidtune-checkpoint-") as temporary:
        export_checkpoint(folder, temporary)
        yield SampleSource(Path(temporary), home, folder)
