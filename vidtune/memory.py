"""Memory savers that change how weights are stored, not what is trained."""

from __future__ import annotations

import torch
from torch import nn


def store_frozen_weights_in_fp8(denoiser: nn.Module) -> None:
    """Keep the denoiser's weights in float8 (e4m3) and upcast each layer to the compute dtype as it runs.

    Done before adapters are added, so only the frozen base layers are affected; norms, embeddings and other
    precision-sensitive layers are skipped by diffusers' default patterns. The compute dtype is the one the
    denoiser was loaded in (bf16 on GPU, fp32 on CPU by default).
    """
    compute_dtype = denoiser.dtype
    denoiser.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=compute_dtype)
