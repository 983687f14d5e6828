"""Control input: a control clip's latents concatenated to the denoiser's input along channels.

The family's spec names the denoiser's input projection (`ModelSpec.control_input_layer`) and says how a control
latent ([B, C, F, H, W], the VAE's layout) is laid out like the denoiser's `hidden_states`
(`ModelSpec.pack_control`: the tensor and its channel dimension). `widen_input` gives that projection
`control_channels` more input channels whose weights start at zero, so the widened model computes exactly what
the base model computes until they train. A forward pre-hook on the denoiser (`ControlInput`) appends the control
latents to `hidden_states` on every call, after anything the family itself concatenates (an image-to-video first
frame), so training (`spec.forward`) and sampling (the family's pipeline) feed the widened layer alike.

On disk (a run's `output_dir`, beside its LoRA file or `transformer/` folder):
- `control.json`: {"format": 1, "family", "layer": the widened module's name, "in_features": its input size
  before widening, "control_channels": latent channels of the control clip, "control_in_features": the inputs
  added};
- `control_input.safetensors`: the widened layer's `weight` (and `bias`), all input channels.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vidtune.data.video import read_clip
from vidtune.errors import ConfigError, ModelError
from vidtune.files import atomic_path, atomic_write_text, follow_umask
from vidtune.processors import ProcessorChoice, apply_processor

CONTROL_CONFIG = "control.json"
CONTROL_WEIGHTS = "control_input.safetensors"
# With `training.ema_decay`: the widened layer's moving average, beside the averaged adapter / transformer.
CONTROL_EMA_WEIGHTS = "control_input_ema.safetensors"
CONTROL_FORMAT = 1


def input_layer(spec: Any, denoiser: nn.Module) -> nn.Module:
    """The module `spec.control_input_layer` names, or a ConfigError for a family without one."""
    name = spec.control_input_layer
    if name is None:
        raise ConfigError(f"training.algorithm: {spec.name} cannot take a control input: "
                          f"{spec.control_refusal}\nWhat to do: use training.algorithm lora or full for this family.")
    return denoiser.get_submodule(name)


def in_size(layer: nn.Module) -> int:
    return layer.in_features if isinstance(layer, nn.Linear) else layer.in_channels


def added_inputs(layer: nn.Module, base_channels: int, control_channels: int) -> int:
    """Inputs the layer gains: a Linear over packed patches (channels most significant) reads
    `in_features / channels` values per channel; a convolution one channel per channel."""
    if isinstance(layer, nn.Linear):
        return layer.in_features // base_channels * control_channels
    return control_channels


def widen(layer: nn.Module, extra: int, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of `layer` (Linear or Conv) with `extra` more inputs, appended last, their weights zero."""
    dtype = dtype or layer.weight.dtype
    factory = {"device": layer.weight.device, "dtype": dtype}
    has_bias = layer.bias is not None
    if isinstance(layer, nn.Linear):
        wider: nn.Module = nn.Linear(layer.in_features + extra, layer.out_features, bias=has_bias, **factory)
    elif isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        if layer.groups != 1:
            raise ModelError(f"the control input layer is a grouped convolution ({layer}), which cannot be widened.")
        wider = type(layer)(layer.in_channels + extra, layer.out_channels, layer.kernel_size, stride=layer.stride,
                            padding=layer.padding, dilation=layer.dilation, bias=has_bias,
                            padding_mode=layer.padding_mode, **factory)
    else:
        raise ModelError(f"the control input layer {type(layer).__name__} is neither a Linear nor a convolution.")
    with torch.no_grad():
        wider.weight.zero_()
        wider.weight[:, : in_size(layer)].copy_(layer.weight)
        if has_bias:
            wider.bias.copy_(layer.bias)
    return wider


def narrow(layer: nn.Module, size: int) -> nn.Module:
    """`layer` restricted to its first `size` inputs (the base model's), e.g. to save a loadable transformer."""
    copy = widen(layer, 0)
    if isinstance(copy, nn.Linear):
        copy.in_features = size
    else:
        copy.in_channels = size
    copy.weight = nn.Parameter(layer.weight.detach()[:, :size].clone(), requires_grad=False)
    return copy


def replace_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


