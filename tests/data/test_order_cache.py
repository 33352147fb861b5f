"""Large epochs' orders kept in the run folder (data/order_cache.py): stored by the writing rank, read back
memory-mapped as what the computation gives, another epoch's removed, small epochs and unidentified data never
stored."""

import numpy as np

from tuneforge.data import order_cache
from tuneforge.data.order_cache import OrderCache
from tuneforge.data.samplers import epoch_order


def test_a_large_epochs_order_is_stored_and_read_back_as_computed(tmp_path, monkeypatch):
    monkeypatch.setattr(order_cache, "MIN_EXAMPLES", 100)
    lengths = np.random.default_rng(0).integers(1, 50, 1000)
    what = dict(seed=1, epoch=0, global_batch=8, group_by_length=True, mixture=None)
    computed = epoch_order(lengths, **what)
    calls = []

    def compute():
        calls.append(1)
        return epoch_order(lengths, **what)

    writer = OrderCache(tmp_path, writes=True, data_key={"--train-file": "abc"})
    assert np.array_equal(writer.order(compute, lengths, **what), computed) and len(calls) == 1
    (stored,) = (tmp_path / "data-order").glob("epoch-0-*.npy")
    reader = OrderCache(tmp_path, writes=False, data_key={"--train-file": "abc"})
    read = reader.order(compute, lengths, **what)
    assert isinstance(read, np.memmap) and np.array_equal(read, computed) and len(calls) == 1
    # other data: computed, not read
    OrderCache(tmp_path, writes=False, data_key={"--train-file": "xyz"}).order(compute, lengths, **what)
    assert len(calls) == 2
    # the next epoch's order replaces the last one's
    writer.order(lambda: epoch_order(lengths, **{**what, "epoch": 1}), lengths, **{**what, "epoch": 1})
    assert [p.name.split("-")[1] for p in (tmp_path / "data-order").glob("*.npy")] == ["1"]
    assert not stored.exists()


def test_small_epochs_and_unidentified_data_are_never_stored(tmp_path):
    lengths = np.ones(1000, dtype=np.int64)
    what = dict(seed=1, epoch=0, global_batch=8, group_by_length=False, mixture=None)
    OrderCache(tmp_path, writes=True, data_key={"x": "y"}).order(lambda: np.arange(1000), lengths, **what)
    big = np.ones(order_cache.MIN_EXAMPLES, dtype=np.int64)
    OrderCache(tmp_path, writes=True, data_key={}).order(lambda: np.arange(len(big)), big, **what)
    assert not (tmp_path / "data-order").exists()


def test_an_order_that_finds_no_room_is_computed_and_leaves_no_temporary(tmp_path, monkeypatch):
    """A write that failed (a full disk) left its `.epoch-N.npy.PID.tmp` behind, taking the room."""
    import resource

    from conftest import run_forked

    monkeypatch.setattr(order_cache, "MIN_EXAMPLES", 100)
    lengths = np.ones(1000, dtype=np.int64)
    what = dict(seed=1, epoch=0, global_batch=8, group_by_length=False, mixture=None)

    def without_room() -> int:
        resource.setrlimit(resource.RLIMIT_FSIZE, (512, resource.RLIM_INFINITY))  # EFBIG, as a full disk's ENOSPC
        order = OrderCache(tmp_path, writes=True, data_key={"x": "y"}).order(lambda: np.arange(1000), lengths, **what)
        return 0 if np.array_equal(order, np.arange(1000)) else 3

    proc = run_forked(without_room, ["order"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert list((tmp_path / "data-order").iterdir()) == []
