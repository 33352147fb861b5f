"""The mixture's plan and epoch order (data/mixture.py, data/samplers.py): shares per epoch, the sources' shares
in every window of the epoch (with length grouping too), passes over a source before any row repeats, and the order
as a pure function of the seed and the epoch."""

import numpy as np
import pytest

from tuneforge.data.mixture import Mixture, share_out, stream_rows
from tuneforge.data.samplers import epoch_order, rank_batches

WINDOW = 10_000


def window_shares(sources: np.ndarray, n_sources: int, window: int = WINDOW) -> np.ndarray:
    """(source, window start) -> the share of that source among `window` consecutive examples, every start."""
    out = []
    for s in range(n_sources):
        hits = np.concatenate([[0], np.cumsum(sources == s)])
        out.append((hits[window:] - hits[:-window]) / window)
    return np.array(out)


@pytest.mark.parametrize("group_by_length", [False, True])
def test_every_window_of_ten_thousand_holds_each_source_within_one_and_a_half_percent(group_by_length):
    sizes, weights = [30_000, 6_000, 1_500], [0.5, 0.3, 0.2]
    mixture = Mixture.of(["web", "books", "code"], sizes, weights=weights)
    # each source's examples have lengths of their own (the worst case for length grouping's sort)
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(lo, hi, n) for n, (lo, hi) in zip(sizes, [(5, 30), (200, 400), (40, 90)])])
    for epoch in (0, 1):
        order = epoch_order(
            lengths, seed=3, epoch=epoch, global_batch=32, group_by_length=group_by_length, mixture=mixture
        )
        assert len(order) == mixture.epoch_rows == sum(sizes)
        shares = window_shares(mixture.source_of(order), 3)
        for s, w in enumerate(weights):
            assert np.abs(shares[s] - w).max() <= 0.015, (s, shares[s].min(), shares[s].max())


def test_epoch_quotas_follow_the_weights_and_add_up():
    mixture = Mixture.of(["a", "b", "c"], [1000, 10, 333], weights=[1, 1, 2])
    assert sum(mixture.quotas) == mixture.epoch_rows == 1343
    assert mixture.quotas == (336, 336, 671)
    assert share_out(7, [1, 1, 1]) == [3, 2, 2]
    assert share_out(3, [1000, 1, 1]) == [1, 1, 1]  # every source is in every epoch


def test_epochs_per_source_read_each_row_that_many_times_in_an_epoch():
    mixture = Mixture.of(["small", "big"], [50, 400], epochs=[3, 0.5])
    order = mixture.order(seed=1, epoch=0)
    counts = np.bincount(order, minlength=450)
    assert (counts[:50] == 3).all()  # the upsampled source: each row three times
    assert counts[50:].sum() == 200 and counts[50:].max() == 1  # half the big one, no row twice


def test_a_downsampled_source_shows_every_row_before_any_repeats():
    mixture = Mixture.of(["big", "small"], [1000, 100], weights=[0.1, 0.9])  # big: 111 of its 1000 rows an epoch
    seen = np.concatenate([o[o < 1000] for o in (mixture.order(seed=5, epoch=e) for e in range(9))])
    assert len(seen) == 9 * mixture.quotas[0] == 999
    assert len(set(seen.tolist())) == 999  # nine epochs, 999 different rows


def test_the_stream_is_the_same_however_it_is_read():
    for size in (1, 7, 1000, 2**20 + 3):
        whole = stream_rows(size, seed=2, source=1, start=0, count=3 * size)
        for k in range(3):
            assert sorted(whole[k * size : (k + 1) * size].tolist()) == list(range(size))
        for start, count in ((0, 1), (size - 1, 2), (size // 2, size + 1), (2 * size, size)):
            assert np.array_equal(
                stream_rows(size, seed=2, source=1, start=start, count=count), whole[start : start + count]
            )


def test_the_order_is_a_function_of_the_seed_and_the_epoch():
    mixture = Mixture.of(["a", "b"], [500, 300], weights=[0.6, 0.4])
    lengths = np.random.default_rng(1).integers(1, 100, 800)
    order = lambda seed, epoch: epoch_order(  # noqa: E731
        lengths, seed=seed, epoch=epoch, global_batch=8, group_by_length=True, mixture=mixture
    )
    assert np.array_equal(order(1, 0), order(1, 0))
    assert not np.array_equal(order(1, 0), order(2, 0))
    assert not np.array_equal(order(1, 0), order(1, 1))
    # two ranks take the global batches one rank takes, split in two
    one = rank_batches(order(1, 0), start=40, global_batch=8, dp_rank=0, dp_size=1)
    two = [rank_batches(order(1, 0), start=40, global_batch=8, dp_rank=r, dp_size=2) for r in (0, 1)]
    assert one == [a + b for a, b in zip(*two)]


def test_max_train_samples_keeps_each_sources_share():
    mixture = Mixture.of(["a", "b"], [900, 100], weights=[0.5, 0.5]).limited(100)
    assert mixture.quotas == (50, 50) and mixture.epoch_rows == 100
    assert len(mixture.order(seed=0, epoch=0)) == 100


def test_the_plan_says_rows_and_shares_per_source():
    lines = Mixture.of(["web", "code"], [300, 30], weights=[0.75, 0.25]).describe()
    assert lines[0] == "data mixture: 2 sources, 330 examples per epoch"
    assert lines[1] == "  web: 300 rows, 247 per epoch (74.8% of it; each row 0.823x per epoch)"
    assert lines[2] == "  code: 30 rows, 83 per epoch (25.2% of it; each row 2.77x per epoch)"


def reference_order(mixture: Mixture, seed: int, epoch: int) -> np.ndarray:
    """The interleaving as first written: every source's keys laid out, one stable sort (ties to the earlier
    source). `Mixture.order` counts each row's place instead, a chunk at a time; the two must agree exactly."""
    phases = np.random.default_rng([seed, epoch, 104_729]).random(len(mixture.sizes))
    keys = np.concatenate([(np.arange(q) + p) / q for q, p in zip(mixture.quotas, phases)])
    rows = [
        offset + stream_rows(size, seed, source, epoch * quota, quota)
        for source, (offset, size, quota) in enumerate(zip(mixture.offsets, mixture.sizes, mixture.quotas))
    ]
    return np.concatenate(rows)[np.argsort(keys, kind="stable")]


@pytest.mark.parametrize("case", range(40))
def test_the_counted_order_is_the_sorted_one_in_small_chunks_and_large(case, monkeypatch):
    rng = np.random.default_rng(case)
    n = int(rng.integers(1, 5))
    sizes = rng.integers(1, 3000, n).tolist()
    if case % 4 == 0:  # equal quotas: keys of two sources can tie
        sizes = [int(sizes[0])] * n
    given = [{}, {"weights": (rng.random(n) + 0.01).tolist()}, {"epochs": (rng.random(n) * 3 + 0.1).tolist()}]
    mixture = Mixture.of(["s"] * n, sizes, **given[case % 3])
    monkeypatch.setattr("tuneforge.data.mixture.ORDER_CHUNK", int(rng.integers(1, 700)) if case % 2 else 2**18)
    for seed, epoch in [(0, 0), (case, 2)]:
        order = mixture.order(seed, epoch)
        assert order.dtype == np.int32
        np.testing.assert_array_equal(order, reference_order(mixture, seed, epoch))
