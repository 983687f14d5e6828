"""Where a run starts from: a fresh start in an unused output_dir, or a checkpoint to continue.

- `resolve_resume`: `checkpoint.resume` (`latest` or a path) -> the checkpoint folder to continue from, or
  None to start at step 0; a new run never starts in an output_dir that already holds one.
- `compare_configs`: a resumed run refuses config changes the checkpoint cannot follow (model, algorithm,
  adapter shape, ...) and states the changes it accepts (learning rate, total steps, ...).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from vidtune import checkpoint as checkpoints
from vidtune.config import Config, build_config
from vidtune.errors import CheckpointError, ConfigError
from vidtune.files import INCOMPLETE, recover_folders
from vidtune.outputs import FINAL_OUTPUTS, checkpoints_root
from vidtune.storage.manifest import Verdict

# Changes a checkpoint cannot follow, whatever the algorithm; algorithm parts add their own (`resume_fixed_keys`).
FIXED_KEYS = (
    "model.name",
    "model.pretrained",
    "model.revision",
    "model.subfolders.transformer",
    "model.transformer_file",
    "model.transformer_2_file",
    "training.algorithm",
    "optimizer.name",
    "optimizer.cpu_offload",  # the offloaded optimizer keeps its state in another layout
)
# Changes that leave the continued run identical to an uninterrupted one (anything else is allowed but stated
# with a note that the run from here on differs from an uninterrupted one).
NEUTRAL_PREFIXES = ("checkpoint.", "logging.", "validation.", "output_dir", "data.num_workers")


def existing_run(output_dir: Path) -> list[str]:
    """What in `output_dir` shows a run already happened there (checkpoints, final weights)."""
    found = [f"checkpoint {path.name}" for path in checkpoints.list_checkpoints(checkpoints_root(output_dir))]
    found += [name for name in FINAL_OUTPUTS if (Path(output_dir) / name).exists()]
    return found


def find_checkpoint(path: str | os.PathLike[str], progress: bool = False) -> Path:
    """A checkpoint folder, a run's `checkpoints` folder or a run folder -> a whole checkpoint folder, checked
    against its digest manifest. A named checkpoint that is damaged is refused (naming the file, and the whole ones
    beside it); in a run folder the newest whole one is taken, saying which newer ones were skipped and why."""
    folder = Path(path).expanduser()
    if checkpoints.is_step_folder(folder):
        return checked(folder, progress)
    if not folder.exists():
        raise CheckpointError(f"{folder} does not exist; give a checkpoint folder (.../checkpoints/step-XXXXXXXX) "
                              "or a run's output_dir.")
    if folder.name.startswith(INCOMPLETE):
        raise CheckpointError(f"{folder} is not a complete checkpoint (it was not fully written); use an earlier "
                              f"one from {folder.parent}.")
    for root in (folder, checkpoints_root(folder)):
        if checkpoints.step_folders(root):
            return newest_whole(root, progress, f"{folder}")
    raise CheckpointError(f"{folder} holds no complete checkpoint (looked for step-XXXXXXXX folders in it and in "
                          f"{checkpoints_root(folder)}).")


def checked(folder: Path, progress: bool = False) -> Path:
    """`folder` if it is a whole checkpoint; else a CheckpointError naming what is wrong and the whole ones beside."""
    verdict = checkpoints.verify(folder, progress=progress)
    if not verdict.intact:
        others = whole_beside(folder)
        instead = (f"name a whole one instead, e.g. {others[0]} (whole checkpoints there: "
                   f"{', '.join(path.name for path in others)}), or checkpoint.resume=latest to take the newest "
                   "whole one" if others
                   else "no other checkpoint beside it is whole: start a new run in another output_dir")
        raise CheckpointError(f"{folder} is not a complete checkpoint: {verdict.reason()}. It was not loaded.\n"
                              f"What to do: {instead}.")
    note_unverified(verdict)
    return folder


def whole_beside(folder: Path) -> list[Path]:
    """The whole checkpoints in `folder`'s folder but `folder`, newest first."""
    return [path for path in reversed(checkpoints.step_folders(folder.parent))
            if path != folder and checkpoints.verify(path).intact]


