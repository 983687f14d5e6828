"""The files a family's adapters and weights live in: which modules LoRA adapts, the adapter file its pipeline's
`load_lora_weights` reads (and loading it back), the adapters `lora.init_from` starts from, a full fine-tune's
denoiser folders, and the names ComfyUI loads (see vidtune/export/comfyui.py)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file
from torch import nn

from vidtune.algorithms.adapters import LORA, add_saved_adapter, file_settings, kind_of
from vidtune.errors import ConfigError
from vidtune.export.comfyui import Rule
from vidtune.export.comfyui_models import ComfyUIModel
from vidtune.export.comfyui_workflow import WorkflowLayout
from vidtune.files import INCOMPLETE, follow_umask
from vidtune.models.spec.base import SpecBase
from vidtune.outputs import LORA_WEIGHTS, TRANSFORMER_FOLDER
from vidtune.storage.digests import stamp_digest
from vidtune.storage.faults import storage_faults

# LoRA target presets (`lora.target_modules: attention`): module-name suffixes, as peft matches them (a name matches
# every module whose path ends with it). A family declares its own where its denoiser names modules otherwise.
ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
# The text stream's projections of joint (MM-DiT) attention, which `to_q`... do not reach.
JOINT_ATTENTION_TARGETS = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
FEED_FORWARD_TARGETS = ("ff.net.0.proj", "ff.net.2")
# Every nn.Linear of the denoiser: resolved against the model when the adapter is added.
ALL_LINEAR = "all-linear"


class Formats(SpecBase):
    """What LoRA adapts and the files a run's weights are written to, in the formats the family's tools read."""

    # Named sets of LoRA targets (`lora.target_modules: attention+ffn`); `default_lora_preset` is used when unset.
    lora_presets: ClassVar[dict[str, tuple[str, ...]]] = {
        "attention": ATTENTION_TARGETS,
        "attention+ffn": ATTENTION_TARGETS + FEED_FORWARD_TARGETS,
        ALL_LINEAR: (ALL_LINEAR,),
    }
    default_lora_preset: ClassVar[str] = "attention"

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        """The module names LoRA adapts when `lora.target_modules` is unset."""
        return self.lora_presets[self.default_lora_preset]

    def lora_exclude_modules(self) -> list[str]:
        """Linear layers no LoRA preset may adapt (peft's `exclude_modules`): layers whose output the loss never
        sees, such as the text stream's output of a last joint block, which would break data-parallel training, and
        layers the model ComfyUI loads the family as has no name for (the adapter could not be exported)."""
        return []

    # ----- adapter and denoiser files -------------------------------------------------------------------------
    def save_lora(self, folder: Path, state_dict: dict[str, torch.Tensor], metadata: dict | None,
                  weight_name: str = LORA_WEIGHTS) -> Path:
        """Write the adapter (`folder/weight_name`) in the format the family's `load_lora_weights` reads."""
        # Written beside and renamed into place: a kill never leaves a cut-short adapter over a complete one.
        target = Path(folder) / weight_name
        with storage_faults(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent, prefix=INCOMPLETE) as scratch:
                written = Path(scratch) / weight_name
                self.pipeline_class.save_lora_weights(
                    scratch, transformer_lora_layers=state_dict, transformer_lora_adapter_metadata=metadata,
                    weight_name=weight_name,
                )
                stamp_digest(written)  # the digest of its tensors in its metadata: `vidtune checkpoint verify` reads it
                follow_umask(written)
                os.replace(written, target)
        return target

    def load_lora(self, pipeline: Any, folder: Path, weight_name: str = LORA_WEIGHTS) -> None:
        """A run's adapter into the family's pipeline (by default its `load_lora_weights`; a family with more than
        one denoiser loads each of its files)."""
        self.load_adapter_file(pipeline, Path(folder) / weight_name)

    def load_adapter_file(self, pipeline: Any, path: Path, component: str = "transformer") -> None:
        """One adapter file into the pipeline's denoiser `component`: a LoRA with the pipeline's own
        `load_lora_weights` (the path users take), a LoKr / LoHa through peft, as diffusers' `load_lora_weights` of
        the video pipelines reads LoRA files only (it refuses other keys as an invalid LoRA checkpoint)."""
        state = load_file(path)
        if kind_of(state) is LORA:
            extra = {"load_into_transformer_2": True} if component == "transformer_2" else {}
            pipeline.load_lora_weights(str(path.parent), weight_name=path.name, **extra)
            return
        prefix = "transformer."
        tensors = {key.removeprefix(prefix): value for key, value in state.items() if key.startswith(prefix)}
        add_saved_adapter(getattr(pipeline, component), tensors, file_settings(path, prefix))

    def initial_adapters(self, path: Path) -> dict[str, Path]:
        """`lora.init_from`: the adapter files to start from, by the prefix their keys take in the denoiser's
        adapter state dict (one denoiser: one file, no prefix; a family with several denoisers maps each to its
        file). Raises ConfigError when `path` is not what the family takes."""
        if not path.is_file():
            raise ConfigError(f"lora.init_from: {path} is not a file.\nWhat to do: give the path of an adapter file "
                              f"(e.g. another run's {LORA_WEIGHTS}).")
        return {"": path}

    def denoiser_folders(self, denoiser: nn.Module) -> dict[str, nn.Module]:
        """Where a full fine-tune's denoiser is saved in a run folder, by folder name (a model with several
        denoisers names one folder per denoiser, as its pipeline's components)."""
        return {TRANSFORMER_FOLDER: denoiser}

    # ----- ComfyUI ------------------------------------------------------------------------------------------
    def comfyui_lora_rules(self) -> list[Rule]:
        """How the family's diffusers modules are named in its original checkpoint, which is what ComfyUI loads
        (see vidtune/export/comfyui.py): one `Rule` per module pattern, fused layers with their parts' sizes
        (read them from the transformer config). Empty: the family has no ComfyUI file."""
        return []

    def comfyui_model(self) -> ComfyUIModel | None:
        """The model of ComfyUI's core that runs this family (vidtune/export/comfyui_models.py), whose LoRA names
        every ComfyUI file is checked against; None: ComfyUI's core has no model for it, and no file is written."""
        return None

    def comfyui_workflow(self) -> WorkflowLayout | None:
        """The ComfyUI workflow written beside the family's ComfyUI LoRA (vidtune/export/comfyui_workflow.py): its
        model files and node layout; None: vidtune has no workflow for it yet (the LoRA file is still written)."""
        return None

    def comfyui_absent(self) -> str:
        """Why the family has no ComfyUI file, and what loads its LoRA in ComfyUI instead."""
        return f"ComfyUI's core has no {self.name} model."
