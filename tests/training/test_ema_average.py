"""The moving average of the trained weights (`training.ema_decay`), on its own."""

from __future__ import annotations

import torch
from torch import nn

from vidtune.ema import EMA


def test_the_average_follows_its_formula_with_the_warm_up():
    weight = nn.Parameter(torch.tensor([0.0, 10.0]))
    ema = EMA({"w": weight}, decay=0.9)
    expected = weight.detach().clone()
    for n, value in enumerate([1.0, 2.0, 3.0, 4.0, 5.0] * 3):
        with torch.no_grad():
            weight.fill_(value)
        ema.update()
        decay = min(0.9, (1 + n) / (10 + n))
        expected = decay * expected + (1 - decay) * torch.full((2,), value)
        torch.testing.assert_close(ema.shadow["w"], expected)
    assert ema.updates == 15 and ema.current_decay() == 16 / 25
    ema.updates = 1000
    assert ema.current_decay() == 0.9  # the warm-up ends at the decay asked for


def test_applied_swaps_the_average_in_and_the_weights_back_exactly():
    weight = nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(0)))
    own = weight.detach().clone()
    ema = EMA({"w": weight}, decay=0.5)
    with torch.no_grad():
        weight.add_(1.0)
    ema.update()
    moved = weight.detach().clone()
    with ema.applied():
        assert torch.equal(weight.detach(), ema.shadow["w"]) and not torch.equal(weight.detach(), moved)
        with torch.no_grad():
            weight.copy_(torch.zeros(3))  # what is written inside lands in the average
    assert torch.equal(weight.detach(), moved)
    assert torch.equal(ema.shadow["w"], torch.zeros(3)) and not torch.equal(own, moved)


def test_read_gives_the_average_as_views_of_it_or_as_copies_of_its_own():
    weight = nn.Parameter(torch.zeros(3))
    ema = EMA({"w": weight}, decay=0.5)
    with torch.no_grad():
        weight.fill_(2.0)
    ema.update()  # the average moves to 2 * (1 - 1/10) = 1.8; the weight stays 2

    def get_weights() -> dict[str, torch.Tensor]:
        return {"w": weight.detach()}

    views, copies = ema.read(get_weights), ema.read(get_weights, own=True)
    assert torch.equal(weight.detach(), torch.full((3,), 2.0))  # the weight is its own again after reading
    for read in (views, copies):
        torch.testing.assert_close(read["w"], torch.full((3,), 1.8))
    assert views["w"].data_ptr() == ema.shadow["w"].data_ptr()  # what a checkpoint writes: no copy made
    assert copies["w"].data_ptr() != ema.shadow["w"].data_ptr()
    copies["w"].zero_()  # a copy is written into (a sharded checkpoint's average read into it), the average is not
    torch.testing.assert_close(ema.shadow["w"], torch.full((3,), 1.8))