class ControlInput:
    """The widened input layer of one denoiser and the hook that feeds it: `given(latents)` sets the control
    latents ([B, C, F, H, W]) the denoiser's calls within it see."""

    def __init__(self, spec: Any, denoiser: nn.Module, in_features: int, control_channels: int) -> None:
        self.spec = spec
        self.denoiser = denoiser
        self.layer_name: str = spec.control_input_layer
        self.in_features = in_features
        self.control_channels = control_channels
        self.latents: torch.Tensor | None = None
        self.handle = denoiser.register_forward_pre_hook(self.append_control, with_kwargs=True)

    @classmethod
    def attach(cls, spec: Any, denoiser: nn.Module, dtype: torch.dtype | None = None) -> ControlInput:
        """Widen the denoiser's input layer (new weights zero) and hook the control latents in."""
        layer = input_layer(spec, denoiser)
        channels = spec.control_channels(denoiser)
        extra = added_inputs(layer, int(denoiser.config.in_channels), channels)
        replace_module(denoiser, spec.control_input_layer, widen(layer, extra, dtype))
        return cls(spec, denoiser, in_size(layer), channels)

    @property
    def layer(self) -> nn.Module:
        return self.denoiser.get_submodule(self.layer_name)

    @contextlib.contextmanager
    def given(self, latents: torch.Tensor) -> Iterator[None]:
        previous, self.latents = self.latents, latents
        try:
            yield
        finally:
            self.latents = previous

    def append_control(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        hidden = kwargs.get("hidden_states")
        if hidden is None or self.latents is None:
            raise ModelError("this denoiser takes a control input, but it was called without control latents "
                             "(or with hidden_states given by position).\nWhat to do: call it within "
                             "`ControlInput.given(latents)` (`vidtune sample --control CLIP` does).")
        control, dim = self.spec.pack_control(self.latents.to(device=hidden.device, dtype=hidden.dtype), module)
        if control.shape[0] != hidden.shape[0]:  # classifier-free guidance batches [uncond, cond]
            control = control.repeat(hidden.shape[0] // control.shape[0], *([1] * (control.ndim - 1)))
        return args, {**kwargs, "hidden_states": torch.cat([hidden, control], dim=dim)}

    # ----- on disk -----------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {"format": CONTROL_FORMAT, "family": self.spec.name, "layer": self.layer_name,
                "in_features": self.in_features, "control_channels": self.control_channels,
                "control_in_features": in_size(self.layer) - self.in_features}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {key: value.detach() for key, value in self.layer.state_dict().items()}

    def save(self, folder: Path, dtype: torch.dtype | None = None, name: str = CONTROL_WEIGHTS) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / name
        with atomic_path(target) as temporary:
            tensors = {k: v.to(dtype or v.dtype).cpu().contiguous() for k, v in self.state_dict().items()}
            save_file(tensors, temporary, metadata={"format": "pt"})
            follow_umask(temporary)
        atomic_write_text(folder / CONTROL_CONFIG, json.dumps(self.describe(), indent=2) + "\n")
        return target


@torch.no_grad()
def encode_control(spec: Any, vae: nn.Module, path: str | Path, frames: int, height: int, width: int,
                   fps: float | None = None, resize: str = "crop",
                   processor: ProcessorChoice | None = None) -> torch.Tensor:
    """A control clip's latents [1, C, F, H, W] (its posterior mean, as training takes it), read like a training
    clip from its start; with `processor`, the clip is a source the control is computed from."""
    video = read_clip(Path(path), frames, height, width, fps=fps, resize=resize)
    if processor is not None:
        video = apply_processor(processor[0], dict(processor[1]), video)
    return spec.prepare_latents(vae, video[None])["latents_mean"]


def has_control(folder: Path) -> bool:
    return (Path(folder) / CONTROL_CONFIG).is_file()


def load_control(spec: Any, denoiser: nn.Module, folder: Path, ema: bool = False) -> ControlInput:
    """Widen `denoiser` as `folder/control.json` says and load `folder/control_input.safetensors` into it (with
    `ema`: the layer's moving average, `control_input_ema.safetensors`)."""
    folder = Path(folder)
    name = CONTROL_EMA_WEIGHTS if ema else CONTROL_WEIGHTS
    try:
        described = json.loads((folder / CONTROL_CONFIG).read_text())
        weights = load_file(str(folder / name))
    except (OSError, ValueError) as error:
        raise ModelError(f"{folder / CONTROL_CONFIG}: the control input could not be read ({error}).\nWhat to do: "
                         f"give the output_dir of a finished control run (it holds {CONTROL_CONFIG} and "
                         f"{name}).") from None
    if described.get("family") != spec.name or described.get("layer") != spec.control_input_layer:
        raise ModelError(f"{folder / CONTROL_CONFIG}: made for {described.get('family')} (layer "
                         f"{described.get('layer')}), not {spec.name}.\nWhat to do: use the run's own model.")
    layer = input_layer(spec, denoiser)
    control = ControlInput.attach(spec, denoiser, dtype=layer.weight.dtype)
    if (control.in_features, control.control_channels) != (described["in_features"], described["control_channels"]):
        raise ModelError(f"{folder / CONTROL_CONFIG}: the input layer had {described['in_features']} inputs and "
                         f"{described['control_channels']} control channels; this model's has "
                         f"{control.in_features} and {control.control_channels}.\nWhat to do: use the run's own "
                         "model (model.pretrained of its config.yaml).")
    control.layer.load_state_dict({k: v.to(layer.weight.dtype) for k, v in weights.items()})
    return control
