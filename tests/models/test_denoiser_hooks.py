"""The hooks generic code asks a family about its denoiser (vidtune/models/spec/hooks.py): one denoiser's defaults, and
Wan 2.2 A14B's two experts, whose parts FSDP shards, the planner counts and control training widens."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.wan22 import BOUNDARY, spec_of
from vidtune.config import TrainingConfig
from vidtune.control import attach_control
from vidtune.models.tiny.wan22 import write_tiny_wan22
from vidtune.parallel.fsdp import transformer_blocks

CPU, CUDA, META = torch.device("cpu"), torch.device("cuda"), torch.device("meta")


@pytest.fixture(scope="module")
def two_expert_dir(tmp_path_factory) -> Path:
    return write_tiny_wan22(tmp_path_factory.mktemp("wan22-a14b-hooks"), two_experts=True, boundary_ratio=BOUNDARY)


def test_one_denoiser_is_one_part_that_stays_put_and_trains_at_every_level(tiny_model_dir, make_config):
    spec = spec_of("wan", tiny_model_dir("wan"))
    denoiser = spec.load_denoiser(CPU)
    assert spec.denoiser_parts(denoiser) == {"": denoiser} and spec.control_parts(denoiser) == {"": denoiser}
    pipeline = SimpleNamespace(transformer=torch.nn.Linear(1, 1))
    assert spec.control_target(denoiser, pipeline) is pipeline.transformer
    assert spec.parts_taking_turns(denoiser, CUDA, 1) == []
    objective = spec.objective(TrainingConfig())
    assert spec.step_objective(objective, make_config("wan"), 7) is objective
    before = {name: p.device for name, p in denoiser.named_parameters()}
    spec.keep_weights_placed(denoiser)
    assert {name: p.device for name, p in denoiser.named_parameters()} == before


def test_two_experts_are_two_parts_sharded_block_by_block(two_expert_dir):
    spec = spec_of("wan2.2", two_expert_dir)
    denoiser = spec.load_denoiser(CPU)
    parts = spec.denoiser_parts(denoiser)
    assert parts == {"transformer": denoiser.transformer, "transformer_2": denoiser.transformer_2}
    # FSDP's units: every block of each expert, as many as the two experts' block lists hold.
    units = [block for part in parts.values() for block in transformer_blocks(part)]
    assert units == [*denoiser.transformer.blocks, *denoiser.transformer_2.blocks] and len(units) >= 2
    assert transformer_blocks(denoiser) == []  # the module holding them has no blocks of its own
    # The keys' prefixes are the parts' names.
    assert {key.split(".")[0] for key in denoiser.state_dict()} == set(parts)


def test_two_experts_take_turns_on_a_gpu_with_one_clip_and_stay_placed_when_asked(two_expert_dir):
    spec = spec_of("wan2.2", two_expert_dir)
    denoiser = spec.load_denoiser(META)
    assert spec.parts_taking_turns(denoiser, CUDA, 1) == [denoiser.transformer, denoiser.transformer_2]
    assert spec.parts_taking_turns(denoiser, CUDA, 2) == []  # a batch may hold clips of both experts
    assert spec.parts_taking_turns(denoiser, CPU, 1) == []
    assert denoiser.offload  # off the CPU the idle expert's frozen weights would move to host memory ...
    spec.keep_weights_placed(denoiser)
    assert not denoiser.offload  # ... unless whoever places the weights says so


def test_control_widens_each_trained_expert_and_samples_through_their_holder(two_expert_dir):
    widened = ["transformer", "transformer_2"]
    spec = spec_of("wan2.2", two_expert_dir)
    denoiser = spec.load_denoiser(CPU)
    assert list(spec.control_parts(denoiser)) == widened
    control = attach_control(spec, denoiser)
    assert list(control.files("control_input.safetensors")) == widened
    assert {key.split(".")[0] for key in control.state_dict()} == set(widened)
    pipeline = SimpleNamespace(transformer=denoiser.transformer)
    assert spec.control_target(denoiser, pipeline) is denoiser
    one = spec_of("wan2.2", two_expert_dir, experts="high_noise")
    assert list(one.control_parts(one.load_denoiser(CPU))) == ["transformer"]
