"""Conditioning modes under data parallelism: a micro-batch mixing samples given their last frame as a keyframe's
extra tokens with samples without them runs in one call of the wrapped denoiser, so two ranks train what one
process trains with twice the batch."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import two_ranks_against_one_process
from vidtune.config import ConditioningConfig
from vidtune.models import conditioning

# Half the samples given their last frame (extra tokens), half a clip to extend (in place): most micro-batches of two
# mix the two token layouts.
MODES = {"last_frame": 0.5, "extension": 0.5, "extension_frames": 5}
SEED = 0


def _takes_last_frame(positions: list[int]) -> list[bool]:
    shares = conditioning.shares(ConditioningConfig(**MODES), 0.0)
    codes = conditioning.draw_modes(shares, torch.tensor(positions), SEED, {})
    return conditioning.is_mode(codes, conditioning.LAST_FRAME_MODES).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_train_micro_batches_mixing_token_layouts_like_one_process(make_config, tmp_path, strategy):
    """One call per micro-batch: under FSDP a second call on a rank with a mixed micro-batch would gather the
    weights for a forward its peer never runs (the ranks hang). FSDP with gradient checkpointing: the blocks
    recomputed in the backward see the same key mask."""
    settings = {"family": "ltx-video-i2v", "model": {"conditioning": MODES}, "parallel": {"strategy": strategy},
                "training": {"steps": 2, "batch_size": 2, "learning_rate": 1e-2, "seed": SEED,
                             "gradient_checkpointing": strategy == "fsdp"}}
    ranks = two_ranks_against_one_process(make_config, tmp_path, settings)
    # Every rank's micro-batches: at least one mixes the layouts on each rank.
    for result in ranks:
        batches = [result["positions"][i:i + 2] for i in range(0, len(result["positions"]), 2)]
        assert any(len(set(_takes_last_frame(batch))) == 2 for batch in batches), batches
