"""The ModelSpec contract: what a model family provides, and nothing about how it is trained.

A spec knows how to load its components, how to turn captions and clips into the tensors its denoiser
takes, how to call the denoiser, which objective its scheduler implies, and how to sample and save in
its diffusers pipeline's format. Trainers only ever talk to this interface.

Latent conventions shared by every spec:
    `prepare_latents` returns {"latents_mean", "latents_std"}: the VAE posterior, already normalised
    exactly as the family's pipeline normalises latents, in the VAE's own layout [B, C, F, H, W].
    A training latent is drawn as mean + std * eps each step (see `draw_latent`). Other keys it
    returns are conditions derived from the video (first-frame latents, image embeddings).
    Noise, noisy latents, predictions and targets all live in that same layout; `forward` does any
    packing/patching the denoiser needs and returns the prediction unpacked.
"""

from __future__ import annotations

import functools
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import AutoTokenizer

from vidtune.config import Config, DType, ModelConfig, TrainingConfig, folder_looked_for
from vidtune.data.audio import AudioFormat
from vidtune.data.sources import Clip
from vidtune.errors import ConfigError, ModelError
from vidtune.export.comfyui import Rule
from vidtune.export.comfyui_models import ComfyUIModel
from vidtune.files import INCOMPLETE, follow_umask
from vidtune.memory import store_text_encoder_weights
from vidtune.models import first_frame
from vidtune.models.defaults import FamilyDefaults
from vidtune.models.hooks import DenoiserHooks
from vidtune.models.hub import check_hub_model, looks_local
from vidtune.models.registry import SPECS, get_spec_class
from vidtune.objectives import Objective, objective_from_scheduler
from vidtune.offload import loading_device
from vidtune.outputs import LORA_WEIGHTS, TRANSFORMER_FOLDER
from vidtune.vae_tiling import enable_vae_tiling

Conditions = dict[str, torch.Tensor]
# A diffusers pipeline's `callback_on_step_end`: (pipeline, step, timestep, {"latents": ...}) -> that dict.
StepCallback = Callable[[Any, int, Any, dict[str, Any]], dict[str, Any]]
Latents = dict[str, torch.Tensor]
# LoRA target presets (`lora.target_modules: attention`): module-name suffixes, as peft matches them (a name matches
# every module whose path ends with it). A family declares its own where its denoiser names modules otherwise.
ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
# The text stream's projections of joint (MM-DiT) attention, which `to_q`... do not reach.
JOINT_ATTENTION_TARGETS = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
FEED_FORWARD_TARGETS = ("ff.net.0.proj", "ff.net.2")
# Every nn.Linear of the denoiser: resolved against the model when the adapter is added.
ALL_LINEAR = "all-linear"

# Keys of `prepare_latents` that describe the posterior; any other key it returns is a video-derived
# condition (e.g. an image-to-video first-frame latent) and is handed to `forward` with the text ones.
POSTERIOR_KEYS = ("latents_mean", "latents_std")
# Control training: the key of a batch's control latents (the control clips' posterior means, [B, C, F, H, W]).
CONTROL_LATENTS = "control_latents"
# The key of each clip's frame rate [B, 1] (float64, frames per second) that families which tell their denoiser a
# frame rate (`ModelSpec.frame_rate_conditioned`) find beside the latents: the rate the clip's frames play at.
FRAME_RATE = "frame_rate"


@dataclass(frozen=True)
class GeneratedSample:
    """One sampled video as a run writes it: its frames and, for a family that generates sound, its waveform."""

    frames: torch.Tensor  # float [F, 3, H, W] in [-1, 1]
    audio: torch.Tensor | None = None  # float [channels, samples] in [-1, 1]
    sample_rate: int | None = None  # of `audio`, in Hz

    def __post_init__(self) -> None:
        if self.audio is not None and (self.sample_rate is None or self.sample_rate <= 0):
            raise ValueError(f"a sample's audio needs its sample rate in Hz (positive), not {self.sample_rate}")


def step_callback(callback: StepCallback | None) -> dict[str, Any]:
    """The pipeline call's arguments for `callback` (none without one)."""
    if callback is None:
        return {}
    return {"callback_on_step_end": callback, "callback_on_step_end_tensor_inputs": ["latents"]}


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


