"""LoRA: low-rank adapters on the denoiser; the base weights stay frozen."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers.training_utils import cast_training_params
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn

from vidtune.errors import ConfigError
from vidtune.export.comfyui import ComfyUIExportError, save_comfyui_lora
from vidtune.memory import store_frozen_weights_in_fp8
from vidtune.outputs import COMFYUI_LORA_WEIGHTS
from vidtune.trainers.base import Trainer


class LoRATrainer(Trainer):
    algorithm = "lora"
    resume_fixed_keys = ("lora.rank", "lora.alpha", "lora.target_modules")

    def lora_config(self) -> LoraConfig:
        options = self.config.lora
        return LoraConfig(
            r=options.rank,
            lora_alpha=options.alpha,
            lora_dropout=options.dropout,
            init_lora_weights=True,
            target_modules=list(options.target_modules or self.spec.default_lora_targets),
        )

    def configure_trainable(self, denoiser: nn.Module) -> list[nn.Parameter]:
        denoiser.requires_grad_(False)
        if self.config.memory.fp8_base_weights:
            store_frozen_weights_in_fp8(denoiser)
        try:
            denoiser.add_adapter(self.lora_config())
        except ValueError as error:
            raise ConfigError(
                f"lora.target_modules: {error}\nUse module names of the denoiser, e.g. "
                f"{', '.join(self.spec.default_lora_targets)}."
            ) from None
        # Adapters train in fp32 even when the frozen base runs in bf16.
        cast_training_params(denoiser, dtype=torch.float32)
        return [p for p in denoiser.parameters() if p.requires_grad]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return get_peft_model_state_dict(self.denoiser)

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        result = set_peft_model_state_dict(self.denoiser, state)
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise ValueError(f"checkpoint has weights this adapter does not: {unexpected[:5]}")

    def save_final(self, folder: Path) -> Path:
        metadata = self.lora_config().to_dict()
        metadata["target_modules"] = sorted(metadata["target_modules"])
        state = self.trainable_state_dict()
        written = self.spec.save_lora(folder, state, metadata)
        self.save_comfyui(folder, state)
        return written

    def export_weights(self, weights: dict[str, torch.Tensor], output: Path) -> Path:
        """A checkpoint holds the adapter exactly as `save_final` writes it: no base model needed."""
        metadata = self.lora_config().to_dict()
        metadata["target_modules"] = sorted(metadata["target_modules"])
        written = self.spec.save_lora(output, weights, metadata)
        self.save_comfyui(output, weights)
        return written

    def save_comfyui(self, folder: Path, state: dict[str, torch.Tensor]) -> Path | None:
        """The same adapter for ComfyUI, beside the diffusers file. An adapter the ComfyUI layout cannot hold
        (a target without an original name) is reported, not fatal: the diffusers file is the run's result."""
        try:
            return save_comfyui_lora(self.spec, folder, state, self.config.lora.alpha)
        except ComfyUIExportError as error:
            print(f"{COMFYUI_LORA_WEIGHTS} was not written: {error}", flush=True)
            return None
