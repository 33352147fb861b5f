"""Dynamic batching of `POST /predict` (classifiers, taggers, qa, multiple choice) and `POST /v1/embeddings`
(sentence encoders) in `tuneforge serve`.

Requests are queued; one worker takes the first waiting request, then keeps collecting more until the
batch holds `max_batch_size` inputs or `max_wait_ms` has passed (requests already queued join whatever the
time: `max_wait_ms 0` batches what queued during the last forward), and runs them through the predictor in
one call (which runs texts of similar length together: tasks/length_runs.py; `infer` says which of its methods:
`predict` unless told). Each caller gets its own slice of the answers. The model runs in one background thread,
so the event loop keeps accepting requests while a batch computes; those form the next batch. The queue is bounded:
`submit` raises `QueueFull` when `max_queue` requests wait.

A request fails alone: `submit` runs the predictor's own input checks (`check_inputs`, where it has them) before
the request joins a batch, and a batch that fails anyway is run again one request at a time, so that only the
request that fails on its own gets the error and the others their answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tuneforge.serve.engine import QueueFull
from tuneforge.serve.options import MAX_QUEUE


class DynamicBatcher:
    """Collects queued requests into batches of at most `max_batch_size` inputs."""

    def __init__(
        self,
        predictor,
        max_batch_size: int,
        max_wait_ms: float,
        max_queue: int = MAX_QUEUE,
        on_batch: Callable[[int], None] | None = None,
        infer: Callable[[list, int], list] | None = None,
    ) -> None:
        self.predictor = predictor
        self.infer = infer or predictor.predict  # (inputs, batch size) -> one answer per input, in order
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000
        self.max_queue = max_queue
        self.on_batch = on_batch or (lambda rows: None)  # called with the inputs of each batch
        self.requests = 0
        self.batches = 0
        self.largest_batch = 0  # in requests
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tuneforge-predict")
        self._queue: asyncio.Queue | None = None
        self._worker: asyncio.Task | None = None

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    async def submit(self, items: list) -> list[dict]:
        """The predictions of `items`; the predictor's input error (DataError) for this request alone."""
        check = getattr(self.predictor, "check_inputs", None)
        if check is not None:
            check(items)
        if self._queue.qsize() >= self.max_queue:
            raise QueueFull(f"{self._queue.qsize()} requests are waiting already (the limit is {self.max_queue})")
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((items, future))
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        carried = None  # a request that did not fit into the previous batch
        while True:
            first = carried or await self._queue.get()
            carried = None
            group, size = [first], len(first[0])
            deadline = loop.time() + self.max_wait_s
            while size < self.max_batch_size:
                try:
                    nxt = await self._next(deadline - loop.time())
                except asyncio.TimeoutError:
                    break
                if size + len(nxt[0]) > self.max_batch_size:
                    carried = nxt
                    break
                group.append(nxt)
                size += len(nxt[0])
            group = [(items, fut) for items, fut in group if not fut.done()]  # callers that went away
            if not group:
                continue
            await self._answer(group)

    async def _next(self, left_s: float):
        """The next queued request: one already waiting at once (whatever the time left, so that `max_wait_ms 0`
        still batches what queued during the last forward), else the first to come within `left_s`."""
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            if left_s <= 0:
                raise asyncio.TimeoutError from None
            return await asyncio.wait_for(self._queue.get(), left_s)

    async def _answer(self, group: list) -> None:
        """Run the group's inputs as one batch; if that fails, each request alone (only the bad one fails)."""
        loop = asyncio.get_running_loop()
        flat = [x for items, _ in group for x in items]
        try:
            preds = await loop.run_in_executor(self._executor, self.infer, flat, self.max_batch_size)
        except Exception as err:  # one bad request must not fail the others, nor stop the server
            if len(group) == 1:
                if not group[0][1].done():
                    group[0][1].set_exception(err)
                return
            for one in group:
                await self._answer([one])
            return
        self.on_batch(len(flat))
        self.requests += len(group)
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(group))
        start = 0
        for items, fut in group:
            if not fut.done():  # the client may have gone away
                fut.set_result(preds[start : start + len(items)])
            start += len(items)
