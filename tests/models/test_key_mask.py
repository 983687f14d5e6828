"""vidtune/models/key_mask.py on a stand-in denoiser: the keep mask reaches the named attentions of a call that
carries it (and no other call), joins a mask the call gives, runs on a backend that takes masks and puts the
configured one back, and refuses keys of another token count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vidtune.models.key_mask import KeyMask, padded_call


class Processor:
    _attention_backend = "flash"


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.processor = Processor()
        self.seen: list[tuple[torch.Tensor | None, str]] = []

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        self.seen.append((attention_mask, self.processor._attention_backend))
        return hidden_states


class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn1, self.attn2 = Attention(), Attention()

    def forward(self, hidden_states, bias=None, attention_kwargs=None):
        self.kwargs = attention_kwargs
        self.attn1(hidden_states=hidden_states, encoder_hidden_states=None, attention_mask=bias)
        return self.attn2(hidden_states, encoder_hidden_states=torch.zeros(2, 7, 4))


def test_the_keep_mask_reaches_the_named_attentions_of_its_call_only():
    denoiser, mask = Denoiser(), KeyMask("attn1")
    mask.attach(denoiser)
    hidden = torch.zeros(2, 3, 4)
    keep = torch.tensor([[True, True, True], [True, True, False]])
    denoiser(hidden, attention_kwargs={**padded_call(keep)["attention_kwargs"], "scale": 1.0})
    (given, backend), = denoiser.attn1.seen
    assert torch.equal(given, keep[:, None, :]) and backend == "native"
    assert denoiser.attn1.processor._attention_backend == "flash"  # put back after the call
    assert denoiser.attn2.seen[0][0] is None and denoiser.kwargs == {"scale": 1.0} and mask.used == 1
    # A mask the call gives (an additive bias) keeps its values where the keys are kept.
    bias = torch.full((2, 3, 3), -5.0)
    denoiser(hidden, bias=bias, **padded_call(keep))
    joined = denoiser.attn1.seen[-1][0]
    assert torch.equal(joined[0], bias[0]) and torch.equal(joined[1, :, :2], bias[1, :, :2])
    assert bool(torch.isneginf(joined[1, :, 2]).all())
    # The next call without it: nothing masked, the configured backend.
    denoiser(hidden)
    assert denoiser.attn1.seen[-1] == (None, "flash") and mask.used == 0 and denoiser.kwargs is None


def test_keys_of_another_token_count_are_refused():
    denoiser, mask = Denoiser(), KeyMask("attn2")
    mask.attach(denoiser)
    with pytest.raises(RuntimeError, match=r"a key mask of \(2, 3\) .* cannot mask keys of \(2, 7\)"):
        denoiser(torch.zeros(2, 3, 4), **padded_call(torch.ones(2, 3, dtype=torch.bool)))
    with pytest.raises(RuntimeError, match="no attn3 modules"):
        KeyMask("attn3").attach(Denoiser())
