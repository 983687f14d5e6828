"""Buckets of shapes, frame windows and the seeded batch schedule (a pure function of seed and batch number)."""

import itertools
from pathlib import Path

import pytest

from vidtune.data.buckets import (
    BatchSchedule,
    ScheduleSampler,
    assign_bucket,
    epoch_permutation,
    visit_start,
    visit_window,
    window_starts,
)
from vidtune.data.video import VideoInfo


def take(sampler, count):
    return list(itertools.islice(iter(sampler), count))


def flat(batches):
    return [key for batch in batches for key in batch]


def info(frames: int, fps: float, width: int, height: int) -> VideoInfo:
    return VideoInfo(Path("clip.mp4"), frames, fps, width, height)


# ----- one bucket: the plain stream of epoch permutations ---------------------------------------------------------
def test_each_epoch_is_a_permutation_and_epochs_differ():
    keys = flat(take(ScheduleSampler(BatchSchedule([0] * 10, [1] * 10, 1, seed=3)), 30))
    assert [p for p, _, _ in keys] == list(range(30))
    epochs = [[i for _, i, _ in keys[k * 10 : (k + 1) * 10]] for k in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1]
    assert epochs[0] == epoch_permutation(10, 3, 0)


def test_one_bucket_batch_size_does_not_change_what_a_position_reads():
    # batch 2 x accumulation 1 sees what batch 1 x accumulation 2 sees, also across an epoch boundary (7 samples).
    ones = flat(take(ScheduleSampler(BatchSchedule([0] * 7, [1] * 7, 1, seed=5)), 20))
    twos = flat(take(ScheduleSampler(BatchSchedule([0] * 7, [1] * 7, 2, seed=5)), 10))
    assert ones == twos


def test_ranks_take_disjoint_batches_without_gaps():
    world = 3
    schedule = lambda: BatchSchedule([0, 1, 0, 1, 1, 0, 0], [1] * 7, 2, seed=1)  # noqa: E731
    per_rank = [flat(take(ScheduleSampler(schedule(), rank=r, world=world), 7)) for r in range(world)]
    positions = sorted(p for rank in per_rank for p, _, _ in rank)
    assert positions == list(range(42))
    single = {p: (i, b) for p, i, b in flat(take(ScheduleSampler(schedule()), 21))}
    assert all(single[p] == (i, b) for rank in per_rank for p, i, b in rank)


def test_starting_mid_stream_continues_the_same_batches():
    schedule = BatchSchedule([0, 1, 2, 0, 1, 2, 0], [1, 2, 1, 1, 1, 3, 1], 2, seed=9)
    full = take(ScheduleSampler(schedule), 17)
    resumed = take(ScheduleSampler(BatchSchedule([0, 1, 2, 0, 1, 2, 0], [1, 2, 1, 1, 1, 3, 1], 2, seed=9),
                                   start_position=22), 6)
    assert resumed == full[11:17]
    with pytest.raises(ValueError, match="multiple of the batch size"):
        ScheduleSampler(schedule, start_position=3)


# ----- several buckets ---------------------------------------------------------------------------------------------
def test_a_batch_holds_one_bucket_and_every_sample_is_seen_its_repeats_per_round():
    buckets = [0, 1, 1, 0, 2, 1, 0, 0]
    repeats = [1, 1, 1, 1, 3, 1, 2, 2]
    schedule = BatchSchedule(buckets, repeats, 2, seed=4)
    assert schedule.round_length == 3 + 2 + 2  # ceil(6 / 2) + ceil(3 / 2) + ceil(3 / 2)
    batches = take(ScheduleSampler(schedule), 4 * schedule.round_length)
    for batch in batches:
        assert len({bucket for _, _, bucket in batch}) == 1
        assert all(buckets[index] == bucket for _, index, bucket in batch)
    counts = {index: 0 for index in range(len(buckets))}
    for _, index, _ in flat(batches):
        counts[index] += 1
    # Bucket 0 holds 6 visits, 3 batches a round: 4 rounds are 4 whole epochs, each sample its repeats per epoch.
    assert [counts[i] for i in (0, 3, 6, 7)] == [4, 4, 8, 8]
    assert counts[4] == 4 * 4  # bucket 2: 3 visits, 4 per round (a full batch wraps into its next epoch)
    orders = [[bucket for _, _, bucket in (batch[0] for batch in batches[r * 7 : r * 7 + 7])] for r in range(4)]
    assert len({tuple(order) for order in orders}) > 1, "the bucket order should be drawn per round"


