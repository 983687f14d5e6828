import itertools

from vidtune.data.sampler import StreamSampler, epoch_permutation, stream_index


def take(sampler, count):
    return list(itertools.islice(iter(sampler), count))


def test_each_epoch_is_a_permutation_and_epochs_differ():
    pairs = take(StreamSampler(10, seed=3), 30)
    assert [p for p, _ in pairs] == list(range(30))
    epochs = [[i for _, i in pairs[k * 10 : (k + 1) * 10]] for k in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1]
    assert epochs[0] == epoch_permutation(10, 3, 0)


def test_ranks_split_positions_without_overlap_or_gaps():
    world = 3
    per_rank = [take(StreamSampler(7, seed=1, rank=r, world=world), 7) for r in range(world)]
    positions = sorted(p for rank in per_rank for p, _ in rank)
    assert positions == list(range(21))
    single = dict(take(StreamSampler(7, seed=1), 21))
    assert all(single[p] == i for rank in per_rank for p, i in rank)


def test_starting_mid_stream_continues_the_same_order():
    full = take(StreamSampler(5, seed=9), 17)
    resumed = take(StreamSampler(5, seed=9, start=11), 6)
    assert resumed == full[11:17]
    assert all(stream_index(5, 9, p) == i for p, i in full)
