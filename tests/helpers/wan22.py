"""Wan 2.2's two-expert models in tests: the boundary, their configs and specs, and which expert each sample ran on."""

from __future__ import annotations

from pathlib import Path

from vidtune.config import ModelConfig
from vidtune.models.experts import TwoExperts
from vidtune.models.registry import get_spec_class
from vidtune.models.tiny.wan22 import TWO_EXPERT_SHAPE

BOUNDARY = 0.5  # the tests' two-expert model: both sides of the boundary alike


def record_routing(monkeypatch) -> list[tuple[bool, ...]]:
    """Which expert each sample of every forward ran on (True: the high-noise one), filled as the run goes."""
    routed: list[tuple[bool, ...]] = []
    route = TwoExperts.is_high_noise

    def recording(self, timestep):
        high = route(self, timestep)
        routed.append(tuple(bool(h) for h in high))
        return high

    monkeypatch.setattr(TwoExperts, "is_high_noise", recording)
    return routed


def two_expert_config(make_config, **sections):
    frames, height, width = TWO_EXPERT_SHAPE
    model = {"pretrained": None, **sections.pop("model", {})}
    # The noise levels these tests were tuned with (shift 1, not the family's published default).
    training = {"sigma_shift": 1.0, **sections.pop("training", {"sigma_sampling": "uniform", "batch_size": 2})}
    return lambda pretrained: make_config(
        "wan2.2", model={**model, "pretrained": str(pretrained)},
        data={"frames": frames, "height": height, "width": width},
        **{"training": training, "lora": {"rank": 4, "alpha": 4}, **sections})


def spec_of(family: str, pretrained: Path, **model) -> object:
    return get_spec_class(family)(ModelConfig(name=family, pretrained=str(pretrained), **model))