def test_the_schedule_depends_on_the_seed():
    first = take(ScheduleSampler(BatchSchedule([0, 1] * 4, [1] * 8, 2, seed=1)), 8)
    second = take(ScheduleSampler(BatchSchedule([0, 1] * 4, [1] * 8, 2, seed=2)), 8)
    assert first != second


# ----- assignment ----------------------------------------------------------------------------------------------------
SHAPES = [(17, 32, 64), (17, 64, 32), (9, 48, 48), (1, 32, 64), (1, 64, 32)]


def test_clips_go_to_the_nearest_aspect_ratio_they_can_fill():
    assert assign_bucket(info(40, 24, 1280, 720), False, SHAPES, None) == (0, None)  # landscape
    assert assign_bucket(info(40, 24, 720, 1280), False, SHAPES, None) == (1, None)  # portrait
    assert assign_bucket(info(40, 24, 500, 480), False, SHAPES, None) == (2, None)  # square
    # Too short for the 17-frame landscape bucket: the square 9-frame one, never a one-frame bucket.
    assert assign_bucket(info(12, 24, 1280, 720), False, SHAPES, None) == (2, None)


def test_stills_go_to_one_frame_buckets_only():
    assert assign_bucket(info(1, 0, 800, 600), True, SHAPES, None) == (3, None)
    assert assign_bucket(info(1, 0, 600, 800), True, SHAPES, None) == (4, None)
    bucket, reason = assign_bucket(info(1, 0, 600, 800), True, SHAPES[:3], None)
    assert bucket is None and "no bucket has 1 frame" in reason and "[1, 32, 64]" in reason


def test_a_clip_too_short_for_every_bucket_says_why_in_seconds_and_frames():
    bucket, reason = assign_bucket(info(78, 25, 640, 360), False, [(97, 32, 64)], 25.0)
    assert bucket is None
    assert "3.12 s at 25 fps gives 78 frames; the bucket needs 97" in reason
    two = [(97, 32, 64), (121, 32, 32)]
    assert "gives 78 frames; the smallest bucket needs 97" in assign_bucket(info(78, 25, 640, 360), False, two, 25.0)[1]
    # At 12 fps the 30 fps clip yields fewer frames: counted after resampling, not before.
    bucket, reason = assign_bucket(info(40, 30, 640, 360), False, [(17, 32, 64)], 12.0)
    assert bucket is None and "1.33 s at 12 fps gives 16 frames; the bucket needs 17" in reason
    assert assign_bucket(info(41, 30, 640, 360), False, [(17, 32, 64)], 12.0) == (0, None)


# ----- windows -------------------------------------------------------------------------------------------------------
def test_window_starts_and_visit_starts():
    clip = info(40, 24, 64, 64)  # 9 frames can start at 0 ... 31
    assert window_starts(clip, 9, None, "start", 4) == [0]
    assert window_starts(clip, 9, None, "middle", 4) == [15]
    assert window_starts(clip, 9, None, "random", 1) == [0]
    assert window_starts(clip, 9, None, "random", 3) == [0, 16, 31]
    assert window_starts(info(9, 24, 64, 64), 9, None, "random", 3) == [0]
    starts = [visit_start(clip, 9, None, "random", 0, position) for position in range(200)]
    assert min(starts) == 0 and max(starts) == 31 and len(set(starts)) > 20
    assert starts == [visit_start(clip, 9, None, "random", 0, position) for position in range(200)]
    assert starts != [visit_start(clip, 9, None, "random", 1, position) for position in range(200)]
    assert {visit_start(clip, 9, None, "middle", 0, p) for p in range(5)} == {15}
    assert {visit_window(3, "random", 0, p) for p in range(50)} == {0, 1, 2}
    assert {visit_window(3, "start", 0, p) for p in range(50)} == {0}
