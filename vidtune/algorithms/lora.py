"""Adapters on the denoiser (LoRA, or LoKr / LoHa by `adapter.type`); the base weights stay frozen.

What is adapted is `lora.target_modules`: a preset the family declares (`attention`, `attention+ffn`,
`all-linear`) or module names. `lora.use_dora` adds DoRA's magnitudes; `lora.init_from` starts from an existing
adapter file instead of a fresh adapter. What differs between the kinds is the kind's (vidtune/algorithms/adapters.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from diffusers.training_utils import cast_training_params
from peft import PeftConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn

from vidtune.algorithms.adapters import LORA, AdapterKind, adapted_module, adapter_kind, kind_of, split_key
from vidtune.algorithms.part import AlgorithmPart
from vidtune.ema import EMA
from vidtune.errors import ConfigError
from vidtune.export.comfyui import ComfyUIExportError, save_comfyui_lora
from vidtune.memory import finish_base_weights, prepare_base_weights
from vidtune.models.spec import ALL_LINEAR
from vidtune.outputs import LORA_EMA_WEIGHTS, LORA_WEIGHTS

CPU = torch.device("cpu")

if TYPE_CHECKING:
    from vidtune.config import Config
    from vidtune.data.sources import Clip
    from vidtune.models.spec import ModelSpec
    from vidtune.objectives import Objective

def module_suffixes(names: Iterable[str]) -> list[str]:
    """Module paths as short peft target names: what follows the first block index
    (`transformer_blocks.0.attn1.to_q` -> `attn1.to_q`), or the whole path outside the blocks. A short name that
    would also end the path of a module holding some of them (Wan Animate's face adapter `to_out`, a Linear, and
    its blocks' `attn1.to_out`, a list holding `to_out.0`) stays the whole path: peft adapts only what it names."""
    names = list(names)
    holders = {".".join(name.split(".")[:end]) for name in names for end in range(1, name.count(".") + 1)}
    holders -= set(names)
    suffixes = set()
    for name in names:
        parts = name.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        short = ".".join(parts[index + 1:]) if index is not None and index + 1 < len(parts) else name
        clashes = any(holder == short or holder.endswith(f".{short}") for holder in holders)
        suffixes.add(name if clashes else short)
    return sorted(suffixes)


def linear_module_names(module: nn.Module) -> list[str]:
    return [name for name, child in module.named_modules() if isinstance(child, nn.Linear)]


class LoRAPart(AlgorithmPart):
    """Adapters on the denoiser (`lora.*`, `adapter.*`); the base weights stay frozen (and may be stored
    quantized)."""

    resume_fixed_keys = ("lora.rank", "lora.alpha", "lora.target_modules", "lora.use_dora", "adapter.type",
                         "adapter.decompose_factor", "adapter.decompose_both")

    def __init__(self, config: Config, spec: ModelSpec) -> None:
        super().__init__(config, spec)
        self.kind: AdapterKind = adapter_kind(config)
        self.targets: list[str] | None = None  # the resolved `lora.target_modules`, once the adapter is added
        # Modules of the denoiser that train fully beside the adapter: never stored quantized (memory.base_weights).
        self.trained_fully: tuple[str, ...] = ()

    def check(self, clips: Sequence[Clip], objective: Objective, resuming: bool) -> None:
        """The LoRA settings, before anything long: a preset the family lacks, an init_from file missing."""
        self.requested_targets()
        init_from = self.config.lora.init_from
        if init_from and not resuming:
            self.spec.initial_adapters(Path(init_from))  # a missing file fails here, before any model loads

    def requested_targets(self) -> tuple[str, ...]:
        """`lora.target_modules` as module names: a preset of the family resolved, a list as it is."""
        option, presets = self.config.lora.target_modules, self.spec.lora_presets
        if option is None:
            return self.spec.default_lora_targets
        if isinstance(option, str):
            if option not in presets:
                raise ConfigError(
                    f"lora.target_modules: '{option}' is not a preset of {self.spec.name} (its presets: "
                    f"{', '.join(presets)}).\nWhat to do: use one of these presets, or a list of module names, e.g. "
                    "lora.target_modules=[to_q,to_v]."
                )
            return presets[option]
        return tuple(option)

    def resolve_targets(self, module_names: list[str]) -> list[str]:
        """The module names handed to peft; `all-linear` becomes the suffixes of every linear layer in
        `module_names` (so the adapter's metadata lists them, and diffusers loads it like any other). Layers that
        train fully (`trained_fully`) are left out."""
        module_names = [name for name in module_names if name not in self.trained_fully]
        requested = self.requested_targets()
        if ALL_LINEAR not in requested:
            return list(requested)
        return module_suffixes(module_names)

    def lora_config(self) -> PeftConfig:
        """The peft config of the adapter: `adapter.type`'s kind, with `lora.*` (vidtune/algorithms/adapters.py)."""
        return self.kind.peft_config(self.config, list(self.targets or self.requested_targets()),
                                     self.spec.lora_exclude_modules() or None)

    def configure(self, denoiser: nn.Module, resuming: bool = False) -> list[nn.Parameter]:
        self._denoiser = denoiser
        denoiser.requires_grad_(False)
        # fp8, nf4: before the adapter wraps the layers; int8 (below): under the adapter's wrapped layers.
        prepare_base_weights(denoiser, self.config.memory.base_weights, self.trained_fully)
        self.targets = self.resolve_targets(linear_module_names(denoiser))
        try:
            denoiser.add_adapter(self.lora_config())
        except ValueError as error:
            examples = ", ".join(self.spec.default_lora_targets)
            raise ConfigError(
                f"lora.target_modules: {error}\nWhat to do: use module names of the denoiser (e.g. {examples}) or a "
                f"preset of {self.spec.name}: {', '.join(self.spec.lora_presets)}."
            ) from None
        # Adapters train in fp32 even when the frozen base runs in bf16.
        cast_training_params(denoiser, dtype=torch.float32)
        if self.config.lora.init_from and not resuming:
            self.load_initial_adapter(denoiser, Path(self.config.lora.init_from))
        finish_base_weights(denoiser, self.config.memory.base_weights, self.trained_fully)
        return [p for p in denoiser.parameters() if p.requires_grad]

    def load_initial_adapter(self, denoiser: nn.Module, path: Path) -> None:
        """`lora.init_from`: the adapter file's weights into the fresh adapter, refused unless they fit it (a
        denoiser of several parts, e.g. two experts, takes a file per part: `spec.initial_adapters`)."""
        expected = get_peft_model_state_dict(denoiser)
        state: dict[str, torch.Tensor] = {}
        alphas: set[float | None] = set()
        for prefix, file in self.spec.initial_adapters(path).items():
            part, alpha = read_adapter(self.spec, file)
            state.update({prefix + key: value for key, value in part.items()})
            alphas.add(alpha)
        options = self.config.lora
        key = f"lora.init_from: {path}"
        try:
            kind = kind_of(state)
        except ValueError as error:
            raise ConfigError(f"{key}: {error}.\nWhat to do: give an adapter file written by vidtune or diffusers.") \
                from None
        if kind != self.kind:
            raise ConfigError(f"{key} is a {kind.label} adapter, but adapter.type is {self.kind.name}.\nWhat to do: "
                              f"set adapter.type={kind.name}.")
        # The rank a file's tensors show: LoRA's A rows, LoHa's w1_b rows (a LoKr factor's shapes depend on more).
        ranks = sorted({int(v.shape[0]) for k, v in state.items() if ".lora_A." in k or k.endswith(".hada_w1_b")})
        if ranks and ranks != [options.rank]:
            raise ConfigError(f"{key} is an adapter of rank {', '.join(map(str, ranks))}, but lora.rank is "
                              f"{options.rank}.\nWhat to do: set lora.rank={ranks[0]} (and lora.alpha to the "
                              "adapter's), or start from a fresh adapter (remove lora.init_from).")
        for alpha in sorted(alphas, key=lambda a: -1.0 if a is None else a):
            effective_alpha = alpha if alpha is not None else float(options.rank)  # no metadata: diffusers scales by 1
            if (ranks or kind is not LORA) and effective_alpha != options.alpha:
                raise ConfigError(f"{key} has alpha {effective_alpha:g}, but lora.alpha is {options.alpha:g} (the "
                                  f"adapter's effect would be scaled differently).\nWhat to do: set "
                                  f"lora.alpha={effective_alpha:g}.")
        has_dora = any("lora_magnitude_vector" in k for k in state)
        if has_dora != options.use_dora:
            raise ConfigError(f"{key} is {'a DoRA' if has_dora else 'a plain LoRA'} adapter, but lora.use_dora is "
                              f"{str(options.use_dora).lower()}.\nWhat to do: set "
                              f"lora.use_dora={str(has_dora).lower()}.")
        extra = sorted({adapted_module(k) for k in state.keys() - expected.keys()})
        missing = sorted({adapted_module(k) for k in expected.keys() - state.keys()})
        if extra or missing:
            lines = [f"{key} does not adapt the same layers as lora.target_modules ({', '.join(self.targets)}):"]
            if extra:
                lines.append(f"  - it adapts {len(extra)} layers this adapter does not, e.g. {', '.join(extra[:3])}")
            if missing:
                lines.append(f"  - it lacks {len(missing)} layers this adapter has, e.g. {', '.join(missing[:3])}")
            suffixes = module_suffixes(adapted_module(k) for k in state)
            lines.append(f"What to do: set lora.target_modules=[{','.join(suffixes)}] (the adapter's layers).")
            raise ConfigError("\n".join(lines))
        shapes = [k for k in state if tuple(state[k].shape) != tuple(expected[k].shape)]
        if shapes:
            raise ConfigError(f"{key}: {shapes[0]} has shape {tuple(state[shapes[0]].shape)}, this model's "
                              f"{tuple(expected[shapes[0]].shape)}: the adapter was made for another model.\n"
                              f"What to do: use an adapter of this model (model.pretrained){self.kind_hint()}.")
        set_peft_model_state_dict(denoiser, state)
        print(f"Starting from the adapter {path} ({len(state)} tensors).", flush=True)

    def kind_hint(self) -> str:
        """What else makes a LoKr / LoHa adapter's shapes differ: its own settings."""
        if self.kind.name == "lora":
            return ""
        return (f", made with this lora.rank ({self.config.lora.rank})"
                + (" and these adapter.decompose_factor / decompose_both" if "lokr_w1" in self.kind.tensors else ""))

    @contextlib.contextmanager
    def teacher(self) -> Iterator[nn.Module]:
        """The frozen base model, without gradients: the same denoiser with its adapters turned off (a teacher that
        costs no second copy). The unwrapped denoiser: under torchrun no DDP hooks run for a forward without them."""
        self.denoiser.disable_adapters()
        try:
            with torch.no_grad():
                yield self.denoiser
        finally:
            self.denoiser.enable_adapters()  # also gives the adapters back their requires_grad

    def state_dict(self) -> dict[str, torch.Tensor]:
        return get_peft_model_state_dict(self.denoiser)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        result = set_peft_model_state_dict(self.denoiser, state)
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise ValueError(f"checkpoint has weights this adapter does not: {unexpected[:5]}")

    def adapter_metadata(self) -> dict:
        metadata = self.lora_config().to_dict()
        metadata["target_modules"] = sorted(metadata["target_modules"])
        return metadata

    def save_final(self, folder: Path, ema: EMA | None, name: str | None = None) -> Path:
        """The adapter (and its ComfyUI file), and with `training.ema_decay` its moving average beside it."""
        state = self.state_dict()
        written = self.spec.save_lora(folder, state, self.adapter_metadata())
        self.save_comfyui(folder, state, self.run_name(name))
        if ema is not None:
            with ema.applied():
                self.spec.save_lora(folder, self.state_dict(), self.adapter_metadata(), LORA_EMA_WEIGHTS)
        return written

    def export(self, weights: dict[str, torch.Tensor], output: Path, ema: dict[str, torch.Tensor] | None = None,
               name: str | None = None) -> Path:
        """A checkpoint holds the adapter exactly as `save_final` writes it: no base model needed."""
        # `all-linear` resolves to the layers the adapter has, as it did when training added it.
        self.targets = self.resolve_targets(sorted({adapted_module(k) for k in weights}))
        written = self.spec.save_lora(output, weights, self.adapter_metadata())
        self.save_comfyui(output, weights, self.run_name(name))
        if ema is not None:
            self.spec.save_lora(output, ema, self.adapter_metadata(), LORA_EMA_WEIGHTS)
        return written

    def base_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        return base_weights_for(self.spec, state, self._denoiser)

    def save_comfyui(self, folder: Path, state: dict[str, torch.Tensor], name: str) -> Path | None:
        """The same adapter for ComfyUI, beside the diffusers file, named after the run (`name`). An adapter the
        ComfyUI layout cannot hold (a target without an original name, a family ComfyUI's core has no model for) is
        reported, not fatal: the diffusers file is the run's result."""
        try:
            return save_comfyui_lora(self.spec, folder, state, self.config.lora.alpha, name,
                                     rank=self.config.lora.rank, base=self.base_weights(state))
        except ComfyUIExportError as error:
            print(f"No LoRA file for ComfyUI: {error}", flush=True)
            return None


def base_weights_for(spec: ModelSpec, state: dict[str, torch.Tensor],
                     denoiser: nn.Module | None = None) -> dict[str, torch.Tensor] | None:
    """The frozen weights a DoRA adapter's ComfyUI file is computed from (ComfyUI divides by the base weight's
    norm, peft by the adapted weight's: vidtune/export/comfyui.py), by module name as the adapter's keys name
    modules; None for an adapter without DoRA. `denoiser`: the one the adapter trained on, else loaded on the CPU."""
    if not any("lora_magnitude_vector" in key for key in state):
        return None
    module = denoiser if denoiser is not None else spec.load_denoiser(CPU)
    return {key.removesuffix(".weight").replace(".base_layer", ""): value.detach()
            for key, value in module.state_dict().items()
            if key.endswith(".weight") and split_key(key) is None and value.ndim == 2}


def read_adapter(spec, path: Path) -> tuple[dict[str, torch.Tensor], float | None]:
    """(the denoiser's adapter tensors in peft's naming, its alpha when the file says) of an adapter file, read
    with the family pipeline's own `lora_state_dict`, which converts the formats diffusers knows."""
    if not path.is_file():
        raise ConfigError(f"lora.init_from: {path} is not a file.\nWhat to do: give the path of an adapter file "
                          f"(e.g. another run's {LORA_WEIGHTS}).")
    try:
        state, metadata = spec.pipeline_class.lora_state_dict(str(path.parent), weight_name=path.name,
                                                              return_lora_metadata=True)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise ConfigError(f"lora.init_from: {path} could not be read as a {spec.name} adapter: {error}\n"
                          "What to do: give an adapter file in the diffusers format (or one the family's diffusers "
                          "loader converts, such as ComfyUI's).") from None
    prefix = "transformer."
    state = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    if not state:
        raise ConfigError(f"lora.init_from: {path} holds no adapter weights for the {spec.name} denoiser.\n"
                          "What to do: give an adapter trained for this model family.")
    metadata = metadata or {}
    if metadata.get(f"{prefix}rank_pattern") or metadata.get(f"{prefix}alpha_pattern"):
        raise ConfigError(f"lora.init_from: {path} has a rank or alpha per layer, which vidtune does not train.\n"
                          "What to do: start from an adapter with one rank and alpha.")
    alpha = metadata.get(f"{prefix}lora_alpha", metadata.get(f"{prefix}alpha"))  # LoraConfig's, LyCORIS configs'
    return state, None if alpha is None else float(alpha)
