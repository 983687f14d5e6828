"""`model.expert_routing` of Wan 2.2's two experts: `step` trains one expert per step (the same on every rank) with
each sample's noise level keeping the objective's distribution; its default and its refusals."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.wan22 import BOUNDARY, spec_of, two_expert_config
from vidtune.data.buckets import visit_generator
from vidtune.errors import ConfigError
from vidtune.models.experts import NoiseRange, StepRouted
from vidtune.models.tiny.wan22 import write_tiny_wan22


@pytest.fixture(scope="module")
def two_expert_dir(tmp_path_factory):
    return write_tiny_wan22(tmp_path_factory.mktemp("wan22-a14b-routing"), two_experts=True, boundary_ratio=BOUNDARY)


def routed_steps(two_expert_dir, make_config, **training):
    """The plain objective, and each step's objective (`step_objective`) under `model.expert_routing: step`."""
    spec = spec_of("wan2.2", two_expert_dir, expert_routing="step")
    config = two_expert_config(make_config, model={"expert_routing": "step"},
                               training={"sigma_sampling": "logit_normal", **training})(two_expert_dir)
    objective = spec.objective(config.training)
    return objective, lambda step: spec.step_objective(objective, config, step)


def test_step_routing_keeps_each_samples_noise_level_distribution(two_expert_dir, make_config):
    """Over many steps, the levels drawn per step (each step's expert, then each sample inside its band) have the
    distribution of the plain objective: the same quantiles within sampling error; every step's levels lie on one
    side of the boundary; two runs (two ranks) draw the same expert for a step."""
    objective, for_step = routed_steps(two_expert_dir, make_config, sigma_shift=3.0)
    steps, per_step = 4000, 2
    routed, sides = [], []
    for step in range(steps):
        band = for_step(step)
        assert isinstance(band, NoiseRange)
        levels = torch.cat([band.sample_noise_levels(1, visit_generator(0, step * per_step + i))
                            for i in range(per_step)])
        high = objective.timesteps(levels) >= BOUNDARY * 1000
        assert bool(high.all()) or not bool(high.any())  # one expert per step
        sides.append(bool(high[0]))
        routed.append(levels)
        assert for_step(step).low == band.low  # another rank draws the same expert for this step
    routed_levels = torch.cat(routed)
    plain = objective.sample_noise_levels(steps * per_step, torch.Generator().manual_seed(123))
    quantiles = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9])
    torch.testing.assert_close(torch.quantile(routed_levels, quantiles), torch.quantile(plain, quantiles),
                               atol=0.03, rtol=0)
    # The high-noise expert's share of steps is its share of the noise levels (shift 3 puts most above 0.5).
    share = float((objective.timesteps(plain) >= BOUNDARY * 1000).float().mean())
    assert abs(sum(sides) / steps - share) < 0.03 and 0.6 < share < 0.9


def test_the_objective_depends_on_the_config_alone(two_expert_dir, make_config, monkeypatch):
    """No call order: a spec that never ran `check_training` routes per step as the run's settings say (here
    `step`: FSDP on two processes), and its `objective` is the scheduler's whatever was checked before; one
    process, or one expert, keeps the objective of every step."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    sharded = two_expert_config(make_config, parallel={"strategy": "fsdp"})(two_expert_dir)
    spec = spec_of("wan2.2", two_expert_dir)
    objective = spec.objective(sharded.training)
    assert not isinstance(objective, NoiseRange | StepRouted)
    bands = {(spec.step_objective(objective, sharded, step).low, spec.step_objective(objective, sharded, step).high)
             for step in range(40)}
    assert bands == {(float("-inf"), BOUNDARY * 1000), (BOUNDARY * 1000, float("inf"))}
    spec.check_training(sharded)
    assert type(spec.objective(sharded.training)) is type(objective)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert spec.step_objective(objective, sharded, 3) is objective
    one = spec_of("wan2.2", two_expert_dir, experts="low_noise")
    one_objective = one.objective(sharded.training)
    assert isinstance(one_objective, NoiseRange) and one.step_objective(one_objective, sharded, 3) is one_objective


def test_routing_defaults_and_refusals(two_expert_dir, tiny_model_dir, make_config, monkeypatch):
    config = two_expert_config(make_config)(two_expert_dir)
    assert spec_of("wan2.2", two_expert_dir).expert_routing(config) == "sample"  # one process: as before
    with pytest.raises(ConfigError, match=r"(?s)model.expert_routing=step with model.experts=high_noise: .*What to do"):
        spec_of("wan2.2", two_expert_dir, experts="high_noise", expert_routing="step").expert_routing(config)
    with pytest.raises(ConfigError, match=r"(?s)model.expert_routing=step: .* one transformer"):
        spec_of("wan2.2", tiny_model_dir("wan2.2"), expert_routing="step").check_source()
    monkeypatch.setenv("WORLD_SIZE", "2")
    for strategy in ("fsdp", "deepspeed"):
        sharded = two_expert_config(make_config, parallel={"strategy": strategy})(two_expert_dir)
        assert spec_of("wan2.2", two_expert_dir).expert_routing(sharded) == "step"
        distilled = two_expert_config(make_config, parallel={"strategy": strategy},
                                      training={"algorithm": "step-distillation"})(two_expert_dir)
        with pytest.raises(ConfigError, match=rf"(?s)parallel.strategy={strategy} with "
                                              r"training.algorithm=step-distillation on two experts"):
            spec_of("wan2.2", two_expert_dir).check_training(distilled)
    ddp = two_expert_config(make_config, parallel={"strategy": "ddp"})(two_expert_dir)
    assert spec_of("wan2.2", two_expert_dir).expert_routing(ddp) == "sample"
