"""`training.preserve_base` and a regularization source under DDP: the base prediction runs on the unwrapped
denoiser (adapter off, no gradients), the adapter's prediction on the preservation caption through the wrapper beside
the denoising forward; two ranks train what one process trains with twice the batch."""

from __future__ import annotations

import pytest

from tests.helpers.datasets import captioned_dataset
from tests.helpers.distributed import two_ranks_against_one_process


@pytest.mark.slow
def test_two_ranks_preserve_the_base_like_one_process_with_twice_the_batch(make_config, shapes_dataset, tmp_path):
    regularization = captioned_dataset(shapes_dataset, tmp_path / "people", ["a plain scene", "another scene"])
    settings = {
        "data": {"root": None, "datasets": [
            {"type": "pairs", "root": str(shapes_dataset), "trigger": "sks"},
            {"type": "pairs", "root": str(regularization), "role": "regularization", "loss_weight": 0.5}]},
        "training": {"steps": 3, "learning_rate": 1e-2, "preserve_base": {"weight": 1.0}},
    }
    two_ranks_against_one_process(make_config, tmp_path, settings)
