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

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict
from torch import nn

from vidtune.algorithms.full import FullPart
from vidtune.algorithms.lora import LoRAPart
from vidtune.algorithms.part import AlgorithmPart, Wrapping
from vidtune.control import CONTROL_EMA_WEIGHTS, ControlInput, ExpertsControlInput, attach_control, encode_control
from vidtune.ema import EMA
from vidtune.errors import ConfigError, DataError
from vidtune.outputs import LORA_EMA_WEIGHTS, LORA_WEIGHTS, TRANSFORMER_EMA_FOLDER, TRANSFORMER_FOLDER
from vidtune.processors import configured_processor, opencv
from vidtune.sampling import SampleSettings

if TYPE_CHECKING:
    from vidtune.config import Config
    from vidtune.data.sources import Clip
    from vidtune.objectives import Objective

# How a checkpoint of `control-lora` names the widened layer's weights beside the adapter's.
CONTROL_PREFIX = "control_input."


def check_control_clips(config: Config, algorithm: str, clips: Sequence[Clip]) -> None:
    """Every sample has a control clip, or `control.processor` computes them (and no clip names one)."""
    processor = configured_processor(config)
    if processor is not None:
        opencv()  # a missing library fails here, before any long work
        listed = [clip for clip in clips if clip.control is not None]
        if listed:
            raise ConfigError(f"control.processor: {processor[0]} computes the control clips, but the dataset "
                              f"also names control clips ({listed[0].where} and {len(listed) - 1} more).\n"
                              "What to do: remove the control list (controls.txt, control_column) or unset "
                              "control.processor.")
        return
    missing = [clip for clip in clips if clip.control is None]
    if missing:
        raise DataError(
            [f"{clip.where} ({clip.video.name}) has no control clip." for clip in missing],
            hint=f"{algorithm} needs a control clip for every sample: a `controls.txt` beside `videos.txt` (one "
            "control clip a line, in the same order), or `control_column` in a metadata dataset (see "
            "docs/algorithms.md).",
        )


