"""`RepeatedOps`: a repeated operator on meta tensors is answered from its first result, a fresh storage of the same
layout each time; views, in-place operators and tensors with data always run the operator."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental import _config as fx_config

from vidtune.memory import repeated
from vidtune.memory.repeated import RepeatedOps
from vidtune.memory.tracking import LiveMemory


@pytest.fixture(autouse=True)
def nothing_remembered(monkeypatch):
    monkeypatch.setattr(repeated, "_LAYOUTS", {})


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_a_repeated_call_gives_a_fresh_tensor_of_the_same_layout():
    a, b = _meta(4, 8), _meta(8)
    transposed = _meta(8, 4).t()  # strides (1, 4): part of the key
    with RepeatedOps() as ops:
        first, second = a + b, a + b
        third = transposed + b
        norm = torch.nn.functional.layer_norm(a, (8,))
        again = torch.nn.functional.layer_norm(a, (8,))
    assert ops.misses == 3 and ops.hits == 1 + 1  # a + b and layer norm repeated (its three outputs at once)
    for made, reference in ((second, first), (again, norm)):
        assert (made.shape, made.stride(), made.dtype) == (reference.shape, reference.stride(), reference.dtype)
        assert made.untyped_storage() is not reference.untyped_storage()
        assert made.untyped_storage().nbytes() == reference.untyped_storage().nbytes()
    assert third.stride() == transposed.stride()
    with RepeatedOps() as later:  # remembered for the process
        assert (a + b).shape == (4, 8) and (a.half() + b).dtype == torch.float32
    assert later.hits == 1


def test_views_in_place_operators_and_real_tensors_always_run():
    a, five = _meta(4, 8), _meta(5)
    real, expected = torch.ones(4, 8), torch.full((4, 8), 3.0)
    with RepeatedOps() as ops:
        for _ in range(2):
            view = a.view(8, 4)
            assert view.untyped_storage() is a.untyped_storage()
            a.mul_(2)
            assert torch.equal(real * 3, expected)  # data: computed, never remembered
            with fx_config.patch(meta_nonzero_assume_all_nonzero=True):  # as the planner traces
                torch.nonzero(five)  # its shape depends on values
    assert ops.hits == 0 and ops.misses == 0


def test_counted_memory_is_the_same_with_and_without(monkeypatch):
    """What `LiveMemory` counts over a small forward and backward pass on meta does not change."""
    layer = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).to("meta")

    def counted() -> tuple[int, int]:
        live = LiveMemory()
        live.known([*layer.parameters()])
        with RepeatedOps(), live:
            layer(_meta(16, 64)).sum().backward()
        for parameter in layer.parameters():
            parameter.grad = None
        return live.peak, live.current

    remembered = counted(), counted()
    monkeypatch.setattr(repeated, "ENABLED", False)
    assert remembered[0] == remembered[1] == counted()
    assert remembered[0][0] > 0
