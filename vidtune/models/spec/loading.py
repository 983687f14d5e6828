"""Loading a family's model: where each component comes from (`model.pretrained`, `model.subfolders`), early and
plain checks of that source (a local folder's layout, a hub id's availability, a component of another family),
which class loads a component (model_index.json), and the dtypes the components load in."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoTokenizer

from vidtune.config import DType, folder_looked_for
from vidtune.errors import ModelError
from vidtune.memory import store_text_encoder_weights
from vidtune.models.hub import HubCheck, looks_local
from vidtune.models.registry import SPECS, get_spec_class
from vidtune.models.single_file import (
    FileHeader,
    apply_scales,
    attach_scales,
    check_quantisation,
    check_scaled,
    checkpoint_converter,
    convert,
    converted_scales,
    dequantise,
    float8_keys,
    float8_linear_weights,
    is_scale,
    load_assigned,
    placed,
    read_header,
)
from vidtune.models.spec.base import SpecBase
from vidtune.offload import loading_device
from vidtune.vae_tiling import enable_vae_tiling


def resolve_dtype(name: DType | None, device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class VAEWithExtras(nn.Module):
    """A VAE and what a family loads beside it (image encoders, an audio VAE), as one `load_vae` result. Opaque
    to trainers, which only hand it back to the spec; it reports the VAE's device and dtype as a VAE would."""

    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae

    @property
    def device(self) -> torch.device:
        return self.vae.device

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.dtype


@dataclass
class TextComponents:
    """Text encoders and tokenizers of one model, by name (e.g. {"text_encoder": ..., "tokenizer": ...})."""

    modules: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.modules[key]

    def to(self, device: torch.device) -> TextComponents:
        for value in self.modules.values():
            if isinstance(value, nn.Module):
                value.to(device)
        return self


@dataclass(frozen=True)
class SingleFile:
    """A denoiser's single file, checked from its header: where it is, the converter that renames its keys, the
    config.json it is built from, the denoiser's tensors (shapes) and those `memory.base_weights: fp8` keeps."""

    header: FileHeader
    converter: Any
    config: dict[str, Any]
    shapes: dict[str, torch.Size]
    float8_keys: frozenset[str]
    float8_linear_weights: frozenset[str]  # of `float8_keys`, the linear layers' weights (those that keep a scale)


