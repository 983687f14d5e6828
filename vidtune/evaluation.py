"""The held-out score: the training loss on clips the run never trains on, comparable from checkpoint to checkpoint.

Which clips: a source marked `eval: true` (held out whole) and `validation.eval_clips` samples set aside from the
training sources (`hold_out`). Each held-out clip is encoded once, when training starts (from the cache, or by the
run's own encoders on the fly, through the same batch sources training reads), and kept in host memory.

What is measured: every clip at each of `validation.eval_noise_levels`, with latents drawn from its posterior and
noise drawn from a generator of its own (seeded by `validation.seed`, the clip and the draw), so every evaluation
sees exactly the same inputs and the score moves only when the weights do. One clip's draws are shared by all
levels, so the levels differ only by how much noise they mix in. The error is training's own
(`vidtune.algorithms.losses.clip_losses`: the spec's training error and the objective's loss weights), computed
without gradients and without touching the training RNGs, so a run resumes bit for bit whether or not it scores.

Under torchrun: a strategy whose forwards gather weights (FSDP, ZeRO-3) needs every rank to run the same forwards,
so every rank scores every clip (the same numbers everywhere); otherwise (DDP) the (clip, level) pairs are shared
out over the ranks and their sums all-reduced. Either way every rank holds the whole score; rank 0 logs it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from vidtune import parallel
from vidtune.algorithms import traits_of
from vidtune.batches import CachedBatches, EncodedBatches
from vidtune.checkpoint import PREFIX
from vidtune.config import Config
from vidtune.data.sources import Clip
from vidtune.errors import ConfigError, DataError
from vidtune.files import append_line, atomic_path
from vidtune.metrics import metrics_lines
from vidtune.models.spec import POSTERIOR_KEYS, Conditions, Latents, ModelSpec, TextComponents, draw_latent
from vidtune.precompute import CachedClips, precompute

# (conditions, noisy latents, timesteps, target, noise levels) -> each sample's weighted error [B]
LossFunction = Callable[[Conditions, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

EVAL_ROW_KEY = "eval_loss"


# ----- which clips ------------------------------------------------------------------------------------------------
def evaluation_requested(config: Config) -> bool:
    """Whether a config asks for the held-out score (eval_clips, or a source marked `eval: true`)."""
    return config.validation.eval_clips > 0 or any(source.eval for source in config.data.sources())


def check_evaluation(config: Config) -> None:
    """Refuse, before any long work, a held-out score an algorithm cannot give."""
    # A distilled student learns the teacher's output, not the denoising loss on data: the score would not measure it.
    algorithm = config.training.algorithm
    if evaluation_requested(config) and not traits_of(config).scored_on_held_out:
        asked = "validation.eval_clips" if config.validation.eval_clips else "a data source marked eval: true"
        raise ConfigError(
            f"{asked}: the held-out score is the denoising loss on clips, which training.algorithm={algorithm} "
            "does not train for (its student learns the teacher's output), so the score would not say whether "
            "the student got better.\nWhat to do: remove validation.eval_clips and the `eval: true` sources, and "
            "judge the student by its validation samples (validation.every)."
        )


def hold_out(clips: Sequence[Clip], config: Config) -> tuple[list[Clip], list[Clip]]:
    """(the samples training takes, the held-out samples), each list numbered from 0 in dataset order.

    Held out: every sample of a source marked `eval: true`, and `validation.eval_clips` samples of the others,
    evenly spread over them (regularization samples never) (also trained on with `validation.train_on_eval_clips`)."""
    validation = config.validation
    marked = [clip for clip in clips if clip.held_out]
    training = [clip for clip in clips if not clip.held_out]
    if not training:
        raise DataError(["Every data source is marked `eval: true`: nothing is left to train on."],
                        hint="remove `eval: true` from the source(s) with the clips to train on.")
    wanted = validation.eval_clips
    spare = len(training) - (0 if validation.train_on_eval_clips else 1)
    if wanted > spare:
        left = "" if validation.train_on_eval_clips else ", and at least one must be left to train on"
        raise DataError(
            [f"validation.eval_clips is {wanted}, but the training sources hold {len(training)} sample"
             f"{'s' if len(training) != 1 else ''}{left}."],
            hint="lower validation.eval_clips, add clips, mark a separate source `eval: true`, or set "
            "validation.train_on_eval_clips=true to score samples that are also trained on.",
        )
    # Regularization samples show what the base model already makes: never the ones scored.
    candidates = [number for number, clip in enumerate(training) if not clip.regularization]
    if wanted > len(candidates):
        raise DataError([f"validation.eval_clips is {wanted}, but the training sources hold {len(candidates)} "
                         "sample(s) that are not regularization samples (role: regularization)."],
                        hint="lower validation.eval_clips, or mark a separate source `eval: true`.")
    picked = {candidates[int((number + 0.5) * len(candidates) / wanted)] for number in range(wanted)} if wanted \
        else set()
    chosen = [clip for number, clip in enumerate(training) if number in picked]
    if not validation.train_on_eval_clips:
        training = [clip for number, clip in enumerate(training) if number not in picked]
    return _numbered(training), _numbered([*chosen, *marked])


def _numbered(clips: list[Clip]) -> list[Clip]:
    """The clips with `index` their place in the list (what batches and the cache plan look them up by)."""
    return [clip if clip.index == number else replace(clip, index=number) for number, clip in enumerate(clips)]


def held_out_line(held_out: Sequence[Clip], training: Sequence[Clip], config: Config) -> str:
    """The line a run starts with: which samples are scored, and whether any of them is also trained on."""
    names = ", ".join(clip.where for clip in held_out[:5]) + (f" and {len(held_out) - 5} more"
                                                              if len(held_out) > 5 else "")
    trained = {clip.video for clip in training}
    overlap = [clip for clip in held_out if clip.video in trained]
    if config.validation.train_on_eval_clips:
        note = " (also trained on: validation.train_on_eval_clips)"
    elif overlap:
        note = (f"; note: {overlap[0].where} ({overlap[0].video.name}) is also a training sample, so the score is "
                "not fully held out")
    else:
        note = ", not trained on"
    levels = ", ".join(f"{level:g}" for level in config.validation.eval_noise_levels)
    return (f"Held-out score: {len(held_out)} sample{'s' if len(held_out) != 1 else ''} ({names}){note}; scored at "
            f"noise levels {levels}.")


# ----- their inputs -----------------------------------------------------------------------------------------------
def encode_held_out(config: Config, spec: ModelSpec, clips: Sequence[Clip], device: torch.device,
                    text: TextComponents | None, vae: torch.nn.Module | None,
                    progress: bool = False) -> list[tuple[Conditions, Latents]]:
    """Each held-out clip's conditions and latents (its VAE posterior, and any video-derived conditions), a batch of
    one on the CPU: from the cache (computing missing entries, as training's own cache is) or encoded with `text`
    and `vae`, through the batch sources training reads. Every rank calls it (the cache stage shares its work)."""
    # One window each, decoded here, once: no worker processes, no store for later epochs.
    data = config.data.model_copy(update={"num_workers": 0, "frame_store_mib": 0})
    quiet = config.model_copy(update={"data": data})
    if config.precompute.enabled:
        summary = precompute(quiet, list(clips), progress=progress)
        source = CachedBatches(quiet, clips, device, CachedClips(quiet, spec, summary.plan, clips))
    else:
        source = EncodedBatches(quiet, clips, device, spec, text, vae)
    # One fixed stream position (0) for every clip: the same window at every evaluation.
    keys = [[(0, number, clip.bucket or 0)] for number, clip in enumerate(clips)]
    items = []
    for raw in source.loader(keys):
        conditions, latents = source.encode(raw)
        items.append(({k: v.detach().cpu() for k, v in conditions.items()},
                      {k: v.detach().cpu() for k, v in latents.items()}))
    return items


def eval_generator(seed: int, clip: int, draw: int) -> torch.Generator:
    """The held-out clip's own randomness (its latent and noise), apart from every training generator."""
    return torch.Generator().manual_seed((seed * 1_000_037 + clip * 15_485_863 + draw * 7_368_787 + 99_991) % 2**63)


def noise_levels(objective: Any, fractions: Sequence[float]) -> torch.Tensor:
    """The objective's noise levels at `fractions` of its range: sigmas for flow matching, the training timestep at
    that fraction for DDPM."""
    alphas = getattr(objective, "alphas_cumprod", None)
    if alphas is not None:
        return torch.tensor([float(round(f * (len(alphas) - 1))) for f in fractions])
    return torch.tensor([float(f) for f in fractions])


@dataclass(frozen=True)
class Score:
    """One evaluation: the mean weighted error per noise level (by its fraction) and their mean."""

    total: float
    by_level: dict[float, float]


@dataclass
class HeldOutSet:
    clips: list[Clip]
    items: list[tuple[Conditions, Latents]]
    fractions: list[float]
    draws: int
    seed: int
    batch_size: int

    @classmethod
    def from_config(cls, config: Config, clips: list[Clip], items: list[tuple[Conditions, Latents]]) -> HeldOutSet:
        validation = config.validation
        return cls(clips, items, list(validation.eval_noise_levels), validation.eval_noise_draws, validation.seed,
                   config.training.batch_size)

    def inputs(self, clip: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The clip's fixed (latents, noise) [draws, C, F, H, W]: the same tensors at every call."""
        _, latents = self.items[clip]
        drawn, noises = [], []
        for draw in range(self.draws):
            generator = eval_generator(self.seed, clip, draw)
            x0 = draw_latent({key: latents[key] for key in POSTERIOR_KEYS}, generator).float()
            drawn.append(x0)
            noises.append(torch.randn(x0.shape[1:], generator=generator).unsqueeze(0))
        return torch.cat(drawn), torch.cat(noises)

    def score(self, objective: Any, losses: LossFunction, device: torch.device, every_rank: bool,
              progress: bool = False) -> Score:
        """The score of the weights as they are (call under no_grad). `every_rank`: every rank scores every clip
        (strategies whose forwards are collectives); else the work is shared out and the sums all-reduced."""
        levels = noise_levels(objective, self.fractions)
        work = [(clip, level) for clip in range(len(self.items)) for level in range(len(levels))]
        mine = work if every_rank else work[parallel.rank()::parallel.world_size()]
        sums = [0.0] * len(levels)
        counts = [0] * len(levels)
        fixed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for clip, level in tqdm(mine, desc="held-out score", unit="forward", disable=not progress, leave=False):
            if clip not in fixed:
                fixed = {clip: self.inputs(clip)}  # one clip's draws at a time in memory
            x0_all, noise_all = fixed[clip]
            conditions, latents = self.items[clip]
            for start in range(0, self.draws, self.batch_size):
                x0 = x0_all[start : start + self.batch_size].to(device)
                noise = noise_all[start : start + self.batch_size].to(device)
                count = x0.shape[0]
                at = levels[level : level + 1].expand(count).clone()
                # The clip's conditions and video-derived conditions (first frames, control, sound), per draw.
                given = {**conditions, **{k: v for k, v in latents.items() if k not in POSTERIOR_KEYS}}
                given = {k: v.to(device).expand(count, *v.shape[1:]) for k, v in given.items()}
                errors = losses(given, objective.noisy(x0, noise, at), objective.timesteps(at).to(device),
                                objective.target(x0, noise, at), at)
                sums[level] += float(errors.float().sum())
                counts[level] += count
        if not every_rank:
            reduced = parallel.all_reduce_sum([*sums, *counts])
            sums, counts = reduced[: len(levels)], reduced[len(levels) :]
        by_level = {fraction: total / number for fraction, total, number in zip(self.fractions, sums, counts,
                                                                                  strict=True)}
        return Score(sum(by_level.values()) / len(by_level), by_level)


# ----- what a run records ------------------------------------------------------------------------------------------
def level_label(fraction: float) -> str:
    return f"{fraction:g}"


@dataclass
class EvalHistory:
    """The evaluations of a run (read back from metrics.jsonl when it resumes), and its best checkpoint."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def read(cls, metrics: Path) -> EvalHistory:
        return cls(read_eval_rows(metrics))

    def add(self, step: int, score: Score, checkpoint: bool) -> dict[str, Any]:
        self.rows = [row for row in self.rows if row["step"] != step]
        row = {"step": step, EVAL_ROW_KEY: score.total,
               "eval_loss_by_noise": {level_label(k): v for k, v in score.by_level.items()},
               "eval_checkpoint": checkpoint}
        self.rows.append(row)
        best = self.best()
        row["eval_best_step"] = best["step"] if best is not None else None
        return row

    @property
    def last_step(self) -> int | None:
        return self.rows[-1]["step"] if self.rows else None

    def best(self) -> dict[str, Any] | None:
        """The evaluation with the lowest score among those of checkpoints (the earliest of equals)."""
        scored = [row for row in self.rows if row.get("eval_checkpoint") and math.isfinite(row[EVAL_ROW_KEY])]
        return min(scored, key=lambda row: (row[EVAL_ROW_KEY], row["step"])) if scored else None


def read_eval_rows(metrics: Path) -> list[dict[str, Any]]:
    """The held-out score rows of metrics.jsonl, in step order."""
    return sorted((row for _, row in metrics_lines(metrics) if EVAL_ROW_KEY in row), key=lambda row: row["step"])


def append_row(metrics: Path, row: dict[str, Any]) -> None:
    append_line(metrics, json.dumps(row))


def tracker_values(score: Score) -> dict[str, float]:
    """What a tracker records of one evaluation (under `eval/`)."""
    return {"loss": score.total, **{f"loss_noise_{level_label(k)}": v for k, v in score.by_level.items()}}


def score_line(step: int, score: Score, best: dict[str, Any] | None) -> str:
    levels = ", ".join(f"{level_label(k)}: {v:.4f}" for k, v in score.by_level.items())
    best_text = f"; best checkpoint so far: step {best['step']} ({best[EVAL_ROW_KEY]:.4f})" if best else ""
    return f"Held-out score at step {step}: {score.total:.4f} (by noise level {levels}){best_text}"


def best_line(history: EvalHistory, checkpoints_root: Path) -> tuple[str, Path | None]:
    """The run's closing line on the held-out score, and its best checkpoint's folder (None when no checkpoint was
    scored)."""
    best = history.best()
    rows = history.rows
    if not rows:
        return "Held-out score: no evaluation was made.", None
    parts = []
    start = next((row for row in rows if row["step"] == 0), None)
    if start is not None:
        parts.append(f"{start[EVAL_ROW_KEY]:.4f} before training")
    parts.append(f"{rows[-1][EVAL_ROW_KEY]:.4f} at step {rows[-1]['step']}")
    if best is None:
        return f"Held-out score: {', '.join(parts)}; no checkpoint was scored.", None
    folder = checkpoints_root / f"{PREFIX}{best['step']:08d}"
    return (f"Held-out score: {', '.join(parts)}. Best checkpoint: step {best['step']} ({best[EVAL_ROW_KEY]:.4f}), "
            f"{folder}\nTo use it: vidtune export {folder} --output FOLDER"), folder


def plot_eval_curve(metrics: Path, output: Path) -> Path | None:
    """eval_loss.png: the held-out score over steps, in total and per noise level, the best checkpoint marked; None
    (nothing drawn) before there are two scores: one is no curve (the console and metrics.jsonl show it)."""
    rows = read_eval_rows(metrics)
    if len(rows) < 2:
        return None
    # A Figure of its own, not pyplot's: no global figure manager to import, select a backend for, or close.
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    steps = [row["step"] for row in rows]
    figure = Figure(figsize=(12, 4.5), dpi=100)
    total_axis, level_axis = figure.subplots(1, 2)
    total_axis.plot(steps, [row[EVAL_ROW_KEY] for row in rows], color="#1f4e79", linewidth=2, marker="o",
                    markersize=3, label="mean over noise levels")
    best = EvalHistory(rows).best()
    if best is not None:
        total_axis.plot([best["step"]], [best[EVAL_ROW_KEY]], marker="*", markersize=14, color="#c0392b",
                        linestyle="none", label=f"best checkpoint (step {best['step']})")
    total_axis.set_title("Held-out score")
    # Each level relative to its first score: levels differ in size, what matters is how each moves.
    labels = list(rows[-1]["eval_loss_by_noise"])
    colours = colormaps["viridis"]
    for number, label in enumerate(labels):
        values = [row["eval_loss_by_noise"].get(label, float("nan")) for row in rows]
        first = next((value for value in values if math.isfinite(value) and value != 0), float("nan"))
        level_axis.plot(steps, [value / first for value in values], color=colours(number / max(1, len(labels) - 1)),
                        linewidth=1.5, label=f"noise {label}")
    level_axis.axhline(1.0, color="#888888", linewidth=0.8, linestyle="--")
    level_axis.set_title("By noise level, relative to the first score")
    total_axis.set_ylabel("loss")
    level_axis.set_ylabel(f"score / score at step {steps[0]}")
    for axis in (total_axis, level_axis):
        axis.set_xlabel("optimizer step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    with atomic_path(output) as temporary:
        figure.savefig(temporary, format="png")
    return output
