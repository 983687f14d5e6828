"""fp8 base weights: the frozen linear layers keep their float8 weight for the backward pass (not an upcast copy),
with the numerics of diffusers' layerwise casting, eager and compiled."""

from __future__ import annotations

import re

import pytest
import torch
from diffusers import LTXVideoTransformer3DModel
from diffusers.hooks import apply_layerwise_casting
from peft import LoraConfig
from torch import nn

from vidtune.memory import store_frozen_weights_in_fp8
from vidtune.memory.float8 import Float8StorageLinear, store_linear_in_float8

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def _ltx_with_adapter(folder, fp8: str) -> LTXVideoTransformer3DModel:
    """The tiny LTX-Video denoiser, frozen, stored as `fp8` says (`layerwise`: diffusers' hooks on every layer
    they cast, skipping the model's own patterns, as fp8 storage was before; `vidtune`: the float8 linear layers),
    with a LoRA whose B is not zero."""
    denoiser = LTXVideoTransformer3DModel.from_pretrained(folder, subfolder="transformer")
    denoiser.requires_grad_(False)
    if fp8 == "layerwise":
        denoiser.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32,
                                          skip_modules_pattern=tuple(denoiser._skip_layerwise_casting_patterns))
    else:
        store_frozen_weights_in_fp8(denoiser)
    torch.manual_seed(0)
    denoiser.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS, init_lora_weights="gaussian"))
    for parameter in denoiser.parameters():
        if parameter.requires_grad:  # as training does: peft made them in the base layer's dtype
            parameter.data = parameter.data.float()
    return denoiser


def _step(denoiser: LTXVideoTransformer3DModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 8, denoiser.config.in_channels, generator=generator)
    text = torch.randn(1, 5, denoiser.config.caption_channels, generator=generator)
    output = denoiser(hidden_states=hidden, encoder_hidden_states=text, timestep=torch.tensor([500]),
                      encoder_attention_mask=torch.ones(1, 5), num_frames=2, height=2, width=2,
                      return_dict=False)[0]
    output.pow(2).mean().backward()
    return output.detach(), {name: p.grad for name, p in denoiser.named_parameters() if p.requires_grad}


def test_float8_linear_layers_compute_exactly_as_layerwise_casting(tiny_model_dir):
    folder = tiny_model_dir("ltx-video")
    reference, ours = _ltx_with_adapter(folder, "layerwise"), _ltx_with_adapter(folder, "vidtune")
    layers = [name for name, module in ours.named_modules() if isinstance(module, Float8StorageLinear)]
    assert any(name.endswith("attn1.to_q.base_layer") for name in layers)
    kept = LTXVideoTransformer3DModel._skip_layerwise_casting_patterns
    assert kept and not any(re.search(pattern, name) for name in layers for pattern in kept)
    assert ours.dtype == torch.float32
    # The same float8 values in the same places.
    stored = {n: p for n, p in reference.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert stored.keys() == {n for n, p in ours.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert all(torch.equal(p.float(), ours.get_parameter(n).float()) for n, p in stored.items())
    with torch.no_grad():  # the same adapter (peft initialises it in the dtype the base layer has at that time)
        for name, parameter in ours.named_parameters():
            if parameter.requires_grad:
                reference.get_parameter(name).copy_(parameter)

    output, grads = _step(reference)
    our_output, our_grads = _step(ours)
    assert torch.equal(output, our_output)
    assert grads.keys() == our_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.equal(grad, our_grads[name]), name


def _saved_bytes(model: nn.Module, input: torch.Tensor) -> dict[torch.dtype, int]:
    """Bytes of the tensors autograd keeps for the backward pass, by dtype (each storage once)."""
    saved: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[id(tensor.untyped_storage())] = tensor
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = model(input)
    by_dtype: dict[torch.dtype, int] = {}
    for tensor in saved.values():
        by_dtype[tensor.dtype] = by_dtype.get(tensor.dtype, 0) + tensor.untyped_storage().nbytes()
    output.sum().backward()
    return by_dtype


def _frozen_stack(fp8: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    model.requires_grad_(False)
    if fp8 == "layerwise":
        apply_layerwise_casting(model, torch.float8_e4m3fn, torch.float32)
    else:
        for linear in model:
            store_linear_in_float8(linear, torch.float32)
    return model


def test_the_backward_pass_keeps_the_float8_weights_not_upcast_copies():
    input = torch.randn(4, 256, requires_grad=True)
    weights_fp32 = 6 * 256 * 256 * 4
    # Layerwise casting keeps every layer's upcast weight: more than the fp32 weights themselves.
    assert _saved_bytes(_frozen_stack("layerwise"), input).get(torch.float32, 0) >= weights_fp32
    saved = _saved_bytes(_frozen_stack("vidtune"), input)
    assert saved.get(torch.float32, 0) == 0  # no input is needed (frozen weights), no copy is kept
    assert saved[torch.float8_e4m3fn] == 6 * 256 * 256  # the stored weights themselves
    assert input.grad is not None and torch.isfinite(input.grad).all()


def test_a_float8_layer_refuses_to_train():
    model = _frozen_stack("vidtune")
    model[0].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="frozen"):
        model(torch.randn(2, 256))


def test_compiled_float8_layers_match_eager():
    """torch.compile traces the upcast and the custom backward: the same output and input gradient."""
    model = _frozen_stack("vidtune")
    input = torch.randn(4, 256)
    eager_input = input.clone().requires_grad_(True)
    eager = model(eager_input)
    eager.pow(2).sum().backward()
    compiled_input = input.clone().requires_grad_(True)
    compiled = torch.compile(model, fullgraph=True)(compiled_input)
    compiled.pow(2).sum().backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(compiled_input.grad, eager_input.grad)