def newest_whole(root: Path, progress: bool, setting: str) -> Path:
    """The newest whole checkpoint under `root`, saying which newer ones were skipped and why; a CheckpointError
    naming each when none is whole (`setting`: what chose `root`, for the message)."""
    chosen, skipped = checkpoints.newest_intact(root, progress)
    for verdict in skipped:
        print(f"Skipped the checkpoint {verdict.folder}: {verdict.reason()}.", flush=True)
    if chosen is None:
        lines = "\n".join(f"  - {verdict.folder.name}: {verdict.reason()}" for verdict in skipped)
        raise CheckpointError(f"{setting}: no checkpoint under {root} is whole; nothing was loaded or changed:\n"
                              f"{lines}\nWhat to do: restore the run folder from a backup, or start a new run in "
                              "another output_dir.")
    if skipped:
        print(f"Continuing from the newest whole checkpoint, {chosen.folder}.", flush=True)
    note_unverified(chosen)
    return chosen.folder


def note_unverified(verdict: Verdict) -> None:
    if not verdict.verified:
        print(f"The checkpoint {verdict.folder} has no digest manifest (it was written by an earlier vidtune), so "
              "its files could not be checked.", flush=True)


def resolve_resume(config: Config) -> Path | None:
    """The checkpoint this run continues from (None: start at step 0). Raises before anything is written."""
    output_dir = Path(config.output_dir)
    root = checkpoints_root(output_dir)
    # What a killed run left: a half-written checkpoint or final save, a swap of either cut short.
    checkpoints.recover(root)
    recover_folders(output_dir)
    resume = config.checkpoint.resume
    if resume is None:
        found = existing_run(output_dir)
        if found:
            fresh = next(f"{output_dir}-{n}" for n in range(2, 10**6) if not Path(f"{output_dir}-{n}").exists())
            raise CheckpointError(
                f"output_dir {output_dir} already holds a run ({', '.join(found[-3:])}); nothing was changed.\n"
                f"What to do: to start a new run, choose a fresh output_dir (e.g. add output_dir={fresh}); to "
                "continue this one, add checkpoint.resume=latest (or delete that folder yourself)."
            )
        return None
    progress = config.logging.progress
    if resume == "latest":
        if checkpoints.step_folders(root):
            return newest_whole(root, progress, "checkpoint.resume=latest")
        finished = [name for name in FINAL_OUTPUTS if (output_dir / name).exists()]
        if finished:
            raise CheckpointError(
                f"checkpoint.resume=latest: output_dir {output_dir} holds {', '.join(finished)} but no checkpoint "
                "to continue from; nothing was changed. Choose another output_dir to start a new run."
            )
        return None
    return find_checkpoint(resume, progress)


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): data}


def saved_config(folder: Path) -> dict[str, Any]:
    return yaml.safe_load((folder / checkpoints.CONFIG).read_text(encoding="utf-8")) or {}


def with_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config with the keys added since it was written at their defaults (a setting that did not
    exist then is what the run used), when it is still a valid config; as it is otherwise."""
    try:
        return build_config(saved).to_dict()
    except ConfigError:
        return saved


def compare_configs(saved: dict[str, Any], current: Config, fixed_keys: tuple[str, ...], where: Path) -> list[str]:
    """Lines describing allowed changes since the checkpoint; raises ConfigError for changes it cannot follow."""
    old, new = _flatten(with_defaults(saved)), _flatten(current.to_dict())
    old.pop("checkpoint.resume", None)
    new.pop("checkpoint.resume", None)
    changed = sorted(key for key in old.keys() | new.keys() if old.get(key, "(not set)") != new.get(key, "(not set)"))

    def line(key: str) -> str:
        return f"{key}: {old.get(key, '(not set)')!r} -> {new.get(key, '(not set)')!r}"

    breaking = [key for key in changed if any(key == f or key.startswith(f + ".") for f in fixed_keys)]
    if breaking:
        raise ConfigError(
            f"Cannot resume from {where}: the config changed in a way the checkpoint cannot follow:\n"
            + "\n".join(f"  - {line(key)}" for key in breaking)
            + f"\nUse the checkpoint's values (its config is {where / checkpoints.CONFIG}), or start a new run in "
            "another output_dir."
        )
    note = " (from here on the run may differ from an uninterrupted one)"
    return [line(key) + ("" if key.startswith(NEUTRAL_PREFIXES) else note) for key in changed]
