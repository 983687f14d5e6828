"""`<run>_workflow.json`: the ComfyUI workflow of a run, written beside its ComfyUI LoRA files at the end of a run
and by `vidtune export --format comfyui` (the layout and nodes: comfyui_workflow.py).

It samples what the run's validation samples: `validation.prompts[0]` (else the prompt validation used: the first
caption, or the newest validation sample's prompt when exported), the validation shape, steps, guidance and seed,
the run's frame rate, and the schedule of `validation.comfyui_scheduler` / `comfyui_shift`. An image-to-video
workflow starts from `<run>_start_image.png`, the first frame validation started from, written beside it; a Wan VACE
workflow follows `<run>_control_video.mp4`, the control clip validation followed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from vidtune.config import Config
from vidtune.data.video import frames_to_uint8, write_video
from vidtune.export.comfyui_workflow import (
    PROMPT_PLACEHOLDER,
    WorkflowInputs,
    build_workflow,
    workflow_file,
    write_workflow,
)
from vidtune.files import atomic_path
from vidtune.models.spec import ModelSpec
from vidtune.outputs import SAMPLES, comfyui_lora_weights
from vidtune.sampling import SampleSettings, comfyui_schedule


def start_image_file(name: str) -> str:
    return f"{name}_start_image.png"


def control_video_file(name: str) -> str:
    return f"{name}_control_video.mp4"


def follows_control_video(spec: ModelSpec) -> bool:
    """A family whose workflow loads the control clip validation follows (Wan VACE; not Wan Animate's pose)."""
    return spec.reads_control_clip and spec.control_input_kind is None


def newest_sample_prompt(folder: Path) -> str | None:
    """The prompt of the newest validation sample in a run folder (its .txt beside the mp4), if any."""
    prompts = sorted((folder / SAMPLES).glob("*/*.txt"), key=lambda path: path.stat().st_mtime)
    return prompts[-1].read_text().strip() if prompts else None


def written_loras(folder: Path, name: str) -> tuple[str | None, str | None]:
    """The ComfyUI LoRA files of run `name` in `folder`, the first and the second denoiser's (None: not written)."""
    files = (comfyui_lora_weights(name), comfyui_lora_weights(name, second=True))
    first, second = (file if (folder / file).is_file() else None for file in files)
    return first, second


def write_start_image(path: Path, reference: torch.Tensor) -> Path:
    """The first frame of `reference` ([F, 3, H, W] in [-1, 1]) as a PNG."""
    pixels = frames_to_uint8(reference[:1])[0]  # [H, W, 3] uint8
    with atomic_path(path) as temporary:
        Image.fromarray(pixels).save(temporary, format="PNG")
    return path


def write_run_workflow(spec: ModelSpec, config: Config, folder: Path, name: str, prompt: str | None = None,
                       reference: torch.Tensor | None = None, left_out: tuple[str, ...] = ()) -> Path | None:
    """Write `folder/<name>_workflow.json` for the ComfyUI LoRA files of run `name` in `folder` (and with
    `reference` [F, 3, H, W], an image-to-video run's start image or Wan VACE's control video); say where, or why
    there is none, and which of validation's inputs (`left_out`: Wan VACE's mask, reference images) it does not
    load. Returns the workflow."""
    loras = written_loras(folder, name)
    if not any(loras):  # no ComfyUI LoRA was written (the run said why): nothing for a workflow to load
        return None
    layout = spec.comfyui_workflow()
    if layout is None:
        print(f"No ComfyUI workflow for {spec.name} yet: load the LoRA with LoraLoaderModelOnly in a workflow of "
              "your own (docs/comfyui.md).", flush=True)
        return None
    loras = loras[:max(1, len(layout.files.diffusion_models))]
    chosen = config.validation.prompts[0] if config.validation.prompts else prompt
    chosen = chosen or newest_sample_prompt(folder) or PROMPT_PLACEHOLDER
    settings = SampleSettings.from_config(config, spec, default_prompt=chosen)
    start = start_image_file(name) if spec.samples_from_image else ""
    control = control_video_file(name) if follows_control_video(spec) else ""
    if start and reference is not None:
        write_start_image(folder / start, reference)
    if control and reference is not None:
        write_video(folder / control, reference, settings.frame_rate)
    inputs = WorkflowInputs(prompt=settings.prompts[0], frames=settings.frames, height=settings.height,
                            width=settings.width, steps=settings.num_inference_steps,
                            guidance=settings.guidance_scale, seed=settings.seed, frame_rate=settings.frame_rate,
                            schedule=settings.comfyui or comfyui_schedule(config, spec), loras=loras,
                            start_image=start,
                            control_video=control, name=name)
    path = write_workflow(folder / workflow_file(name), build_workflow(layout, inputs, spec.name))
    image = ""
    for given, what in ((start, "image to start from"), (control, "control video")):
        if given:
            image += (f"; put {given} in ComfyUI/input" if (folder / given).is_file()
                      else f"; put the {what} in ComfyUI/input as {given}")
    print(f"Wrote the ComfyUI workflow: {path} (open it in ComfyUI with Workflow > Open; the LoRA files go in "
          f"ComfyUI/models/loras{image}).", flush=True)
    if left_out:
        print(f"The workflow follows the control video only: validation also used the first clip's "
              f"{' and '.join(kind.replace('_', ' ') for kind in left_out)}, which it does not load; add them to "
              "WanVaceToVideo (control_masks, reference_image) to see the same.", flush=True)
    return path
