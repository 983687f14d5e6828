"""Which samples the held-out score takes, its noise levels, its history and the checkpoints it keeps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vidtune import checkpoint
from vidtune.config import build_config
from vidtune.data.sources import Clip
from vidtune.errors import ConfigError, DataError
from vidtune.evaluation import EvalHistory, Score, hold_out, noise_levels
from vidtune.objectives import DDPM, FlowMatching


def config(**validation):
    return build_config({"model": {"name": "ltx-video", "pretrained": "some/model"}, "data": {"root": "."},
                         "validation": validation})


def clips(count: int, held_out: int = 0) -> list[Clip]:
    return [Clip(Path(f"/clips/{n}.mp4"), f"caption {n}", n, n + 1, held_out=n >= count - held_out)
            for n in range(count)]


def test_eval_clips_are_spread_over_the_dataset_and_taken_out_of_training():
    training, held = hold_out(clips(10), config(eval_clips=3))
    assert [clip.video.name for clip in held] == ["1.mp4", "5.mp4", "8.mp4"]
    assert [clip.video.name for clip in training] == [f"{n}.mp4" for n in (0, 2, 3, 4, 6, 7, 9)]
    # Each list numbered from 0: batches and the cache plan look samples up by their index.
    assert [clip.index for clip in training] == list(range(7)) and [clip.index for clip in held] == [0, 1, 2]


def test_train_on_eval_clips_keeps_them_in_training():
    training, held = hold_out(clips(4), config(eval_clips=1, train_on_eval_clips=True))
    assert len(training) == 4 and [clip.video.name for clip in held] == ["2.mp4"]
    training, held = hold_out(clips(1), config(eval_clips=1, train_on_eval_clips=True))
    assert training[0].video == held[0].video


def test_samples_of_a_source_marked_eval_are_held_out_after_the_chosen_ones():
    training, held = hold_out(clips(6, held_out=2), config(eval_clips=1))
    assert [clip.video.name for clip in held] == ["2.mp4", "4.mp4", "5.mp4"]
    assert [clip.video.name for clip in training] == ["0.mp4", "1.mp4", "3.mp4"]
    assert hold_out(clips(3), config()) == (clips(3), [])


def test_holding_out_every_sample_is_refused():
    with pytest.raises(DataError, match="at least one must be left to train on"):
        hold_out(clips(2), config(eval_clips=2))
    with pytest.raises(DataError, match="nothing is left to train on"):
        hold_out(clips(2, held_out=2), config())


def test_noise_levels_must_be_inside_the_range_and_distinct():
    with pytest.raises(ConfigError, match="eval_noise_levels"):
        config(eval_noise_levels=[0.5, 0.5])
    with pytest.raises(ConfigError, match="eval_noise_levels"):
        config(eval_noise_levels=[0.0, 0.5])


def test_noise_levels_are_sigmas_for_flow_matching_and_timesteps_for_ddpm():
    assert noise_levels(FlowMatching(), [0.1, 0.9]).tolist() == pytest.approx([0.1, 0.9])
    ddpm = DDPM(alphas_cumprod=torch.linspace(0.99, 0.01, 1000))
    assert noise_levels(ddpm, [0.1, 0.5, 0.9]).tolist() == [100.0, 500.0, 899.0]


def test_the_best_checkpoint_is_the_lowest_score_among_checkpoints_the_earliest_of_equals():
    history = EvalHistory()
    history.add(0, Score(0.1, {0.5: 0.1}), checkpoint=False)  # the base model's score is no checkpoint
    assert history.best() is None
    history.add(2, Score(0.5, {0.5: 0.5}), checkpoint=True)
    history.add(3, Score(0.2, {0.5: 0.2}), checkpoint=False)  # a validation step without a checkpoint
    history.add(4, Score(0.3, {0.5: 0.3}), checkpoint=True)
    row = history.add(6, Score(0.3, {0.5: 0.3}), checkpoint=True)
    assert history.best()["step"] == 4 and row["eval_best_step"] == 4
    assert row["eval_loss_by_noise"] == {"0.5": 0.3}


def test_the_pruning_keeps_the_protected_checkpoints(tmp_path):
    for step in (2, 4, 6, 8):
        folder = tmp_path / f"step-{step:08d}"
        folder.mkdir()
        for name in (checkpoint.STATE, checkpoint.CONFIG, checkpoint.WEIGHTS):
            (folder / name).write_text("x")
    checkpoint.prune(tmp_path, 1, protect={4})
    assert [path.name for path in checkpoint.list_checkpoints(tmp_path)] == ["step-00000004", "step-00000008"]
    checkpoint.prune(tmp_path, 1)
    assert [path.name for path in checkpoint.list_checkpoints(tmp_path)] == ["step-00000008"]
