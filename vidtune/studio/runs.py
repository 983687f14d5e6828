"""Run folders as `vidtune train` leaves them, wherever the run was started (the studio or the command line): the
resolved config, metrics.jsonl, validation samples and checkpoints."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vidtune import outputs
from vidtune.evaluation import EVAL_ROW_KEY
from vidtune.metrics import metrics_lines

NOISE_BINS = 10
SEARCH_DEPTH = 4  # how deep under the root run folders are looked for
SKIPPED = {".git", "__pycache__", "node_modules", outputs.CHECKPOINTS, outputs.SAMPLES}


def is_run_folder(folder: Path) -> bool:
    """A folder `vidtune train` wrote: its resolved config beside metrics or checkpoints."""
    return (folder / outputs.RESOLVED_CONFIG).is_file() and (
        (folder / outputs.METRICS).is_file() or (folder / outputs.CHECKPOINTS).is_dir())


def find_runs(root: Path, depth: int = SEARCH_DEPTH) -> list[Path]:
    """Every run folder under `root` (hidden folders left out), newest first."""
    found: list[Path] = []

    def walk(folder: Path, level: int) -> None:
        if is_run_folder(folder):
            found.append(folder)
            return
        if level >= depth:
            return
        try:
            children = sorted(entry for entry in folder.iterdir() if entry.is_dir() and not entry.is_symlink())
        except OSError:
            return
        for child in children:
            if not child.name.startswith(".") and child.name not in SKIPPED:
                walk(child, level + 1)

    walk(root, 0)
    return sorted(found, key=_changed, reverse=True)


def _changed(folder: Path) -> float:
    metrics = folder / outputs.METRICS
    return (metrics if metrics.is_file() else folder / outputs.RESOLVED_CONFIG).stat().st_mtime


# A terminal's run whose metrics were written this recently (seconds) is taken as running (validation samples and
# slow steps write nothing for a while).
TERMINAL_QUIET_S = 300.0

# What a run leaves for ComfyUI (vidtune/export/comfyui.py, workflow_file.py): the files the run page offers.
COMFYUI_ENDINGS = ("_comfyui.safetensors", "_workflow.json", "_start_image.png", "_control_video.mp4")


# Where the studio's Export writes, inside the run folder: one folder per format.
EXPORTS = Path("exports")


def comfyui_files(folder: Path) -> list[Path]:
    """The run's ComfyUI LoRA files, its workflow and the start image or control video it loads: those the run
    wrote at its end, then those an export wrote."""
    found = []
    for place in (folder, folder / EXPORTS / "comfyui"):
        if place.is_dir():
            found += sorted(path for path in place.iterdir() if path.is_file() and path.name.endswith(COMFYUI_ENDINGS))
    return found


def comfyui_run(file: Path) -> Path | None:
    """The run folder whose ComfyUI files (`comfyui_files`) include `file`; None for any other file."""
    for folder in (file.parent, file.parent.parent.parent):
        if is_run_folder(folder) and file in comfyui_files(folder):
            return folder
    return None


@dataclass(frozen=True)
class Sample:
    step: int
    video: Path
    prompt: str


@dataclass(frozen=True)
class RunView:
    """What the run page shows of one run folder."""

    folder: Path
    steps: list[int]
    losses: list[float]
    learning_rates: list[float]
    seconds_per_step: list[float]
    eval_steps: list[int]
    eval_losses: list[float]
    noise_levels: list[tuple[float, float, int]]  # (bin centre, mean loss, samples) of the levels drawn
    samples: list[Sample]
    checkpoints: list[Path]
    finished: bool
    total_steps: int | None

    @property
    def last_step(self) -> int:
        return self.steps[-1] if self.steps else 0

    def summary(self) -> dict[str, Any]:
        return {"steps": self.steps, "losses": self.losses, "learning_rates": self.learning_rates,
                "seconds_per_step": self.seconds_per_step, "eval_steps": self.eval_steps,
                "eval_losses": self.eval_losses, "noise_levels": self.noise_levels,
                "samples": [{"step": s.step, "video": s.video.name, "prompt": s.prompt} for s in self.samples],
                "checkpoints": [path.name for path in self.checkpoints], "finished": self.finished,
                "last_step": self.last_step, "total_steps": self.total_steps}


def terminal_state(view: RunView, now: float | None = None) -> str:
    """The state of a run the studio did not start (a terminal's `vidtune train`): finished, running (its metrics
    written within a few of its own logging intervals), or stopped: resumable from its newest checkpoint, or not."""
    if view.finished:
        return "finished"
    metrics = view.folder / outputs.METRICS
    if metrics.is_file():
        interval = 0.0
        if len(view.steps) >= 2 and view.seconds_per_step:
            interval = (view.steps[-1] - view.steps[-2]) * view.seconds_per_step[-1]
        quiet = (time.time() if now is None else now) - metrics.stat().st_mtime
        if quiet < max(TERMINAL_QUIET_S, 3 * interval):
            return "running from a terminal"
    return "stopped, can resume" if view.checkpoints else "stopped before its first checkpoint"


def read_run(folder: Path) -> RunView:
    rows = [row for _, row in metrics_lines(folder / outputs.METRICS)]
    # A resumed run rewrites the steps after its checkpoint: the last row of a step is the one that counts.
    by_step = {row["step"]: row for row in rows if "loss" in row and isinstance(row.get("step"), int)}
    steps = sorted(by_step)
    evals = {row["step"]: row for row in rows if EVAL_ROW_KEY in row and isinstance(row.get("step"), int)}
    return RunView(
        folder=folder, steps=steps, losses=[_number(by_step[s]["loss"]) for s in steps],
        learning_rates=[_number(by_step[s].get("lr")) for s in steps],
        seconds_per_step=[_number(by_step[s].get("seconds_per_step")) for s in steps],
        eval_steps=sorted(evals), eval_losses=[_number(evals[s][EVAL_ROW_KEY]) for s in sorted(evals)],
        noise_levels=noise_bins(by_step.values()), samples=read_samples(folder),
        checkpoints=sorted(outputs.checkpoints_root(folder).glob("step-*")) if
        outputs.checkpoints_root(folder).is_dir() else [],
        finished=any((folder / name).exists() for name in outputs.FINAL_OUTPUTS),
        total_steps=_total_steps(folder),
    )


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else math.nan


def noise_bins(rows: Any) -> list[tuple[float, float, int]]:
    """The loss by noise level over every logged sample: (bin centre, mean loss, samples) of each non-empty bin of
    [0, 1] (sigmas; DDPM timesteps are scaled by 1000)."""
    totals = [0.0] * NOISE_BINS
    counts = [0] * NOISE_BINS
    for row in rows:
        levels = row.get("sigmas")
        scale = 1.0
        if levels is None and row.get("timesteps") is not None:
            levels, scale = row["timesteps"], 1000.0
        losses = row.get("sample_losses")
        if not isinstance(levels, list) or not isinstance(losses, list):
            continue
        for level, loss in zip(levels, losses, strict=False):
            if isinstance(level, int | float) and isinstance(loss, int | float) and math.isfinite(loss):
                at = min(max(int(level / scale * NOISE_BINS), 0), NOISE_BINS - 1)
                totals[at] += loss
                counts[at] += 1
    return [((at + 0.5) / NOISE_BINS, totals[at] / counts[at], counts[at]) for at in range(NOISE_BINS) if counts[at]]


def read_samples(folder: Path) -> list[Sample]:
    """The validation samples (`samples/step-NNNNNNNN-K.mp4`) and those `vidtune sample` wrote, in order."""
    home = folder / outputs.SAMPLES
    if not home.is_dir():
        return []
    found = []
    for video in sorted(home.glob("*.mp4")):
        if video.name.endswith(".tmp.mp4") or not _complete(video):
            continue
        prompt_file = video.with_suffix(".txt")
        prompt = prompt_file.read_text(encoding="utf-8", errors="replace").strip() if prompt_file.is_file() else ""
        parts = video.stem.split("-")
        step = int(parts[1]) if len(parts) > 2 and parts[0] == "step" and parts[1].isdigit() else -1
        found.append(Sample(step, video, prompt))
    return found


def _complete(video: Path) -> bool:
    try:
        return video.stat().st_size > 0
    except OSError:
        return False


def _total_steps(folder: Path) -> int | None:
    import yaml

    try:
        data = yaml.safe_load((folder / outputs.RESOLVED_CONFIG).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    steps = (data or {}).get("training", {}).get("steps") if isinstance(data, dict) else None
    return steps if isinstance(steps, int) else None


def latest_checkpoint(folder: Path) -> Path | None:
    root = outputs.checkpoints_root(folder)
    found = sorted(root.glob("step-*")) if root.is_dir() else []
    return found[-1] if found else None


def modified(path: Path) -> float:
    return os.stat(path).st_mtime if path.exists() else 0.0
