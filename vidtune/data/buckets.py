"""Buckets of shapes, which frames of a clip a visit reads, and the seeded batch schedule that respects both.

A bucket is a shape `(frames, height, width)`. Each sample goes to one bucket, chosen once, up front: among the
buckets whose frame count it can fill (at `data.fps`, or its own rate), the one of nearest aspect ratio (compared
as log-ratios, so 2:1 and 1:2 are equally far from 1:1); ties go to the bucket with more frames, then the earlier
one. Stills go to one-frame buckets; clips go to buckets of more than one frame (with one-frame buckets alone, clips
are a problem: they would train as stills).
A sample that fits no bucket is reported with the reason; nothing is ever stretched in time.

A batch holds samples of one bucket. The schedule is a pure function of (seed, batch number), so a run resumes
from the number of samples consumed, and data-parallel ranks take disjoint batches (rank r: r, r + world, ...):

- each bucket has its own endless stream of visits: its samples, each `repeats` times, in a fresh seeded
  permutation per epoch of that bucket;
- the schedule runs in rounds; in a round bucket b gives ceil(visits_b / batch_size) batches, in a seeded order;
  batch j of bucket b takes the next `batch_size` visits of b's stream.

With `data.datasets[].weight`, visits are drawn with replacement by weight instead (`BatchSchedule`).

Batch n covers stream positions n * batch_size ... n * batch_size + batch_size - 1; a position seeds the randomness
of its visit (noise, noise level, caption dropout, and the frame window through `frame_generator`). With one bucket
this is exactly the plain stream of epoch permutations (batch 2 x accumulation 1 sees what batch 1 x accumulation 2
sees); with several, the batch size decides which samples share a batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from vidtune.data.video import VideoInfo, format_fps, frames_available, required_source_frames
from vidtune.errors import ConfigError, VidtuneError

Shape = tuple[int, int, int]


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def visit_generator(seed: int, position: int) -> torch.Generator:
    """Randomness of one visit of one sample: independent of batch size, accumulation and rank."""
    return torch.Generator().manual_seed((seed * 1_000_003 + position * 7_919 + 17) % 2**63)


def frame_generator(seed: int, position: int) -> torch.Generator:
    """Which frames a visit reads: its own generator, so it never shares draws with the visit's noise."""
    return torch.Generator().manual_seed((seed * 1_000_033 + position * 104_729 + 1_009) % 2**63)


# ----- assigning samples to buckets ---------------------------------------------------------------------------
def describe_shape(shape: Shape) -> str:
    """'17x64x96': frames x height x width, the order of the config's data.buckets."""
    return "x".join(str(value) for value in shape)


def assign_bucket(info: VideoInfo, is_image: bool, shapes: Sequence[Shape], fps: float | None
                  ) -> tuple[int | None, str | None]:
    """(index of the sample's bucket, None) or (None, why it fits none, in words)."""
    if is_image:
        candidates = [i for i, shape in enumerate(shapes) if shape[0] == 1]
        if not candidates:
            return None, (f"it is a still image, and no bucket has 1 frame (the buckets hold "
                          f"{_frame_counts(shapes)} frames): set data.buckets to {with_still_buckets(shapes)} (the "
                          "bucket list in full: it replaces data.frames / height / width), or remove the image")
    else:
        try:
            available = frames_available(info.num_frames, fps, info.fps)
        except VidtuneError as error:
            return None, str(error)
        moving = [i for i, shape in enumerate(shapes) if shape[0] > 1]
        usable = moving or list(range(len(shapes)))
        candidates = [i for i in usable if shapes[i][0] <= available]
        if not candidates:
            return None, _too_short(info, available, fps, min(shapes[i][0] for i in usable), len(usable) == 1)
    aspect = math.log(info.width / info.height)
    return min(candidates, key=lambda i: (abs(math.log(shapes[i][2] / shapes[i][1]) - aspect), -shapes[i][0], i)), None


def with_still_buckets(shapes: Sequence[Shape]) -> str:
    """`shapes` and a one-frame bucket of each of their sizes, written as data.buckets takes them: the list that trains
    the clips as before and the stills beside them."""
    sizes = list(dict.fromkeys((height, width) for _, height, width in shapes))
    return str([list(shape) for shape in shapes] + [[1, height, width] for height, width in sizes])


def clips_as_stills(shapes: Sequence[Shape], frames: int, infos: Sequence[tuple[bool, int | None]]) -> str | None:
    """The problem of a bucket list that has only one-frame buckets while the samples include video clips: each clip
    would train as a single frame, which is never what a list of clips means. `infos`: (is_image, bucket) per sample
    that fits a bucket; `frames`: data.frames, the frame count suggested for the clips."""
    if any(shape[0] > 1 for shape in shapes):
        return None
    clips = sum(1 for is_image, bucket in infos if not is_image and bucket is not None)
    if not clips:
        return None
    sizes = list(dict.fromkeys((height, width) for _, height, width in shapes))
    suggested = [[frames, height, width] for height, width in sizes] + [list(shape) for shape in shapes]
    counted = f"{clips} clip would train as a still" if clips == 1 else f"{clips} clips would train as stills"
    return (f"{counted}: every bucket of data.buckets has 1 frame "
            f"({[list(shape) for shape in shapes]}), so each video clip would train as a single frame. Give the clips "
            f"a bucket with more frames beside the one-frame ones, e.g. data.buckets: {suggested} (data.frames, "
            "height and width are not read when data.buckets is set), or list only images")


def _frame_counts(shapes: Sequence[Shape]) -> str:
    return ", ".join(str(count) for count in sorted({shape[0] for shape in shapes}))


def _too_short(info: VideoInfo, available: int, fps: float | None, smallest: int, single: bool) -> str:
    seconds = f"{info.duration:.2f} s" if info.fps > 0 else f"{info.num_frames} frames"
    rate = f"{format_fps(fps)} fps" if fps is not None else f"its own {format_fps(info.fps)} fps"
    what = "the bucket needs" if single else "the smallest bucket needs"
    return (f"it is too short: {seconds} at {rate} gives {available} frame{'s' if available != 1 else ''}; "
            f"{what} {smallest}. Use a longer clip, "
            f"{'lower data.frames' if single else 'add a bucket with fewer frames'}"
            f"{', or raise data.fps' if fps is not None else ''}; it is never stretched in time")


def check_bucket_shapes(spec, shapes: Sequence[Shape], single: bool) -> None:
    """Every bucket against the family's shape rules; one ConfigError naming each bad bucket and its nearest
    valid values. `single`: the shape came from data.frames / height / width (the message names those keys)."""
    if single:
        spec.check_video_shape(*shapes[0])
        return
    problems = []
    for number, shape in enumerate(shapes):
        try:
            spec.check_video_shape(*shape)
        except ConfigError as error:
            # The family names the one-bucket keys (data.frames=10 ...): here each value is a bucket's.
            details = [line.strip()[2:].replace("data.", "") for line in str(error).splitlines()
                       if line.strip().startswith("- ")]
            problems.append(f"data.buckets[{number}] = {list(shape)}: " + "; ".join(details))
    if problems:
        raise ConfigError(
            f"{len(problems)} bucket{'s' if len(problems) != 1 else ''} of data.buckets "
            f"{'do' if len(problems) != 1 else 'does'} not fit the {spec.name} model at {spec.config.pretrained}:\n"
            + "\n".join(f"  - {problem}" for problem in problems)
            + "\nWhat to do: set the nearest valid values above in data.buckets (frames, height, width)."
        )


# ----- which frames a visit reads --------------------------------------------------------------------------------
def last_start(info: VideoInfo, frames: int, fps: float | None) -> int:
    """The latest source frame a window of `frames` (at `fps`) can start at; 0 for a still."""
    if info.num_frames <= 1:
        return 0
    return max(0, info.num_frames - required_source_frames(frames, fps, info.fps))


