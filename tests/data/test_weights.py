"""`data.datasets[].weight`: each source's share of the draws, whatever its size, over buckets, as a pure function of
(seed, position)."""

from __future__ import annotations

from collections import Counter

import pytest

from vidtune.data.buckets import BatchSchedule, ScheduleSampler
from vidtune.data.sources import Clip, draw_weights

DRAWS = 10_000


def clips(sizes: list[int], weights: list[float], buckets: list[list[int]]) -> list[Clip]:
    found = []
    for number, (size, weight) in enumerate(zip(sizes, weights, strict=True)):
        for i in range(size):
            found.append(Clip(video=f"{number}-{i}.mp4", caption="c", index=len(found), line=i + 1,
                              source_number=number, weight=weight, bucket=buckets[number][i % len(buckets[number])]))
    return found


def drawn(samples: list[Clip], batch_size: int, seed: int = 0) -> list[int]:
    schedule = BatchSchedule([c.bucket for c in samples], [1] * len(samples), batch_size, seed, draw_weights(samples))
    sampler = iter(ScheduleSampler(schedule))
    out = []
    while len(out) < DRAWS:
        batch = next(sampler)
        assert len({bucket for _, _, bucket in batch}) == 1  # one bucket a batch
        out.extend(index for _, index, _ in batch)
    return out[:DRAWS]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_sources_are_drawn_in_proportion_to_their_weights_whatever_their_size(batch_size):
    # Source 0: 12 samples, weight 3; source 1: 2 samples, weight 1; two buckets shared by both.
    samples = clips([12, 2], [3.0, 1.0], [[0, 1], [1, 0]])
    counts = Counter(samples[index].source_number for index in drawn(samples, batch_size))
    share = counts[0] / DRAWS
    # Binomial: standard deviation sqrt(0.75 * 0.25 / 10000) = 0.0043; 4.5 of them is 0.02.
    print(f"source 0 share {share:.4f} (stated 0.75), batch size {batch_size}")
    assert share == pytest.approx(0.75, abs=0.02)
    # Within a source each sample equally often: 1/12 of 0.75 and 1/2 of 0.25.
    per_sample = Counter(drawn(samples, batch_size))
    for index, sample in enumerate(samples):
        expected = 0.75 / 12 if sample.source_number == 0 else 0.25 / 2
        assert per_sample[index] / DRAWS == pytest.approx(expected, abs=4.5 * (expected * (1 - expected) / DRAWS)
                                                          ** 0.5)


def test_weighted_draws_are_a_function_of_seed_and_position():
    samples = clips([5, 3], [1.0, 2.0], [[0], [0]])
    ones = drawn(samples, 1)[:40]
    assert ones == drawn(samples, 4)[:40]  # one bucket: batch 4 sees what four batches of 1 see
    assert ones != drawn(samples, 1, seed=1)[:40]
    schedule = BatchSchedule([0] * 8, [1] * 8, 2, 0, draw_weights(samples))
    resumed = next(iter(ScheduleSampler(schedule, start_position=6)))
    assert [index for _, index, _ in resumed] == ones[6:8]


def test_without_weights_the_epochs_of_repeats_are_kept():
    samples = clips([3, 2], [None, None], [[0], [0]])
    assert draw_weights(samples) is None
