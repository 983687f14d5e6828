"""Split attention on diffusers' `native` backend: ring attention, and cross-attention to a split caption.

diffusers' context parallelism (vidtune/parallel/context.py) computes attention through the backend's pair of
forward and backward ops inside its `TemplatedRingAttention` / `TemplatedUlyssesAttention` autograd functions. Ulysses
needs only the attention output, which `native` gives; ring merges the partial attentions of the key / value chunks
by their log-sum-exp, which diffusers' `native` ops do not return ("Native attention does not support
return_lse=True"), and the backends that do (flash, cuDNN, native flash) have no CPU kernel. Cross-attention to a
caption split with the video tokens (LTX-Video's plan) fails both ways in diffusers' training path: Ulysses' backward
reshapes the keys' gradient with the queries' length, and ring applies one chunk's caption mask to every chunk.

`install` wraps the `native` entry of diffusers' backend registry once:
- no context parallelism: diffusers' own function, unchanged;
- an attention mask, or keys of another length than the queries (cross-attention): the caption's keys, values and
  mask gathered whole over the group, this rank's queries attending to them (`whole_keys`);
- Ulysses alone: diffusers' own function;
- ring: diffusers' templated ring (or ring x Ulysses) attention with torch's fused attention ops that return the
  log-sum-exp: `_scaled_dot_product_flash_attention_for_cpu` on the CPU, diffusers' cuDNN ops on CUDA (bf16 / fp16
  only, as cuDNN attention is).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_INSTALLED = "_vidtune_ring"  # the attribute marking the wrapped function


def install() -> None:
    """Make diffusers' `native` attention backend ring-capable (idempotent)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    name = AttentionBackendName.NATIVE
    original = _AttentionBackendRegistry._backends[name]
    if getattr(original, _INSTALLED, False):
        return

    @functools.wraps(original)
    def native(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False, return_lse: bool = False, _parallel_config: Any = None) -> Any:
        context = None if _parallel_config is None else _parallel_config.context_parallel_config
        if context is None:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse)
        if attn_mask is not None or key.shape[1] != query.shape[1]:
            return whole_keys(original, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                              return_lse, context)
        if context.ring_degree == 1:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                            _parallel_config=_parallel_config)
        return ring_attention(query, key, value, dropout_p, is_causal, scale, enable_gqa, return_lse,
                              _parallel_config)

    setattr(native, _INSTALLED, True)
    _AttentionBackendRegistry._backends[name] = native


def whole_keys(original: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool, scale: float | None,
               enable_gqa: bool, return_lse: bool, context: Any) -> Any:
    """Cross-attention to a split caption (LTX-Video splits its text tokens too): the keys, values and mask (a
    caption: few tokens) are gathered whole over the data group and this rank's queries attend to them.

    diffusers' Ulysses backward reshapes the keys' gradient with the queries' length, which fails when the two
    differ, and its ring applies the local chunk's mask to every chunk of keys it passes round; gathering the few
    caption tokens avoids both. The gather's backward sums the keys' and values' gradients back to the rank that
    holds them."""
    import torch.distributed._functional_collectives as funcol

    group = context._flattened_mesh.get_group()
    key, value = (funcol.all_gather_tensor_autograd(x.contiguous(), gather_dim=1, group=group) for x in (key, value))
    if attn_mask is not None:
        attn_mask = funcol.all_gather_tensor(attn_mask.contiguous(), gather_dim=attn_mask.ndim - 1, group=group)
    return original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float, is_causal: bool,
                   scale: float | None, enable_gqa: bool, return_lse: bool, parallel_config: Any) -> Any:
    """diffusers' templated context-parallel attention (ring, or ring x Ulysses) with ops that return the
    log-sum-exp on this device."""
    from diffusers.models import attention_dispatch as dispatch

    if query.device.type == "cuda":
        forward_op, backward_op = dispatch._cudnn_attention_forward_op, dispatch._cudnn_attention_backward_op
    else:
        forward_op, backward_op = _cpu_forward_op, _cpu_backward_op
    return dispatch._templated_context_parallel_attention(
        query, key, value, None, dropout_p, is_causal, scale, enable_gqa, return_lse, forward_op=forward_op,
        backward_op=backward_op, _parallel_config=parallel_config)


def _cpu_forward_op(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                    scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                    _save_ctx: bool = True, _parallel_config: Any = None) -> Any:
    """Attention of [B, S, H, D] tensors and its log-sum-exp [B, S, H] (float32), by torch's CPU flash kernel."""
    if enable_gqa or dropout_p:
        raise ValueError("ring attention on the CPU supports neither grouped-query attention nor attention dropout")
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0.0, is_causal, scale=scale)
    out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    if _save_ctx:
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale
    return (out, lse) if return_lse else out


def _cpu_backward_op(ctx: Any, grad_out: torch.Tensor, *args: Any, query: torch.Tensor | None = None,
                     key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of the query, key and value chunk; the ring passes the chunk of this turn and the whole
    attention's output and log-sum-exp (the global softmax normaliser), else those saved by the forward."""
    saved = ctx.saved_tensors
    query, key, value, out, lse = (given if given is not None else kept
                                   for given, kept in zip((query, key, value, out, lse), saved, strict=True))
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.transpose(1, 2).contiguous(), query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        out.to(query.dtype).transpose(1, 2).contiguous(), lse.float().transpose(1, 2).contiguous(), 0.0,
        ctx.is_causal, scale=ctx.scale)
    grad_query, grad_key, grad_value = (grad.transpose(1, 2) for grad in grads)
    return grad_query, grad_key, grad_value
