"""Which strategy `parallel.strategy` gives, and the settings it refuses before any model loads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vidtune.config import load_config
from vidtune.errors import ConfigError
from vidtune.models.registry import get_spec_class
from vidtune.parallel.checkpointers import ShardedCheckpointer
from vidtune.parallel.choose import choose_strategy
from vidtune.parallel.ddp import DataParallelStrategy
from vidtune.parallel.fsdp import FullyShardedStrategy, quantized_parameters, transformer_blocks, weights_not_read
from vidtune.parallel.strategy import Strategy

REQUIRED = ["model.name=ltx-video", "model.pretrained=some/model", "data.root=clips"]
CPU = torch.device("cpu")


def choose(*overrides: str) -> Strategy:
    return choose_strategy(load_config(None, [*REQUIRED, *overrides]), CPU)


@pytest.mark.parametrize(("world", "setting", "expected"), [
    ("1", "auto", Strategy),
    ("2", "auto", DataParallelStrategy),
    ("1", "ddp", DataParallelStrategy),
    ("4", "fsdp", FullyShardedStrategy),
])
def test_the_strategy_named_or_implied(monkeypatch, world, setting, expected):
    monkeypatch.setenv("WORLD_SIZE", world)
    strategy = choose(f"parallel.strategy={setting}")
    assert type(strategy) is expected
    assert isinstance(strategy.checkpointer(), ShardedCheckpointer) == (expected is FullyShardedStrategy)


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.replicate_degree=3"], r"replicate_degree=3 does not divide the 4 processes.*What to do"),
])
def test_fsdp_refuses_what_it_cannot_run(monkeypatch, overrides, message):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=message):
        choose("parallel.strategy=fsdp", *overrides)


def test_fsdp_takes_a_moving_average_and_a_quantized_base(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    strategy = choose("parallel.strategy=fsdp", "training.ema_decay=0.99", "memory.base_weights=int8")
    assert type(strategy) is FullyShardedStrategy


def test_only_the_quantized_frozen_weights_are_kept_out_of_the_sharding():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = nn.ModuleDict({"int8": nn.Linear(32, 32), "fp8": nn.Linear(4, 4), "norm": nn.LayerNorm(4),
                           "adapter": nn.Linear(4, 4)})
    model.requires_grad_(False)
    model["adapter"].requires_grad_(True)
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda module, name: name == "int8")
    model["fp8"].to(torch.float8_e4m3fn)
    kept = quantized_parameters(model)
    assert kept == {model["int8"].weight, model["fp8"].weight, model["fp8"].bias}
    assert model["int8"].bias not in kept  # stays fp32: sharded like the rest


def test_hsdp_groups_that_divide_the_processes_are_accepted(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert choose("parallel.strategy=fsdp", "parallel.replicate_degree=2").config.parallel.replicate_degree == 2


def test_every_list_of_blocks_is_sharded_block_by_block():
    class Denoiser(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch_embed = nn.Linear(2, 2)
            self.transformer_blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])
            self.single_transformer_blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
            self.norms = nn.ModuleList([nn.LayerNorm(2)])

    denoiser = Denoiser()
    assert transformer_blocks(denoiser) == [*denoiser.transformer_blocks, *denoiser.single_transformer_blocks]


@pytest.mark.parametrize(("world", "setting", "expected"), [
    ("4", "auto", True), ("1", "auto", False), ("4", "false", False), ("4", "true", True)])
def test_rank0_loading_is_on_for_several_processes_unless_turned_off(monkeypatch, world, setting, expected):
    monkeypatch.setenv("WORLD_SIZE", world)
    strategy = choose("parallel.strategy=fsdp", f"parallel.load_on_rank0={setting}")
    assert strategy.loads_on_rank0 is expected


def test_rank0_loading_without_fsdp_names_the_keys():
    with pytest.raises(ConfigError, match=r"parallel.load_on_rank0=true needs parallel.strategy=fsdp .*What to do"):
        load_config(None, [*REQUIRED, "parallel.strategy=ddp", "parallel.load_on_rank0=true"])


def test_the_ranks_that_do_not_load_build_the_same_denoiser_without_weights(tiny_model_dir):
    """What rank 0 loads and what the other ranks build on the meta device: the same names, shapes and dtypes."""
    config = load_config(None, [*REQUIRED, f"model.pretrained={tiny_model_dir('ltx-video')}"])
    spec = get_spec_class("ltx-video")(config.model)
    loaded = spec.load_denoiser(CPU)
    with weights_not_read(spec):
        built = spec.load_denoiser(CPU, torch.device("meta"))
    assert "load_component" not in vars(spec)  # the spec loads weights again afterwards
    layout = {name: (t.shape, t.dtype) for name, t in loaded.state_dict().items()}
    assert {name: (t.shape, t.dtype) for name, t in built.state_dict().items()} == layout and layout
    assert all(t.is_meta for t in [*built.parameters(), *built.buffers()])
