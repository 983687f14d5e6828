"""What only a GPU can show: bf16 training on CUDA. Skipped where no CUDA device exists."""

from __future__ import annotations

import math

import pytest
import torch

from vidtune.models.registry import available_models
from vidtune.trainers import build_trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("family", available_models())
@pytest.mark.parametrize("algorithm", ["lora", "full"])
def test_bf16_training_on_cuda(make_config, family, algorithm):
    config = make_config(
        family,
        model={"dtype": "bfloat16"},
        training={"algorithm": algorithm, "steps": 3, "device": "cuda", "precision": "bf16",
                  "gradient_checkpointing": True},
        validation={"enabled": True, "num_inference_steps": 2},
    )
    trainer = build_trainer(config)
    result = trainer.run()
    assert all(math.isfinite(loss) for loss in result.losses)
    assert next(trainer.context.denoiser.parameters()).device.type == "cuda"
    trainable = [p for p in trainer.context.denoiser.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)  # trained in fp32, base in bf16
    assert result.weights_path.exists() and result.sample_paths
