"""`training.ema_decay`: an exponential moving average (EMA) of the trained weights.

After each applied optimizer step, every trained parameter's shadow copy moves towards it:
`shadow = decay_n * shadow + (1 - decay_n) * weight`, with `decay_n = min(decay, (1 + n) / (10 + n))` at the n-th
update (the warm-up diffusers' EMAModel uses: early on the average follows the weights, so a fresh adapter's
zeros do not dominate it for thousands of steps). A skipped, non-finite step is no update.

The shadow lives beside the weights, in fp32 and on their device (a full fine-tune holds one more copy of the
trained weights). Checkpoints store it, so a resumed run continues it bit for bit; validation samples with it
(`applied`); a finished run writes it beside its weights (`pytorch_lora_weights_ema.safetensors`,
`transformer_ema/`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class EMA:
    """The moving average of `parameters` (the trained ones, by name)."""

    def __init__(self, parameters: dict[str, nn.Parameter], decay: float) -> None:
        self.parameters = parameters
        self.decay = decay
        self.updates = 0
        self.shadow = {name: p.detach().clone() for name, p in parameters.items()}

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        weight = 1.0 - self.current_decay()
        for name, parameter in self.parameters.items():
            self.shadow[name].lerp_(parameter.detach(), weight)
        self.updates += 1

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The parameters hold the average inside the block and their own weights again after it. What is
        written into them inside (loading a checkpoint's average) lands in the average."""
        own = {name: p.data for name, p in self.parameters.items()}
        try:
            for name, parameter in self.parameters.items():
                parameter.data = self.shadow[name]
            yield
        finally:
            for name, parameter in self.parameters.items():
                parameter.data = own[name]
