"""Control input: a control clip's latents concatenated to the denoiser's input along channels.

The family's spec names the denoiser's input projection (`ModelSpec.control_input_layer`) and says how a control
latent ([B, C, F, H, W], the VAE's layout) is laid out like the denoiser's `hidden_states`
(`ModelSpec.pack_control`: the tensor and its channel dimension). `widen_input` gives that projection
`control_channels` more input channels whose weights start at zero, so the widened model computes exactly what
the base model computes until they train. A forward pre-hook on the denoiser (`ControlInput`) appends the control
latents to `hidden_states` on every call, after anything the family itself concatenates (an image-to-video first
frame), so training (`spec.forward`) and sampling (the family's pipeline) feed the widened layer alike.

A denoiser module holding several denoisers (Wan 2.2 A14B's two experts; the spec's `control_parts` names them):
each part's input layer is widened and trained on its own (`ExpertsControlInput`). In training the module that
routes samples to its parts gets the whole batch's control latents as a keyword argument (`CONTROL_KWARG`), so a
batch split between the parts hands each part the control rows of its own samples; the pipeline calls the parts
directly, and each takes the latents set with `given`.

On disk (a run's `output_dir`, beside its LoRA file or `transformer/` folder):
- `control.json`: {"format": 1, "family", "layer": the widened module's name, "in_features": its input size
  before widening, "control_channels": latent channels of the control clip, "control_in_features": the inputs
  added; several parts: "experts": the parts' names, e.g. ["transformer", "transformer_2"]};
- `control_input.safetensors`: the widened layer's `weight` (and `bias`), all input channels; several parts: the
  first part's, and a file per further part named after it (`control_input_transformer_2.safetensors` for Wan 2.2's
  low-noise expert, the adapter files' naming).
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

from vidtune.data.video import ClipWindow, read_clip
from vidtune.errors import ConfigError, ModelError
from vidtune.files import atomic_path, atomic_write_text, follow_umask
from vidtune.models.experts import expert_file
from vidtune.processors import ProcessorChoice, apply_processor
from vidtune.storage.digests import stamp_digest

CONTROL_CONFIG = "control.json"
CONTROL_WEIGHTS = "control_input.safetensors"
# With `training.ema_decay`: the widened layer's moving average, beside the averaged adapter / transformer.
CONTROL_EMA_WEIGHTS = "control_input_ema.safetensors"
CONTROL_FORMAT = 1
# The keyword a module routing samples to several denoisers passes each one its samples' rows of the control latents by.
CONTROL_KWARG = "control_latents"


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
        if spec.control_channels_innermost:
            self.layer.register_forward_pre_hook(self.control_inputs_last)
        elif spec.control_channels_before_own:
            self.layer.register_forward_pre_hook(self.own_inputs_before_control)

    def control_inputs_last(self, layer: nn.Module, args: tuple) -> tuple:
        """A Linear reading patches with the channels innermost sees each position's base channels, then its control
        channels: its inputs in the widened layer's order, the base model's (position by position) first, then the
        control's (see `ModelSpec.control_channels_innermost`)."""
        features = args[0]
        positions = self.in_features // self.spec.input_channels(self.denoiser)
        grouped = features.unflatten(-1, (positions, -1))
        base = self.in_features // positions
        return (torch.cat([grouped[..., :base].flatten(-2), grouped[..., base:].flatten(-2)], dim=-1), *args[1:])

    def own_inputs_before_control(self, layer: nn.Module, args: tuple) -> tuple:
        """A channels-outermost Linear of a denoiser that appends channels of its own after the control's (see
        `ModelSpec.control_channels_before_own`) sees [latents, control, its own]: its inputs in the widened layer's
        order, [latents, its own, control]."""
        features = args[0]
        per_channel = self.in_features // self.spec.input_channels(self.denoiser)
        lead = self.in_features - self.spec.control_channels_before_own * per_channel
        control = features.shape[-1] - self.in_features
        reordered = torch.cat([features[..., :lead], features[..., lead + control:],
                               features[..., lead:lead + control]], dim=-1)
        return (reordered, *args[1:])

    @classmethod
    def attach(cls, spec: Any, denoiser: nn.Module, dtype: torch.dtype | None = None) -> ControlInput:
        """Widen the denoiser's input layer (new weights zero) and hook the control latents in."""
        layer = input_layer(spec, denoiser)
        channels = spec.control_channels(denoiser)
        extra = added_inputs(layer, spec.input_channels(denoiser), channels)
        replace_module(denoiser, spec.control_input_layer, widen(layer, extra, dtype))
        return cls(spec, denoiser, in_size(layer), channels)

    @property
    def layer(self) -> nn.Module:
        return self.denoiser.get_submodule(self.layer_name)

    def layers(self) -> dict[str, nn.Module]:
        """The widened layers by their name in the trained denoiser (one here)."""
        return {self.layer_name: self.layer}

    def files(self, name: str) -> dict[str, str]:
        """The file of each widened layer by its key prefix in `state_dict` (one file, no prefix)."""
        return {"": name}

    @contextlib.contextmanager
    def narrowed(self) -> Iterator[None]:
        """The input layer cut back to the base model's inputs (its current weights), e.g. to save a transformer
        every diffusers loader reads; the widened one is back afterwards."""
        wide = self.layer
        replace_module(self.denoiser, self.layer_name, narrow(wide, self.in_features))
        try:
            yield
        finally:
            replace_module(self.denoiser, self.layer_name, wide)

    @contextlib.contextmanager
    def given(self, latents: torch.Tensor) -> Iterator[None]:
        previous, self.latents = self.latents, latents
        try:
            yield
        finally:
            self.latents = previous

    def append_control(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        # A router's call brings its rows of the control latents; the pipeline's calls take those of `given`.
        routed = kwargs.get(CONTROL_KWARG)
        kwargs = {key: value for key, value in kwargs.items() if key != CONTROL_KWARG}
        latents = routed if routed is not None else self.latents
        hidden = kwargs.get("hidden_states")
        if hidden is None or latents is None:
            raise ModelError("this denoiser takes a control input, but it was called without control latents "
                             "(or with hidden_states given by position).\nWhat to do: call it within "
                             "`ControlInput.given(latents)` (`vidtune sample --control CLIP` does).")
        control, dim = self.spec.pack_control(latents.to(device=hidden.device, dtype=hidden.dtype), module, hidden)
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

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        layer = self.layer
        layer.load_state_dict({key: value.to(layer.weight.dtype) for key, value in state.items()})

    def save(self, folder: Path, dtype: torch.dtype | None = None, name: str = CONTROL_WEIGHTS) -> Path:
        return save_control(self, folder, dtype, name)


def save_control(control: ControlInput | ExpertsControlInput, folder: Path, dtype: torch.dtype | None = None,
                 name: str = CONTROL_WEIGHTS) -> Path:
    """The widened layer(s) into `folder` (a file each, `control.files(name)`) and `control.json`; returns the
    first file."""
    folder.mkdir(parents=True, exist_ok=True)
    state = control.state_dict()
    written = []
    for prefix, file_name in control.files(name).items():
        key_start = f"{prefix}." if prefix else ""
        target = folder / file_name
        with atomic_path(target) as temporary:
            tensors = {key.removeprefix(key_start): value.to(dtype or value.dtype).cpu().contiguous()
                       for key, value in state.items() if key.startswith(key_start)}
            save_file(tensors, temporary, metadata={"format": "pt"})
            stamp_digest(temporary)
            follow_umask(temporary)
        written.append(target)
    atomic_write_text(folder / CONTROL_CONFIG, json.dumps(control.describe(), indent=2) + "\n")
    return written[0]


class ExpertsControlInput:
    """Each part of a denoiser module holding several denoisers widened (`spec.control_parts`), each with its own
    `ControlInput` (its own trained layer and hook), behind `ControlInput`'s interface; state-dict keys and files
    name the part (`transformer.weight`, `control_input_transformer_2.safetensors`)."""

    def __init__(self, spec: Any, router: nn.Module, parts: dict[str, ControlInput]) -> None:
        self.spec = spec
        self.router = router
        self.parts = parts
        first = next(iter(parts.values()))
        self.layer_name: str = first.layer_name
        self.in_features = first.in_features
        self.control_channels = first.control_channels
        self.latents: torch.Tensor | None = None
        # The router's training calls: the batch's control latents go in as a keyword argument, which the router
        # splits by rows with the samples (as every per-sample input), so each part sees its own samples' controls.
        self.handle = router.register_forward_pre_hook(self.route_control, with_kwargs=True)

    @classmethod
    def attach(cls, spec: Any, router: nn.Module, dtype: torch.dtype | None = None) -> ExpertsControlInput:
        parts = {name: ControlInput.attach(spec, part, dtype) for name, part in spec.control_parts(router).items()}
        return cls(spec, router, parts)

    def layers(self) -> dict[str, nn.Module]:
        return {f"{name}.{self.layer_name}": part.layer for name, part in self.parts.items()}

    def files(self, name: str) -> dict[str, str]:
        return {expert: expert_file(name, expert) for expert in self.parts}

    @contextlib.contextmanager
    def given(self, latents: torch.Tensor) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for part in self.parts.values():  # the pipeline calls each expert directly
                stack.enter_context(part.given(latents))
            previous, self.latents = self.latents, latents
            try:
                yield
            finally:
                self.latents = previous

    def route_control(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        if self.latents is None:
            return args, kwargs  # each expert's own hook says what is missing
        return args, {**kwargs, CONTROL_KWARG: self.latents}

    @contextlib.contextmanager
    def narrowed(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for part in self.parts.values():
                stack.enter_context(part.narrowed())
            yield

    def describe(self) -> dict[str, Any]:
        return {**next(iter(self.parts.values())).describe(), "experts": list(self.parts)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{key}": value for name, part in self.parts.items()
                for key, value in part.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        unknown = sorted({key.split(".")[0] for key in state} - self.parts.keys())
        if unknown:
            raise ModelError(f"control input weights for {', '.join(unknown)}, which this model does not widen.\n"
                             "What to do: load them with the two-expert model and model.experts they were trained "
                             "with.")
        for name, part in self.parts.items():
            part.load_state_dict({key.removeprefix(f"{name}."): value for key, value in state.items()
                                  if key.startswith(f"{name}.")})

    def save(self, folder: Path, dtype: torch.dtype | None = None, name: str = CONTROL_WEIGHTS) -> Path:
        return save_control(self, folder, dtype, name)


def several_parts(spec: Any, denoiser: nn.Module) -> bool:
    """Whether the control input widens parts of `denoiser` (keys and files named after them), not `denoiser`."""
    return list(spec.control_parts(denoiser)) != [""]


def attach_control(spec: Any, denoiser: nn.Module, dtype: torch.dtype | None = None
                   ) -> ControlInput | ExpertsControlInput:
    """Widen the denoiser's input layer for control latents: each part's, for a denoiser of several parts."""
    if several_parts(spec, denoiser):
        return ExpertsControlInput.attach(spec, denoiser, dtype)
    return ControlInput.attach(spec, denoiser, dtype)


@torch.no_grad()
def encode_control(spec: Any, vae: nn.Module, path: str | Path, frames: int, height: int, width: int,
                   fps: float | None = None, resize: str = "crop",
                   processor: ProcessorChoice | None = None) -> torch.Tensor:
    """A control clip's latents [1, C, F, H, W] (its posterior mean, as training takes it), read like a training
    clip from its start; with `processor`, the clip is a source the control is computed from."""
    video = read_clip(Path(path), ClipWindow(frames, height, width, fps=fps, resize=resize))
    if processor is not None:
        video = apply_processor(processor[0], dict(processor[1]), video)
    return spec.prepare_latents(vae, video[None])["latents_mean"]


def has_control(folder: Path) -> bool:
    return (Path(folder) / CONTROL_CONFIG).is_file()


def load_control(spec: Any, denoiser: nn.Module, folder: Path, ema: bool = False
                 ) -> ControlInput | ExpertsControlInput:
    """Widen `denoiser` as `folder/control.json` says and load `folder/control_input.safetensors` into it (with
    `ema`: the layer's moving average, `control_input_ema.safetensors`). A denoiser of several parts: each part's,
    from its own file (Wan 2.2's low-noise expert from `control_input_transformer_2.safetensors`)."""
    folder = Path(folder)
    name = CONTROL_EMA_WEIGHTS if ema else CONTROL_WEIGHTS
    try:
        described = json.loads((folder / CONTROL_CONFIG).read_text())
    except (OSError, ValueError) as error:
        raise ModelError(f"{folder / CONTROL_CONFIG}: the control input could not be read ({error}).\nWhat to do: "
                         f"give the output_dir of a finished control run (it holds {CONTROL_CONFIG} and "
                         f"{name}).") from None
    if described.get("family") != spec.name or described.get("layer") != spec.control_input_layer:
        raise ModelError(f"{folder / CONTROL_CONFIG}: made for {described.get('family')} (layer "
                         f"{described.get('layer')}), not {spec.name}.\nWhat to do: use the run's own model.")
    experts = described.get("experts")
    several = several_parts(spec, denoiser)
    if experts is not None and (not several or tuple(experts) != tuple(spec.control_parts(denoiser))):
        raise ModelError(f"{folder / CONTROL_CONFIG}: made for the experts {', '.join(experts)} of a two-expert "
                         "model, which this model does not match.\nWhat to do: use the run's own model and "
                         "model.experts (its config.yaml).")
    if experts is None and several:
        raise ModelError(f"{folder / CONTROL_CONFIG}: made for one denoiser, but {spec.config.pretrained} has two "
                         "experts.\nWhat to do: use the run's own model (model.pretrained of its config.yaml).")
    control = attach_control(spec, denoiser)
    weights: dict[str, torch.Tensor] = {}
    for prefix, file_name in control.files(name).items():
        try:
            part = load_file(str(folder / file_name))
        except (OSError, ValueError) as error:
            raise ModelError(f"{folder / file_name}: the control input could not be read ({error}).\nWhat to do: "
                             f"give the output_dir of a finished control run.") from None
        weights.update({f"{prefix}.{key}" if prefix else key: value for key, value in part.items()})
    if (control.in_features, control.control_channels) != (described["in_features"], described["control_channels"]):
        raise ModelError(f"{folder / CONTROL_CONFIG}: the input layer had {described['in_features']} inputs and "
                         f"{described['control_channels']} control channels; this model's has "
                         f"{control.in_features} and {control.control_channels}.\nWhat to do: use the run's own "
                         "model (model.pretrained of its config.yaml).")
    control.load_state_dict(weights)
    return control
