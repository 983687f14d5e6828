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


def find_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A checkpoint folder, a run's `checkpoints` folder or a run folder -> a complete checkpoint folder."""
    folder = Path(path).expanduser()
    if checkpoints.is_complete(folder):
        return folder
    if not folder.exists():
        raise CheckpointError(f"{folder} does not exist; give a checkpoint folder (.../checkpoints/step-XXXXXXXX) "
                              "or a run's output_dir.")
    for root in (folder, checkpoints_root(folder)):
        newest = checkpoints.latest(root)
        if newest is not None:
            return newest
    if folder.name.startswith(checkpoints.PREFIX) or folder.name.startswith(INCOMPLETE):
        raise CheckpointError(f"{folder} is not a complete checkpoint (it was not fully written); use an earlier "
                              f"one from {folder.parent}.")
    raise CheckpointError(f"{folder} holds no complete checkpoint (looked for step-XXXXXXXX folders in it and in "
                          f"{checkpoints_root(folder)}).")


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
    if resume == "latest":
        newest = checkpoints.latest(root)
        finished = [name for name in FINAL_OUTPUTS if (output_dir / name).exists()]
        if newest is None and finished:
            raise CheckpointError(
                f"checkpoint.resume=latest: output_dir {output_dir} holds {', '.join(finished)} but no checkpoint "
                "to continue from; nothing was changed. Choose another output_dir to start a new run."
            )
        return newest
    return find_checkpoint(resume)


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
