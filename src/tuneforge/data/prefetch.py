"""Prefetch: the next optimizer steps' micro-batches read and collated in a background thread while the current
step trains, so reading memory-mapped rows and padding them never holds the step up; and the time the step did
wait for its data, which the training log reports (`data_wait_s`).

The thread collates the epoch's steps in their order, at most `depth` steps ahead. A step asks for its batches by
their example indices: the ones the thread made for them, or (a caller that changed a step's indices) collated
there and then. Collation draws no random numbers, so a run is the same with or without the thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

DEPTH = 2  # steps collated ahead


class Prefetch:
    def __init__(
        self,
        collate: Callable[[list[int]], dict],
        steps: list[list[list[int]]],
        on_wait: Callable[[float], None],
        depth: int = DEPTH,
    ):
        """`on_wait(seconds)`: told each time a step waited for its data."""
        self.collate, self.on_wait = collate, on_wait
        self.ready: queue.Queue = queue.Queue(maxsize=depth)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(steps,), name="tuneforge-prefetch", daemon=True)
        self.thread.start()

    def take(self, micro_batches: list[list[int]]) -> list[dict]:
        """The collated micro-batches of the step with these example indices (the time waited for them counts)."""
        t0 = time.perf_counter()
        try:
            made, batches, error = self.ready.get()
        finally:
            self.on_wait(time.perf_counter() - t0)
        if error is not None:
            raise error
        if made != micro_batches:  # not the step the thread expected: collate it here
            t0 = time.perf_counter()
            batches = [self.collate(idx) for idx in micro_batches]
            self.on_wait(time.perf_counter() - t0)
        return batches

    def close(self) -> None:  # returns None: `run.feed = run.feed.close()`
        """Stop the thread (the loop may have left the epoch early); what it made and no step took is dropped."""
        self.stopped.set()
        while self.thread.is_alive():
            try:
                self.ready.get(timeout=0.05)
            except queue.Empty:
                pass

    def _run(self, steps) -> None:
        for micro_batches in steps:
            if self.stopped.is_set():
                return
            try:
                item = (micro_batches, [self.collate(idx) for idx in micro_batches], None)
            except BaseException as err:  # raised in the training loop by the step that needs it
                item = (micro_batches, None, err)
            while not self.stopped.is_set():
                try:
                    self.ready.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
