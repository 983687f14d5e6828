"""What a run leaves in its `output_dir`, by name: the one place these file names are spelled."""

from __future__ import annotations

from pathlib import Path

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # the name diffusers' `load_lora_weights` looks for
COMFYUI_LORA_WEIGHTS = "pytorch_lora_weights_comfyui.safetensors"  # the same LoRA for ComfyUI's LoRA loaders
TRANSFORMER_FOLDER = "transformer"  # full fine-tuning: the denoiser in its family's diffusers layout
# With `training.ema_decay`: the moving average of the trained weights, beside them, in the same format.
LORA_EMA_WEIGHTS = "pytorch_lora_weights_ema.safetensors"
TRANSFORMER_EMA_FOLDER = "transformer_ema"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
LOSS_PLOT = "loss.png"
DATASET_OVERVIEW = "dataset_overview.png"
SAMPLES = "samples"
RESOLVED_CONFIG = "config.yaml"
TENSORBOARD = "tensorboard"  # event files, when logging.tensorboard is on

# What shows that a run finished in a folder (one per algorithm's result).
FINAL_OUTPUTS = (LORA_WEIGHTS, TRANSFORMER_FOLDER)


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS
