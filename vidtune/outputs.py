"""What a run leaves in its `output_dir`, by name: the one place these file names are spelled."""

from __future__ import annotations

from pathlib import Path

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # the name diffusers' `load_lora_weights` looks for
# A second denoiser's adapter (Wan 2.2's low-noise expert, `load_lora_weights(..., load_into_transformer_2=True)`).
LORA_WEIGHTS_2 = "pytorch_lora_weights_transformer_2.safetensors"
TRANSFORMER_FOLDER = "transformer"  # full fine-tuning: the denoiser in its family's diffusers layout
# With `training.ema_decay`: the moving average of the trained weights, beside them, in the same format.
LORA_EMA_WEIGHTS = "pytorch_lora_weights_ema.safetensors"
LORA_EMA_WEIGHTS_2 = "pytorch_lora_weights_ema_transformer_2.safetensors"
TRANSFORMER_EMA_FOLDER = "transformer_ema"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
LOSS_PLOT = "loss.png"
EVAL_PLOT = "eval_loss.png"  # the held-out score over steps (validation.eval_clips)
DATASET_OVERVIEW = "dataset_overview.png"
# `vidtune data check`'s overview in a folder a run trained in (the run's own is kept as it trained).
DATA_CHECK_OVERVIEW = "data_check_overview.png"
SAMPLES = "samples"
SAMPLES_BY_STEP = "samples_by_step.png"  # every validation's samples side by side, one column per training step
RESOLVED_CONFIG = "config.yaml"
TENSORBOARD = "tensorboard"  # event files, when logging.tensorboard is on

# What shows that a run finished in a folder (one per algorithm's result).
FINAL_OUTPUTS = (LORA_WEIGHTS, LORA_WEIGHTS_2, TRANSFORMER_FOLDER)


def comfyui_lora_weights(name: str, second: bool = False) -> str:
    """The same LoRA for ComfyUI's LoRA loaders, named after its run (`name`: the run folder's name), so the files
    of several runs can sit side by side in ComfyUI's loras folder; `second`: a second denoiser's (Wan 2.2's
    low-noise expert)."""
    return f"{name}{'_transformer_2' if second else ''}_comfyui.safetensors"


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS
