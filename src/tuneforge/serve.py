"""`tuneforge serve MODEL_DIR`: an HTTP server for a fine-tuned classifier or tagger, with dynamic batching.

Requests are queued; a single worker takes the first waiting request, then keeps collecting
more until the batch holds `max_batch_size` texts or `max_wait_ms` has passed, and runs them
through `predict.Predictor` in one go (sorted by length inside). Each caller gets its own slice
of the answers. The model runs in one background thread, so the event loop keeps accepting
requests while a batch computes; those form the next batch.

    POST /predict  {"texts": ["a text", ...]}  or  {"pairs": [["s1", "s2"], ...]}
                   -> {"predictions": [{"label", "label_id", "score", "scores"} | {"score"}, ...]}
                   NER: texts -> [{"entities": [{"entity", "text", "start", "end", "score"}]}, ...]
                   qa: pairs of (question, context) -> [{"answer", "start", "end", "score"}, ...]
                   multiple choice: {"inputs": [{"question", "choices"}]} -> [{"label", "choice", "score", "scores"}]
    GET  /health   -> {"status": "ok", "model", "labels", counters of requests and batches}

No `from __future__ import annotations` here: FastAPI reads the request model from the endpoint's
real (evaluated) annotation, and that model is defined inside `create_app`.
"""

import argparse
import asyncio
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tuneforge.errors import ConfigError


class DynamicBatcher:
    """Collects queued requests into batches of at most `max_batch_size` texts."""

    def __init__(self, predictor, max_batch_size: int, max_wait_ms: float) -> None:
        self.predictor = predictor
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000
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

    async def submit(self, items: list) -> list[dict]:
        future = asyncio.get_running_loop().create_future()
        await self._queue.put((items, future))
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
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    nxt = await asyncio.wait_for(self._queue.get(), left)
                except asyncio.TimeoutError:
                    break
                if size + len(nxt[0]) > self.max_batch_size:
                    carried = nxt
                    break
                group.append(nxt)
                size += len(nxt[0])
            flat = [x for items, _ in group for x in items]
            try:
                preds = await loop.run_in_executor(self._executor, self.predictor.predict, flat, self.max_batch_size)
            except Exception as err:  # one bad batch must not stop the server
                for _, fut in group:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            self.requests += len(group)
            self.batches += 1
            self.largest_batch = max(self.largest_batch, len(group))
            start = 0
            for items, fut in group:
                if not fut.done():  # the client may have gone away
                    fut.set_result(preds[start : start + len(items)])
                start += len(items)


def create_app(
    predictor, model_dir: str, max_batch_size: int = 32, max_wait_ms: float = 10.0, max_request_items: int = 1024
):
    """The FastAPI app serving `predictor` (a `tuneforge.predict.Predictor`)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from pydantic import BaseModel, Field, model_validator

    batcher = DynamicBatcher(predictor, max_batch_size, max_wait_ms)

    accepts = predictor.accepts  # the request kinds this model's task takes

    class PredictRequest(BaseModel):
        texts: list[str] | None = Field(None, description="single texts")
        pairs: list[tuple[str, str]] | None = Field(None, description="sentence pairs (qa: question, context)")
        inputs: list[dict[str, Any]] | None = Field(None, description='multiple choice: {"question", "choices"}')

        @model_validator(mode="after")
        def _one_kind(self):
            kinds = (("texts", self.texts), ("pairs", self.pairs), ("inputs", self.inputs))
            given = {k: v for k, v in kinds if v is not None}
            names = " or ".join(f'"{k}"' for k in accepts)
            if len(given) != 1:
                raise ValueError(f"give exactly one of {names}")
            (kind, items), *_ = given.items()
            if kind not in accepts:
                raise ValueError(f'this model takes {names}, not "{kind}"')
            if not items:
                raise ValueError("the list of inputs is empty; send at least one")
            if len(items) > max_request_items:
                raise ValueError(f"at most {max_request_items} inputs per request; split the request")
            return self

    @asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="tuneforge", lifespan=lifespan)
    app.state.batcher = batcher

    @app.post("/predict")
    async def predict(request: PredictRequest) -> dict[str, Any]:
        if request.inputs is not None:
            items = request.inputs
        else:
            items = request.texts if request.texts is not None else [tuple(p) for p in request.pairs]
        return {"predictions": await batcher.submit(items)}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": model_dir,
            "task": predictor.task,
            "labels": predictor.labels,
            "regression": predictor.regression,
            "max_batch_size": batcher.max_batch_size,
            "max_wait_ms": batcher.max_wait_s * 1000,
            "requests": batcher.requests,
            "batches": batcher.batches,
            "largest_batch": batcher.largest_batch,
        }

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading anything heavy, so a busy port is one clear line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({err.strerror}); pass another --port or --host") from None
    return sock


def cmd_serve(ns: argparse.Namespace) -> int:
    from tuneforge.predict import load_predictor
    from tuneforge.tasks.base import check_model_path

    if ns.max_batch_size <= 0:
        raise ConfigError(f"--max-batch-size must be positive, got {ns.max_batch_size}")
    if ns.max_wait_ms < 0:
        raise ConfigError(f"--max-wait-ms must be zero or more, got {ns.max_wait_ms:g}")
    if not 0 <= ns.port < 65536:
        raise ConfigError(f"--port must be between 0 and 65535, got {ns.port}")
    if ns.max_length is not None and ns.max_length < 1:
        raise ConfigError(f"--max-length must be at least 1, got {ns.max_length}")
    check_model_path(ns.model_dir)
    try:
        import fastapi  # noqa: F401  (create_app's)
        import uvicorn
    except ImportError as err:
        raise ConfigError(
            f"`tuneforge serve` needs fastapi and uvicorn ({err.name or err} is missing): pip install fastapi uvicorn"
        ) from None
    sock = bind_socket(ns.host, ns.port)

    predictor = load_predictor(ns.model_dir, max_length=ns.max_length)
    app = create_app(predictor, ns.model_dir, ns.max_batch_size, ns.max_wait_ms)
    host, port = sock.getsockname()[:2]
    print(
        f"serving {ns.model_dir} on http://{host}:{port} (POST /predict, GET /health); "
        f"batches of up to {ns.max_batch_size} texts, waiting at most {ns.max_wait_ms:g} ms",
        file=sys.stderr,
        flush=True,
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    server.run(sockets=[sock])
    return 0


def add_arguments(p) -> None:
    """`tuneforge serve`'s arguments (the CLI lists the command and its help)."""
    p.add_argument("model_dir", help="HF model folder (e.g. OUTPUT_DIR/model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch-size", type=int, default=32, help="most texts run in one batch")
    p.add_argument(
        "--max-wait-ms", type=float, default=10.0, help="longest a request waits for others to join its batch"
    )
    p.add_argument("--max-length", type=int, default=None, help="truncate inputs (default: the training max_length)")
    p.set_defaults(func=cmd_serve)
