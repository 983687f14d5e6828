"""Validation samples during training, and what a finished run writes (rank 0)."""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from vidtune import outputs
from vidtune.algorithms.build import build_part
from vidtune.compile import eager
from vidtune.export.workflow_file import write_run_workflow, written_loras
from vidtune.given_frames import validation_given
from vidtune.metrics import plot_loss_curve
from vidtune.sampling import (
    SampleSettings,
    SamplingStopped,
    clip_sampling_inputs,
    describe_samples,
    reference_clip,
    render_samples,
    validation_shape,
)
from vidtune.sheets import write_samples_by_step
from vidtune.training.stop import SIGNAL_EXIT_CODES, StopSignals, TrainingInterrupted

if TYPE_CHECKING:
    from collections.abc import Sequence

    from vidtune.algorithms.part import AlgorithmPart
    from vidtune.data.sources import Clip
    from vidtune.training.context import TrainingContext


def say(line: str) -> None:
    """A line on stdout that leaves a progress bar intact, written at once (also into a log file)."""
    tqdm.write(line)
    sys.stdout.flush()


def default_prompt(clips: Sequence[Clip]) -> str:
    """The prompt validation samples without `validation.prompts`: the first caption of a sample the run learns
    (regularization samples show what the base model already makes)."""
    return next((clip.caption for clip in clips if not clip.regularization), clips[0].caption)


def validate(context: TrainingContext, part: AlgorithmPart, stop: StopSignals | None = None) -> list[Path]:
    """Sample the validation prompts with `part`'s denoiser as it is now, or its moving average when
    `training.ema_decay` is set, saying at which shape, with a bar per sample; a stop signal ends the samples within
    a denoising step. A run trained from the cache loads the text encoders and the VAE for it, once, and says so.
    Also draws every validation so far side by side (samples_by_step.png)."""
    config, clips = context.config, context.clips
    context.encoders.load("Loading the text encoders and the VAE for validation samples (training read the cache).")
    spec = part.sampling_spec(context.spec)  # e.g. a student's embedded guidance scale
    settings = SampleSettings.from_config(config, spec, default_prompt=default_prompt(clips))
    step = context.state.step
    say(f"Validation at step {step}: {describe_samples(settings, validation_shape(config)[1])}.")
    compiled = eager() if config.training.compile else contextlib.nullcontext()
    folder = context.output_dir / outputs.SAMPLES
    pipeline = spec.pipeline(context.encoders.text, context.encoders.vae, part.denoiser)
    try:
        with compiled, context.average.applied(), part.sampling(pipeline, context.encoders.vae, clips) as pipeline:
            videos = render_samples(spec, pipeline, settings, folder, f"step-{step:08d}",
                                    reference=reference_clip(spec, clips, settings, config.data.fps),
                                    given=validation_given(spec, config, clips, settings.frames, settings.height,
                                                           settings.width),
                                    inputs=clip_sampling_inputs(spec, clips[0], settings, config.data.fps),
                                    bf16=context.bf16, progress=context.show_progress, step=step,
                                    stop=(lambda: stop.received is not None) if stop is not None else None)
    except SamplingStopped as stopped:
        say(f"Validation at step {step} stopped: {len(stopped.written)} of {len(settings.prompts)} samples written.")
        return stopped.written
    by_step = write_samples_by_step(folder, context.output_dir / outputs.SAMPLES_BY_STEP)
    say(f"Validation samples of step {step} in {folder}" + (f"; every validation side by side: {by_step}"
                                                              if by_step else ""))
    context.log.samples(step, videos, settings.frame_rate)
    return videos


def validate_in_place(context: TrainingContext, stop: StopSignals | None = None) -> list[Path]:
    """`validate` with the trained part, or under ZeRO-3 a plain copy of it (`DeepSpeedStrategy.sampling`)."""
    fresh = functools.partial(build_part, context.config, context.spec)
    with context.strategy.sampling(context.part, fresh) as part:
        return validate(context, part, stop)


def write_workflow(context: TrainingContext, name: str | None = None) -> Path | None:
    """The ComfyUI workflow beside the run's ComfyUI LoRA, sampling what validation samples (an image-to-video run's
    start image: the first frame validation starts from; Wan VACE's control video: the one validation follows)."""
    spec, config, clips = context.spec, context.config, context.clips
    run_name = context.part.run_name(name)
    if not any(written_loras(context.output_dir, run_name)) or spec.comfyui_workflow() is None:
        # No ComfyUI LoRA (a full fine-tune) or no workflow for the family: no clip to read; the writer says why.
        return write_run_workflow(spec, config, context.output_dir, run_name)
    settings = SampleSettings.from_config(config, spec, default_prompt=default_prompt(clips))
    reference = reference_clip(spec, clips, settings, config.data.fps)
    inputs = clip_sampling_inputs(spec, clips[0], settings, config.data.fps) or {}
    return write_run_workflow(spec, config, context.output_dir, run_name, prompt=default_prompt(clips),
                              reference=reference, left_out=tuple(inputs))


def write_results(context: TrainingContext, name: str | None = None) -> tuple[Path, list[Path]]:
    """What a finished run leaves: the weights, the loss curve, the validation samples (rank 0 only); `name`: what
    files named after the run are called (default: the output folder's name)."""
    weights = context.part.save_final(context.output_dir, context.average.average, name)
    write_workflow(context, name)
    plot_loss_curve(context.output_dir / outputs.METRICS, context.output_dir / outputs.LOSS_PLOT)
    if not context.config.validation.enabled:
        return weights, []
    with StopSignals("stopping the validation samples (the trained weights are saved). Send {key} again to "
                     "quit at once.") as stop:
        samples = validate_in_place(context, stop)
    if stop.received is not None:
        raise TrainingInterrupted(
            f"{stop.received.name} received: stopped the validation samples after the last step "
            f"({context.state.step}); the trained weights are saved: {weights}.\nTo sample them: vidtune sample "
            f"{context.output_dir} --prompt \"...\"", SIGNAL_EXIT_CODES[stop.received])
    return weights, samples
