"""Block swap and activation offload on CUDA: the same results as without them, and less peak memory.
Skipped where no CUDA device exists (the CPU tests of the same hooks are in tests/memory/test_block_swap.py)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from vidtune import offload
from vidtune.models.registry import available_models
from vidtune.trainers import build_trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _adapter(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu() for name, p in trainer.context.denoiser.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", available_models())
@pytest.mark.parametrize("memory", [{"blocks_to_swap": 2}, {"activation_offload": True},
                                    {"blocks_to_swap": 1, "activation_offload": True}])
def test_offload_trains_as_without_it_on_cuda(make_config, tmp_path, family, memory):
    training = {"steps": 3, "device": "cuda", "precision": "fp32", "gradient_checkpointing": True}
    plain = build_trainer(make_config(family, training=training, output_dir=str(tmp_path / "plain")))
    plain_result = plain.run()
    trainer = build_trainer(make_config(family, training=training, memory=memory, output_dir=str(tmp_path / "o")))
    result = trainer.run()
    assert bool(trainer.context.block_swaps) == bool(memory.get("blocks_to_swap"))
    assert result.losses == pytest.approx(plain_result.losses, rel=1e-5)
    expected, trained = _adapter(plain), _adapter(trainer)
    for name in expected:
        torch.testing.assert_close(trained[name], expected[name], rtol=1e-5, atol=1e-6)
    assert all(p.device.type == "cuda" for p in trainer.context.denoiser.parameters() if p.requires_grad)


def _mid_size_ltx(layers: int = 8, heads: int = 16, head_dim: int = 64) -> torch.nn.Module:
    """An LTX-Video transformer of 1024 channels with random weights and a rank-16 adapter, on the GPU in bf16."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(in_channels=128, out_channels=128, num_attention_heads=heads,
                                       attention_head_dim=head_dim, cross_attention_dim=heads * head_dim,
                                       num_layers=layers, caption_channels=256)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    for parameter in model.parameters():
        parameter.data = parameter.data.to(torch.float32 if parameter.requires_grad else torch.bfloat16)
    model.enable_gradient_checkpointing()
    return model.to("cuda")


def _step(model: torch.nn.Module, offload_activations: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward at 16 x 32 x 32 latents (16k tokens); the peak allocated GiB and the gradients."""
    generator = torch.Generator("cuda").manual_seed(0)
    frames, height, width = 4, 32, 32
    hidden = torch.randn(1, frames * height * width, 128, device="cuda", generator=generator, dtype=torch.bfloat16)
    text = torch.randn(1, 32, 256, device="cuda", generator=generator, dtype=torch.bfloat16)
    mask = torch.ones(1, 32, device="cuda")
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with offload.activation_offload(offload_activations, torch.device("cuda")), \
            torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(hidden, text, torch.tensor([500], device="cuda"), mask, num_frames=frames, height=height,
                    width=width, return_dict=False)[0]
    out.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    return peak, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_block_swap_lowers_peak_memory_and_keeps_gradients_on_cuda():
    model = _mid_size_ltx()
    plain_peak, plain_grads = _step(model)
    blocks = offload.swappable_blocks(model, ("transformer_blocks",))
    swap = offload.apply_block_swap(model, ("transformer_blocks",), 6, torch.device("cuda"))
    swapped_peak, swapped_grads = _step(model)
    # A bf16 block of 1024 channels (attention, feed-forward, cross-attention) is about 25 MiB; 6 swapped blocks
    # with at most 2 on the device save about 4 blocks.
    block_gib = sum(p.numel() * p.element_size() for p in blocks[0].parameters() if not p.requires_grad) / 2**30
    assert swapped_peak < plain_peak - 3 * block_gib, (plain_peak, swapped_peak, block_gib)
    for name in plain_grads:
        torch.testing.assert_close(swapped_grads[name], plain_grads[name], rtol=1e-3, atol=1e-5)
    assert swap.loads >= 6 * 2 - 1
    swap.remove()


def test_activation_offload_lowers_peak_memory_and_keeps_gradients_on_cuda():
    model = _mid_size_ltx()
    model.disable_gradient_checkpointing()  # the saved activations are what moves
    plain_peak, plain_grads = _step(model)
    offloaded_peak, offloaded_grads = _step(model, offload_activations=True)
    assert offloaded_peak < 0.8 * plain_peak, (plain_peak, offloaded_peak)
    for name in plain_grads:
        torch.testing.assert_close(offloaded_grads[name], plain_grads[name], rtol=1e-3, atol=1e-5)
