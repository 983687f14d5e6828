"""Samples: videos generated with trained weights through the family's own diffusers pipeline.

Two callers share the rendering here:
- validation during a run (`Trainer.validate`) hands `render_samples` the pipeline it assembles from the
  components it holds, with the settings and (image-to-video families) the clip to start from;
- `vidtune sample RUN_DIR` (and scripts) load what a finished run wrote with `load_pipeline`: the family's
  pipeline built from the spec, with the run's transformer (full fine-tuning) or with its adapter loaded by
  the pipeline's own `load_lora_weights`, then render with `render_sample`.

Each sample is an mp4 (with the generated sound as its AAC track, for a family that generates sound: LTX-2), a PNG
contact sheet to judge it without a player, and its prompt; on request also the final latents (safetensors, key
`latents`, the training layout [B, C, F, H, W], normalised like `spec.prepare_latents`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from safetensors.torch import save_file

from vidtune import checkpoint as checkpoints
from vidtune import outputs
from vidtune.algorithms import traits_of
from vidtune.config import Config, load_config
from vidtune.control import encode_control, has_control, load_control
from vidtune.data.input_files import InputRead, frames_tensor
from vidtune.data.inputs import INPUT_KINDS
from vidtune.data.sources import Clip, read_sources
from vidtune.data.video import ClipWindow, frames_to_uint8, is_image_path, read_clip, write_video
from vidtune.errors import ConfigError, VidtuneError
from vidtune.export.comfyui_sigmas import ComfyUISchedule, ltxv_tokens
from vidtune.export.comfyui_workflow import pipeline_shift
from vidtune.files import atomic_path, atomic_write_text, follow_umask
from vidtune.given_frames import given_from_files
from vidtune.in_context import read_reference, referenced
from vidtune.models.conditioning import Given
from vidtune.models.registry import get_spec_class
from vidtune.models.spec import ModelSpec
from vidtune.parallel import parse_device
from vidtune.processors import ProcessorChoice, configured_processor, control_downscale, with_reference_controls
from vidtune.schedulers import fixed_sigmas_scheduler, student_scheduler
from vidtune.sheets import write_contact_sheet


@dataclass(frozen=True)
class SampleSettings:
    """What to sample and how: prompts, shape, steps, guidance, seed, and the frame rate of the mp4s."""

    prompts: tuple[str, ...]
    frames: int
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    frame_rate: float
    comfyui: ComfyUISchedule | None = None  # `validation.sampler: comfyui`: Euler through ComfyUI's sigmas

    @classmethod
    def from_config(cls, config: Config, spec: ModelSpec, default_prompt: str) -> SampleSettings:
        """The `validation` section, falling back to a shape the run trains (`validation_shape`), the family's
        recommended guidance and `default_prompt` (the first caption of the dataset)."""
        options = config.validation
        frames, height, width = validation_shape(config)[0]
        return cls(
            prompts=tuple(options.prompts or [default_prompt]),
            frames=frames,
            height=height,
            width=width,
            num_inference_steps=options.num_inference_steps,
            guidance_scale=(spec.validation_guidance_scale if options.guidance_scale is None
                            else options.guidance_scale),
            seed=options.seed,
            frame_rate=config.frame_rate,
            comfyui=comfyui_schedule(config, spec) if options.sampler == "comfyui" else None,
        )


def comfyui_schedule(config: Config, spec: ModelSpec) -> ComfyUISchedule:
    """The ComfyUI schedule of the run's workflow: `validation.comfyui_scheduler` (default: the family's) over the
    model's noise levels shifted by `validation.comfyui_shift` (default: the family scheduler's shift)."""
    layout = spec.comfyui_workflow()
    if layout is None:
        why = spec.comfyui_absent() if spec.comfyui_model() is None else f"vidtune has no {spec.name} workflow yet."
        raise ConfigError(f"validation.sampler=comfyui: {why}\nWhat to do: use validation.sampler=pipeline (the "
                          "default) for this family.")
    options = config.validation
    shift = options.comfyui_shift or pipeline_shift(dict(spec.load_scheduler().config))
    return ComfyUISchedule(options.comfyui_scheduler or layout.scheduler, shift)


def comfyui_sigmas(spec: ModelSpec, settings: SampleSettings) -> torch.Tensor:
    """The sigmas a sample of `settings` goes through with `validation.sampler: comfyui`; LTXVScheduler's shift
    follows the latent's frames x height x width, with the family's compression."""
    if settings.comfyui is None:
        raise ValueError("these settings sample with the pipeline's own scheduler")
    spatial, temporal = getattr(spec, "compression", (32, 8))[:2]
    tokens = ltxv_tokens(settings.frames, settings.height, settings.width, spatial, temporal)
    return settings.comfyui.sigmas(settings.num_inference_steps, tokens)


@contextlib.contextmanager
def comfyui_scheduler(spec: ModelSpec, pipeline: Any, settings: SampleSettings) -> Iterator[None]:
    """With `validation.sampler: comfyui`, the pipeline steps with Euler through ComfyUI's sigmas while active (its
    own scheduler is put back after)."""
    if settings.comfyui is None:
        yield
        return
    own = pipeline.scheduler
    pipeline.scheduler = fixed_sigmas_scheduler(own, comfyui_sigmas(spec, settings))
    try:
        yield
    finally:
        pipeline.scheduler = own


def validation_shape(config: Config) -> tuple[tuple[int, int, int], str]:
    """The (frames, height, width) samples take by default and where it comes from, in words: each of
    `validation.frames / height / width` that is set, the rest from a shape the run trains: the first bucket of
    `data.buckets` with more than one frame (else its first), or `data.frames / height / width`."""
    options, data = config.validation, config.data
    if data.buckets:
        shapes = data.bucket_shapes()
        trained = next((shape for shape in shapes if shape[0] > 1), shapes[0])
        origin = ("the first bucket of data.buckets with more than one frame" if trained[0] > 1
                  else "the first bucket of data.buckets")
    else:
        trained, origin = (data.frames, data.height, data.width), "data.frames / height / width"
    given = {"frames": options.frames, "height": options.height, "width": options.width}
    shape = tuple(value or trained[number] for number, value in enumerate(given.values()))
    named = [f"validation.{key}" for key, value in given.items() if value]
    if len(named) == 3:
        origin = "validation.frames / height / width"
    elif named:
        origin = f"{', '.join(named)}; the rest from {origin}"
    return shape, origin  # type: ignore[return-value]


def describe_samples(settings: SampleSettings, origin: str) -> str:
    """'2 samples at 17x64x96 (frames x height x width, from ...), 30 denoising steps each'."""
    count = len(settings.prompts)
    return (f"{count} sample{'s' if count != 1 else ''} at {settings.frames}x{settings.height}x{settings.width} "
            f"(frames x height x width, from {origin}), {settings.num_inference_steps} denoising steps each")


class SamplingStopped(VidtuneError):
    """Sampling was asked to stop (Ctrl+C during validation): raised between two denoising steps. `written`: the
    samples finished before it."""

    def __init__(self, message: str, written: Sequence[Path] = ()) -> None:
        super().__init__(message)
        self.written = list(written)


def reference_clip(spec: ModelSpec, clips: Sequence[Clip], settings: SampleSettings,
                   fps: float | None = None) -> torch.Tensor | None:
    """Image-to-video families start from a first frame (or keyframes): those of the first dataset clip
    ([K, 3, H, W], read at `fps` like training clips). A family whose conditioning reads a control clip follows the
    first dataset clip's control clip, read like a training clip ([F, 3, H, W])."""
    if spec.reads_control_clip and spec.control_input_kind is None:  # not Wan Animate's pose: one of its own inputs
        return control_clip(spec, clips[0].control, settings, fps)
    if not spec.samples_from_image:
        return None
    window = ClipWindow(spec.reference_frame_count(settings.frames), settings.height, settings.width, fps=fps)
    return read_clip(clips[0].video, window)


