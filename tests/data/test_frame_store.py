"""The decoded-window store (data.frame_store_mib) and the cache's read-ahead thread."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from vidtune.batches import read_ahead
from vidtune.config import DataConfig
from vidtune.data.dataset import VideoCaptionDataset, collate_samples
from vidtune.data.frame_store import FrameStore
from vidtune.data.sources import load_dataset

SHAPE = (9, 32, 32)


@pytest.fixture(scope="module")
def clips(shapes_dataset):
    return load_dataset(DataConfig(root=str(shapes_dataset), frames=9, height=32, width=32, num_workers=0),
                        progress=False)


def dataset(clips, store: FrameStore | None, sampling: str = "start") -> VideoCaptionDataset:
    return VideoCaptionDataset(clips, [SHAPE], frame_sampling=sampling, seed=3, store=store)


def test_a_window_is_decoded_once_and_read_back_unchanged(clips):
    store = FrameStore.create(8, num_workers=0)
    stored, plain = dataset(clips, store, "random"), dataset(clips, None, "random")
    for position in (0, 1, 0, 1):
        for index in range(len(clips)):
            assert torch.equal(stored[(position, index, 0)]["video"], plain[(position, index, 0)]["video"])
    windows = len({(i, s) for i in range(len(clips)) for s in (stored_start(stored, 0, i), stored_start(stored, 1, i))})
    assert (store.misses, store.hits) == (windows, 4 * len(clips) - windows)
    assert len(list(store.folder.glob("*.npy"))) == windows


def stored_start(data: VideoCaptionDataset, position: int, index: int) -> int:
    from vidtune.data.buckets import visit_start

    return visit_start(data.clips[index].info, SHAPE[0], None, data.frame_sampling, data.seed, position)


def test_the_store_keeps_to_its_size_and_still_gives_every_window(clips):
    window_bytes = int(np.prod(SHAPE)) * 3
    owner = FrameStore.create(1, num_workers=0)  # owns (and removes) the folder
    store = FrameStore(owner.folder, budget_bytes=2 * window_bytes)
    data = dataset(clips, store)
    for _ in range(2):
        videos = [data[(0, index, 0)]["video"] for index in range(len(clips))]
    assert len(list(store.folder.glob("*.npy"))) == 2
    assert store.stored_bytes == 2 * window_bytes
    assert all(v.shape == (9, 3, 32, 32) for v in videos)


def test_worker_processes_share_the_store_and_it_is_removed_after(clips):
    store = FrameStore.create(8, num_workers=2)
    folder = store.folder
    loader = DataLoader(dataset(clips, store), batch_sampler=[[(0, i, 0)] for i in range(len(clips))] * 2,
                        num_workers=2, collate_fn=collate_samples)
    batches = list(loader)
    # Each window decoded once whichever worker met it first; the second epoch read the files back.
    assert len(list(folder.glob("*.npy"))) == len(clips)
    assert all(torch.equal(a["video"], b["video"]) for a, b in zip(batches[: len(clips)], batches[len(clips):],
                                                                   strict=True))
    assert not list(folder.glob(".*.tmp.npy"))
    del store, loader, batches
    gc.collect()
    assert not folder.exists()


def test_a_store_of_zero_is_off():
    assert FrameStore.create(0, num_workers=2) is None


def test_read_ahead_keeps_the_order_and_starts_in_the_callers_thread():
    started_in: list[str] = []

    class Items:  # like a DataLoader: its iterator (and its base seed) is made when `iter` is called
        def __iter__(self):
            started_in.append(threading.current_thread().name)
            return iter(range(10))

    stream = read_ahead(Items(), depth=2)
    assert not started_in  # nothing happens before the first batch is asked for
    assert list(stream) == list(range(10))
    assert started_in == [threading.current_thread().name]


def test_read_ahead_raises_the_loaders_error_in_order():
    def items():
        yield 1
        raise ValueError("entry 2 is damaged")

    stream = read_ahead(items(), depth=4)
    assert next(stream) == 1
    with pytest.raises(ValueError, match="entry 2 is damaged"):
        next(stream)
