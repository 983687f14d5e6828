"""Tokens a batch pads in, hidden from the self-attention of every block, so one denoiser call runs samples of
different token counts.

A batch of conditioning modes may mix samples given a keyframe's extra tokens with samples without them. Running
each layout as its own call would call the wrapped denoiser twice before one backward, which sharded weights
(FSDP, DeepSpeed ZeRO-3) cannot pair up across ranks whose batches split otherwise. Instead every sample takes
the extra tokens, and a sample's padded ones are left out of every key of its self-attention: its other tokens
then compute exactly what they compute without them (the softmax gives the left-out keys weight 0), and the padded
tokens' own outputs stay out of the prediction and the loss.

The keep mask travels with the call as `attention_kwargs[KEEP]` ([B, tokens] bool, True where a token takes part):
a pre-hook on the denoiser reads it (or None) at each call, hooks on the self-attentions add it as their mask. It
stays in place until the next call, so a gradient checkpoint recomputing a block in the backward sees it too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

KEEP = "vidtune_keep_tokens"


class KeyMask:
    """The hooks of one denoiser (see the module); `attach` once, before the denoiser is wrapped or sharded."""

    def __init__(self, self_attention: str) -> None:
        self.self_attention = self_attention  # the last name of each block's self-attention module
        self.keep: torch.Tensor | None = None
        self.used = 0  # self-attentions masked in the current call

    def attach(self, denoiser: nn.Module) -> None:
        denoiser.register_forward_pre_hook(self._read, with_kwargs=True)
        attentions = [module for name, module in denoiser.named_modules()
                      if name.rsplit(".", 1)[-1] == self.self_attention]
        if not attentions:
            raise RuntimeError(f"the denoiser has no `{self.self_attention}` modules to mask")
        for module in attentions:
            module.register_forward_pre_hook(self._mask, with_kwargs=True)

    def _read(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        extra = dict(kwargs.get("attention_kwargs") or {})
        self.keep, self.used = extra.pop(KEEP, None), 0
        return args, {**kwargs, "attention_kwargs": extra or None}

    def _mask(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
        if self.keep is None:
            return None
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if hidden.shape[:2] != self.keep.shape:
            raise RuntimeError(f"a key mask of {tuple(self.keep.shape)} (batch, tokens) cannot mask "
                               f"{tuple(hidden.shape[:2])} tokens (split over ranks by context parallelism?)")
        self.used += 1
        # [B, 1, tokens]: the attention processors repeat it over the heads and queries.
        return args, {**kwargs, "attention_mask": self.keep[:, None, :].to(hidden.device)}


def padded_call(keep: torch.Tensor) -> dict[str, Any]:
    """The denoiser's keyword arguments that hide the tokens `keep` leaves False ([B, tokens])."""
    return {"attention_kwargs": {KEEP: keep.bool()}}
