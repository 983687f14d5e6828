"""Where a run starts from, and stopping it cleanly.

- `resolve_resume`: `checkpoint.resume` (`latest` or a path) -> the checkpoint folder to continue from, or
  None to start at step 0; a new run never starts in an output_dir that already holds one.
- `compare_configs`: a resumed run refuses config changes the checkpoint cannot follow (model, algorithm,
  adapter shape, ...) and states the changes it accepts (learning rate, total steps, ...).
- `StopSignals`: SIGINT / SIGTERM ask the loop to stop after the current step; a second one stops at once.
- `truncate_metrics`: metrics.jsonl keeps only the rows up to the step a run starts from.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import yaml

from vidtune import checkpoint as checkpoints
from vidtune.config import Config
from vidtune.errors import ConfigError, VidtuneError

# Files and folders a finished run leaves in its output_dir (LoRA adapter, full transformer).
FINAL_OUTPUTS = ("pytorch_lora_weights.safetensors", "transformer")

# Changes a checkpoint cannot follow, whatever the algorithm; trainers add their own (`Trainer.resume_fixed_keys`).
FIXED_KEYS = (
    "model.name",
    "model.pretrained",
    "model.revision",
    "model.subfolders.transformer",
    "training.algorithm",
    "optimizer.name",
)
# Changes that leave the continued run identical to an uninterrupted one (anything else is allowed but stated
# with a note that the run from here on differs from an uninterrupted one).
NEUTRAL_PREFIXES = ("checkpoint.", "logging.", "validation.", "output_dir", "data.num_workers")


class CheckpointError(VidtuneError):
    """A checkpoint to resume from or export is missing, incomplete or does not fit the config."""


class TrainingInterrupted(VidtuneError):
    """SIGINT / SIGTERM stopped the run after a checkpoint was saved; `exit_code` is 130 or 143."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def checkpoints_root(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


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
    if folder.name.startswith(checkpoints.PREFIX) or folder.name.startswith(checkpoints.INCOMPLETE):
        raise CheckpointError(f"{folder} is not a complete checkpoint (it was not fully written); use an earlier "
                              f"one from {folder.parent}.")
    raise CheckpointError(f"{folder} holds no complete checkpoint (looked for step-XXXXXXXX folders in it and in "
                          f"{checkpoints_root(folder)}).")


def resolve_resume(config: Config) -> Path | None:
    """The checkpoint this run continues from (None: start at step 0). Raises before anything is written."""
    output_dir = Path(config.output_dir)
    root = checkpoints_root(output_dir)
    checkpoints.recover(root)
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


def compare_configs(saved: dict[str, Any], current: Config, fixed_keys: tuple[str, ...], where: Path) -> list[str]:
    """Lines describing allowed changes since the checkpoint; raises ConfigError for changes it cannot follow."""
    old, new = _flatten(saved), _flatten(current.to_dict())
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


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the rows of metrics.jsonl up to `step` (rows a killed run wrote after its checkpoint go)."""
    if not path.is_file():
        return
    kept = []
    for text in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(text)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(text)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(temporary, path)


SIGNAL_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class StopSignals:
    """While active, SIGINT / SIGTERM set `received` instead of killing the process; a second one stops at once.

    Handlers are installed only from the main thread and restored on exit. Worker processes forked while
    it is active (DataLoader workers) inherit the handler and ignore the signals: the main process owns
    the stop, so a Ctrl+C in a terminal cannot kill a worker in the middle of the step being finished.
    """

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._pid = os.getpid()

    def __enter__(self) -> StopSignals:
        self._pid = os.getpid()
        if threading.current_thread() is threading.main_thread():
            for number in SIGNAL_EXIT_CODES:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()

    @property
    def exit_code(self) -> int:
        return SIGNAL_EXIT_CODES.get(self.received, 1) if self.received is not None else 0

    def _handle(self, number: int, frame: Any) -> None:
        if os.getpid() != self._pid:
            return  # a forked worker: the main process decides
        if self.received is not None:
            self.__exit__()
            if number == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(SIGNAL_EXIT_CODES.get(signal.Signals(number), 1))
        self.received = signal.Signals(number)
        key = "Ctrl+C" if number == signal.SIGINT else "the signal"
        # os.write, not print: a handler can run while print holds stderr's lock.
        os.write(2, f"\n{self.received.name}: stopping after the current step and saving a checkpoint. "
                    f"Send {key} again to quit at once without saving.\n".encode())
