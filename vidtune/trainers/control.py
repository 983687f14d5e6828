"""Control training: the denoiser also sees a control clip of each sample (edges, depth, a pose video...).

The control clip's latents (the same VAE, `Batch.latents["control_latents"]`) are concatenated to the noisy latents
along channels; the denoiser's input projection (`ModelSpec.control_input_layer`) is widened for them with zero
weights, so step 0 is the base model exactly (see vidtune/control.py). The widened layer trains fully; the rest
trains as LoRA (`control-lora`) or as a full fine-tune (`control-full`, `full.*` patterns).

What a run writes: `control-lora` the adapter (`pytorch_lora_weights.safetensors`), `control-full` the denoiser
(`transformer/`, its input layer cut back to the base model's inputs so any diffusers loader reads it), and both
`control_input.safetensors` (the whole widened layer) with `control.json` (which layer, how many inputs). Load
them with `vidtune.sampling.load_pipeline` or sample with `vidtune sample RUN --control CLIP`. Two experts (Wan 2.2
A14B): each expert's layer is widened and trained, and each expert's files are written as its adapter's are
(`..._transformer_2...` for the low-noise expert; `transformer_2/` for control-full).
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict
from torch import nn

from vidtune.control import CONTROL_EMA_WEIGHTS, ControlInput, ExpertsControlInput, attach_control, encode_control
from vidtune.errors import ConfigError, DataError
from vidtune.models.spec import CONTROL_LATENTS
from vidtune.outputs import LORA_EMA_WEIGHTS, TRANSFORMER_EMA_FOLDER, TRANSFORMER_FOLDER
from vidtune.processors import configured_processor, opencv
from vidtune.sampling import SampleSettings
from vidtune.trainers.base import NoisyInputs, Trainer
from vidtune.trainers.full import FullTrainer
from vidtune.trainers.lora import LoRATrainer

# How a checkpoint of `control-lora` names the widened layer's weights beside the adapter's.
CONTROL_PREFIX = "control_input."


class ControlTraining(Trainer):
    """What both control algorithms add to their base algorithm (listed first among the bases)."""

    control: ControlInput | ExpertsControlInput | None = None

    def check_inputs(self) -> None:
        super().check_inputs()
        processor = configured_processor(self.config)
        if processor is not None:
            opencv()  # a missing library fails here, before any long work
            listed = [clip for clip in [*self.clips, *self.eval_clips] if clip.control is not None]
            if listed:
                raise ConfigError(f"control.processor: {processor[0]} computes the control clips, but the dataset "
                                  f"also names control clips ({listed[0].where} and {len(listed) - 1} more).\n"
                                  "What to do: remove the control list (controls.txt, control_column) or unset "
                                  "control.processor.")
            return
        missing = [clip for clip in [*self.clips, *self.eval_clips] if clip.control is None]
        if missing:
            raise DataError(
                [f"{clip.where} ({clip.video.name}) has no control clip." for clip in missing],
                hint=f"{self.algorithm} needs a control clip for every sample: a `controls.txt` beside "
                "`videos.txt` (one control clip a line, in the same order), or `control_column` in a metadata "
                "dataset (see docs/algorithms.md).",
            )

    def configure_trainable(self, denoiser: nn.Module) -> list[nn.Parameter]:
        # Widened first, so `full.*` patterns and the state dicts see the layer under its own name.
        self.control = attach_control(self.spec, denoiser)
        parameters = super().configure_trainable(denoiser)
        known = {id(p) for p in parameters}
        for layer in self.control.layers().values():
            if isinstance(layer, BaseTunerLayer):
                raise ConfigError(f"lora.target_modules: the adapter would wrap {self.control.layer_name}, the input "
                                  f"layer {self.algorithm} trains fully.\nWhat to do: choose targets without it (e.g. "
                                  "the `attention` preset).")
            # The widened layer trains fully, in fp32 like every trained weight.
            layer.float().requires_grad_(True)
            parameters = parameters + [p for p in layer.parameters() if id(p) not in known]
        return parameters

    def export_weights(self, weights: dict[str, torch.Tensor], output: Path,
                       ema: dict[str, torch.Tensor] | None = None) -> Path:
        """A checkpoint's weights need the widened layer: the denoiser set up as for training, then `save_final`
        (the base class's, which also loads the moving average `ema`)."""
        return Trainer.export_weights(self, weights, output, ema)

    def clip_losses(self, inputs: NoisyInputs, denoiser: nn.Module | None = None) -> torch.Tensor:
        """The base losses, with the control latents (among the inputs' video-derived conditions) appended to the
        denoiser's input: in training and in the held-out score alike."""
        with self.control.given(inputs.conditions[CONTROL_LATENTS]):
            return super().clip_losses(inputs, denoiser)

    def validate(self) -> list[Path]:
        """Validation samples take the first dataset clip's control clip (or, with `control.processor`, its
        processed first clip)."""
        self.load_encoders()
        settings = SampleSettings.from_config(self.config, self.spec, default_prompt=self.clips[0].caption)
        processor = configured_processor(self.config)
        source = self.clips[0].video if processor is not None else self.clips[0].control
        latents = encode_control(self.spec, self.vae, source, settings.frames, settings.height, settings.width,
                                 fps=self.config.data.fps, resize=self.config.data.resize, processor=processor)
        with self.control.given(latents):
            return super().validate()


# The control clips a checkpoint's weights learnt from cannot change under it.
CONTROL_FIXED_KEYS = ("control.processor", "control.canny_low", "control.canny_high")


class ControlLoRATrainer(ControlTraining, LoRATrainer):
    algorithm = "control-lora"
    resume_fixed_keys = LoRATrainer.resume_fixed_keys + CONTROL_FIXED_KEYS

    @property
    def trained_fully(self) -> tuple[str, ...]:
        # The widened layers by their names in the denoiser (each expert's, for two).
        return tuple(self.control.layers()) if self.control is not None else (self.spec.control_input_layer,)

    def resolve_targets(self, module_names: list[str]) -> list[str]:
        # The widened input layer trains fully: `all-linear` adapts every other linear layer.
        return super().resolve_targets([name for name in module_names if name not in self.trained_fully])

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        control = {CONTROL_PREFIX + key: value for key, value in self.control.state_dict().items()}
        return {**get_peft_model_state_dict(self.denoiser), **control}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        control = {k.removeprefix(CONTROL_PREFIX): v for k, v in state.items() if k.startswith(CONTROL_PREFIX)}
        self.control.load_state_dict(control)
        super().load_trainable_state_dict({k: v for k, v in state.items() if not k.startswith(CONTROL_PREFIX)})

    def save_final(self, folder: Path) -> Path:
        """The adapter (no ComfyUI file: ComfyUI's LoRA loaders cannot widen the input) and the control input;
        with `training.ema_decay` their moving averages beside them."""
        written = self.spec.save_lora(folder, get_peft_model_state_dict(self.denoiser), self.adapter_metadata())
        self.control.save(Path(folder))
        if self.ema is not None:
            with self.ema.applied():
                self.spec.save_lora(folder, get_peft_model_state_dict(self.denoiser), self.adapter_metadata(),
                                    LORA_EMA_WEIGHTS)
                self.control.save(Path(folder), name=CONTROL_EMA_WEIGHTS)
        return written



class ControlFullTrainer(ControlTraining, FullTrainer):
    algorithm = "control-full"
    resume_fixed_keys = FullTrainer.resume_fixed_keys + CONTROL_FIXED_KEYS

    def save_final(self, folder: Path) -> Path:
        """`transformer/` with the input layer's base part (so the base class loads it), and the control input;
        with `training.ema_decay` their moving averages as `transformer_ema/` and `control_input_ema.safetensors`.
        Two experts: `transformer_2/` (`transformer_2_ema/`) and the low-noise expert's control files too."""
        written = self.save_narrowed(Path(folder))
        self.control.save(Path(folder), dtype=self.base_dtype)
        if self.ema is not None:
            with self.ema.applied():
                self.save_narrowed(Path(folder), ema=True)
                self.control.save(Path(folder), dtype=self.base_dtype, name=CONTROL_EMA_WEIGHTS)
        return written

    def save_narrowed(self, folder: Path, ema: bool = False) -> Path:
        """Each denoiser folder of the spec (`transformer/`, or its `_ema` with `ema`), the input layer cut back
        to the base model's inputs (its current weights), as `save_pretrained` writes it. Returns the first."""
        with self.control.narrowed():
            written = []
            for name, module in self.spec.denoiser_folders(self.denoiser).items():
                target = (TRANSFORMER_EMA_FOLDER if name == TRANSFORMER_FOLDER else f"{name}_ema") if ema else name
                written.append(self.save_transformer(folder / target, module))
        return written[0]
