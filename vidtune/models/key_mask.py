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
stays in place until the next call, so a gradient checkpoint recomputing a block in the backward sees it too. A
masked attention runs on torch's scaled_dot_product_attention (diffusers' `native` backend) where the denoiser's
backend takes no mask (FlashAttention); the other calls keep the configured backend.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

KEEP = "vidtune_keep_tokens"
NATIVE = "native"  # diffusers' backend name of torch's scaled_dot_product_attention, which takes a mask


class KeyMask:
    """The hooks of one denoiser (see the module); `attach` once, before the denoiser is wrapped or sharded."""

    def __init__(self, *attentions: str) -> None:
        # The last names of the attention modules whose keys are the padded tokens: each block's self-attention,
        # and any attention of another stream that reads them as its keys (LTX-2's video-to-audio).
        self.attentions = attentions
        self.keep: torch.Tensor | None = None
        self.used = 0  # attentions masked in the current call

    def attach(self, denoiser: nn.Module) -> None:
        denoiser.register_forward_pre_hook(self._read, with_kwargs=True)
        modules = [module for name, module in denoiser.named_modules()
                   if name.rsplit(".", 1)[-1] in self.attentions]
        if not modules:
            raise RuntimeError(f"the denoiser has no {' / '.join(self.attentions)} modules to mask")
        for module in modules:
            module.register_forward_pre_hook(self._mask, with_kwargs=True)
            module.register_forward_hook(self._restore)

    def _read(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        extra = dict(kwargs.get("attention_kwargs") or {})
        self.keep, self.used = extra.pop(KEEP, None), 0
        return args, {**kwargs, "attention_kwargs": extra or None}

    def _mask(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
        if self.keep is None:
            return None
        keys = kwargs.get("encoder_hidden_states")
        if keys is None:
            keys = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if keys.shape[:2] != self.keep.shape:
            raise RuntimeError(f"a key mask of {tuple(self.keep.shape)} (batch, tokens) cannot mask keys of "
                               f"{tuple(keys.shape[:2])} (split over ranks by context parallelism?)")
        self.used += 1
        processor = getattr(module, "processor", None)
        backend = getattr(processor, "_attention_backend", None)
        if backend is not None and not str(getattr(backend, "value", backend)).lstrip("_").startswith("native"):
            # FlashAttention takes no mask: this call's masked attention runs on torch's own kernel.
            module._vidtune_backend = backend
            processor._attention_backend = NATIVE
        keep = self.keep[:, None, :].to(keys.device)  # [B, 1, keys]: the processors repeat it over heads, queries
        given = kwargs.get("attention_mask")
        # A mask the call gives already (an additive bias) keeps its values on the kept keys.
        mask = keep if given is None else given.masked_fill(~keep, float("-inf"))
        return args, {**kwargs, "attention_mask": mask}

    def _restore(self, module: nn.Module, args: Any, output: Any) -> None:
        backend = module.__dict__.pop("_vidtune_backend", None)
        if backend is not None:
            module.processor._attention_backend = backend


def padded_call(keep: torch.Tensor) -> dict[str, Any]:
    """The denoiser's keyword arguments that hide the tokens `keep` leaves False ([B, tokens])."""
    return {"attention_kwargs": {KEEP: keep.bool()}}
