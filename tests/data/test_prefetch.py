"""The prefetch thread (data/prefetch.py): the steps' batches in order, a changed step collated on the spot, an error
raised in the step that needs the batch, an early stop that leaves no thread behind, and the waiting counted."""

import threading
import time

import pytest

from tuneforge.data.prefetch import Prefetch

STEPS = [[[0, 1], [2]], [[3, 4]], [[5], [6, 7]]]


def collate(indices: list[int]) -> dict:
    return {"ids": list(indices), "thread": threading.current_thread().name}


def test_each_step_gets_its_batches_collated_ahead_by_the_thread():
    waited = []
    feed = Prefetch(collate, STEPS, on_wait=waited.append)
    for step in STEPS:
        batches = feed.take(step)
        assert [b["ids"] for b in batches] == step
        assert {b["thread"] for b in batches} == {"tuneforge-prefetch"}
    assert feed.close() is None and not feed.thread.is_alive()
    assert len(waited) == 3 and all(w >= 0 for w in waited)


def test_a_step_with_other_indices_is_collated_on_the_spot():
    feed = Prefetch(collate, STEPS, on_wait=lambda s: None)
    batches = feed.take([[9, 9]])
    assert [b["ids"] for b in batches] == [[9, 9]] and batches[0]["thread"] == threading.current_thread().name
    assert [b["ids"] for b in feed.take(STEPS[1])] == STEPS[1]  # the next steps stay in step
    feed.close()


def test_a_collate_error_is_raised_by_the_step_that_needs_the_batch():
    def failing(indices):
        if 4 in indices:
            raise ValueError("row 4 is bad")
        return collate(indices)

    feed = Prefetch(failing, STEPS, on_wait=lambda s: None)
    feed.take(STEPS[0])
    with pytest.raises(ValueError, match="row 4 is bad"):
        feed.take(STEPS[1])
    feed.close()
    assert not feed.thread.is_alive()


def test_an_early_stop_ends_the_thread_though_steps_were_left():
    many = [[[i]] for i in range(1000)]
    feed = Prefetch(collate, many, on_wait=lambda s: None)
    feed.take(many[0])
    feed.close()
    assert not feed.thread.is_alive()


def test_the_time_a_step_waits_for_a_slow_collate_is_counted():
    def slow(indices):
        time.sleep(0.2)
        return collate(indices)

    waited = []
    feed = Prefetch(slow, STEPS, on_wait=waited.append)
    feed.take(STEPS[0])  # the first batch is not ready at once: most of 0.2 s (two micro-batches: 0.4 s)
    feed.close()
    assert waited[0] > 0.1