def draw_latent(latents: Latents, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one latent from the stored posterior (mean + std * eps), per step, so clips keep their noise."""
    mean, std = latents["latents_mean"], latents["latents_std"]
    eps = torch.randn(mean.shape, generator=generator, dtype=torch.float32, device="cpu")
    return mean + std * eps.to(device=mean.device, dtype=mean.dtype)


def nearest_multiple(value: int, multiple: int) -> int:
    """The multiple of `multiple` nearest to `value` (at least one multiple): for shape-rule messages."""
    return max(1, round(value / multiple)) * multiple


def frame_count_problem(frames: int, temporal: int, latent_multiple: int = 1) -> str | None:
    """The usual video-VAE rule: frames = temporal * (latents - 1) + 1, latents a multiple of `latent_multiple`
    (a transformer's temporal patch). Returns the message naming the nearest valid values, or None."""
    latents = (frames - 1) / temporal + 1
    if latents == int(latents) and int(latents) % latent_multiple == 0:
        return None
    valid = [temporal * (n - 1) + 1 for n in range(latent_multiple, frames // temporal + 2 * latent_multiple + 1,
                                                     latent_multiple)]
    nearest = [v for v in valid if v < frames][-1:] + [v for v in valid if v > frames][:1]
    rule = f"{temporal}k+1" if latent_multiple == 1 else f"{temporal}k+1 with k+1 a multiple of {latent_multiple}"
    return (f"data.frames={frames} must be {rule} for this model; nearest valid values: "
            f"{' or '.join(str(v) for v in nearest)}")


def side_problems(height: int, width: int, height_multiple: int, width_multiple: int | None = None) -> list[str]:
    problems = []
    for key, value, multiple in (("data.height", height, height_multiple),
                                 ("data.width", width, width_multiple or height_multiple)):
        if value % multiple != 0:
            problems.append(f"{key}={value} must be a multiple of {multiple} for this model; nearest valid value: "
                            f"{nearest_multiple(value, multiple)}")
    return problems


# The clip rules of each family's published checkpoints (what README.md lists), to compare a model's own rule with.
PUBLISHED_SHAPE_RULES = {
    "ltx-video": "frames 8k+1, sides multiples of 32",
    "ltx-video-i2v": "frames 8k+1, sides multiples of 32",
    "ltx-2": "frames 8k+1, sides multiples of 32",
    "cogvideox": "frames 4k+1, sides multiples of 16",
    "cogvideox-i2v": "frames 4k+1, 480x720",
    "hunyuan-video": "frames 4k+1, sides multiples of 16",
    "hunyuan-video-1.5": "frames 4k+1, sides multiples of 16",
    "hunyuan-video-1.5-i2v": "frames 4k+1, sides multiples of 16",
    "mochi": "frames 6k+1, sides multiples of 16",
    "wan": "frames 4k+1, sides multiples of 16",
    "wan-i2v": "frames 4k+1, sides multiples of 16",
}


def shape_rule(temporal: int, latent_multiple: int, height_multiple: int, width_multiple: int | None = None) -> str:
    """A model's clip rule in words, e.g. `frames 8k+1, sides multiples of 32`."""
    frames = f"{temporal}k+1" if latent_multiple == 1 else f"{temporal}k+1 with k+1 a multiple of {latent_multiple}"
    if width_multiple in (None, height_multiple):
        return f"frames {frames}, sides multiples of {height_multiple}"
    return f"frames {frames}, height a multiple of {height_multiple}, width of {width_multiple}"


def raise_shape_problems(family: str, problems: list[str | None], spec: ModelSpec | None = None,
                         rule: str = "") -> None:
    """One ConfigError listing every problem of the clip shape. With `spec`, it names the model whose rule it is
    (read from that model's configs: a tiny or custom model has its own) and, for a local model, the published
    checkpoints' rule to compare with."""
    found = [problem for problem in problems if problem]
    if not found:
        return
    if spec is None:
        lines = [f"The clip shape does not fit {family}:"]
    else:
        its_rule = f" (its rule, read from its own configs: {rule})" if rule else ""
        lines = [f"The clip shape does not fit the {spec.name} model at {spec.config.pretrained}{its_rule}:"]
    lines += [f"  - {problem}" for problem in found]
    published = PUBLISHED_SHAPE_RULES.get(spec.name) if spec is not None else None
    if published and looks_local(spec.config.pretrained):
        lines.append(f"For comparison, the published {family} checkpoints need {published}.")
    lines.append("What to do: set the nearest valid values above (data.frames, data.height, data.width; in the config "
                 "or on the command line).")
    raise ConfigError("\n".join(lines))


class ModelSpec(DenoiserHooks, ABC):
    """One model family. Subclasses set the class attributes and implement the abstract methods; the hooks generic
    code asks about the denoiser (`DenoiserHooks`, vidtune/models/hooks.py) have defaults for one denoiser."""

    name: ClassVar[str]
    # Named sets of LoRA targets (`lora.target_modules: attention+ffn`); `default_lora_preset` is used when unset.
    lora_presets: ClassVar[dict[str, tuple[str, ...]]] = {
        "attention": ATTENTION_TARGETS,
        "attention+ffn": ATTENTION_TARGETS + FEED_FORWARD_TARGETS,
        ALL_LINEAR: (ALL_LINEAR,),
    }
    default_lora_preset: ClassVar[str] = "attention"
    # Classifier-free guidance the family's pipeline recommends; validation samples use it unless configured.
    validation_guidance_scale: ClassVar[float] = 1.0
    # The clip shape, frame rate and noise levels of the family's published recipe, for the keys a config leaves
    # unset (vidtune/models/defaults.py; the table in docs/models.md). These are vidtune's generic ones.
    defaults: ClassVar[FamilyDefaults] = FamilyDefaults(frames=49, height=512, width=768, fps=25.0)
    # Image-to-video families sample from a first frame: `generate(..., reference=video)` hands it to
    # `pipeline_inputs`. A spec holds no per-run state, so the reference is always an argument.
    image_to_video: ClassVar[bool] = False
    # The denoiser is told the frame rate of its input (LTX): each clip's own rate reaches `forward` (`FRAME_RATE`).
    frame_rate_conditioned: ClassVar[bool] = False
    # Share of training samples given their first latent frame clean (`model.first_frame_conditioning`'s default;
    # None: the family cannot take it). See vidtune/models/first_frame.py.
    first_frame_conditioning: ClassVar[float | None] = None
    # Bump when the family's prepare_conditions / prepare_latents code changes what it computes, so that
    # precomputed entries made by the old code are not reused (see `condition_identity`).
    cache_version: ClassVar[int] = 1
    # Control training (`training.algorithm: control-*`, see vidtune/control.py): the denoiser's input projection,
    # widened to take the control latents; None with `control_refusal` saying why the family cannot.
    control_input_layer: ClassVar[str | None] = None
    control_refusal: ClassVar[str] = "its spec names no input projection to widen."
    # The denoiser's transformer blocks, in forward order: the attribute names of its block lists
    # (`memory.blocks_to_swap` swaps the last N of them; see vidtune/offload.py).
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    # diffusers / transformers classes of the components, used by the default loaders below, and the
    # family's pipeline (its `save_lora_weights` writes the LoRA format the family's tools read).
    pipeline_class: ClassVar[Any]
    text_encoder_class: ClassVar[Any] = None
    vae_class: ClassVar[Any]
    denoiser_class: ClassVar[Any]
    scheduler_class: ClassVar[Any]

    def __init__(self, config: ModelConfig, frame_rate: float = 25.0, text_encoder_weights: str = "auto",
                 vae_tiling: bool = False) -> None:
        self.config = config
        self.frame_rate = frame_rate
        self.text_encoder_weights = text_encoder_weights  # memory.text_encoder_weights
        self.vae_tiling = vae_tiling  # memory.vae_tiling

    def lora_exclude_modules(self) -> list[str]:
        """Linear layers no LoRA preset may adapt (peft's `exclude_modules`): layers whose output the loss never
        sees, such as the text stream's output of a last joint block, which would break data-parallel training."""
        return []

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        """The module names LoRA adapts when `lora.target_modules` is unset."""
        return self.lora_presets[self.default_lora_preset]

    def native_max_sequence_length(self) -> int:
        """Caption tokens the family's pipeline uses by default."""
        return 128

    @functools.cached_property
    def max_sequence_length(self) -> int:
        """Caption tokens: `model.max_sequence_length` when set, else the family's own."""
        return self.config.max_sequence_length or self.native_max_sequence_length()

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

    def check_source(self) -> None:
        """Fail early and clearly when the model cannot be had: a local folder missing or incomplete, or a hub id
        the hub cannot give (unreachable, offline and not cached, gated, missing, a wrong revision)."""
        pretrained = self.config.pretrained
        needed = tuple(name for name in self.required_components() if name not in self.config.subfolders)
        if not looks_local(pretrained):
            check_hub_model(pretrained, self.config.revision, self.name, needed, folder_looked_for(pretrained))
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

    def _load_problem(self, what: str, source: str, subfolder: str | None, error: BaseException) -> ModelError:
        where = f"{source}/{subfolder}" if subfolder else source
        hint = ("check model.pretrained and model.subfolders (a local folder in the diffusers layout, or a hub id "
                "whose files this machine can download or has in its hub cache); `vidtune data check CONFIG` "
                "checks the model before anything long starts.")
        return ModelError(f"Could not load the {what} of {self.name} from {where}: {error}\nWhat to do: {hint}")

    def load_component(self, cls: Any, component: str, **kwargs: Any) -> Any:
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

    # ----- the contract ------------------------------------------------------------------------------
    def required_components(self) -> tuple[str, ...]:
        """Subfolders a local model folder must have: one text encoder, the VAE, the denoiser and the scheduler
        (families with more extend it)."""
        return ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")

    @abstractmethod
    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        """Raise a ConfigError naming the nearest valid values when the shape breaks the model's rules."""

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

    def objective(self, training: TrainingConfig) -> Objective:
        """The training objective implied by the family's scheduler (override only to add to it)."""
        return objective_from_scheduler(
            self.load_scheduler(),
            sampling=training.sigma_sampling,
            logit_mean=training.logit_mean,
            logit_std=training.logit_std,
            shift=training.sigma_shift,
            source=self.describe_file("scheduler", "scheduler_config.json"),
            stretch=training.sigma_stretch,
            uniform_fraction=training.sigma_uniform_fraction,
            weighting=training.loss_weighting,
        )

    @functools.cached_property
    def patch_sizes(self) -> tuple[int, int, int]:
        """(temporal, height, width) patch of the denoiser, from its config: `patch_size` and `patch_size_t`, or a
        (t, h, w) `patch_size` (Wan)."""
        config = self.load_config(self.denoiser_class, "transformer")
        patch = config.get("patch_size") or 1
        if isinstance(patch, list | tuple):
            return int(patch[0]), int(patch[1]), int(patch[2])
        return int(config.get("patch_size_t") or 1), int(patch), int(patch)

    def token_count(self, latent_shape: tuple[int, ...] | torch.Size) -> int:
        """The denoiser's video tokens for one clip's latents of `latent_shape` ([C, F, H, W]): what noise levels
        drawn by token count (`token_shifted_logit_normal`) depend on."""
        patch_t, patch_h, patch_w = self.patch_sizes
        frames, height, width = (int(size) for size in latent_shape[-3:])
        return -(-frames // patch_t) * (height // patch_h) * (width // patch_w)

    def stream_noise(self, objective: Objective, latents: Latents,
                     generators: list[torch.Generator]) -> tuple[Conditions, dict[str, torch.Tensor]]:
        """The noise of the streams a family's denoiser takes beside the video (LTX-2's audio), drawn for each clip
        of a micro-batch from its visit's generator after the video's draws: (what `forward` reads from the
        conditions, each stream's noise levels by metrics name). By default none."""
        return {}, {}

    # ----- what a precomputed entry depends on ----------------------------------------------------------
    def condition_identity(self) -> dict[str, Any]:
        """Everything `prepare_conditions` depends on besides the text components' weights, their dtype and the
        caption (the cache adds those): part of every precomputed condition's key, and nothing else is.

        A family adds the constants its `prepare_conditions` reads (a prompt template, a hidden layer, a
        setting read from the model folder outside the text components). JSON values only. Settings that do
        not change the tensors (validation, LoRA targets, the denoiser's inputs) stay out, so that changing
        them keeps the cache."""
        return {"family": self.name, "version": self.cache_version, "max_sequence_length": self.max_sequence_length}

    def latent_identity(self) -> dict[str, Any]:
        """Everything `prepare_latents` depends on besides the VAE's (and image encoder's) weights, their dtype,
        the preprocessing and the clip (the cache adds those); a family adds the constants its
        `prepare_latents` reads (e.g. the noise augmentation of an image-to-video first frame). JSON values."""
        return {"family": self.name, "version": self.cache_version}

    @abstractmethod
    def prepare_conditions(self, text: TextComponents, captions: list[str]) -> Conditions: ...

    @abstractmethod
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        """videos: [B, F, 3, H, W] in [-1, 1] -> normalised posterior {"latents_mean", "latents_std"}. A family
        with an `audio_format` also takes `audio=` (an `AudioBatch`: each window's sound, or None)."""

    def audio_format(self) -> AudioFormat | None:
        """The sound a family trains on beside the frames (sample rate, channels), which the data path then decodes
        for each window and hands to `prepare_latents` as `audio=`; None (the default): no sound is decoded."""
        return None

    @abstractmethod
    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor: ...

    @abstractmethod
    def pipeline(self, text: TextComponents, vae: nn.Module, denoiser: nn.Module) -> Any:
        """The family's diffusers pipeline assembled from already loaded components."""

    # ----- sampling with the family's pipeline, and its LoRA format ---------------------------------------------
    def prompt_inputs(self, pipeline: Any, prompt: str, guidance_scale: float) -> dict[str, Any]:
        """How the caption reaches the pipeline call (by default as text: the pipeline encodes it)."""
        return {"prompt": prompt}

    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        """Family-specific inputs of the pipeline call (a frame rate, an image-to-video first frame, ...).
        `reference`: the clip ([F, 3, H, W] in [-1, 1]) whose first frame image-to-video families start from."""
        return {}

    def latents_from_pipeline(self, latents: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
        """The pipeline's `output_type="latent"` result in the training layout [B, C, F, H, W]."""
        return latents

    def guidance_inputs(self, guidance_scale: float) -> dict[str, Any]:
        """Further inputs of the pipeline call that follow the guidance scale (a pipeline with other guidances
        turns them off without guidance)."""
        return {}

    def run_pipeline(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                     num_inference_steps: int, guidance_scale: float, generator: torch.Generator, output_type: str,
                     reference: torch.Tensor | None = None, callback: StepCallback | None = None) -> torch.Tensor:
        """One call of the family's pipeline; returns its `.frames`. `callback`: the pipeline's
        `callback_on_step_end`, given the step's latents."""
        return self.call_pipeline(pipeline, prompt, frames, height, width, num_inference_steps, guidance_scale,
                                  generator, output_type, reference, callback).frames

    def call_pipeline(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                      num_inference_steps: int, guidance_scale: float, generator: torch.Generator, output_type: str,
                      reference: torch.Tensor | None = None, callback: StepCallback | None = None) -> Any:
        """`run_pipeline`'s call, returning the pipeline's whole output (a family with more than frames reads the
        rest)."""
        return pipeline(
            **self.prompt_inputs(pipeline, prompt, guidance_scale),
            num_frames=frames,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            max_sequence_length=self.max_sequence_length,
            generator=generator,
            output_type=output_type,
            **self.guidance_inputs(guidance_scale),
            **self.pipeline_inputs(reference),
            **step_callback(callback),
        )

    def generate(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                 num_inference_steps: int, guidance_scale: float, generator: torch.Generator,
                 reference: torch.Tensor | None = None, callback: StepCallback | None = None) -> torch.Tensor:
        """Sample one video with the family's pipeline: float [F, 3, H, W] in [-1, 1]. `callback(pipeline, step,
        timestep, {"latents": ...})` runs after each denoising step (it returns the dict)."""
        video = self.run_pipeline(pipeline, prompt, frames, height, width, num_inference_steps, guidance_scale,
                                  generator, "pt", reference, callback)
        return video[0].float() * 2.0 - 1.0

    def generate_sample(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                        num_inference_steps: int, guidance_scale: float, generator: torch.Generator,
                        reference: torch.Tensor | None = None, callback: StepCallback | None = None
                        ) -> GeneratedSample:
        """What validation and `vidtune sample` write: `generate`'s frames, and the sound of a family whose pipeline
        generates it (a family with a sound track overrides this)."""
        return GeneratedSample(self.generate(pipeline, prompt, frames, height, width, num_inference_steps,
                                             guidance_scale, generator, reference, callback))

    def generate_latents(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                         num_inference_steps: int, generator: torch.Generator,
                         reference: torch.Tensor | None = None) -> torch.Tensor:
        """Sample with the family's pipeline (its own scheduler, no guidance), returning the final latents
        in the training layout [B, C, F, H, W], normalised like `prepare_latents` output. Used to check
        that what the trainer teaches is what the pipeline samples."""
        latents = self.run_pipeline(pipeline, prompt, frames, height, width, num_inference_steps, 1.0, generator,
                                    "latent", reference)
        return self.latents_from_pipeline(latents, frames, height, width)

    def check_training(self, config: Config) -> None:
        """Refuse, before any long work, run settings the model cannot take (e.g. an algorithm that cannot train a
        two-expert model); by default everything goes."""
        return None

    # ----- frame rate and first-frame conditioning ------------------------------------------------------------
    def clip_frame_rate(self, clip: Clip, data_fps: float | None) -> float | None:
        """The frame rate the denoiser is told for `clip` (None: the family takes none): `data.fps` when clips are
        resampled to it, else the clip's own rate as its file says; `model.frame_rate` for stills, clips that do
        not say their rate, and every clip when `model.clip_frame_rate` is off."""
        if not self.frame_rate_conditioned:
            return None
        if not self.config.clip_frame_rate:
            return self.frame_rate
        if data_fps:
            return float(data_fps)
        if clip.info is not None and not clip.is_image and clip.info.fps > 0:
            return float(clip.info.fps)
        return self.frame_rate

    def frame_rates(self, conditions: Conditions, batch: int) -> torch.Tensor:
        """[B] float64: each sample's frame rate (`FRAME_RATE` beside its latents; `frame_rate` without it, as in
        sampling-time checks that pass tensors directly)."""
        if FRAME_RATE in conditions:
            return conditions[FRAME_RATE].detach().double().flatten().cpu()
        return torch.full((batch,), float(self.frame_rate), dtype=torch.float64)

    @property
    def first_frame_probability(self) -> float:
        """`model.first_frame_conditioning`, else the family's default (0 for a family without it)."""
        chosen = self.config.first_frame_conditioning
        return float(self.first_frame_conditioning or 0.0) if chosen is None else float(chosen)

    def visit_conditions(self, x0: torch.Tensor, positions: torch.Tensor, seed: int) -> Conditions:
        """Conditions drawn per visit from the clean latents `x0` [B, C, F, H, W] (the trainer adds them to the
        batch's): by default, first-frame conditioning when the family takes it and its probability is above 0."""
        if self.first_frame_conditioning is None or self.first_frame_probability <= 0:
            return {}
        return first_frame.draw(self.first_frame_probability, x0, positions, seed)

    def check_frame_settings(self, config: Config, clips: list[Clip]) -> None:
        """Before any long work: `model.first_frame_conditioning` only for a family that takes it; and for a family
        whose sound lasts frames / rate (LTX-2), the clips a batch can hold (one bucket) must share a frame rate when
        batches hold several clips, as their sound is stacked."""
        if self.first_frame_conditioning is None and config.model.first_frame_conditioning is not None:
            raise ConfigError(
                f"model.first_frame_conditioning={config.model.first_frame_conditioning}: {self.name} takes no "
                "first-frame conditioning (the LTX families do).\nWhat to do: remove model.first_frame_conditioning."
            )
        if self.audio_format() is None or config.training.batch_size == 1:
            return
        by_bucket: dict[int, dict[float, Clip]] = {}
        for clip in clips:
            rate = self.clip_frame_rate(clip, config.data.fps)
            if rate is not None:
                by_bucket.setdefault(clip.bucket or 0, {}).setdefault(rate, clip)
        mixed = {bucket: rates for bucket, rates in by_bucket.items() if len(rates) > 1}
        if mixed:
            lines = [f"  - bucket {bucket}: " + "; ".join(f"{rate:g} fps ({clip.where})"
                                                          for rate, clip in rates.items())
                     for bucket, rates in sorted(mixed.items())]
            raise ConfigError(
                f"training.batch_size={config.training.batch_size}: {self.name} trains each clip with the sound of its "
                "frames at its own frame rate, so a batch's clips must share a rate, but clips of one bucket "
                "differ:\n" + "\n".join(lines) + "\nWhat to do: set data.fps to resample every clip to one rate, "
                "or training.batch_size=1 (training.gradient_accumulation gives the same clips per step), or set "
                "model.clip_frame_rate=false to tell every clip model.frame_rate."
            )

    def per_clip_error(self, error: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        """Each clip's mean of the squared error [B, C, F, H, W] (a family leaves out what its pipeline does not
        predict, e.g. a first frame given as a condition)."""
        return error.flatten(1).mean(dim=1)

    def denoiser_folders(self, denoiser: nn.Module) -> dict[str, nn.Module]:
        """Where a full fine-tune's denoiser is saved in a run folder, by folder name (a model with several
        denoisers names one folder per denoiser, as its pipeline's components)."""
        return {TRANSFORMER_FOLDER: denoiser}

    def initial_adapters(self, path: Path) -> dict[str, Path]:
        """`lora.init_from`: the adapter files to start from, by the prefix their keys take in the denoiser's
        adapter state dict (one denoiser: one file, no prefix; a family with several denoisers maps each to its
        file). Raises ConfigError when `path` is not what the family takes."""
        if not path.is_file():
            raise ConfigError(f"lora.init_from: {path} is not a file.\nWhat to do: give the path of an adapter file "
                              f"(e.g. another run's {LORA_WEIGHTS}).")
        return {"": path}

    def load_lora(self, pipeline: Any, folder: Path, weight_name: str = LORA_WEIGHTS) -> None:
        """A run's adapter into the family's pipeline (by default its `load_lora_weights`; a family with more than
        one denoiser loads each of its files)."""
        pipeline.load_lora_weights(str(folder), weight_name=weight_name)

    def comfyui_lora_rules(self) -> list[Rule]:
        """How the family's diffusers modules are named in its original checkpoint, which is what ComfyUI loads
        (see vidtune/export/comfyui.py): one `Rule` per module pattern, fused layers with their parts' sizes
        (read them from the transformer config). Empty: the family has no ComfyUI file."""
        return []

    def comfyui_model(self) -> ComfyUIModel | None:
        """The model of ComfyUI's core that runs this family (vidtune/export/comfyui_models.py), whose LoRA names
        every ComfyUI file is checked against; None: ComfyUI's core has no model for it, and no file is written."""
        return None

    def comfyui_absent(self) -> str:
        """Why the family has no ComfyUI file, and what loads its LoRA in ComfyUI instead."""
        return f"ComfyUI's core has no {self.name} model."

    def save_lora(self, folder: Path, state_dict: dict[str, torch.Tensor], metadata: dict | None,
                  weight_name: str = LORA_WEIGHTS) -> Path:
        """Write the adapter (`folder/weight_name`) in the format the family's `load_lora_weights` reads."""
        # Written beside and renamed into place: a kill never leaves a cut-short adapter over a complete one.
        target = Path(folder) / weight_name
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=INCOMPLETE) as scratch:
            written = Path(scratch) / weight_name
            self.pipeline_class.save_lora_weights(
                scratch, transformer_lora_layers=state_dict, transformer_lora_adapter_metadata=metadata,
                weight_name=weight_name,
            )
            follow_umask(written)
            os.replace(written, target)
        return target

    def control_channels(self, denoiser: nn.Module) -> int:
        """Channels of a control latent: the VAE's latent channels, which the denoiser predicts."""
        config = denoiser.config
        return int(config.out_channels or config.in_channels)

    def pack_control(self, control: torch.Tensor, denoiser: nn.Module) -> tuple[torch.Tensor, int]:
        """A control latent [B, C, F, H, W] in the layout of the denoiser's `hidden_states`, and the dimension
        its channels are on (the control is concatenated last there). By default the VAE's layout, channels 1."""
        return control, 1

    def training_error(self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor,
                       timesteps: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Each clip's error [B] for the loss: `forward`, then `per_clip_error` against the video target. A family
        whose denoiser also predicts other streams (LTX-2's audio) adds their errors here, so trainers stay unaware."""
        prediction = self.forward(denoiser, conditions, noisy_latents, timesteps)
        return self.per_clip_error((prediction.float() - target).pow(2), conditions)

    def reference_frame_count(self, frames: int) -> int:
        """Frames of the reference clip an image-to-video family samples from (the first, unless keyframes)."""
        return 1

    def empty_conditions(self, conditions: Conditions) -> Conditions:
        """The `zero` caption-dropout technique: same shapes, zero embedding (masks kept)."""
        return {k: (torch.zeros_like(v) if v.is_floating_point() else v) for k, v in conditions.items()}
