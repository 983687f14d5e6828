"""`vidtune export`: turn a checkpoint into what a finished run writes (LoRA adapter or transformer folder, and with
`training.ema_decay` the weights' moving average beside it), or a LoRA into the ComfyUI format (`comfyui.py`).

A run stopped early (Ctrl+C, a preempted node, a crash) is then still usable: the result is the same file
or folder `save_final` writes at the end of a run, from the checkpoint's own config, which is written beside it
(`config.yaml`, unless the folder holds one) so that `vidtune sample FOLDER` samples it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch
import yaml
from safetensors.torch import load_file

from vidtune import checkpoint as checkpoints
from vidtune.algorithms import traits_of
from vidtune.algorithms.build import build_part, build_spec
from vidtune.algorithms.lora import base_weights_for
from vidtune.config import load_config, write_resolved_config
from vidtune.errors import CheckpointError
from vidtune.export.comfyui import save_comfyui_lora
from vidtune.export.workflow_file import newest_sample_prompt, write_run_workflow
from vidtune.files import check_writable
from vidtune.outputs import (
    CHECKPOINTS,
    FINAL_OUTPUTS,
    LORA_WEIGHTS,
    LORA_WEIGHTS_2,
    RESOLVED_CONFIG,
    comfyui_lora_weights,
)
from vidtune.resume import find_checkpoint

Format = Literal["diffusers", "comfyui"]
FORMATS: tuple[Format, ...] = ("diffusers", "comfyui")


def export_checkpoint(checkpoint: str | os.PathLike[str], output: str | os.PathLike[str],
                      overwrite: bool = False, format: Format = "diffusers") -> Path:
    """Write the final weights of `checkpoint` (a checkpoint folder, or a run folder: its newest) into `output`.

    `format="comfyui"` writes only the ComfyUI LoRA file; given a finished LoRA run's folder, it converts the
    run's final adapter (`pytorch_lora_weights.safetensors`), which is newer than any of its checkpoints. The
    ComfyUI file is named after the run (`<run>_comfyui.safetensors`), a checkpoint's after the run and the step
    (`<run>_step-00000500_comfyui.safetensors`)."""
    if format not in FORMATS:
        raise CheckpointError(f"--format {format}: unknown format.\nWhat to do: choose one of {', '.join(FORMATS)}.")
    output = Path(output)
    run = Path(checkpoint).expanduser()
    finished = [run / name for name in (LORA_WEIGHTS, LORA_WEIGHTS_2) if (run / name).is_file()]
    if format == "comfyui" and finished and (run / RESOLVED_CONFIG).is_file():
        config_file, weights_file = run / RESOLVED_CONFIG, finished[0]
        name = run.resolve().name
    else:
        folder = find_checkpoint(checkpoint)
        config_file, weights_file = folder / checkpoints.CONFIG, None
        name = f"{run_name(folder)}_{folder.name}"
    comfyui_names = (comfyui_lora_weights(name), comfyui_lora_weights(name, second=True))
    names = comfyui_names if format == "comfyui" else (*FINAL_OUTPUTS, *comfyui_names)
    existing = [name for name in names if (output / name).exists()]
    if existing and not overwrite:
        raise CheckpointError(f"{output} already holds {', '.join(existing)}; nothing was written. Choose another "
                              "--output, or add --overwrite to replace it.")
    config = load_config(config_file, [f"output_dir={output}"])
    traits = traits_of(config)
    # A LoRA run, or a distillation whose student is an adapter.
    if format == "comfyui" and not traits.trains_adapter:
        raise CheckpointError(
            f"{checkpoint} is a {config.training.algorithm} fine-tune; --format comfyui converts LoRA adapters.\n"
            "What to do: export it without --format (it writes transformer/), or export a LoRA run."
        )
    try:
        weights = run_adapters(finished) if weights_file is not None else checkpoints.load(folder)[0]
        ema = checkpoints.load_ema(folder) if weights_file is None else None
    except (OSError, RuntimeError, ValueError) as error:
        raise CheckpointError(f"Could not read {weights_file or folder}: {error}\n"
                              "What to do: export another checkpoint of the run, or the run's folder.") from None
    check_writable(output, "--output")
    spec = build_spec(config)
    if format == "comfyui":
        written = save_comfyui_lora(spec, output, weights, config.lora.alpha, name, rank=config.lora.rank,
                                    base=base_weights_for(spec, weights))
        write_run_workflow(spec, config, output, name, prompt=sample_prompt(run, weights_file))
        return written
    written = build_part(config, spec).export(weights, output, ema, name)
    if traits.trains_adapter:
        write_run_workflow(spec, config, output, name, prompt=sample_prompt(run, weights_file))
    if not (output / RESOLVED_CONFIG).is_file():  # what `vidtune sample` reads to sample them; a run's own is kept
        write_resolved_config(config, output)
    return written


def sample_prompt(given: Path, weights_file: Path | None) -> str | None:
    """The prompt of the newest validation sample of the run being exported (`given`: its folder, or one of its
    checkpoints), which its workflow samples when the config names no validation prompt."""
    folder = given.resolve()
    if weights_file is None and folder.parent.name == CHECKPOINTS:
        folder = folder.parent.parent
    return newest_sample_prompt(folder)


def run_name(checkpoint: Path) -> str:
    """The name of the run a checkpoint folder belongs to: the folder holding its `checkpoints/` folder, or (a
    checkpoint moved elsewhere) the `output_dir` its config names."""
    folder = checkpoint.resolve()
    if folder.parent.name == CHECKPOINTS:
        return folder.parent.parent.name
    try:
        output_dir = yaml.safe_load((folder / checkpoints.CONFIG).read_text()).get("output_dir")
    except (OSError, yaml.YAMLError, AttributeError):
        output_dir = None
    return Path(output_dir).name if isinstance(output_dir, str) and output_dir else folder.name


def run_adapters(files: list[Path]) -> dict[str, torch.Tensor]:
    """A finished run's adapter files as one state dict: a second denoiser's file (`LORA_WEIGHTS_2`, Wan 2.2's
    low-noise expert) under `transformer_2.` keys, as a checkpoint of that run holds them."""
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        tensors = load_file(path)
        if path.name == LORA_WEIGHTS_2:
            tensors = {"transformer_2." + key.removeprefix("transformer."): value for key, value in tensors.items()}
        weights.update(tensors)
    return weights
