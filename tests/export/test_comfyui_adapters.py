"""LoKr, LoHa and DoRA in the ComfyUI file: the weight ComfyUI patches equals peft's merged weight, and every family's
file is read whole by its ComfyUI model.

ComfyUI's arithmetic is re-implemented here from its source (no ComfyUI needed), with the file's tensors as ComfyUI's
loader finds them (`comfy/lora.py` `load_lora`: `<module>.alpha`, `<module>.dora_scale`, then each adapter's own
names):
- `comfy/weight_adapter/lora.py` `LoRAAdapter.calculate_weight`: `W + (alpha / rank or 1) * lora_B @ lora_A`;
- `comfy/weight_adapter/lokr.py` `LoKrAdapter.calculate_weight`: `w1 = lokr_w1 or lokr_w1_a @ lokr_w1_b`, `w2`
  likewise, `W + scale * kron(w1, w2).reshape(W.shape)`, scale `alpha / dim` only with an alpha and a split factor;
- `comfy/weight_adapter/loha.py` `LoHaAdapter.calculate_weight`: `W + scale * (w1a @ w1b) * (w2a @ w2b)`;
- `comfy/weight_adapter/base.py` `weight_decompose` (DoRA): with `dora_scale` of the weight's row count,
  `(W + dW) * dora_scale / (|W rows| + eps)`, the norm of the base weight `W`, eps float32's.
Tolerance: float32 throughout, `torch.testing.assert_close`'s defaults for float32 (rtol 1.3e-6, atol 1e-5).
"""

from __future__ import annotations

import re

import pytest
import torch
from peft import LoHaConfig, LoKrConfig, LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from torch import nn

from vidtune.algorithms.adapters import KINDS, adapted_module
from vidtune.algorithms.build import build_part, build_spec
from vidtune.export.comfyui import COMFYUI_TENSORS, PREFIX, Rule, comfyui_lora, fused
from vidtune.models.registry import available_models, get_spec_class
from vidtune.models.spec import ModelSpec
from vidtune.outputs import comfyui_lora_weights

CPU = torch.device("cpu")
# The families ComfyUI's core has a model for: those whose spec names ComfyUI's layers.
COMFYUI_FAMILIES = [family for family in available_models()
                    if get_spec_class(family).comfyui_lora_rules is not ModelSpec.comfyui_lora_rules]
RULES = [Rule(r"block\.(\d+)\.out", r"blocks.\1.o"), Rule(r"block\.(\d+)\.ff", r"blocks.\1.w1", swap_halves=True),
         *fused([r"block\.(\d+)\.q", r"block\.(\d+)\.k"], r"blocks.\1.qk", [16, 16])]


class Block(nn.Module):
    """Linear layers the rules above name: a plain one, one whose halves swap, two parts of a fused one."""

    def __init__(self) -> None:
        super().__init__()
        self.out, self.ff, self.q, self.k = nn.Linear(24, 16), nn.Linear(24, 32), nn.Linear(24, 16), nn.Linear(24, 16)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.ModuleList([Block()])


# ----- ComfyUI's arithmetic, from its source ---------------------------------------------------------------
def comfy_lora(weight, tensors, alpha):
    up, down = tensors["lora_B.weight"], tensors["lora_A.weight"]
    scale = alpha / down.shape[0] if alpha is not None else 1.0
    return up @ down, scale


def comfy_lokr(weight, tensors, alpha):
    w1 = tensors["lokr_w1"] if "lokr_w1" in tensors else tensors["lokr_w1_a"] @ tensors["lokr_w1_b"]
    dim = tensors["lokr_w1_b"].shape[0] if "lokr_w1" not in tensors else None
    w2 = tensors["lokr_w2"] if "lokr_w2" in tensors else tensors["lokr_w2_a"] @ tensors["lokr_w2_b"]
    dim = tensors["lokr_w2_b"].shape[0] if "lokr_w2" not in tensors else dim
    scale = alpha / dim if alpha is not None and dim is not None else 1.0
    return torch.kron(w1, w2).reshape(weight.shape), scale


