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

from vidtune.errors import ConfigError
from vidtune.files import atomic_path, follow_umask
from vidtune.outputs import LORA_WEIGHTS, comfyui_lora_weights

if TYPE_CHECKING:
    from vidtune.export.comfyui_models import ComfyUIModel
    from vidtune.models.spec import ModelSpec

PREFIX = "diffusion_model."


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


def _adapters(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name -> (lora_A weight, lora_B weight), from a peft or diffusers (`transformer.`) state dict."""
    found: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    other = []
    for key, value in state_dict.items():
        name = key.removeprefix("transformer.")
        match = re.fullmatch(r"(.+)\.(lora_A|lora_B)\.weight", name)
        if match is None:
            other.append(key)
            continue
        found[match.group(1)][match.group(2)] = value
    if other:
        kind = "DoRA magnitudes" if any("lora_magnitude_vector" in key for key in other) else "weights"
        raise ComfyUIExportError(
            f"The adapter holds {kind} the ComfyUI LoRA format has no place for: {', '.join(sorted(other)[:5])}.\n"
            "What to do: use the diffusers file (pytorch_lora_weights.safetensors) for this adapter; the ComfyUI "
            "file is written for plain LoRA adapters."
        )
    incomplete = sorted(name for name, pair in found.items() if len(pair) != 2)
    if incomplete:
        raise ComfyUIExportError(f"The adapter of {', '.join(incomplete[:5])} lacks lora_A or lora_B.\n"
                                 "What to do: export from a complete checkpoint (vidtune export CHECKPOINT_DIR).")
    return {name: (pair["lora_A"], pair["lora_B"]) for name, pair in found.items()}


def _find_rule(name: str, rules: list[Rule]) -> tuple[Rule, str] | None:
    for rule in rules:
        match = re.fullmatch(rule.source, name)
        if match is not None:
            return rule, match.expand(rule.target)
    return None


def comfyui_lora(state_dict: dict[str, torch.Tensor], rules: list[Rule], alpha: float,
                 family: str = "this model", model: ComfyUIModel | None = None) -> dict[str, torch.Tensor]:
    """The ComfyUI LoRA of an adapter (peft state dict, or a diffusers file's) trained with `lora.alpha = alpha`;
    with `model`, checked against the names that ComfyUI model reads."""
    if not rules:
        raise ComfyUIExportError(f"There is no ComfyUI LoRA layout for {family} yet.\n"
                                 f"What to do: use the diffusers file ({LORA_WEIGHTS}).")
    singles: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    groups: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = defaultdict(dict)
    sizes: dict[str, tuple[int, ...]] = {}
    unknown = []
    for name, (down, up) in sorted(_adapters(state_dict).items()):
        found = _find_rule(name, rules)
        if found is None or down.ndim != 2:
            unknown.append(name)
            continue
        rule, target = found
        up = up * (alpha / down.shape[0])  # peft scales B @ A by alpha / rank; ComfyUI without alpha by 1
        if rule.swap_halves:
            first, second = up.chunk(2, dim=0)
            up = torch.cat([second, first], dim=0)
        if not rule.parts:
            singles[target] = (down, up)
            continue
        if up.shape[0] != rule.parts[rule.part]:
            raise ValueError(f"{name}: {up.shape[0]} output features, but the {family} layout of {target} "
                             f"says {rule.parts[rule.part]}")
        groups[target][rule.part] = (down, up)
        sizes[target] = rule.parts
    if unknown:
        raise ComfyUIExportError(
            f"These adapted modules have no name in {family}'s original checkpoint layout, so ComfyUI could not "
            f"load them: {', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}.\n"
            "What to do: leave them out of lora.target_modules to get a ComfyUI file, or use the diffusers file "
            "(pytorch_lora_weights.safetensors)."
        )
    result = {}
    for target, (down, up) in singles.items():
        result[f"{PREFIX}{target}.lora_A.weight"] = down.contiguous()
        result[f"{PREFIX}{target}.lora_B.weight"] = up.contiguous()
    for target, parts in groups.items():
        down, up = fuse(parts, sizes[target])
        result[f"{PREFIX}{target}.lora_A.weight"] = down
        result[f"{PREFIX}{target}.lora_B.weight"] = up
    if model is not None:
        check_names(result, model, family)
    return dict(sorted(result.items()))


def unread_keys(tensors: dict[str, torch.Tensor], model: ComfyUIModel) -> list[str]:
    """The keys of a ComfyUI LoRA file that `model`'s LoRA loader would not apply (it logs "lora key not loaded")."""
    names = model.lora_names()
    unread = []
    for key in tensors:
        match = re.fullmatch(rf"{re.escape(PREFIX)}(.+)\.lora_[AB]\.weight", key)
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
        follow_umask(temporary)
    return Path(path)


def save_comfyui_lora(spec: ModelSpec, folder: str | os.PathLike[str], state_dict: dict[str, torch.Tensor],
                      alpha: float, name: str) -> Path:
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
    files = {comfyui_lora_weights(name, is_second): comfyui_lora(part, rules, alpha, spec.name, model)
             for is_second, part in ((False, first), (True, second)) if part}
    written = [write_comfyui_lora(Path(folder) / file, tensors) for file, tensors in files.items()]
    for path in written:
        print(f"Wrote the LoRA for ComfyUI: {path} (for ComfyUI/models/loras).", flush=True)
    return written[0]