class Loading(SpecBase):
    """The components of a family's model, loaded from where the config says, after plain early checks."""

    # diffusers' single-file converter for `denoiser_class` reads this family's original / ComfyUI files
    # (`model.transformer_file`; vidtune/models/single_file.py). Families whose denoiser has none leave it False.
    loads_single_file: ClassVar[bool] = False

    def required_components(self) -> tuple[str, ...]:
        """Subfolders a local model folder must have: one text encoder, the VAE, the denoiser and the scheduler
        (families with more extend it)."""
        return ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")

    # ----- where components come from -------------------------------------------------------------
    def component_source(self, component: str) -> tuple[str, str | None]:
        """(path or hub id, subfolder) of a component, honouring `model.subfolders` overrides."""
        override = self.config.subfolders.get(component)
        if override:
            return override, None
        return self.config.pretrained, component

    def describe_file(self, component: str, filename: str) -> str:
        """For messages: the config key and the file a component's `filename` comes from, e.g.
        `model.pretrained: /models/wan/scheduler/scheduler_config.json`."""
        source, subfolder = self.component_source(component)
        key = f"model.subfolders.{component}" if self.config.subfolders.get(component) else "model.pretrained"
        relative = f"{subfolder}/{filename}" if subfolder else filename
        local = Path(source).expanduser()
        if local.is_dir():
            return f"{key}: {(local / relative).resolve()}"
        return f"{key}: {relative} of {source}"

    @functools.cached_property
    def _hub_check(self) -> HubCheck:
        """This spec's hub check: the hub is asked once for its run, however many checks read the model."""
        return HubCheck()

    def check_source(self) -> None:
        """Fail early and clearly when the model cannot be had: a local folder missing or incomplete, or a hub id
        the hub cannot give (unreachable, offline and not cached, gated, missing, a wrong revision)."""
        pretrained = self.config.pretrained
        needed = tuple(name for name in self.required_components() if name not in self.config.subfolders)
        if not looks_local(pretrained):
            self._hub_check(pretrained, self.config.revision, self.name, needed, folder_looked_for(pretrained))
            return
        from vidtune.models.folders import check_folder_exists, describe_run, model_folders_inside, run_folder

        check_folder_exists(pretrained)
        folder = Path(pretrained).expanduser()
        missing = [name for name in needed if not (folder / name).is_dir()]
        if missing:

            folder = folder.resolve()
            run = run_folder(folder)
            if run is not None:
                raise ModelError(f"model.pretrained: {describe_run(folder, run)}")
            problem = (f"model.pretrained: {folder} is not a complete {self.name} model folder; missing "
                       f"subfolder(s): {', '.join(missing)}.")
            inside = model_folders_inside(folder, needed)
            if inside:
                also = f" (or {', '.join(str(path) for path in inside[1:])})" if len(inside) > 1 else ""
                raise ModelError(f"{problem} The model folder is inside it: {inside[0]}{also}.\n"
                                 f"What to do: set model.pretrained={inside[0]}.")
            raise ModelError(
                f"{problem}\n"
                f"What to do: use a folder in the diffusers layout ({', '.join(self.required_components())}), "
                "or give the missing parts with model.subfolders (e.g. {transformer: /path/to/transformer})."
            )
        for component in self.single_file_components():
            self.single_file(component)

    # ----- a denoiser from one file (model.transformer_file) ------------------------------------------------------
    def single_file_components(self) -> tuple[str, ...]:
        """The components the config reads from single files."""
        return tuple(name for name in ("transformer", "transformer_2") if self.config.single_file(name))

    def single_file_problem(self, config: dict[str, Any]) -> str | None:
        """Why diffusers' converter cannot read this denoiser (`config`: its config.json), or None. Families whose
        converter assumes the released model's sizes say so here."""
        return None

    def single_file(self, component: str) -> SingleFile:
        """The checked single file of `component`, read from its header once: a family without a converter, a
        file that is not this family's denoiser (another model, an adapter, a whole pipeline without it, another
        size) or a scaled fp8 file vidtune cannot read is a ModelError before any weight is read."""
        checked = self.__dict__.setdefault("_single_files", {})
        if component not in checked:
            checked[component] = self._check_single_file(component)
        return checked[component]

    def _check_single_file(self, component: str) -> SingleFile:
        key = f"model.{component}_file"
        if component not in self.required_components():
            raise ModelError(f"{key}: {self.config.pretrained} has no {component} ({self.name} has one "
                             "transformer).\nWhat to do: remove the key; model.transformer_file gives the transformer.")
        converter = checkpoint_converter(self.denoiser_class) if self.loads_single_file else None
        if converter is None:
            raise ModelError(
                f"{key}: {self.name} cannot load its transformer from a single file: diffusers has no converter "
                f"from the original layout for {self.denoiser_class.__name__}.\nWhat to do: use the model in the "
                "diffusers layout (model.pretrained, or model.subfolders.transformer for a fine-tuned transformer)."
            )
        config = self.load_config(self.denoiser_class, component)
        problem = self.single_file_problem(config)
        if problem:
            raise ModelError(f"{key}: {problem}\nWhat to do: use the model in the diffusers layout "
                             f"(model.pretrained, or model.subfolders.{component}).")
        header = read_header(str(self.config.single_file(component)), key)
        check_quantisation(header)
        if header.scaled:
            check_scaled(header)
        with torch.device("meta"):
            empty = self.denoiser_class.from_config(config)
        shapes = {name: tensor.shape for name, tensor in empty.state_dict().items()}
        stand_ins = header.meta_tensors()
        convert(header, dequantise(stand_ins, torch.float32) if header.scaled else stand_ins, converter, config,
                shapes, self.name)
        return SingleFile(header, converter, config, shapes, frozenset(float8_keys(empty)),
                          frozenset(float8_linear_weights(empty)))

    def load_single_file(self, cls: Any, component: str, dtype: torch.dtype) -> nn.Module:
        """`component` from its single file, each tensor in the dtype `from_pretrained(torch_dtype=dtype)` gives it;
        with `memory.base_weights: fp8` the file's float8 weights of the layers stored in float8 stay as they are in
        the file (vidtune/models/single_file.py)."""
        checked = self.single_file(component)
        header = checked.header
        tensors = load_file(str(header.path))
        keep = set(checked.float8_keys) if self.base_weights == "fp8" else set()
        scales: dict[str, torch.Tensor] = {}
        if header.scaled:
            scales = converted_scales(header, tensors, checked.converter, checked.config, checked.shapes, self.name)
            tensors = {key: tensor for key, tensor in tensors.items() if not is_scale(key)}
        converted = convert(header, tensors, checked.converter, checked.config, checked.shapes, self.name)
        del tensors  # the converted dict holds them now: `placed` lets each go once copied
        stored_scaled = {key for key in scales if key in keep and key in checked.float8_linear_weights}
        if scales:
            converted = apply_scales(converted, scales, dtype, stored_scaled)
        keep_fp32 = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())
        denoiser = load_assigned(cls, checked.config, placed(converted, dtype, keep, keep_fp32))
        attach_scales(denoiser, {key: scales[key] for key in stored_scaled})
        return denoiser

    def _load_problem(self, what: str, source: str, subfolder: str | None, error: BaseException) -> ModelError:
        where = f"{source}/{subfolder}" if subfolder else source
        hint = ("check model.pretrained and model.subfolders (a local folder in the diffusers layout, or a hub id "
                "whose files this machine can download or has in its hub cache); `vidtune data check CONFIG` "
                "checks the model before anything long starts.")
        return ModelError(f"Could not load the {what} of {self.name} from {where}: {error}\nWhat to do: {hint}")

    def load_component(self, cls: Any, component: str, **kwargs: Any) -> Any:
        if self.config.single_file(component):
            return self.load_single_file(cls, component, kwargs.get("torch_dtype") or torch.float32)
        source, subfolder = self.component_source(component)
        extra = {"subfolder": subfolder} if subfolder else {}
        if self.config.revision:
            extra["revision"] = self.config.revision
        try:
            return cls.from_pretrained(source, **extra, **kwargs)
        except (OSError, ValueError) as error:
            raise self._load_problem(component, source, subfolder, error) from None

    def load_config(self, cls: Any, component: str) -> dict[str, Any]:
        """A component's config.json, without loading its weights (for early shape checks)."""
        source, subfolder = self.component_source(component)
        if not looks_local(source):
            # Shape checks read configs before `check_source` may have run: ask the hub once, plainly, first.
            self.check_source()
        try:
            config = dict(cls.load_config(source, subfolder=subfolder, revision=self.config.revision))
        except (OSError, ValueError) as error:
            raise self._load_problem(f"{component} config", source, subfolder, error) from None
        self.check_component_class(cls, component, config)
        return config

    def check_component_class(self, cls: Any, component: str, config: dict[str, Any]) -> None:
        """A model folder of another family (model.name does not match model.pretrained) fails here, plainly,
        instead of on a config key the family expects. Schedulers are exempt: several classes serve a family."""
        found = config.get("_class_name")
        if component == "scheduler" or not found or found == cls.__name__:
            return
        def classes(name: str) -> set[str]:
            return {getattr(get_spec_class(name), attr, type).__name__ for attr in ("vae_class", "denoiser_class")}

        fits = [name for name in SPECS if found in classes(name)]
        hint = f"; it fits model.name={' or '.join(fits)}" if fits else ""
        raise ModelError(
            f"{self.describe_file(component, 'config.json')} names {found}, but model.name={self.name} needs "
            f"{cls.__name__}{hint}. Check model.name and model.pretrained."
        )

    @functools.cached_property
    def model_index(self) -> dict[str, Any]:
        """model.pretrained's model_index.json: the class of each component, as the pipeline reads it (empty for a
        local folder without one: its components' own configs then say)."""
        source = self.config.pretrained
        if looks_local(source) and not (Path(source).expanduser() / "model_index.json").is_file():
            return {}
        return self.read_model_index()

    def read_model_index(self) -> dict[str, Any]:
        """model.pretrained's model_index.json; a missing or unreadable one is a ModelError naming it."""
        source = self.config.pretrained
        try:
            return dict(self.pipeline_class.load_config(source, revision=self.config.revision))
        except (OSError, ValueError) as error:
            raise self._load_problem("model_index.json", source, None, error) from None

    def component_class(self, component: str, choices: tuple[type, ...]) -> type:
        """Which of `choices` loads `component`: the class its checkpoint names (a family whose pipeline accepts
        several classes for one component). model_index.json's entry names it, as the pipeline reads it; a component
        given by `model.subfolders` (or missing from model_index.json) names it in its own config.json; the first
        choice where neither names one. Any other class is refused before anything loads."""
        by_name = {cls.__name__: cls for cls in choices}
        entry = None if self.config.subfolders.get(component) else self.model_index.get(component)
        if isinstance(entry, (list, tuple)) and entry and entry[-1]:  # ["diffusers", "LTX2Vocoder"]
            found, where = str(entry[-1]), self._describe_model_index()
        else:
            found, where = self._class_in_config(component, choices[0]), self.describe_file(component, "config.json")
        if found is None:
            return choices[0]
        if found not in by_name:
            raise ModelError(
                f"{where} names {found} for the {component}, but {self.name} loads its {component} as "
                f"{' or '.join(by_name)}.\nWhat to do: point model.pretrained (or model.subfolders.{component}) at "
                f"a {self.name} checkpoint in the diffusers layout whose {component} is one of these classes, or "
                "update vidtune and diffusers if a newer release of the model brought a new class."
            )
        return by_name[found]

    def _describe_model_index(self) -> str:
        source = self.config.pretrained
        local = Path(source).expanduser()
        if local.is_dir():
            return f"model.pretrained: {(local / 'model_index.json').resolve()}"
        return f"model.pretrained: model_index.json of {source}"

    def _class_in_config(self, component: str, cls: type) -> str | None:
        """The class a component's config.json names (diffusers' `_class_name`, transformers' `architectures`)."""
        from diffusers.configuration_utils import ConfigMixin
        from transformers import PretrainedConfig

        source, subfolder = self.component_source(component)
        try:
            if issubclass(cls, ConfigMixin):
                return cls.load_config(source, subfolder=subfolder, revision=self.config.revision).get("_class_name")
            config, _ = PretrainedConfig.get_config_dict(source, subfolder=subfolder or "",
                                                         revision=self.config.revision)
        except (OSError, ValueError) as error:
            raise self._load_problem(f"{component} config", source, subfolder, error) from None
        architectures = config.get("architectures") or [None]
        return architectures[0]

    def component_dtype(self, component: str, device: torch.device) -> torch.dtype:
        override = {
            "text_encoder": self.config.text_encoder_dtype,
            "vae": self.config.vae_dtype,
            "transformer": self.config.transformer_dtype,
        }.get(component)
        return resolve_dtype(override or self.config.dtype, device)

    # ----- the components ----------------------------------------------------------------------------
    def load_text(self, device: torch.device) -> TextComponents:
        """The text components, their encoders stored as `memory.text_encoder_weights` says."""
        # Quantized encoders for a GPU are quantized in host memory, then moved (as the denoiser's base weights).
        load_on = loading_device(self.text_encoder_weights, device)
        if load_on == device:
            text = self.load_text_components(device)
            store_text_encoder_weights(text, self.text_encoder_weights)
            return text
        text = self.load_text_components(device, load_on)
        store_text_encoder_weights(text, self.text_encoder_weights)
        return text.to(device)

    def load_text_components(self, device: torch.device, load_on: torch.device | None = None) -> TextComponents:
        """One tokenizer + one frozen text encoder (`text_encoder_class`) in the dtype for `device`, placed on
        `load_on` (default: `device`); families with more override this."""
        tokenizer = self.load_component(AutoTokenizer, "tokenizer")
        dtype = self.component_dtype("text_encoder", device)
        text_encoder = self.load_component(self.text_encoder_class, "text_encoder", torch_dtype=dtype)
        text_encoder.requires_grad_(False).eval().to(load_on or device)
        return TextComponents({"tokenizer": tokenizer, "text_encoder": text_encoder})

    def load_vae(self, device: torch.device) -> Any:
        """The frozen VAE; opaque to trainers (image-to-video families may return a container with more)."""
        vae = self.load_component(self.vae_class, "vae", torch_dtype=self.component_dtype("vae", device))
        if self.vae_tiling:
            enable_vae_tiling(vae)
        return vae.requires_grad_(False).eval().to(device)

    def load_denoiser(self, device: torch.device, load_on: torch.device | None = None) -> nn.Module:
        """The denoiser in the dtype for `device`, placed on `load_on` (default: `device`)."""
        dtype = self.component_dtype("transformer", device)
        return self.load_component(self.denoiser_class, "transformer", torch_dtype=dtype).to(load_on or device)

    def load_scheduler(self) -> Any:
        return self.load_component(self.scheduler_class, "scheduler")