def comfy_loha(weight, tensors, alpha):
    scale = alpha / tensors["hada_w1_b"].shape[0] if alpha is not None else 1.0
    return (tensors["hada_w1_a"] @ tensors["hada_w1_b"]) * (tensors["hada_w2_a"] @ tensors["hada_w2_b"]), scale


def weight_decompose(dora_scale, weight, diff, scale):
    weight_calc = weight + diff * scale
    assert dora_scale.shape[0] == weight.shape[0]  # the output-axis branch
    norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True) + torch.finfo(torch.float32).eps
    return weight_calc * (dora_scale / norm)


def comfyui_patched(weight: torch.Tensor, file: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """`weight` as ComfyUI patches it with the file's tensors of `module` (strength 1)."""
    tensors = {key.removeprefix(f"{PREFIX}{module}."): value for key, value in file.items()
               if key.startswith(f"{PREFIX}{module}.")}
    assert tensors, f"nothing for {module}"
    alpha = tensors["alpha"].item() if "alpha" in tensors else None
    adapter = comfy_lokr if "lokr_w1" in tensors or "lokr_w1_a" in tensors else comfy_loha if "hada_w1_a" in tensors \
        else comfy_lora
    diff, scale = adapter(weight, tensors, alpha)
    if "dora_scale" in tensors:
        return weight_decompose(tensors["dora_scale"], weight, diff, scale)
    return weight + scale * diff


# ----- peft's merged weights --------------------------------------------------------------------------------
def adapted(config) -> tuple[Model, dict[str, torch.Tensor]]:
    model = Model()
    base = {name: layer.weight.detach().clone() for name, layer in model.named_modules()
            if isinstance(layer, nn.Linear)}
    inject_adapter_in_model(config, model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_magnitude_vector" in name:
                parameter.add_(torch.rand(parameter.shape, generator=generator))
            elif any(part in name for part in ("lora_", "lokr_", "hada_")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model, base


def merged(model: Model) -> dict[str, torch.Tensor]:
    """Each layer's weight with peft's adapter merged into it (peft's own `merge`)."""
    weights = {}
    for name, layer in model.named_modules():
        if isinstance(layer, BaseTunerLayer):
            layer.merge()
            weights[name] = layer.get_base_layer().weight.detach().clone()
            layer.unmerge()
    return weights


CONFIGS = {
    "lokr": LoKrConfig(r=2, alpha=3, target_modules=["out", "ff", "q"]),
    "lokr-both-factor-4": LoKrConfig(r=2, alpha=3, target_modules=["out", "ff", "q"], decompose_both=True,
                                     decompose_factor=4),
    "lokr-full-factors": LoKrConfig(r=16, alpha=5, target_modules=["out", "ff", "q"]),  # no split: scale still alpha/r
    "loha": LoHaConfig(r=3, alpha=2, target_modules=["out", "ff", "q"]),
    "dora": LoraConfig(r=2, lora_alpha=3, target_modules=["out", "ff", "q"], use_dora=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_comfyuis_patched_weight_is_pefts_merged_weight(name):
    """A plain layer, a layer whose output halves swap in the original, and one part of a fused layer (the other
    part without an adapter): ComfyUI's weight from the file equals peft's merged weight, in the original's rows."""
    config = CONFIGS[name]
    model, base = adapted(config)
    state = get_peft_model_state_dict(model)
    rank, alpha = config.r, config.alpha if hasattr(config, "alpha") else config.lora_alpha
    file = comfyui_lora(state, RULES, alpha, rank=rank, base=base)
    if name.startswith(("lokr", "loha")):  # a plain layer keeps the LyCORIS tensors under ComfyUI's names
        kind = KINDS[name[:4]]
        assert {key.rpartition(".")[2] for key in file if ".o." in key} <= set(kind.tensors)
    expected = merged(model)
    swap = torch.cat([torch.arange(16, 32), torch.arange(0, 16)])
    torch.testing.assert_close(comfyui_patched(base["block.0.out"], file, "blocks.0.o"), expected["block.0.out"])
    torch.testing.assert_close(comfyui_patched(base["block.0.ff"][swap], file, "blocks.0.w1"),
                               expected["block.0.ff"][swap])
    fused_base = torch.cat([base["block.0.q"], base["block.0.k"]])
    torch.testing.assert_close(comfyui_patched(fused_base, file, "blocks.0.qk"),
                               torch.cat([expected["block.0.q"], base["block.0.k"]]))
    assert all(re.fullmatch(rf"{re.escape(PREFIX)}.+\.({'|'.join(map(re.escape, COMFYUI_TENSORS))})", key)
               for key in file)
    assert not any(key.endswith(".alpha") for key in file)  # peft's scale is in the tensors


def test_the_exact_low_rank_factors_are_the_delta():
    """LoKr and LoHa deltas as one product (what a fused or swapped layer takes) are the kinds' own deltas."""
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    loha = {"hada_w1_a": rand(6, 3), "hada_w1_b": rand(3, 5), "hada_w2_a": rand(6, 3), "hada_w2_b": rand(3, 5)}
    up, down = KINDS["loha"].low_rank(loha, 0.5)
    torch.testing.assert_close(up @ down, 0.5 * (loha["hada_w1_a"] @ loha["hada_w1_b"])
                               * (loha["hada_w2_a"] @ loha["hada_w2_b"]))
    for lokr in ({"lokr_w1": rand(2, 3), "lokr_w2_a": rand(4, 2), "lokr_w2_b": rand(2, 5)},
                 {"lokr_w1_a": rand(3, 1), "lokr_w1_b": rand(1, 2), "lokr_w2": rand(4, 5)}):
        up, down = KINDS["lokr"].low_rank(lokr, 2.0)
        w1 = lokr["lokr_w1"] if "lokr_w1" in lokr else lokr["lokr_w1_a"] @ lokr["lokr_w1_b"]
        w2 = lokr["lokr_w2"] if "lokr_w2" in lokr else lokr["lokr_w2_a"] @ lokr["lokr_w2_b"]
        torch.testing.assert_close(up @ down, 2.0 * torch.kron(w1, w2))


@pytest.mark.parametrize("kind", ["lokr", "loha", "dora"])
@pytest.mark.parametrize("family", COMFYUI_FAMILIES)
def test_comfyuis_model_reads_every_tensor_of_a_lycoris_or_dora_file(make_config, tmp_path, family, kind):
    """The file of the trainer's own adapter (the family's default targets), written as a run writes it: every key
    is one the family's ComfyUI model reads, under a name ComfyUI's loader takes, and every adapted module is there."""
    settings = {"adapter": {"type": kind}} if kind != "dora" else {"lora": {"rank": 2, "use_dora": True}}
    config = make_config(family, **({"lora": {"rank": 2}} | settings))
    spec = build_spec(config)
    part = build_part(config, spec)
    denoiser = spec.load_denoiser(CPU)
    part.configure(denoiser)
    state = {key: torch.randn_like(value) for key, value in get_peft_model_state_dict(denoiser).items()}
    assert part.save_comfyui(tmp_path, state, "run") is not None
    exported = load_file(tmp_path / comfyui_lora_weights("run"))
    names = spec.comfyui_model().lora_names()
    suffixes = "|".join(map(re.escape, COMFYUI_TENSORS))
    modules = {re.fullmatch(rf"diffusion_model\.(.+)\.({suffixes})", key).group(1) for key in exported}
    assert modules <= names.keys(), sorted(modules - names.keys())
    rules = spec.comfyui_lora_rules()
    targets = {next(match.expand(rule.target) for rule in rules if (match := re.fullmatch(rule.source, name)))
               for name in {adapted_module(key) for key in state}}
    assert modules == targets
    if kind == "dora":
        assert all(f"{PREFIX}{module}.dora_scale" in exported for module in modules)
