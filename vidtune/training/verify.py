"""`vidtune checkpoint verify RUN`: whether a run's checkpoints and final weights are whole.

Each checkpoint is checked against its digest manifest (`vidtune.storage.manifest`), each final weights file
(the diffusers LoRA, the ComfyUI file, a full fine-tune's shards) against the digest of its tensors in its own
metadata (`vidtune.storage.digests`). A file written before vidtune kept digests is reported as not checkable.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vidtune import checkpoint as checkpoints
from vidtune.errors import CheckpointError
from vidtune.outputs import CHECKPOINTS
from vidtune.storage.digests import file_digest_problem
from vidtune.storage.space import folder_size, human_size


@dataclass(frozen=True)
class Finding:
    """One checkpoint or weights file, and what its check found."""

    path: Path
    size: int
    problem: str | None  # None: whole
    checked: bool = True  # False: it carries no digest, so it could not be checked

    def line(self, run: Path) -> str:
        name = self.path.relative_to(run).as_posix() if self.path.is_relative_to(run) else str(self.path)
        if self.problem:
            verdict = f"DAMAGED: {self.problem}"
        elif not self.checked:
            verdict = "not checkable (written without a digest, by an earlier vidtune)"
        else:
            verdict = "whole"
        return f"  {name:<48} {human_size(self.size):>10}  {verdict}"


def check_checkpoint(folder: Path, progress: bool) -> Finding:
    verdict = checkpoints.verify(folder, progress=progress)
    return Finding(folder, folder_size(folder), verdict.reason() or None, verdict.verified)


def check_weights_file(path: Path) -> Finding:
    try:
        problem = file_digest_problem(path)
    except LookupError:
        return Finding(path, path.stat().st_size, None, checked=False)
    return Finding(path, path.stat().st_size, problem)


def weights_files(run: Path) -> list[Path]:
    """A run folder's final weights: its safetensors files, and those of its `transformer*` folders."""
    return sorted([*run.glob("*.safetensors"), *run.glob("transformer*/*.safetensors")])


def verify_run(path: Path, progress: bool = True) -> list[Finding]:
    """Every checkpoint and final weights file of the run folder `path` (or the one checkpoint `path` names)."""
    path = path.expanduser()
    if checkpoints.is_step_folder(path):
        return [check_checkpoint(path, progress)]
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder.\nWhat to do: give a run's output_dir, or one checkpoint "
                              "folder (.../checkpoints/step-XXXXXXXX).")
    root = path if path.name == CHECKPOINTS else path / CHECKPOINTS
    folders = checkpoints.step_folders(root)
    files = weights_files(path) if root != path else []
    if not folders and not files:
        raise CheckpointError(f"{path} holds no checkpoint (checkpoints/step-XXXXXXXX) and no weights file.\n"
                              "What to do: give a run's output_dir, or one checkpoint folder.")
    return [*(check_checkpoint(folder, progress) for folder in folders), *(check_weights_file(f) for f in files)]


def report(path: Path, findings: list[Finding]) -> tuple[str, bool]:
    """The lines to print, and whether everything checkable is whole."""
    run = path.expanduser() if path.is_dir() else path.parent
    damaged = [finding for finding in findings if finding.problem]
    lines = [f"{path}:", *(finding.line(run) for finding in findings)]
    if damaged:
        lines.append(f"\n{len(damaged)} of {len(findings)} damaged. What to do: checkpoint.resume=latest resumes from "
                     "the newest whole checkpoint and skips damaged ones; replace a damaged weights file from a "
                     "backup, or export it again from a whole checkpoint (vidtune export CHECKPOINT --output FOLDER).")
    else:
        unchecked = sum(not finding.checked for finding in findings)
        lines.append(f"\nAll {len(findings) - unchecked} checked {'is' if len(findings) - unchecked == 1 else 'are'} "
                     f"whole{f'; {unchecked} could not be checked' if unchecked else ''}.")
    return "\n".join(lines), not damaged
