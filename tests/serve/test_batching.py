"""The dynamic batcher of the classifier and encoder routes (tuneforge/serve/batching.py), on its own: which
requests share a forward."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tuneforge.serve.batching import DynamicBatcher


class HeldPredictor:
    """Answers each input with its own text upper-cased; the first forward waits until `release` is set, so that
    requests queue behind it as they do behind a busy model."""

    def __init__(self) -> None:
        self.busy, self.release = threading.Event(), threading.Event()
        self.batches: list[list[str]] = []

    def infer(self, items: list, batch_size: int) -> list:
        if not self.batches:
            self.busy.set()
            self.release.wait(timeout=30)
        self.batches.append(list(items))
        return [text.upper() for text in items]


async def queue_behind_a_busy_forward(max_wait_ms: float, max_batch_size: int, later: int):
    predictor = HeldPredictor()
    batcher = DynamicBatcher(predictor, max_batch_size, max_wait_ms, infer=predictor.infer)
    await batcher.start()
    try:
        first = asyncio.ensure_future(batcher.submit(["first"]))
        assert await asyncio.to_thread(predictor.busy.wait, 30)  # "first" is in its forward
        rest = [asyncio.ensure_future(batcher.submit([f"text {i}"])) for i in range(later)]
        while batcher.queue_depth < later:
            await asyncio.sleep(0.005)
        predictor.release.set()
        answers = await asyncio.gather(first, *rest)
    finally:
        await batcher.stop()
    return answers, predictor.batches


@pytest.mark.parametrize("max_wait_ms", [0, 1])
def test_requests_queued_during_a_forward_share_the_next_one_whatever_the_wait(max_wait_ms):
    """`--max-wait-ms 0` means no waiting for others, not no batching: what queued while the model was busy goes
    into the next forward together (before, each such request ran alone: the unbatched server's 47-55 req/s instead
    of 121-130 under the 32-client embedding load, benchmarks/README.md)."""
    answers, batches = asyncio.run(queue_behind_a_busy_forward(max_wait_ms, max_batch_size=4, later=6))
    assert answers == [["FIRST"]] + [[f"TEXT {i}"] for i in range(6)]
    assert batches == [["first"], [f"text {i}" for i in range(4)], ["text 4", "text 5"]]


def test_a_lone_request_waits_at_most_max_wait_ms_for_company():
    """With nothing else queued, a request waits `max_wait_ms` for others and then runs alone."""

    async def lone():
        predictor = HeldPredictor()
        predictor.release.set()
        batcher = DynamicBatcher(predictor, 8, 50, infer=predictor.infer)
        await batcher.start()
        try:
            loop = asyncio.get_running_loop()
            began = loop.time()
            answer = await batcher.submit(["alone"])
            return answer, loop.time() - began, predictor.batches
        finally:
            await batcher.stop()

    answer, took_s, batches = asyncio.run(lone())
    assert (answer, batches) == (["ALONE"], [["alone"]])
    assert 0.04 <= took_s < 5