def control_clip(spec: ModelSpec, path: Path | None, settings: SampleSettings, fps: float | None = None,
                 resize: str = "crop") -> torch.Tensor:
    """The control clip a family that `reads_control_clip` samples from ([F, 3, H, W], the sample's frames read
    from its start like a training clip)."""
    if path is None:
        raise VidtuneError(f"{spec.name} follows a control clip, and none was given.\nWhat to do: give the first "
                           "sample a control clip (controls.txt, control_column), or pass --control CLIP.")
    return read_clip(Path(path), ClipWindow(settings.frames, settings.height, settings.width, fps=fps, resize=resize))


def clip_sampling_inputs(spec: ModelSpec, clip: Clip | None, settings: SampleSettings, fps: float | None = None,
                         control: Path | None = None) -> dict[str, torch.Tensor] | None:
    """The inputs ([3, F, H, W]) a family's pipeline takes beside the prompt (`spec.sampling_inputs`: Wan Animate's
    pose and face, Wan VACE's mask and reference images) for a sample following `clip` (validation: the first dataset
    clip): each kind from the clip's own inputs; the control input of a family that takes its control clip as one
    (`spec.control_input_kind`: Wan Animate's pose) from `control`, else the clip's control clip when it has no such
    input. Read at `fps` with the samples' shape, as training reads them: a still is one frame; an `images` kind's
    pictures each fitted inside the shape (keeping their aspect), one a frame."""
    if not spec.sampling_inputs:
        return None
    paths: dict[str, tuple[Path, ...]] = {}
    if clip is not None:
        paths = {kind: clip.inputs[kind] for kind in spec.sampling_inputs if kind in clip.inputs}
    kind = spec.control_input_kind
    if spec.reads_control_clip and kind is not None:
        source = control or (None if clip is None or kind in paths else clip.control)
        if source is not None:
            paths[kind] = (Path(source),)
    window = ClipWindow(settings.frames, settings.height, settings.width, fps=fps)
    return {kind: sampling_input(kind, files, window) for kind, files in paths.items()} or None


