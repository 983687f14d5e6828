"""`vidtune plan` with context parallelism: the activations divided by the degree, the gathered prediction and the
communication buffers added, and a degree suggested when nothing else fits."""

from __future__ import annotations

import pytest

from vidtune.config import build_config, load_config
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


@pytest.mark.slow
def test_a_clip_that_fits_no_single_gpu_is_split_over_several():
    """Wan 2.1 1.3B LoRA at 81 x 720 x 1280 (the shipped architecture, traced on meta), 7 GiB: its text encoder
    fits in 4 bits, but no saver (checkpointing, activation offload, block swap...) fits the step on one GPU; with two
    GPUs the suggestion splits its tokens (a degree is offered only when nothing else fits)."""
    config = load_config(None, ["model.name=wan", "model.pretrained=Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
                                "data.frames=81", "data.height=720", "data.width=1280", "precompute.enabled=true"],
                         required_placeholder="(unset)")
    found = suggest(config, 7.0, world_size=2)
    assert found is not None and found.overrides[0] == "parallel.context.ulysses=2", found and found.overrides
    assert found.plan.peak <= 7.0 * GIB
