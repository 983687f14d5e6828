"""Errors meant for people, not for debuggers.

A `VidtuneError` carries a message written for the user: the command-line entry point prints it
without a traceback and exits non-zero. Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path


class VidtuneError(Exception):
    """An error caused by the user's input, explained in plain words.

    Every message has the same shape: what is wrong and where (the config key, the file and line, the folder),
    then a last line `What to do: ...`."""


class ConfigError(VidtuneError):
    """A config file or override is wrong."""


class DataError(VidtuneError):
    """One or more lines of the user's dataset are wrong.

    All problems are collected first, so a user fixes every line in one go instead of one per run.
    """

    def __init__(self, problems: list[str], hint: str = "") -> None:
        self.problems = list(problems)
        count = len(self.problems)
        header = f"The dataset has {count} problem{'s' if count != 1 else ''}; nothing was trained:"
        lines = [header, *(f"  - {problem}" for problem in self.problems)]
        lines.append(f"What to do: {hint or 'fix the lines above and run again.'}")
        super().__init__("\n".join(lines))


class ModelError(VidtuneError):
    """A model path, component or setting is wrong for the chosen model family."""


class TrainingError(VidtuneError):
    """Training cannot go on (the loss became NaN, a checkpoint cannot be written); the message says where and
    what to try."""


class CacheError(VidtuneError):
    """The precompute cache folder cannot be used, or one of its entries cannot be trusted."""


class SchedulerError(ModelError):
    """A model's scheduler config names a scheduler (or prediction type) vidtune has no training objective for."""


class CheckpointError(VidtuneError):
    """A checkpoint to resume from or export is missing, incomplete or does not fit the config."""


class StorageError(VidtuneError):
    """A disk would not take a file: full, read-only, no permission, or the folder gone (`vidtune.storage.faults`).

    `problem` names the folder and what was being written, `advice` what to do; `folder` and `full` let a caller
    add what it knows (how much space a run needs, the command that continues it) with `with_notes`."""

    def __init__(self, problem: str, advice: str = "", *, folder: Path | None = None, full: bool = False,
                 reason: str = "") -> None:
        super().__init__(problem, advice)
        self.problem = problem
        self.advice = advice
        self.folder = folder
        self.full = full
        self.reason = reason  # what went wrong with the disk, in words ("the disk is full (0 B free there)")

    def __str__(self) -> str:
        if not self.advice:
            return self.problem
        end = "" if "\n" in self.advice or self.advice.endswith((".", ":")) else "."  # a command stays copyable
        return f"{self.problem}\nWhat to do: {self.advice}{end}"

    def with_notes(self, *notes: str, advice: str | None = None) -> StorageError:
        """The same fault with more lines after the problem, and perhaps other advice."""
        problem = "\n".join([self.problem, *(note for note in notes if note)])
        return StorageError(problem, self.advice if advice is None else advice, folder=self.folder, full=self.full,
                            reason=self.reason)

    def restated(self, what: str, folder: Path) -> StorageError:
        """The same fault said of `what` in `folder` (a checkpoint, rather than one file inside its temporary
        folder)."""
        return StorageError(f"Could not write {what} in {folder}: {self.reason}.", self.advice, folder=folder,
                            full=self.full, reason=self.reason)
