"""memory.blocks_to_swap and memory.activation_offload.

On the CPU the trainer leaves both off with a notice. The swap's hooks are device-agnostic, so these tests force a
CPU -> CPU swap (host copies and compute copies are separate tensors) into the trainer: each swapped block must
compute with a freshly brought copy in its forward, its backward and checkpointing's recomputation, never with the
host copy, and training must give bit for bit the losses and adapter of the run without it. The CUDA tests
(identical results, lower peak memory) are in tests/training/test_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vidtune import offload
from vidtune.errors import ConfigError
from vidtune.models.registry import SPECS
from vidtune.trainers import build_trainer


class Recorder:
    """Forces a CPU -> CPU swap of the last `n` blocks, and checks every linear layer of a swapped block at each
    use (forward, recomputation, backward): its weight must not be the host copy."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.swap: offload.BlockSwap | None = None
        self.uses = {"forward": 0, "backward": 0}
        self.host_uses = 0
        monkeypatch.setattr("vidtune.training.setup.apply_block_swap", self.apply)

    def apply(self, denoiser, block_lists, blocks_to_swap, device):
        blocks = offload.swappable_blocks(denoiser, block_lists)
        swapped = range(len(blocks) - blocks_to_swap, len(blocks))
        # One block on the "device" at a time, so the tiny models' two blocks move at every use.
        self.swap = offload.BlockSwap(blocks, swapped, torch.device("cpu"), torch.device("cpu"), resident_blocks=1)
        for index in swapped:
            for module in blocks[index].modules():
                if type(module) is nn.Linear and not module.weight.requires_grad:
                    module.register_forward_pre_hook(self.check("forward"))
                    module.register_full_backward_pre_hook(self.check("backward"))
        return self.swap

    def host_pointers(self) -> set[int]:
        return {_pointer(host) for block in self.swap.swapped.values() for _, _, host in block.stored}

    def check(self, kind: str):
        def hook(module, *_):
            self.uses[kind] += 1
            self.host_uses += _pointer(module.weight) in self.host_pointers()
        return hook


def _pointer(tensor: torch.Tensor) -> int:
    """Where a weight's values are: torchao's int8 tensors hold them in `qdata`."""
    return getattr(tensor, "qdata", tensor).data_ptr()


def _adapter(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.context.denoiser.named_parameters() if p.requires_grad}


def _train_with_and_without_swap(make_config, tmp_path, monkeypatch, family, swap, **sections):
    plain = build_trainer(make_config(family, output_dir=str(tmp_path / "plain"), **sections))
    plain_result = plain.run()
    recorder = Recorder(monkeypatch)
    memory = {**sections.pop("memory", {}), "blocks_to_swap": swap}
    swapped = build_trainer(make_config(family, output_dir=str(tmp_path / "swap"), memory=memory, **sections))
    swapped_result = swapped.run()
    return plain, plain_result, swapped, swapped_result, recorder


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SPECS))
def test_block_swap_trains_exactly_as_without_it(make_config, tmp_path, monkeypatch, family):
    training = {"steps": 1, "gradient_checkpointing": True}
    plain, plain_result, swapped, result, recorder = _train_with_and_without_swap(
        make_config, tmp_path, monkeypatch, family, 2, training=training)

    # Equal to float32's rounding: the CPU's matrix kernels may round differently on the swapped blocks' separately
    # allocated copies of the weights (Kandinsky 5's loss differs by 1.2e-7 relative; most families' not at all).
    torch.testing.assert_close(result.losses, plain_result.losses, rtol=1e-6, atol=0)
    expected, trained = _adapter(plain), _adapter(swapped)
    assert expected.keys() == trained.keys() and expected
    for name in expected:
        # Bit for bit for most families; CogVideoX image-to-video's adapter differs by up to 1.3e-7 and
        # HunyuanVideo 1.5's (trained at shift 3) in one element of 384 by 1.6e-6 (the CPU's matrix kernels may
        # round differently on the separately allocated copies of the weights; AdamW's first step scales an
        # element's rounding by its gradient's own size, so a near-zero gradient's shows most).
        torch.testing.assert_close(trained[name], expected[name], rtol=1e-5, atol=5e-6)
    # Both swapped blocks brought for the forward, then at least the first again for its backward and
    # recomputation (joint-attention blocks, whose two outputs' gradients arrive at different times, move more
    # often); each linear layer used in both, never with the host copy; one block on the device at rest.
    swap = recorder.swap
    assert swap.loads >= 3, swap.loads
    assert recorder.uses["forward"] > 0 and recorder.uses["backward"] > 0
    assert recorder.host_uses == 0
    assert sum(block.resident for block in swap.swapped.values()) == 1


