"""Batch order (pure functions of data/samplers.py): seeded length-grouped training batches,
plain shuffling, data-parallel shards of each global batch, and sorted evaluation batches."""

import numpy as np
import pytest

from tuneforge.data.samplers import epoch_order, eval_batches, rank_batches

N, GLOBAL_BATCH = 1000, 16


@pytest.fixture(scope="module")
def lengths():
    return np.random.default_rng(0).integers(5, 300, size=N)


def order(lengths, *, seed=1, epoch=0, grouped=True, global_batch=GLOBAL_BATCH):
    return epoch_order(lengths, seed=seed, epoch=epoch, global_batch=global_batch, group_by_length=grouped)


def mean_spread(lengths, idx, batch):
    """Mean (max - min) length inside each batch of `idx`."""
    return float(np.mean([np.ptp(lengths[idx[i : i + batch]]) for i in range(0, len(idx), batch)]))


@pytest.mark.parametrize("grouped", [True, False])
def test_every_example_once_per_epoch(lengths, grouped):
    for epoch in range(3):
        assert sorted(order(lengths, epoch=epoch, grouped=grouped).tolist()) == list(range(N))


@pytest.mark.parametrize("grouped", [True, False])
def test_seeded_deterministic_per_epoch_and_different_across_epochs(lengths, grouped):
    a = order(lengths, epoch=0, grouped=grouped)
    assert np.array_equal(a, order(lengths, epoch=0, grouped=grouped))  # same seed + epoch: same order
    assert not np.array_equal(a, order(lengths, epoch=1, grouped=grouped))  # next epoch differs
    assert not np.array_equal(a, order(lengths, seed=2, epoch=0, grouped=grouped))  # another seed differs


def test_length_grouping_puts_similar_lengths_together(lengths):
    grouped = mean_spread(lengths, order(lengths, grouped=True), GLOBAL_BATCH)
    plain = mean_spread(lengths, order(lengths, grouped=False), GLOBAL_BATCH)
    assert grouped < plain / 5, (grouped, plain)
    # ... while the batch order itself is shuffled, not longest-to-shortest over the epoch
    idx = order(lengths, grouped=True)
    batch_max = [lengths[idx[i : i + GLOBAL_BATCH]].max() for i in range(0, N - GLOBAL_BATCH + 1, GLOBAL_BATCH)]
    assert batch_max != sorted(batch_max, reverse=True)


def test_plain_shuffling_is_a_seeded_permutation(lengths):
    idx = order(lengths, grouped=False)
    assert np.array_equal(idx, np.random.default_rng([1, 0]).permutation(N))
    # no length structure: the spread inside batches is like that of the whole data
    assert mean_spread(lengths, idx, GLOBAL_BATCH) > 0.6 * np.ptp(lengths)


def test_no_group_by_length_flag_gives_plain_shuffling():
    from tuneforge.cli import _flags, build_parser, train_flags
    from tuneforge.configure import config_from_sources

    ns = build_parser().parse_args(["train", "--task", "classification", "--no-group-by-length"])
    assert config_from_sources(None, [], _flags(ns, train_flags())).data.group_by_length is False
    ns = build_parser().parse_args(["train", "--task", "classification"])
    assert config_from_sources(None, [], _flags(ns, train_flags())).data.group_by_length is True


@pytest.mark.parametrize("dp_size", [2, 3, 4])
@pytest.mark.parametrize("start", [0, 37])
def test_ranks_take_disjoint_slices_covering_each_global_batch(lengths, dp_size, start):
    global_batch = 10
    idx = order(lengths, global_batch=global_batch)
    per_rank = [
        rank_batches(idx, start=start, global_batch=global_batch, dp_rank=r, dp_size=dp_size) for r in range(dp_size)
    ]
    n_batches = {len(b) for b in per_rank}
    assert len(n_batches) == 1  # every rank runs the same number of steps
    rest = idx[start:]
    for i in range(n_batches.pop()):
        shards = [per_rank[r][i] for r in range(dp_size)]
        assert all(len(s) >= 1 for s in shards)
        flat = [x for s in shards for x in s]
        assert len(flat) == len(set(flat))  # disjoint
        assert flat == rest[i * global_batch : (i + 1) * global_batch].tolist()  # covers the global batch, in order
        assert max(map(len, shards)) - min(map(len, shards)) <= 1  # as even as possible


def test_last_global_batch_smaller_than_world_is_dropped():
    idx = np.arange(21)
    per_rank = [rank_batches(idx, start=0, global_batch=10, dp_rank=r, dp_size=4) for r in range(4)]
    assert all(len(b) == 2 for b in per_rank)  # the 1-example tail cannot feed 4 ranks
    covered = sorted(x for b in per_rank for batch in b for x in batch)
    assert covered == list(range(20))


def test_single_rank_gets_every_example(lengths):
    idx = order(lengths)
    batches = rank_batches(idx, start=0, global_batch=GLOBAL_BATCH, dp_rank=0, dp_size=1)
    assert [x for b in batches for x in b] == idx.tolist()


@pytest.mark.parametrize("dp_size", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 2, 50, 103])
def test_eval_batches_sorted_and_each_example_on_exactly_one_rank(dp_size, n):
    lens = np.random.default_rng(n).integers(1, 100, size=n)
    per_rank = [eval_batches(lens, batch_size=8, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    assert len({len(b) for b in per_rank}) == 1  # same number of batches: collectives line up
    seen = [i for b in per_rank for batch in b for i in batch if i >= 0]
    assert sorted(seen) == list(range(n))  # every example exactly once across ranks
    for batches in per_rank:
        for batch in batches:
            assert len(batch) <= 8
            real = [i for i in batch if i >= 0]
            assert real or batch == [-1]  # an empty share is a single -1 placeholder
            assert list(lens[real]) == sorted(lens[real], reverse=True)  # sorted by length inside a batch
    # the global order is longest first: batch k on every rank is no longer than batch k-1
    if dp_size == 1:
        flat = [i for b in per_rank[0] for i in b]
        assert list(lens[flat]) == sorted(lens, reverse=True)


@pytest.mark.parametrize("sort_rows", [1, 37, 1000, 2**20])
def test_length_grouping_sorted_in_parts_is_the_order_sorted_at_once(sort_rows, monkeypatch):
    """The epoch is sorted SORT_ROWS examples at a time (bounded memory): the order must not depend on it, and
    stays in 4-byte indices."""
    rng = np.random.default_rng(sort_rows)
    lengths = rng.integers(1, 300, 4_321)
    whole = epoch_order(lengths, seed=3, epoch=1, global_batch=8, group_by_length=True)
    monkeypatch.setattr("tuneforge.data.samplers.SORT_ROWS", sort_rows)
    parts = epoch_order(lengths.astype(np.uint16), seed=3, epoch=1, global_batch=8, group_by_length=True)
    assert parts.dtype == np.int32
    np.testing.assert_array_equal(parts, whole)
