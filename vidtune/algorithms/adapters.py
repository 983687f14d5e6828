"""The adapter kinds of `adapter.type`: LoRA, LoKr and LoHa, each as one `AdapterKind`.

Everything that differs between the kinds lives here, so the rest of vidtune asks a kind instead of comparing
names: the peft config that adds the adapter (`lora.rank`, `lora.alpha`, `lora.target_modules` apply to every kind;
the LyCORIS knobs are `adapter.*`), the tensor names of one adapted module in peft's state dict, the weight delta
they make (peft's formula, with peft's scale `alpha / rank` for every kind), the ComfyUI names of those tensors, and
the delta as exact low-rank factors (what a fused ComfyUI layer takes, see vidtune/export/comfyui.py).

peft's formulas (`peft/tuners/lokr/layer.py` `LoKrLayer.get_delta_weight`, `peft/tuners/loha/layer.py`
`LoHaLayer.get_delta_weight`): LoKr `s * kron(w1, w2)` with `w1 = lokr_w1` or `lokr_w1_a @ lokr_w1_b` and `w2`
likewise; LoHa `s * (hada_w1_a @ hada_w1_b) * (hada_w2_a @ hada_w2_b)`. ComfyUI computes the same products under
the same names (`comfy/weight_adapter/lokr.py`, `loha.py`, `calculate_weight`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft import LoHaConfig, LoKrConfig, LoraConfig, PeftConfig, inject_adapter_in_model
from peft.utils import set_peft_model_state_dict
from safetensors import safe_open
from torch import nn

if TYPE_CHECKING:
    from vidtune.config import Config

# The tensors of one adapted module in a peft state dict, by kind (a key is `<module>.<name>[.weight]`).
LORA_TENSORS = ("lora_A", "lora_B", "lora_magnitude_vector")
LOKR_TENSORS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
LOHA_TENSORS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
# What diffusers writes a file's adapter settings under (diffusers/loaders/lora_base.py LORA_ADAPTER_METADATA_KEY).
METADATA_KEY = "lora_adapter_metadata"


def split_key(key: str) -> tuple[str, str] | None:
    """`blocks.0.to_q.lokr_w2_a` -> (`blocks.0.to_q`, `lokr_w2_a`); None for a key of no adapter kind."""
    parts = key.split(".")
    for index in range(len(parts) - 1, -1, -1):
        if parts[index] in LORA_TENSORS + LOKR_TENSORS + LOHA_TENSORS:
            return ".".join(parts[:index]), parts[index]
    return None


def adapted_module(key: str) -> str:
    """`blocks.0.attn1.to_q.lora_A.weight` -> `blocks.0.attn1.to_q` (any kind's tensor)."""
    found = split_key(key)
    return found[0] if found is not None else key


def by_module(state_dict: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """module -> {tensor name: tensor}; keys of no adapter kind are under their own name with an empty name."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        module, name = split_key(key) or (key, "")
        modules.setdefault(module, {})[name] = value
    return modules


def _identity_split(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, V) with U @ V == matrix and the inner size min(rows, columns): the matrix beside an identity."""
    rows, columns = matrix.shape
    if rows <= columns:
        return torch.eye(rows, dtype=matrix.dtype, device=matrix.device), matrix
    return matrix, torch.eye(columns, dtype=matrix.dtype, device=matrix.device)


@dataclass(frozen=True)
class AdapterKind:
    """One adapter kind: how peft adds it, the tensors it keeps per module, and the delta they make."""

    name: str  # the `adapter.type` value
    label: str  # how people write it
    tensors: tuple[str, ...]

    def peft_config(self, config: Config, targets: list[str], exclude: list[str] | None) -> PeftConfig:
        lora, adapter = config.lora, config.adapter
        common: dict[str, Any] = {"r": lora.rank, "target_modules": targets, "exclude_modules": exclude}
        if self.name == "lokr":
            return LoKrConfig(**common, alpha=lora.alpha, rank_dropout=adapter.rank_dropout,
                              module_dropout=adapter.module_dropout, decompose_both=adapter.decompose_both,
                              decompose_factor=adapter.decompose_factor, init_weights=True)
        if self.name == "loha":
            return LoHaConfig(**common, alpha=lora.alpha, rank_dropout=adapter.rank_dropout,
                              module_dropout=adapter.module_dropout, init_weights=True)
        return LoraConfig(**common, lora_alpha=lora.alpha, lora_dropout=lora.dropout, init_lora_weights=True,
                          use_dora=lora.use_dora)

    def holds(self, names: set[str]) -> bool:
        return bool(names) and names <= set(self.tensors)

    def delta(self, tensors: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
        """The weight delta of one module's tensors (names without `.weight`), as peft's merged adapter adds it
        (DoRA's magnitudes left out: they rescale the merged weight, vidtune/export/comfyui.py)."""
        up, down = self.low_rank(tensors, scale)
        return up @ down

    def low_rank(self, tensors: dict[str, torch.Tensor], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(up, down) with `up @ down` exactly the delta: LoRA's own factors; LoHa's Hadamard product of two rank-r
        products as one product of rank r * r (`(a1 b1) * (a2 b2) = (a1 . a2) (b1 . b2)`, rows and columns of the
        pairs); LoKr's Kronecker product as `kron(u1, u2) @ kron(v1, v2)` of each factor's own split."""
        if self.name == "lora":
            return tensors["lora_B"] * scale, tensors["lora_A"]
        if self.name == "loha":
            a1, b1, a2, b2 = (tensors[f"hada_w{i}_{s}"] for i, s in ((1, "a"), (1, "b"), (2, "a"), (2, "b")))
            up = (a1[:, :, None] * a2[:, None, :]).reshape(a1.shape[0], -1)
            down = (b1[:, None, :] * b2[None, :, :]).reshape(-1, b1.shape[1])
            return up * scale, down
        u1, v1 = ((tensors["lokr_w1_a"], tensors["lokr_w1_b"]) if "lokr_w1_a" in tensors
                  else _identity_split(tensors["lokr_w1"]))
        u2, v2 = ((tensors["lokr_w2_a"], tensors["lokr_w2_b"]) if "lokr_w2_a" in tensors
                  else _identity_split(tensors["lokr_w2"]))
        return torch.kron(u1, u2) * scale, torch.kron(v1, v2)

    def comfyui_tensors(self, tensors: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
        """One LoKr / LoHa module under ComfyUI's names (`<name>` as peft names it), peft's scale folded into the
        first factor and no `alpha` written: ComfyUI then scales by 1 (`calculate_weight`: alpha is 1.0 without an
        `.alpha` key), so its `kron(w1, w2)` / `(w1a w1b) * (w2a w2b)` is peft's delta whatever the factors'
        shapes."""
        first = "lokr_w1_a" if "lokr_w1_a" in tensors else "lokr_w1" if self.name == "lokr" else "hada_w1_a"
        return {name: (value * scale if name == first else value).contiguous() for name, value in tensors.items()}


KINDS = {
    "lora": AdapterKind("lora", "LoRA", LORA_TENSORS),
    "lokr": AdapterKind("lokr", "LoKr", LOKR_TENSORS),
    "loha": AdapterKind("loha", "LoHa", LOHA_TENSORS),
}
ADAPTER_TYPES = tuple(KINDS)
LORA = KINDS["lora"]


def adapter_kind(config: Config) -> AdapterKind:
    """The kind a config's `adapter.type` names."""
    return KINDS[config.adapter.type]


def kind_of(tensors: dict[str, torch.Tensor] | set[str]) -> AdapterKind:
    """The kind of an adapter state dict (or of a module's tensor names); ValueError when it mixes kinds."""
    names = {found[1] for key in tensors if (found := split_key(key)) is not None} or set(tensors)
    for kind in KINDS.values():
        if kind.holds(names):
            return kind
    raise ValueError(f"the tensors {', '.join(sorted(names)[:6])} are not those of one LoRA, LoKr or LoHa adapter")


def file_settings(path: Path, prefix: str = "transformer.") -> dict[str, Any]:
    """The adapter settings a diffusers adapter file keeps in its header (its peft config, keys under `prefix`)."""
    with safe_open(str(path), framework="pt") as file:
        raw = (file.metadata() or {}).get(METADATA_KEY)
    settings = json.loads(raw) if raw else {}
    return {key.removeprefix(prefix): value for key, value in settings.items() if key.startswith(prefix)}


def add_saved_adapter(module: nn.Module, state: dict[str, torch.Tensor], settings: dict[str, Any]) -> None:
    """A LoKr / LoHa adapter file's tensors (keys without the `transformer.` prefix) into `module` through peft:
    diffusers' `load_lora_weights` of the video pipelines reads LoRA files only."""
    kind = kind_of(state)
    config_class = {"lokr": LoKrConfig, "loha": LoHaConfig}.get(kind.name)
    if config_class is None:
        raise ValueError("a LoRA file is loaded with the pipeline's own load_lora_weights")
    known = set(config_class.__dataclass_fields__)
    config = config_class(**{key: value for key, value in settings.items() if key in known})
    inject_adapter_in_model(config, module)
    result = set_peft_model_state_dict(module, state)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"the adapter file has tensors its settings do not make: {unexpected[:5]}")