def window_starts(info: VideoInfo, frames: int, fps: float | None, sampling: str, windows: int) -> list[int]:
    """The fixed windows (source frame starts) a clip offers: one for `start` / `middle`; for `random` with the
    precompute cache, `windows` evenly spaced from the start to the end (1: the start)."""
    end = last_start(info, frames, fps)
    if sampling == "middle":
        return [end // 2]
    if sampling == "start" or windows == 1 or end == 0:
        return [0]
    return sorted({round(number * end / (windows - 1)) for number in range(windows)})


def visit_start(info: VideoInfo, frames: int, fps: float | None, sampling: str, seed: int, position: int) -> int:
    """The source frame a visit's window starts at (on the fly): `random` draws it from the visit's generator."""
    end = last_start(info, frames, fps)
    if sampling == "random" and end > 0:
        return int(torch.randint(0, end + 1, (1,), generator=frame_generator(seed, position)))
    return end // 2 if sampling == "middle" else 0


def visit_window(count: int, sampling: str, seed: int, position: int) -> int:
    """Which of `count` cached windows a visit reads (precompute): drawn for `random`, else the only one."""
    if sampling != "random" or count <= 1:
        return 0
    return int(torch.randint(0, count, (1,), generator=frame_generator(seed, position)))


# ----- the batch schedule -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Visit:
    position: int
    index: int  # the sample's index in the dataset
    bucket: int


def draw_generator(seed: int, position: int) -> torch.Generator:
    """Which sample a weighted visit draws (`data.datasets[].weight`): apart from the visit's noise and frames."""
    return torch.Generator().manual_seed((seed * 1_000_117 + position * 49_979_687 + 23) % 2**63)


class BatchSchedule:
    """The batches of a run: batch n is `batch_size` visits of one bucket (a pure function of seed and n).

    With `weights` (each sample's probability of being drawn, from `data.datasets[].weight`), visits are drawn with
    replacement instead of walking epochs: a batch's first visit draws among all samples, the others among the
    samples of the bucket it drew, each from its position's own generator, so every visit draws sample i with
    probability weights[i] (summed over the buckets) and, with one bucket, batch 2 x accumulation 1 still equals
    batch 1 x accumulation 2."""

    def __init__(self, buckets: Sequence[int], repeats: Sequence[int], batch_size: int, seed: int,
                 weights: Sequence[float] | None = None) -> None:
        """`buckets[i]` / `repeats[i]` / `weights[i]`: the bucket, the repeats and the draw weight of sample i."""
        if not buckets:
            raise ValueError("the dataset is empty")
        self.batch_size = batch_size
        self.seed = seed
        self.weights = None if weights is None else torch.tensor(weights, dtype=torch.float64)
        self.samples_of = {b: torch.tensor([i for i, own in enumerate(buckets) if own == b]) for b in set(buckets)}
        self.buckets = list(buckets)
        self.visits: dict[int, list[int]] = {}  # bucket -> sample indices, each `repeats` times
        for index, (bucket, count) in enumerate(zip(buckets, repeats, strict=True)):
            self.visits.setdefault(bucket, []).extend([index] * count)
        self.order = sorted(self.visits)
        self.per_round = {b: math.ceil(len(self.visits[b]) / batch_size) for b in self.order}
        self.round_length = sum(self.per_round.values())
        self._round: tuple[int, list[int], list[int]] | None = None  # (round, bucket of each slot, slot's rank)
        self._epochs: dict[int, tuple[int, list[int]]] = {}  # bucket -> (epoch, permutation)

    @property
    def visits_per_epoch(self) -> int:
        if self.weights is not None:  # drawn with replacement: an epoch is as many draws as samples
            return len(self.buckets)
        return sum(len(visits) for visits in self.visits.values())

    def _drawn(self, number: int) -> list[Visit]:
        assert self.weights is not None
        visits: list[Visit] = []
        for k in range(self.batch_size):
            position = number * self.batch_size + k
            generator = draw_generator(self.seed, position)
            if k == 0:
                index = int(torch.multinomial(self.weights, 1, generator=generator))
                bucket = self.buckets[index]
            else:
                among = self.samples_of[bucket]
                index = int(among[int(torch.multinomial(self.weights[among], 1, generator=generator))])
            visits.append(Visit(position, index, bucket))
        return visits

    def bucket_seed(self, bucket: int) -> int:
        # The first bucket uses the run's seed as it is: one bucket is the plain stream of epoch permutations.
        return self.seed if bucket == self.order[0] else self.seed + 7_919 * (bucket + 1)

    def _slots(self, round_number: int) -> tuple[list[int], list[int]]:
        if self._round is None or self._round[0] != round_number:
            slots = [b for b in self.order for _ in range(self.per_round[b])]
            if len(self.order) > 1:
                generator = torch.Generator().manual_seed(self.seed * 1_000_037 + round_number)
                slots = [slots[i] for i in torch.randperm(len(slots), generator=generator).tolist()]
            seen: dict[int, int] = {}
            ranks = []
            for bucket in slots:
                ranks.append(seen.get(bucket, 0))
                seen[bucket] = ranks[-1] + 1
            self._round = (round_number, slots, ranks)
        return self._round[1], self._round[2]

    def _visit(self, bucket: int, offset: int) -> int:
        visits = self.visits[bucket]
        epoch, within = divmod(offset, len(visits))
        cached = self._epochs.get(bucket)
        if cached is None or cached[0] != epoch:
            cached = (epoch, epoch_permutation(len(visits), self.bucket_seed(bucket), epoch))
            self._epochs[bucket] = cached
        return visits[cached[1][within]]

    def batch(self, number: int) -> list[Visit]:
        if self.weights is not None:
            return self._drawn(number)
        round_number, slot = divmod(number, self.round_length)
        slots, ranks = self._slots(round_number)
        bucket = slots[slot]
        first = (round_number * self.per_round[bucket] + ranks[slot]) * self.batch_size
        return [Visit(number * self.batch_size + k, self._visit(bucket, first + k), bucket)
                for k in range(self.batch_size)]


class ScheduleSampler:
    """A DataLoader batch sampler: this rank's batches (rank, rank + world, ...) from `start_position` on, forever;
    each item is a (position, sample index, bucket) key."""

    def __init__(self, schedule: BatchSchedule, start_position: int = 0, rank: int = 0, world: int = 1) -> None:
        if start_position % schedule.batch_size:
            raise ValueError(f"start position {start_position} is not a multiple of the batch size "
                             f"{schedule.batch_size}")
        self.schedule = schedule
        self.start = start_position // schedule.batch_size
        self.rank = rank
        self.world = world

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        number = self.start + self.rank
        while True:
            yield [(visit.position, visit.index, visit.bucket) for visit in self.schedule.batch(number)]
            number += self.world