def test_block_swap_without_checkpointing_brings_blocks_back_for_the_backward(make_config, tmp_path, monkeypatch):
    """Without recomputation, the hook on a block's output gradient brings it back before its backward; with the
    quantized int8 base (torchao tensors, moved as they are) the run still equals its unswapped twin."""
    sections = {"training": {"steps": 2}, "memory": {"activation_offload": True, "base_weights": "int8"}}
    plain, plain_result, swapped, result, recorder = _train_with_and_without_swap(
        make_config, tmp_path, monkeypatch, "ltx-video", 2, **sections)
    assert result.losses == plain_result.losses
    expected, trained = _adapter(plain), _adapter(swapped)
    assert all(torch.equal(trained[name], expected[name]) for name in expected)
    assert recorder.uses["backward"] > 0 and recorder.host_uses == 0
    # Step 1: blocks 0, 1 forward, block 0 backward; step 2: block 1 forward (0 is there), block 0 backward.
    assert recorder.swap.loads == 5
    stored = [host for block in recorder.swap.swapped.values() for _, _, host in block.stored]
    assert any(type(host).__name__ == "Int8Tensor" for host in stored)


def test_block_swap_and_activation_offload_are_off_on_the_cpu_with_a_notice(make_config, tmp_path, capsys):
    config = make_config(training={"steps": 1, "gradient_checkpointing": True},
                         memory={"blocks_to_swap": 1, "activation_offload": True})
    trainer = build_trainer(config)
    trainer.run()
    out = capsys.readouterr().out
    assert "memory.blocks_to_swap=1: block swap works on CUDA only; off on cpu." in out
    assert "memory.activation_offload: works on CUDA only; off on cpu." in out
    assert trainer.context.block_swaps == ()


@pytest.mark.parametrize(("sections", "message"), [
    ({"training": {"algorithm": "full", "gradient_checkpointing": True}},
     "works with adapter algorithms only: training.algorithm=full trains"),
    ({"training": {"algorithm": "guidance-distillation", "gradient_checkpointing": True},
      "distillation": {"student": "full"}},
     "works with adapter algorithms only: distillation.student=full trains"),
    ({}, "needs training.gradient_checkpointing=true"),
    ({"training": {"gradient_checkpointing": True}, "parallel": {"strategy": "fsdp"}},
     "cannot be combined with parallel.strategy=fsdp"),
    ({"training": {"gradient_checkpointing": True, "compile": True}},
     "cannot be combined with training.compile=true"),
])
def test_block_swap_refuses_what_it_cannot_serve_before_loading(make_config, sections, message, monkeypatch):
    trainer = build_trainer(make_config(memory={"blocks_to_swap": 1}, **sections))
    monkeypatch.setattr("vidtune.training.setup.load_denoiser",
                        lambda *args, **kwargs: pytest.fail("loaded models before refusing"))
    with pytest.raises(ConfigError, match=message) as error:
        trainer.run()
    assert "What to do:" in str(error.value)


@pytest.mark.parametrize(("family", "blocks"), [("ltx-video", 2), ("hunyuan-video", 2), ("wan", 2)])
def test_block_swap_names_the_number_of_blocks_before_loading(make_config, monkeypatch, family, blocks):
    trainer = build_trainer(make_config(family, training={"gradient_checkpointing": True},
                                        memory={"blocks_to_swap": 99}))
    monkeypatch.setattr("vidtune.training.setup.load_denoiser",
                        lambda *args, **kwargs: pytest.fail("loaded models before refusing"))
    with pytest.raises(ConfigError, match=f"blocks_to_swap=99, but the denoiser has {blocks} transformer blocks"):
        trainer.run()


def test_every_family_names_its_block_lists(tiny_model_dir):
    """The spec's `block_lists` are ModuleLists of its denoiser, with every block of the model's depth."""
    from vidtune.config import ModelConfig
    from vidtune.models.registry import get_spec_class

    for family in sorted(SPECS):
        spec = get_spec_class(family)(ModelConfig(name=family, pretrained=str(tiny_model_dir(family))))
        denoiser = spec.load_denoiser(torch.device("cpu"))
        blocks = offload.swappable_blocks(denoiser, spec.block_lists)
        lists = [m for m in denoiser.children() if isinstance(m, nn.ModuleList) and len(m) and
                 any(p.numel() for p in m.parameters())]
        biggest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
        assert blocks and all(any(block is b for b in blocks) for block in biggest), family


def test_a_quantized_base_for_a_gpu_is_set_up_in_host_memory():
    """The GPU never holds the unquantized denoiser: quantized storage is made on the host, then moved."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert all(offload.loading_device(option, cuda) == cpu for option in ("fp8", "int8", "nf4"))
    assert offload.loading_device("auto", cuda) == cuda
    assert offload.loading_device("int8", cpu) == cpu


def test_the_planner_refuses_block_swap_for_full_fine_tuning_as_training_does(make_config):
    from vidtune.memory.plan import plan_memory

    config = make_config(training={"algorithm": "full", "gradient_checkpointing": True},
                         memory={"blocks_to_swap": 1})
    with pytest.raises(ConfigError, match=r"works with adapter algorithms only: training\.algorithm=full trains"):
        plan_memory(config)