def sampling_input(kind: str, paths: tuple[Path, ...], window: ClipWindow) -> torch.Tensor:
    """One input as training reads it, [3, F, H, W] in [-1, 1]: a clip with the sample's window; a still as one frame,
    cropped and resized as the clip; an `images` kind's pictures each fitted inside keeping its aspect, one a frame."""
    if INPUT_KINDS[kind].media == "images":
        return torch.cat([read_sampling_input(kind, path, window) for path in paths], dim=1)
    return read_sampling_input(kind, paths[0], window)


def read_sampling_input(kind: str, path: Path, window: ClipWindow) -> torch.Tensor:
    """One file of an input as training reads it ([3, F, H, W]): a clip with the sample's window; a still as one
    frame ([3, 1, H, W]), cropped and resized as the clip, or for an `images` kind fitted inside keeping its aspect."""
    if not is_image_path(path):
        return read_clip(path, window).transpose(0, 1)
    fit = INPUT_KINDS[kind].media == "images"
    read = InputRead(str(path), (0,), window.height, window.width, window.resize, fit_own_aspect=fit)
    return frames_tensor(read.frames())


def read_image(path: Path, height: int, width: int) -> torch.Tensor:
    """A picture as a one-frame clip [1, 3, H, W] in [-1, 1]: resized to cover H x W, then center-cropped (as
    training clips are)."""
    try:
        with Image.open(path) as opened:
            image = opened.convert("RGB")
    except (OSError, UnidentifiedImageError) as error:
        reason = "no such file" if not path.exists() else f"not an image PIL can read ({error})"
        raise VidtuneError(f"--image: {path}: {reason}.\nWhat to do: give a PNG or JPEG file.") from None
    scale = max(height / image.height, width / image.width)
    size = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    image = image.resize(size, Image.Resampling.BICUBIC)
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    array = np.asarray(image.crop((left, top, left + width, top + height)))
    return torch.from_numpy(array.copy()).permute(2, 0, 1)[None].float().div_(127.5).sub_(1.0)


