"""The LoRA in ComfyUI's format: `diffusion_model.`-prefixed keys named after the original checkpoint's modules.

ComfyUI loads a LoRA by matching `diffusion_model.<module>` against the module names of the checkpoint it runs,
which are the model's original (non-diffusers) names: Wan's `blocks.N.self_attn.q`, HunyuanVideo's fused
`double_blocks.N.img_attn_qkv`. Each family declares how its diffusers modules map to those names
(`ModelSpec.comfyui_lora_rules`, a list of `Rule`); this module applies the rules.

The adapter naming is `lora_A` / `lora_B` with no `.alpha`: ComfyUI reads it (scale 1 without alpha), and it is
the naming diffusers' converters for non-diffusers LoRAs read back (LTX-Video's rejects `lora_down` / `lora_up`
and bare `.alpha` keys). So the alpha / rank scale is folded into `lora_B`.

Several diffusers modules can be slices of one original layer (q, k and v of a fused `qkv`). Their adapters
(A_i: r_i x in, B_i: out_i x r_i) become one of rank sum(r_i): A stacks the A_i, B is block-diagonal, so
B @ A stacks the B_i @ A_i row blocks, exactly the fused layer's delta. A part without an adapter is a block
of zero rows.

LoKr and LoHa modules keep their own tensors under the names ComfyUI's `comfy/weight_adapter/lokr.py` and
`loha.py` read (`lokr_w1`, `lokr_w2_a`, ..., `hada_w1_a`, ...), peft's scale folded into the first factor and no
`alpha`. A fused layer, or one whose output halves swap, cannot take one Kronecker or Hadamard factorisation from
its parts', so there the module's delta is written as exact LoRA factors (`AdapterKind.low_rank`) and fused as
above: ComfyUI reads each module of a file by the names it finds.

DoRA: ComfyUI reads `<module>.dora_scale` beside `lora_A` / `lora_B` (`comfy/lora.py` `load_lora`) and rescales
(`comfy/weight_adapter/base.py` `weight_decompose`): with `dora_scale` of shape [rows, 1] it makes each row
`(W + dW) * dora_scale / (|W| + eps)`, where |W| is the *base* weight's row norm, while peft makes
`(W + dW) * m / |W + dW|` (`peft/tuners/lora/dora.py`). The file's `dora_scale` is therefore
`m * (|W| + eps) / |W + dW|`, computed from the base weights (eps: float32's, the dtype ComfyUI patches in), which
gives peft's weight exactly; a fused layer's rows without an adapter get `|W| + eps`, which leaves them as they are.

Every file is checked, before it is written, against the LoRA names the ComfyUI model of its family reads
(`comfyui_models.py`): a key ComfyUI would skip is an error naming it, never a file that half-applies.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from vidtune.algorithms.adapters import LORA, AdapterKind, by_module, kind_of
from vidtune.errors import ConfigError
from vidtune.files import atomic_path, follow_umask
from vidtune.outputs import LORA_WEIGHTS, comfyui_lora_weights
from vidtune.storage.digests import stamp_digest

if TYPE_CHECKING:
    from vidtune.export.comfyui_models import ComfyUIModel
    from vidtune.models.spec import ModelSpec

PREFIX = "diffusion_model."
# The tensor names ComfyUI reads per module (comfy/lora.py `load_lora`, comfy/weight_adapter/*.py `load`).
COMFYUI_TENSORS = ("lora_A.weight", "lora_B.weight", "dora_scale", "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2",
                   "lokr_w2_a", "lokr_w2_b", "lokr_t2", "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1",
                   "hada_t2")
# ComfyUI computes DoRA in float32 and adds this to the base weight's row norm (`weight_decompose`).
DORA_EPS = torch.finfo(torch.float32).eps


class ComfyUIExportError(ConfigError):
    """The adapter has weights that the ComfyUI format of its family cannot hold."""


@dataclass(frozen=True)
class Rule:
    """Diffusers modules whose name fully matches `source` (a regex) are the original module `target`
    (`\\1`-style groups of `source`), or, with `parts`, the rows of part `part` of the fused original layer
    `target`, whose parts have `parts` output features each, in order. `swap_halves`: the original orders the
    two halves of the output rows the other way round (SwiGLU's projection and gate, scale and shift)."""

    source: str
    target: str
    part: int = 0
    parts: tuple[int, ...] = ()
    swap_halves: bool = False


def fused(sources: list[str], target: str, sizes: list[int]) -> list[Rule]:
    """The rules of one fused original layer: `sources[i]` is its part i, of `sizes[i]` output features."""
    return [Rule(source, target, part, tuple(sizes)) for part, source in enumerate(sources)]


@dataclass(frozen=True)
class Module:
    """One adapted module of a peft / diffusers state dict: its kind and tensors (names without `.weight`)."""

    name: str
    kind: AdapterKind
    tensors: dict[str, torch.Tensor]

    @property
    def magnitude(self) -> torch.Tensor | None:
        return self.tensors.get("lora_magnitude_vector")


def _modules(state_dict: dict[str, torch.Tensor]) -> list[Module]:
    """The adapted modules of a peft or diffusers (`transformer.`) state dict, by name."""
    state = {key.removeprefix("transformer."): value for key, value in state_dict.items()}
    other = sorted(key for key, tensors in by_module(state).items() if "" in tensors)
    if other:
        raise ComfyUIExportError(
            f"The adapter holds weights the ComfyUI format has no place for: {', '.join(other[:5])}.\n"
            "What to do: use the diffusers file (pytorch_lora_weights.safetensors) for this adapter."
        )
    modules, incomplete = [], []
    for name, tensors in sorted(by_module(state).items()):
        try:
            kind = kind_of(set(tensors))
        except ValueError as error:
            raise ComfyUIExportError(f"{name}: {error}.\nWhat to do: use the diffusers file ({LORA_WEIGHTS}).") \
                from None
        if kind is LORA and not {"lora_A", "lora_B"} <= tensors.keys():
            incomplete.append(name)
        modules.append(Module(name, kind, tensors))
    if incomplete:
        raise ComfyUIExportError(f"The adapter of {', '.join(incomplete[:5])} lacks lora_A or lora_B.\n"
                                 "What to do: export from a complete checkpoint (vidtune export CHECKPOINT_DIR).")
    return modules


def _find_rule(name: str, rules: list[Rule]) -> tuple[Rule, str] | None:
    for rule in rules:
        match = re.fullmatch(rule.source, name)
        if match is not None:
            return rule, match.expand(rule.target)
    return None


def comfyui_lora(state_dict: dict[str, torch.Tensor], rules: list[Rule], alpha: float,
                 family: str = "this model", model: ComfyUIModel | None = None, rank: int | None = None,
                 base: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The ComfyUI file of an adapter (peft state dict, or a diffusers file's) trained with `lora.alpha = alpha`
    and `lora.rank = rank` (a LoRA's rank is its matrices'); with `model`, checked against the names that ComfyUI
    model reads. `base`: the frozen weights by module name, which a DoRA adapter's `dora_scale` is computed from."""
    if not rules:
        raise ComfyUIExportError(f"There is no ComfyUI LoRA layout for {family} yet.\n"
                                 f"What to do: use the diffusers file ({LORA_WEIGHTS}).")
    result: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = defaultdict(dict)
    group_scales: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    sizes: dict[str, tuple[int, ...]] = {}
    unknown = []
    for module in _modules(state_dict):
        found = _find_rule(module.name, rules)
        if found is None or any(value.ndim > 2 for value in module.tensors.values()):
            unknown.append(module.name)
            continue
        rule, target = found
        scale = alpha / _rank(module, rank)
        if module.kind is not LORA and not rule.parts and not rule.swap_halves:
            result.update({f"{PREFIX}{target}.{name}": value
                           for name, value in module.kind.comfyui_tensors(module.tensors, scale).items()})
            continue
        up, down = module.kind.low_rank(module.tensors, scale)  # peft scales the delta; ComfyUI without alpha by 1
        dora = None if module.magnitude is None else _dora_scale(module, up @ down, base, family)
        if rule.swap_halves:
            up = _swap_halves(up)
            dora = None if dora is None else _swap_halves(dora)
        if not rule.parts:
            result[f"{PREFIX}{target}.lora_A.weight"] = down.contiguous()
            result[f"{PREFIX}{target}.lora_B.weight"] = up.contiguous()
            if dora is not None:
                result[f"{PREFIX}{target}.dora_scale"] = dora[:, None].contiguous()
            continue
        if up.shape[0] != rule.parts[rule.part]:
            raise ValueError(f"{module.name}: {up.shape[0]} output features, but the {family} layout of {target} "
                             f"says {rule.parts[rule.part]}")
        groups[target][rule.part] = (down, up)
        sizes[target] = rule.parts
        if dora is not None:
            group_scales[target][rule.part] = dora
    if unknown:
        raise ComfyUIExportError(
            f"These adapted modules have no name in {family}'s original checkpoint layout, so ComfyUI could not "
            f"load them: {', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}.\n"
            "What to do: leave them out of lora.target_modules to get a ComfyUI file, or use the diffusers file "
            "(pytorch_lora_weights.safetensors)."
        )
    for target, parts in groups.items():
        down, up = fuse(parts, sizes[target])
        result[f"{PREFIX}{target}.lora_A.weight"] = down
        result[f"{PREFIX}{target}.lora_B.weight"] = up
        if group_scales[target]:
            rows = _fused_rows(target, sizes[target], group_scales[target], rules, base, family)
            result[f"{PREFIX}{target}.dora_scale"] = rows[:, None].contiguous()
    if model is not None:
        check_names(result, model, family)
    return dict(sorted(result.items()))


def _rank(module: Module, rank: int | None) -> int:
    """The rank peft divides alpha by: a LoRA's (its matrices'), else `lora.rank`."""
    if module.kind is LORA:
        return int(module.tensors["lora_A"].shape[0])
    if rank is None:
        raise ValueError(f"{module.name}: a {module.kind.label} adapter's ComfyUI file needs lora.rank")
    return rank


def _swap_halves(rows: torch.Tensor) -> torch.Tensor:
    first, second = rows.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def _base_weight(name: str, base: dict[str, torch.Tensor] | None, family: str) -> torch.Tensor:
    if base is None or name not in base:
        raise ComfyUIExportError(f"The DoRA adapter of {name} needs {family}'s base weight of that layer for its "
                                 "ComfyUI file, which was not given.\nWhat to do: export it with the model it was "
                                 "trained on (vidtune export), or use the diffusers file.")
    return base[name].float()


def _dora_scale(module: Module, delta: torch.Tensor, base: dict[str, torch.Tensor] | None,
                family: str) -> torch.Tensor:
    """ComfyUI's `dora_scale` rows that give peft's DoRA weight `m * (W + dW) / |W + dW|` (see the module's
    docstring): `m * (|W| + eps) / |W + dW|`, one per output row (diffusers' row order)."""
    weight = _base_weight(module.name, base, family)
    magnitude = module.magnitude.float()
    return magnitude * (weight.norm(dim=1) + DORA_EPS) / (weight + delta.float()).norm(dim=1)


def _fused_rows(target: str, sizes: tuple[int, ...], scales: dict[int, torch.Tensor], rules: list[Rule],
                base: dict[str, torch.Tensor] | None, family: str) -> torch.Tensor:
    """The `dora_scale` of a fused layer: each adapted part's rows, and `|W| + eps` for a part without an adapter
    (ComfyUI then leaves its rows as they are), the part's base weight found by the rules."""
    rows = []
    for part in range(len(sizes)):
        if part in scales:
            rows.append(scales[part])
            continue
        names = [name for name in (base or {}) if (found := _find_rule(name, rules)) is not None
                 and found[1] == target and found[0].part == part]
        if not names:
            raise ComfyUIExportError(f"{target}: part {part} of the fused layer has no adapter and no base weight "
                                     f"to keep it as it is under DoRA.\nWhat to do: adapt all of its parts, or use "
                                     "the diffusers file.")
        weight = _base_weight(names[0], base, family)
        found = _find_rule(names[0], rules)
        norms = weight.norm(dim=1) + DORA_EPS
        rows.append(_swap_halves(norms) if found is not None and found[0].swap_halves else norms)
    return torch.cat(rows)


def unread_keys(tensors: dict[str, torch.Tensor], model: ComfyUIModel) -> list[str]:
    """The keys of a ComfyUI LoRA file that `model`'s LoRA loader would not apply (it logs "lora key not loaded")."""
    names = model.lora_names()
    suffixes = "|".join(re.escape(name) for name in COMFYUI_TENSORS)
    unread = []
    for key in tensors:
        match = re.fullmatch(rf"{re.escape(PREFIX)}(.+)\.({suffixes})", key)
        if match is None or match.group(1) not in names:
            unread.append(key)
    return sorted(unread)


def check_names(tensors: dict[str, torch.Tensor], model: ComfyUIModel, family: str) -> None:
    """Raise when a key of the file is not one `model` reads: such a file would apply only in part."""
    unread = unread_keys(tensors, model)
    if unread:
        raise ComfyUIExportError(
            f"ComfyUI's {model.name} model ({family}) would not load {len(unread)} of the {len(tensors)} tensors of "
            f"the ComfyUI file: {', '.join(unread[:6])}{' ...' if len(unread) > 6 else ''}.\n"
            "What to do: leave these layers out of lora.target_modules to get a ComfyUI file, or use the diffusers "
            f"file ({LORA_WEIGHTS}); please report it, with the model's name, as vidtune's layout for it is wrong."
        )


def fuse(parts: dict[int, tuple[torch.Tensor, torch.Tensor]], sizes: tuple[int, ...]) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """One adapter for a fused layer from the adapters of some of its parts (part -> (A, B)): A stacked, B
    block-diagonal, zero rows for parts without an adapter. Its B @ A is the parts' B_i @ A_i stacked by rows."""
    ordered = [parts[index] for index in sorted(parts)]
    down = torch.cat([a for a, _ in ordered], dim=0)
    reference = ordered[0][1]
    up = reference.new_zeros(sum(sizes), down.shape[0])
    row_starts = [sum(sizes[:index]) for index in range(len(sizes))]
    column = 0
    for index in sorted(parts):
        _, b = parts[index]
        up[row_starts[index]:row_starts[index] + b.shape[0], column:column + b.shape[1]] = b
        column += b.shape[1]
    return down.contiguous(), up


def write_comfyui_lora(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor]) -> Path:
    """Write the ComfyUI LoRA file atomically: a kill never leaves a cut-short file over a complete one."""
    with atomic_path(path) as temporary:
        save_file(tensors, temporary, metadata={"format": "pt"})
        stamp_digest(temporary)  # the digest of its tensors in its metadata: `vidtune checkpoint verify` reads it
        follow_umask(temporary)
    return Path(path)


def save_comfyui_lora(spec: ModelSpec, folder: str | os.PathLike[str], state_dict: dict[str, torch.Tensor],
                      alpha: float, name: str, rank: int | None = None,
                      base: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `folder/<name>_comfyui.safetensors`: the adapter (peft or diffusers state dict) in `spec`'s ComfyUI
    layout, checked against the names ComfyUI's model of the family reads; a second denoiser's adapter
    (`transformer_2.` keys) goes to `folder/<name>_transformer_2_comfyui.safetensors`. Nothing is written unless
    every file passes. Returns the first file written."""
    model = spec.comfyui_model()
    if model is None:
        raise ComfyUIExportError(spec.comfyui_absent())
    rules = spec.comfyui_lora_rules()
    # A second denoiser's adapter (`transformer_2.` keys: Wan 2.2's low-noise expert) is a LoRA file of its own.
    second_prefix = "transformer_2."
    second = {k.removeprefix(second_prefix): v for k, v in state_dict.items() if k.startswith(second_prefix)}
    first = {k: v for k, v in state_dict.items() if not k.startswith(second_prefix)}
    bases = (None, None) if base is None else (
        {k.removeprefix("transformer."): v for k, v in base.items() if not k.startswith(second_prefix)},
        {k.removeprefix(second_prefix): v for k, v in base.items() if k.startswith(second_prefix)})
    files = {comfyui_lora_weights(name, is_second): comfyui_lora(part, rules, alpha, spec.name, model, rank,
                                                                 bases[is_second])
             for is_second, part in ((False, first), (True, second)) if part}
    written = [write_comfyui_lora(Path(folder) / file, tensors) for file, tensors in files.items()]
    for path in written:
        print(f"Wrote the LoRA for ComfyUI: {path} (for ComfyUI/models/loras).", flush=True)
    return written[0]