class ControlPart(Wrapping):
    """The control input on top of the student's kind (`LoRAPart`: control-lora, `FullPart`: control-full)."""

    # The control clips a checkpoint's weights learnt from cannot change under it.
    own_fixed_keys = ("control.processor", "control.canny_low", "control.canny_high")

    def __init__(self, inner: AlgorithmPart) -> None:
        super().__init__(inner)
        self._control: ControlInput | ExpertsControlInput | None = None
        if isinstance(inner, LoRAPart):
            inner.trained_fully = (self.spec.control_input_layer,)

    @property
    def control(self) -> ControlInput | ExpertsControlInput:
        """The widened input layer(s) and their hook, once `configure` attached them."""
        if self._control is None:
            raise RuntimeError("the control input is attached by configure(denoiser)")
        return self._control

    def control_given(self, latents: torch.Tensor) -> contextlib.AbstractContextManager[None]:
        return self.control.given(latents)

    def check(self, clips: Sequence[Clip], objective: Objective, resuming: bool) -> None:
        """Every sample has a control clip (or `control.processor` computes them), before anything long."""
        self.inner.check(clips, objective, resuming)
        check_control_clips(self.config, self.traits.name, clips)

    def configure(self, denoiser: nn.Module, resuming: bool = False) -> list[nn.Parameter]:
        # Widened first, so `full.*` patterns and the state dicts see the layer under its own name.
        self._control = control = attach_control(self.spec, denoiser)
        if isinstance(self.inner, LoRAPart):
            # The widened layers by their names in the denoiser (each expert's, for two): never adapted nor quantized.
            self.inner.trained_fully = tuple(control.layers())
        parameters = self.inner.configure(denoiser, resuming)
        known = {id(p) for p in parameters}
        for layer in control.layers().values():
            if isinstance(layer, BaseTunerLayer):
                raise ConfigError(f"lora.target_modules: the adapter would wrap {control.layer_name}, the input "
                                  f"layer {self.traits.name} trains fully.\nWhat to do: choose targets without it "
                                  "(e.g. the `attention` preset).")
            # The widened layer trains fully, in fp32 like every trained weight.
            layer.float().requires_grad_(True)
            parameters = parameters + [p for p in layer.parameters() if id(p) not in known]
        return parameters

    def state_dict(self) -> dict[str, torch.Tensor]:
        if not isinstance(self.inner, LoRAPart):  # a full fine-tune's state dict holds the widened layer already
            return self.inner.state_dict()
        control = {CONTROL_PREFIX + key: value for key, value in self.control.state_dict().items()}
        return {**get_peft_model_state_dict(self.denoiser), **control}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if not isinstance(self.inner, LoRAPart):
            self.inner.load_state_dict(state)
            return
        control = {k.removeprefix(CONTROL_PREFIX): v for k, v in state.items() if k.startswith(CONTROL_PREFIX)}
        self.control.load_state_dict(control)
        self.inner.load_state_dict({k: v for k, v in state.items() if not k.startswith(CONTROL_PREFIX)})

    def save_final(self, folder: Path, ema: EMA | None, name: str | None = None) -> Path:
        """LoRA: the adapter (no ComfyUI file: ComfyUI's LoRA loaders cannot widen the input) and the control
        input. Full: `transformer/` with the input layer's base part (so the base class loads it), and the control
        input. With `training.ema_decay` their moving averages beside them (`..._ema`). Two experts:
        `transformer_2/` (`transformer_2_ema/`) and the low-noise expert's control files too."""
        folder = Path(folder)
        inner = self.inner
        dtype = inner.base_dtype if isinstance(inner, FullPart) else None
        written = self.save_weights(folder, ema=False)
        self.control.save(folder, dtype=dtype)
        if ema is not None:
            with ema.applied():
                self.save_weights(folder, ema=True)
                self.control.save(folder, dtype=dtype, name=CONTROL_EMA_WEIGHTS)
        return written

    def save_weights(self, folder: Path, ema: bool) -> Path:
        """The student's weights without the widened layer: the adapter, or each denoiser folder of the spec
        (`transformer/`, or its `_ema`) with the input layer cut back to the base model's inputs."""
        inner = self.inner
        if isinstance(inner, LoRAPart):
            return self.spec.save_lora(folder, get_peft_model_state_dict(self.denoiser), inner.adapter_metadata(),
                                       LORA_EMA_WEIGHTS if ema else LORA_WEIGHTS)
        assert isinstance(inner, FullPart)
        with self.control.narrowed():
            written = []
            for part, module in self.spec.denoiser_folders(self.denoiser).items():
                target = (TRANSFORMER_EMA_FOLDER if part == TRANSFORMER_FOLDER else f"{part}_ema") if ema else part
                written.append(inner.save_transformer(folder / target, module))
        return written[0]

    def export(self, weights: dict[str, torch.Tensor], output: Path, ema: dict[str, torch.Tensor] | None = None,
               name: str | None = None) -> Path:
        """A checkpoint's weights need the widened layer: the denoiser set up as for training, then `save_final`."""
        return AlgorithmPart.export(self, weights, output, ema, name)

    @contextlib.contextmanager
    def sampling(self, pipeline: Any, vae: nn.Module, clips: Sequence[Clip]) -> Iterator[Any]:
        """Validation samples take the first dataset clip's control clip (or, with `control.processor`, its
        processed first clip)."""
        settings = SampleSettings.from_config(self.config, self.spec, default_prompt=clips[0].caption)
        processor = configured_processor(self.config)
        source = clips[0].video if processor is not None else clips[0].control
        latents = encode_control(self.spec, vae, source, settings.frames, settings.height, settings.width,
                                 fps=self.config.data.fps, resize=self.config.data.resize, processor=processor)
        with self.inner.sampling(pipeline, vae, clips) as inner, self.control.given(latents):
            yield inner