# ----- rendering: validation and `vidtune sample` -------------------------------------------------------------
@contextlib.contextmanager
def stoppable(pipeline: Any, stop: Callable[[], bool] | None) -> Iterator[None]:
    """While active, each call of the pipeline's denoisers first asks `stop` and raises SamplingStopped when it
    says so: a sample stops within one denoising step, in every family's pipeline alike."""
    if stop is None:
        yield
        return

    def check(_module: Any, _inputs: Any) -> None:
        if stop():
            raise SamplingStopped("sampling stopped")

    denoisers = [module for module in (getattr(pipeline, "transformer", None), getattr(pipeline, "transformer_2", None))
                 if isinstance(module, torch.nn.Module)]
    hooks = [module.register_forward_pre_hook(check) for module in denoisers]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def render_sample(spec: ModelSpec, pipeline: Any, prompt: str, settings: SampleSettings, seed: int,
                  video_path: Path, *, reference: torch.Tensor | None = None, bf16: bool = False,
                  latents_path: Path | None = None, stop: Callable[[], bool] | None = None,
                  step: int | None = None, given: Given | None = None,
                  inputs: dict[str, torch.Tensor] | None = None) -> Path:
    """One sample with `pipeline`: `video_path` (mp4), its .png contact sheet (captioned with the prompt and, for a
    validation sample, the training `step`) and .txt prompt, and with `latents_path` the final latents. The denoiser
    is put in eval mode for sampling and back in the mode it had. `stop`: asked before each denoising step
    (SamplingStopped when it says so). `given`: a conditioning mode's inputs, in place of `reference`. `inputs`: the
    sample's input videos (`ModelSpec.sampling_inputs`)."""
    denoiser = pipeline.transformer
    was_training = denoiser.training
    denoiser.eval()
    device = next(denoiser.parameters()).device
    final: dict[str, torch.Tensor] = {}

    def keep_latents(_pipeline: Any, _step: int, _timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        final["latents"] = tensors["latents"]  # after each step: after the last, the final latents
        return tensors

    try:
        with stoppable(pipeline, stop), comfyui_scheduler(spec, pipeline, settings), \
                torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            sample = spec.sample(pipeline, prompt, frames=settings.frames, height=settings.height,
                                 width=settings.width, num_inference_steps=settings.num_inference_steps,
                                 guidance_scale=settings.guidance_scale, generator=torch.Generator().manual_seed(seed),
                                 reference=reference, callback=keep_latents if latents_path is not None else None,
                                 inputs=inputs, **({"given": given} if given is not None else {}))
    finally:
        denoiser.train(was_training)
    pixels = frames_to_uint8(sample.frames)
    if sample.audio is None:
        write_video(video_path, pixels, fps=settings.frame_rate)
    else:  # a family that generates sound (LTX-2): its waveform is the mp4's sound track
        write_video(video_path, pixels, fps=settings.frame_rate, audio=sample.audio, sample_rate=sample.sample_rate)
    write_contact_sheet(pixels, video_path.with_suffix(".png"), caption=sheet_caption(prompt, settings, seed, step))
    atomic_write_text(video_path.with_suffix(".txt"), prompt + "\n")
    if latents_path is not None:
        latents = spec.latents_from_pipeline(final["latents"], settings.frames, settings.height, settings.width)
        write_latents(latents, latents_path, {"model": spec.name, "prompt": prompt, "seed": str(seed),
                                              "num_inference_steps": str(settings.num_inference_steps),
                                              "guidance_scale": str(settings.guidance_scale)})
    return video_path


def render_samples(spec: ModelSpec, pipeline: Any, settings: SampleSettings, folder: Path, name: str, *,
                   reference: torch.Tensor | None = None, bf16: bool = False, progress: bool = False,
                   stop: Callable[[], bool] | None = None, step: int | None = None,
                   given: Given | None = None, inputs: dict[str, torch.Tensor] | None = None) -> list[Path]:
    """One sample per prompt (seed `settings.seed + number`), written as `folder/{name}-{number}.mp4`
    (+ .png contact sheet, + .txt prompt). `progress`: a bar of each sample's denoising steps; `stop`: asked
    before each sample and each denoising step (SamplingStopped when it says so)."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for number, prompt in enumerate(settings.prompts):
        if stop is not None and stop():
            raise SamplingStopped("sampling stopped", written)
        pipeline.set_progress_bar_config(disable=not progress, leave=False, dynamic_ncols=True,
                                         desc=f"sample {number + 1}/{len(settings.prompts)}")
        try:
            written.append(render_sample(spec, pipeline, prompt, settings, settings.seed + number,
                                         folder / f"{name}-{number}.mp4", reference=reference, bf16=bf16, stop=stop,
                                         step=step, given=given, inputs=inputs))
        except SamplingStopped:
            raise SamplingStopped("sampling stopped", written) from None
    return written


def sheet_caption(prompt: str, settings: SampleSettings, seed: int, step: int | None = None) -> list[str]:
    """The lines above a sample's contact sheet: its prompt, then what made it."""
    made = [f"step {step}"] if step is not None else []
    made += [f"seed {seed}", f"{settings.frames}x{settings.height}x{settings.width} (frames x height x width)",
             f"{settings.num_inference_steps} denoising steps", f"guidance {settings.guidance_scale:g}"]
    if settings.comfyui is not None:
        made.append(f"as ComfyUI: euler, {settings.comfyui.describe()}")
    return [prompt, ", ".join(made)]


def write_latents(latents: torch.Tensor, path: Path, metadata: dict[str, str]) -> Path:
    """`{"latents": tensor}` as safetensors (float32, on the CPU), with what made them as metadata."""
    with atomic_path(path) as temporary:
        save_file({"latents": latents.detach().float().cpu().contiguous()}, temporary, metadata=metadata)
        follow_umask(temporary)
    return path


# ----- what a run produced, as a ready pipeline ----------------------------------------------------------------
@dataclass
class RunPipeline:
    """A finished run's weights in the family's diffusers pipeline (see `load_pipeline`)."""

    pipeline: Any  # the family's diffusers pipeline (LTXPipeline, WanPipeline, ...)
    spec: ModelSpec
    config: Config  # the run's resolved config
    weights: Path  # the adapter file or transformer folder in the pipeline
    device: torch.device
    # A control run's widened input layer (set its latents with `control.given`), and the VAE (as the spec loads
    # it) that encodes control clips.
    control: Any = None
    vae: Any = None

    @property
    def bf16(self) -> bool:
        """Sampling computes as the run trained: `training.precision` (auto: bf16 on a GPU)."""
        precision = self.config.training.precision
        return precision == "bf16" or (precision == "auto" and self.device.type == "cuda")


def run_weights(run: Path, ema: bool | None = None) -> tuple[Path, bool]:
    """(the weights `run` holds, whether they are an adapter): the LoRA file or the transformer folder; their
    moving average (`training.ema_decay`) when `ema` is True, or when it is None and the run has one."""
    found = [(run / outputs.LORA_EMA_WEIGHTS, run / outputs.LORA_WEIGHTS, True),
             (run / outputs.LORA_EMA_WEIGHTS_2, run / outputs.LORA_WEIGHTS_2, True),
             (run / outputs.TRANSFORMER_EMA_FOLDER, run / outputs.TRANSFORMER_FOLDER, False)]
    for averaged, plain, adapter in found:
        if not plain.exists():
            continue
        if ema is False or (ema is None and not averaged.exists()):
            return plain, adapter
        if not averaged.exists():
            raise VidtuneError(f"{run} has no moving average of its weights ({averaged.name}): it was trained "
                               "without training.ema_decay.\nWhat to do: leave out --ema.")
        return averaged, adapter
    newest = checkpoints.latest(outputs.checkpoints_root(run))
    hint = (f"export its newest checkpoint into it first: vidtune export {newest} --output {run}" if newest
            else "give the output_dir of a run that finished.")
    raise VidtuneError(f"{run} holds no trained weights ({outputs.LORA_WEIGHTS} or {outputs.TRANSFORMER_FOLDER}/): "
                       f"the run did not finish.\nWhat to do: {hint}")


def embedded_guidance_scale(config: Config, requested: float | None) -> float | None:
    """The scale a guidance embedding (HunyuanVideo's) is told when sampling a run: `requested`, else for a student
    of a range of scales `distillation.guidance_scale` (as its validation samples), else None (the model's own,
    `model.guidance_scale`)."""
    options = config.distillation
    learned = options.guidance_range if traits_of(config).teacher_guidance else None
    if requested is None:
        return options.guidance_scale if learned is not None else None
    if learned is not None and not learned[0] <= requested <= learned[1]:
        raise VidtuneError(f"--embedded-guidance {requested:g}: the student learned the scales {learned[0]:g} to "
                           f"{learned[1]:g} (distillation.guidance_range).\nWhat to do: choose a scale in that "
                           "range.")
    if requested <= 0:
        raise VidtuneError(f"--embedded-guidance {requested:g} must be positive.\nWhat to do: give e.g. 6.")
    return requested


def load_pipeline(run_dir: str | os.PathLike[str], device: str | torch.device = "auto",
                  ema: bool | None = None, embedded_guidance: float | None = None) -> RunPipeline:
    """The family's diffusers pipeline with what the run in `run_dir` trained, ready to call.

    Built from the run's resolved config (`config.yaml`): the spec loads the text encoders, the VAE and the
    denoiser (a full fine-tune's own `transformer/`) and assembles the family's pipeline class with its
    scheduler; an adapter is then loaded with the pipeline's `load_lora_weights`. A control run's input layer is
    then widened and loaded from `control_input.safetensors` (see vidtune/control.py); sample it within
    `run.control.given(latents)`. `ema`: the weights' moving average (None: when the run has one, as its
    validation samples did). `embedded_guidance`: the scale a guidance embedding (HunyuanVideo) is told (None: a
    range student's `distillation.guidance_scale`, else the model's `model.guidance_scale`).

        run = load_pipeline("outputs/my-lora")
        video = run.pipeline(prompt="a dog running on a beach", num_frames=49, height=512, width=768).frames[0]
    """
    run = Path(run_dir)
    config_path = run / outputs.RESOLVED_CONFIG
    if not config_path.is_file():
        raise VidtuneError(f"{run} is not the folder of a vidtune run: it has no {outputs.RESOLVED_CONFIG}.\n"
                           f"What to do: give a run's output_dir (the folder holding {outputs.RESOLVED_CONFIG} and "
                           f"{outputs.LORA_WEIGHTS} or {outputs.TRANSFORMER_FOLDER}/).")
    config = load_config(config_path)
    weights, adapter = run_weights(run, ema)
    model = config.model
    if not adapter:  # the trained transformer replaces the base one; everything else comes from model.pretrained
        trained = {"transformer": str(weights)}
        second = run / weights.name.replace("transformer", "transformer_2", 1)  # a second denoiser's folder
        if second.is_dir():
            trained["transformer_2"] = str(second)
        # The trained weights replace a base read from a single file too (model.transformer_file).
        single_files = {f"{name}_file": None for name in trained}
        model = model.model_copy(update={"subfolders": {**model.subfolders, **trained}, **single_files})
    embedded = embedded_guidance_scale(config, embedded_guidance)
    if embedded is not None:  # the spec tells the denoiser's guidance embedding `model.guidance_scale`
        model = model.model_copy(update={"guidance_scale": embedded})
    spec = get_spec_class(model.name)(model, frame_rate=config.frame_rate,
                                     text_encoder_weights=config.memory.text_encoder_weights,
                                     vae_tiling=config.memory.vae_tiling)
    spec.check_source()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = parse_device(str(device), "--device") if not isinstance(device, torch.device) else device
    denoiser = spec.load_denoiser(device).requires_grad_(False).eval()
    if embedded_guidance is not None and not denoiser.config.get("guidance_embeds", False):
        raise VidtuneError(f"--embedded-guidance: {spec.name} has no guidance embedding.\nWhat to do: leave it out; "
                           "--guidance sets the classifier-free guidance scale.")
    vae = spec.load_vae(device)
    pipeline = spec.pipeline(spec.load_text(device), vae, denoiser)
    if traits_of(config).in_context:  # sampled with reference clips: the adapter loads into the in-context pipeline
        pipeline = spec.in_context_pipeline(pipeline)
    if traits_of(config).learns_sampling_steps:  # the sigmas the student learnt (vidtune/schedulers.py)
        pipeline.scheduler = student_scheduler(pipeline.scheduler, config.distillation.sigma_shift)
    if adapter:
        spec.load_lora(pipeline, run, weights.name)
    averaged = weights.name in (outputs.LORA_EMA_WEIGHTS, outputs.TRANSFORMER_EMA_FOLDER)
    widened = spec.control_target(denoiser, pipeline)  # what the pipeline calls (several parts: their holder)
    control = load_control(spec, widened, run, ema=averaged) if has_control(run) else None
    return RunPipeline(pipeline, spec, config, weights, device, control, vae)


def check_sample_shape(spec: ModelSpec, settings: SampleSettings) -> None:
    """The model's shape rule, in the words of `vidtune sample`'s options."""
    try:
        spec.check_video_shape(settings.frames, settings.height, settings.width)
    except ConfigError as error:
        lines = [line for line in str(error).replace("data.", "--").splitlines()
                 if not line.startswith("What to do")]
        raise ConfigError("\n".join([*lines, "What to do: pass the nearest valid values above as --frames, "
                                     "--height, --width."])) from None


def sample_run(run: RunPipeline, prompt: str, output: Path, *, image: Path | None = None,
               latents: Path | None = None, control: Path | None = None, progress: bool = False,
               last_frame: Path | None = None, extend: Path | None = None, inpaint: Path | None = None,
               mask: Path | None = None, **overrides: Any) -> Path:
    """One sample of `run` into `output` (mp4, + .png, + .txt; + `latents`). `overrides`: SampleSettings fields
    (num_inference_steps, guidance_scale, seed, frames, height, width); the rest are the run's validation
    settings. An image-to-video family starts from `image`, else from the run's first clip (as validation); a
    control run follows the control clip `control`, else the run's first clip's control clip (as validation). A
    conditioning mode (a family with `conditioning_modes`, model.conditioning): `image` with `last_frame`
    (first-last), `last_frame`, `extend` (a clip to extend) or `inpaint` (a clip whose region outside `mask`, else the
    configured rectangle, is kept). `progress`: a bar of the denoising steps."""
    spec, config = run.spec, run.config
    settings = SampleSettings.from_config(config, spec, default_prompt=prompt)
    settings = replace(settings, prompts=(prompt,), **{k: v for k, v in overrides.items() if v is not None})
    check_sample_shape(spec, settings)
    if progress:
        given = [f"--{key}" for key in ("frames", "height", "width") if overrides.get(key) is not None]
        origin = validation_shape(config)[1] if not given else \
            f"{' '.join(given)}" + ("" if len(given) == 3 else f"; the rest from {validation_shape(config)[1]}")
        print(f"{describe_samples(settings, origin)}.", flush=True)
    reference = None
    given = given_from_files(spec, config, settings.frames, settings.height, settings.width, image=image,
                             last_frame=last_frame, extend=extend, inpaint=inpaint, mask=mask)
    if given is not None:
        image = None  # the mode's inputs replace the first frame
    if image is not None:
        if not spec.samples_from_image:
            raise VidtuneError(f"--image: {spec.name} generates from text alone; it takes no image.\n"
                               "What to do: leave out --image.")
        reference = read_image(image, settings.height, settings.width)
    elif spec.image_to_video and given is None:
        try:  # the run's first sample, as validation takes it (the sources in order; nothing probed)
            clips = read_sources(config.data).clips
            reference = reference_clip(spec, clips, settings, fps=config.data.fps)
        except (VidtuneError, OSError, IndexError):
            raise VidtuneError(f"{spec.name} generates from a first frame: without --image it starts from the "
                               "run's first clip, but the run's data (its config's data section) cannot be read.\n"
                               "What to do: pass --image PNG.") from None
        print(f"Starting from the first frame of {clips[0].video} (the run's first clip; --image to choose).",
              flush=True)
    # A family whose pipeline's conditioning video is the control clip (Wan VACE); one that takes it among its own
    # inputs (Wan Animate's pose) reads it with them below.
    if spec.reads_control_clip and spec.control_input_kind is None:
        reference = family_control_clip(run, settings, control)
        control = None
    controlled = contextlib.nullcontext()
    inputs = None
    if spec.sampling_inputs:  # the pipeline's own inputs (Wan Animate's pose and face): the run's first clip's
        given_pose = checked_control(control) if spec.reads_control_clip and spec.control_input_kind else None
        inputs = clip_sampling_inputs(spec, first_clip(run), settings, config.data.fps, control=given_pose)
        if image is not None and inputs:  # --image is the character image, over the first clip's reference image
            inputs = {kind: value for kind, value in inputs.items() if kind != "reference_images"} or None
        if inputs:
            named = " and ".join(kind.replace("_", " ") for kind in inputs)
            print(f"Following the {named} of the run's first clip"
                  + (f" (the {spec.control_input_kind} from --control)" if given_pose is not None else "") + ".",
                  flush=True)
        if spec.reads_control_clip:
            control = None
    in_context = traits_of(config).in_context
    if control is not None and run.control is None and not in_context:
        raise VidtuneError(f"--control: {run.weights} was not trained with control clips (training.algorithm "
                           f"{config.training.algorithm}).\nWhat to do: leave out --control, or sample a run of "
                           "control-lora, control-full or in-context-lora.")
    if run.control is not None:
        controlled = run.control.given(run_control_latents(run, settings, control))
    pipeline = run.pipeline
    if in_context:  # the reference clip read as training read it, given to every call of the in-context pipeline
        factor = control_downscale(config)
        source, processor = run_control_source(run, control)
        clip = read_reference(source, settings.frames, settings.height, settings.width, factor, fps=config.data.fps,
                              resize=config.data.resize, processor=processor)
        pipeline = referenced(spec, run.pipeline, clip, factor, config.control.attention_strength)
    pipeline.set_progress_bar_config(disable=not progress, desc="denoising", dynamic_ncols=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    with controlled:
        return render_sample(spec, pipeline, prompt, settings, settings.seed, output, reference=reference,
                             bf16=run.bf16, latents_path=latents, given=given, inputs=inputs)


def checked_control(control: Path | None) -> Path | None:
    """`--control`, refused when it names no file."""
    if control is not None and not Path(control).is_file():
        raise VidtuneError(f"--control: {control} is not a file.\nWhat to do: give the path of a video clip.")
    return control


def first_clip(run: RunPipeline) -> Clip | None:
    """The run's first sample (the sources in order; nothing probed), or None when its data cannot be read."""
    try:
        return read_sources(run.config.data).clips[0]
    except (VidtuneError, OSError, IndexError):
        return None


def run_control_latents(run: RunPipeline, settings: SampleSettings, control: Path | None) -> torch.Tensor:
    """The latents of the control clip a control run samples from: `control`, or the run's first clip's."""
    control, processor = run_control_source(run, control)
    data = run.config.data
    return encode_control(run.spec, run.vae, Path(control), settings.frames, settings.height, settings.width,
                          fps=data.fps, resize=data.resize, processor=processor)


def run_control_source(run: RunPipeline, control: Path | None) -> tuple[Path, ProcessorChoice | None]:
    """(the clip a control run's sample follows: `control`, or the run's first clip's control clip; the processor
    that computes the control from it, when the run computed its controls)."""
    data = run.config.data
    processor = configured_processor(run.config)  # the run computed its controls: --control is their source
    if control is None:
        try:
            first = with_reference_controls(run.config, read_sources(data).clips[:1])[0]
            control = first.video if processor is not None else first.control
        except (VidtuneError, OSError, IndexError):
            control = None
        if control is None:
            raise VidtuneError(f"{run.spec.name} follows a control clip: without --control it takes the run's "
                               "first clip's control clip, but the run's data cannot be read.\nWhat to do: pass "
                               "--control CLIP.")
        print(f"Following the control clip {control} (the run's first clip's; --control to choose).", flush=True)
    elif not Path(control).is_file():
        raise VidtuneError(f"--control: {control} is not a file.\nWhat to do: give the path of a video clip.")
    return Path(control), processor


def family_control_clip(run: RunPipeline, settings: SampleSettings, control: Path | None) -> torch.Tensor:
    """The control clip a family that `reads_control_clip` samples from: `control`, or the run's first clip's."""
    source, _ = run_control_source(run, control)
    return control_clip(run.spec, source, settings, fps=run.config.data.fps, resize=run.config.data.resize)


def next_sample_path(run_dir: Path) -> Path:
    """`run_dir/samples/sample-NNN.mp4`, the first number not taken."""
    folder = run_dir / outputs.SAMPLES
    number = 1
    while (folder / f"sample-{number:03d}.mp4").exists():
        number += 1
    return folder / f"sample-{number:03d}.mp4"
