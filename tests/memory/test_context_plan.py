"""`vidtune plan` with context parallelism: the activations divided by the degree, the gathered prediction and the
communication buffers added, and a degree suggested when nothing else fits."""

from __future__ import annotations

import pytest

from vidtune.config import build_config
from vidtune.memory import suggest as search
from vidtune.memory.context import BUFFERS, GATHERED, context_choices
from vidtune.memory.plan import GIB, plan_memory
from vidtune.memory.suggest import suggest
from vidtune.models.tiny import TINY_SHAPES


@pytest.fixture(autouse=True)
def traces_stored_in_a_temporary_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("VIDTUNE_PLAN_CACHE", str(tmp_path / "stored-traces"))


def _tiny(tiny_model_dir, family: str = "ltx-video", **parallel):
    frames, height, width = TINY_SHAPES[family]
    return build_config({"model": {"name": family, "pretrained": str(tiny_model_dir(family))},
                         "data": {"root": ".", "frames": frames, "height": height, "width": width},
                         "training": {"device": "cpu"}, "precompute": {"enabled": True}, "parallel": parallel})


@pytest.mark.parametrize("split", [{"ulysses": 2}, {"ring": 2}])
def test_a_context_degree_divides_the_activations_and_adds_its_buffers(tiny_model_dir, split):
    one = plan_memory(_tiny(tiny_model_dir), world_size=2)
    two = plan_memory(_tiny(tiny_model_dir, context=split), world_size=2)
    assert two.training["activations"] == -(-one.training["activations"] // 2)
    assert two.training[GATHERED] > 0 and two.training[BUFFERS] > 0
    for part in ("weights", "gradients", "optimizer state"):
        assert two.training[part] == one.training[part]
    # Fewer GPUs than the degree: nothing is split, and the plan says so.
    alone = plan_memory(_tiny(tiny_model_dir, context=split), world_size=1)
    assert alone.training == plan_memory(_tiny(tiny_model_dir)).training
    assert any("--gpus 2" in note for note in alone.notes)


def test_ulysses_is_offered_where_it_divides_the_heads_else_ring():
    config = build_config({"model": {"name": "wan", "pretrained": "x"}, "data": {"root": "."}})
    assert context_choices(config, 8, heads=12) == [["parallel.context.ulysses=2"], ["parallel.context.ulysses=4"],
                                                    ["parallel.context.ring=8"]]
    assert context_choices(config, 1, heads=12) == []


def test_a_degree_is_suggested_when_nothing_else_fits(tiny_model_dir, monkeypatch):
    """The search's last resort: with the savers out of the way (none left to try, the precompute stage taken as
    fitting), a budget between the split and the unsplit step's peak is met by splitting over the two GPUs, and one
    GPU gets no suggestion."""
    monkeypatch.setattr(search, "_precompute_overrides", lambda config, budget, world_size: [])
    monkeypatch.setattr(search, "_training_changes", lambda config: [[]])
    monkeypatch.setattr(search, "_fewest_blocks", lambda config, budget, world_size: None)
    monkeypatch.setattr(search, "fits", lambda plan, budget_gib, host_gib=None: plan.training_peak <= budget_gib * GIB)
    config = _tiny(tiny_model_dir)
    whole = plan_memory(config, world_size=2).training_peak
    split = plan_memory(_tiny(tiny_model_dir, context={"ulysses": 2}), world_size=2).training_peak
    assert split < whole
    budget = (split + whole) / 2 / GIB
    found = suggest(config, budget, world_size=2)
    assert found is not None and found.overrides == ["parallel.context.ulysses=2"]
    assert suggest(config, budget, world_size=1) is None
