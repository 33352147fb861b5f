"""The FastAPI app of `tuneforge serve`: routes, the request gate (API key, body size, draining, metrics),
and the errors every refusal shares (the OpenAI error body).

    GET  /                      the playground page (serve/static/index.html)
    GET  /health                200 {"status": "ok", ...} once the model is loaded; 503 while loading or draining
    GET  /metrics               Prometheus text
    POST /predict               classifiers, taggers, qa, multiple choice (dynamic batching, serve/batching.py)
    GET  /v1/models             the served model's name
    POST /v1/completions        generative models (continuous batching, serve/engine.py)
    POST /v1/chat/completions   generative models with a chat template

The model loads in a background thread after the server starts listening (`load`, a callable returning a
`tuneforge.generate.Generator` or a predictor); until then every route but /health, /metrics and / answers
503. A request fails alone (see serve/engine.py and serve/batching.py); when the server can serve nothing
more (the model failed to load, or the engine died) `on_fatal(err)` is called: `tuneforge serve` exits
non-zero, so that a supervisor restarts it. Text the tokenizer cannot take is refused (400; /predict 422) naming
its field before the request joins a batch. No `from __future__ import annotations` here: FastAPI reads the
request models from the endpoints' evaluated annotations.
"""

import asyncio
import base64
import binascii
import hmac
import json
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from tuneforge.errors import UserError
from tuneforge.generate import Generator
from tuneforge.serve import openai_api as oa
from tuneforge.serve.batching import DynamicBatcher
from tuneforge.serve.engine import EngineDied, GenerationEngine, QueueFull, SamplingParams, Sequence
from tuneforge.serve.metrics import Metrics

ROUTES = ("/", "/health", "/metrics", "/predict", "/v1/models", "/v1/completions", "/v1/chat/completions")
OPEN_ROUTES = ("/health",)  # answered without the API key
PAGE = Path(__file__).with_name("static") / "index.html"
MAX_PROMPT_ROWS = 64  # prompts x n in one generation request
RETRY_AFTER_S = 1  # what a 503 (busy, loading, shutting down) asks the client to wait


@dataclass(frozen=True)
class ServeOptions:
    model_dir: str
    served_model_name: str
    max_batch_size: int = 32
    max_wait_ms: float = 10.0
    max_queue: int = 256
    max_request_items: int = 1024
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout_s: float = 600.0
    default_max_tokens: int = 512  # chat completions without max_tokens (completions: 16, as OpenAI)
    api_key: str | None = None


class ServerState:
    """What the routes share: the loaded model and its batcher or engine, the metrics, the server's phase."""

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.metrics = Metrics()
        self.served = None  # a Generator or a predictor, once loaded
        self.engine: GenerationEngine | None = None
        self.batcher: DynamicBatcher | None = None
        self.context: int | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.created = oa.now()
        self.metrics.gauges = self.gauges

    def begin_draining(self) -> None:
        """Stop taking new requests (SIGTERM): those in flight finish."""
        self.draining = True

    @property
    def ready(self) -> bool:
        return self.served is not None and (self.engine is None or self.engine.error is None)

    def gauges(self) -> dict[str, tuple[str, float]]:
        out = {"tuneforge_ready": ("1 once the model is loaded and the server takes requests.", float(self.ready))}
        if self.engine is not None:
            e = self.engine
            out.update(
                tuneforge_queue_depth=("Sequences waiting to join the running batch.", e.queue_depth),
                tuneforge_running_sequences=("Sequences in the running batch.", e.running_rows),
                tuneforge_generated_tokens_total=("Tokens generated.", e.generated_tokens),
                tuneforge_prompt_tokens_total=("Prompt tokens prefilled.", e.prompt_tokens),
                tuneforge_generation_tokens_per_second=(
                    "Tokens generated per second, last 10 s.",
                    e.tokens_per_second(),
                ),
            )
        elif self.batcher is not None:
            out["tuneforge_queue_depth"] = ("Requests waiting for a batch.", self.batcher.queue_depth)
        return out

    def require_ready(self) -> None:
        if self.load_error is not None or (self.engine is not None and self.engine.error is not None):
            raise oa.ApiError(503, "the model failed; see the server's log", kind="server_error")
        if self.served is None:
            raise oa.ApiError(503, "the model is still loading; retry in a moment", kind="server_busy")


# ---- the gate: every HTTP request passes here first -------------------------------------------
def _given_key(headers: dict[bytes, bytes]) -> str:
    auth = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, credentials = auth.partition(" ")
    if scheme.lower() == "bearer":
        return credentials.strip()
    if scheme.lower() == "basic":  # the browser's login prompt for the page: any user name, the key as password
        try:
            user, _, password = base64.b64decode(credentials.strip()).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return ""
        return password or user
    return headers.get(b"x-api-key", b"").decode("latin-1")


class Gate:
    """Pure ASGI middleware: metrics of every response, the API key, draining, and the body size limit (413 from
    the Content-Length header or while the body arrives, before anything parses it)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else "other"
        start, status, done = time.perf_counter(), [500], [False]

        async def send_observed(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body") and not done[0]:
                done[0] = True
                self.state.metrics.observe_request(route, status[0], time.perf_counter() - start)

        try:
            refusal = self._refusal(scope, path)
            if refusal is not None:
                await refusal(scope, receive, send_observed)
                return
            body = await self._read_body(scope, receive)
            if isinstance(body, JSONResponse):
                await body(scope, receive, send_observed)
                return
            await self.app(scope, _replay(body, receive), send_observed)
        finally:
            if not done[0]:  # the client went away mid-response
                self.state.metrics.observe_request(route, status[0], time.perf_counter() - start)

    def _refusal(self, scope, path: str) -> JSONResponse | None:
        options = self.state.options
        if options.api_key and path not in OPEN_ROUTES:
            headers = dict(scope["headers"])
            if not hmac.compare_digest(_given_key(headers).encode(), options.api_key.encode()):
                extra = {"WWW-Authenticate": 'Basic realm="tuneforge"'}  # a browser asks for it (the key as password)
                return _error(
                    oa.ApiError(
                        401, "missing or wrong API key: send Authorization: Bearer KEY", kind="authentication_error"
                    ),
                    extra,
                )
        if self.state.draining and path not in OPEN_ROUTES:
            return _error(oa.ApiError(503, "the server is shutting down", kind="server_busy"))
        return None

    async def _read_body(self, scope, receive) -> bytes | JSONResponse:
        limit = self.state.options.max_body_bytes
        too_large = oa.ApiError(
            413, f"the request body is larger than {limit} bytes; send less per request", kind="request_too_large"
        )
        if _declared_too_large(scope, limit):
            return _error(too_large, {"Connection": "close"})
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b""
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return _error(too_large, {"Connection": "close"})
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)


def _declared_too_large(scope, limit: int) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value) > limit
            except ValueError:
                return False
    return False


def _replay(body: bytes, receive):
    sent = [False]

    async def replay():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _error(err: oa.ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    if err.status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_S), **(headers or {})}
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or None


# ---- /predict ----------------------------------------------------------------------------------
class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    texts: list[str] | None = Field(None, description="single texts")
    pairs: list[tuple[str, str]] | None = Field(None, description="sentence pairs (qa: question, context)")
    inputs: list[dict[str, Any]] | None = Field(None, description='multiple choice: {"question", "choices"}')


def _predict_items(request: PredictRequest, accepts: tuple[str, ...], max_items: int) -> list:
    kinds = (("texts", request.texts), ("pairs", request.pairs), ("inputs", request.inputs))
    given = {k: v for k, v in kinds if v is not None}
    names = " or ".join(f'"{k}"' for k in accepts)
    if len(given) != 1:
        raise oa.ApiError(422, f"give exactly one of {names}")
    (kind, items), *_ = given.items()
    if kind not in accepts:
        raise oa.ApiError(422, f'this model takes {names}, not "{kind}"', kind)
    if not items:
        raise oa.ApiError(422, "the list of inputs is empty; send at least one", kind)
    if len(items) > max_items:
        raise oa.ApiError(422, f"at most {max_items} inputs per request; split the request", kind)
    return [tuple(p) for p in items] if kind == "pairs" else items


async def answer_predict(state: ServerState, request: PredictRequest) -> dict:
    """/predict: the request's inputs checked (text, then the predictor's own checks) before they join a batch;
    an input the predictor refuses is a 422 naming the field, for this request alone."""
    state.require_ready()
    if state.batcher is None:
        raise oa.ApiError(
            400, "this server serves a text-generation model: use POST /v1/completions or /v1/chat/completions"
        )
    oa.refuse_unencodable(request, 422)
    items = _predict_items(request, tuple(state.served.accepts), state.options.max_request_items)
    kind = next(k for k in ("texts", "pairs", "inputs") if getattr(request, k) is not None)
    try:
        return {"predictions": await state.batcher.submit(items)}
    except QueueFull as err:
        raise oa.ApiError(503, f"the server is busy ({err}); retry later", kind="server_busy") from None
    except UserError as err:  # the predictor's own checks: this request's inputs
        raise oa.ApiError(422, str(err), kind) from None


# ---- generation --------------------------------------------------------------------------------
class Generation:
    """One generation request's sequences and the events the engine sends back for them."""

    def __init__(self, prompts: list[list[int]], params: list[SamplingParams], n: int) -> None:
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.seqs = []  # choice k is the (k % n)-th choice of prompt k // n, as OpenAI numbers them
        for ids, p in zip(prompts, params):
            for j in range(n):
                self.seqs.append(Sequence(ids, _nth(p, j), self._emitter(loop, len(self.seqs))))

    def _emitter(self, loop, index: int):
        def emit(text: str, reason: str | None) -> None:
            try:
                loop.call_soon_threadsafe(self.events.put_nowait, (index, text, reason))
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                pass

        return emit

    def cancel(self) -> None:
        for seq in self.seqs:
            if seq.finish_reason is None:
                seq.cancel()

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


def _nth(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th choice of a request: its own seed (seed + j), so n choices differ and each is reproducible."""
    if params.seed is None or j == 0:
        return params
    return SamplingParams(params.max_tokens, params.temperature, params.top_p, params.stop, params.seed + j)


async def _events(gen: Generation, request: Request | None, deadline: float):
    """(index, text, finish_reason) as the engine sends them; ApiError 504 past the deadline. `request`: stop
    (cancelling the sequences) when its client goes away; a stream learns that from its failing writes."""
    pending = len(gen.seqs)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            gen.cancel()
            raise oa.ApiError(504, "the request took longer than the server's --request-timeout", kind="timeout")
        try:
            index, text, reason = await asyncio.wait_for(gen.events.get(), min(left, 1.0))
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                gen.cancel()
                return
            continue
        if reason is not None:
            pending -= 1
            if reason == "error":
                gen.cancel()
                raise oa.ApiError(500, "generation failed; see the server's log", kind="server_error")
        yield index, text, reason


def tokenize(served: Generator, text: str, field: str, context: int | None, special: bool = True) -> list[int]:
    """The prompt's token ids; ApiError 400 naming `field` for text without tokens, text the tokenizer fails on,
    or (seq2seq) more tokens than the encoder has positions. A causal LM's length is checked with max_tokens."""
    try:
        if served.family == "seq2seq":
            text = (served.info.get("source_prefix") or "") + text
            limit = served.info.get("max_length")
            enc = served.tokenizer(text, truncation=limit is not None, max_length=limit)
        else:
            enc = served.tokenizer(text, add_special_tokens=special)
    except Exception as err:  # the tokenizer's own refusal, whatever the text held
        raise oa.ApiError(400, f"{field} could not be tokenized: {type(err).__name__}", field) from None
    ids = list(enc["input_ids"])
    if not ids:
        raise oa.ApiError(400, f"{field} has no tokens; give the model some text", field)
    if served.family == "seq2seq" and context is not None and len(ids) > context:
        raise oa.ApiError(400, f"{field} has {len(ids)} tokens; the model reads at most {context}: shorten it", field)
    return ids


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def load_served(state: ServerState, load: Callable[[], Any], on_fatal: Callable | None) -> None:
    """Load the model (in a thread) and start its engine or batcher; `on_fatal` hears of the engine's death."""
    options = state.options
    served = await asyncio.to_thread(load)
    if isinstance(served, Generator):
        from tuneforge.chat import check_chat_template
        from tuneforge.tasks.base import context_length

        check_chat_template(served.tokenizer, options.model_dir)  # one line at start-up, not a 500 per request
        state.context = context_length(served.model.config)
        engine = GenerationEngine(
            served,
            options.max_batch_size,
            options.max_queue,
            state.context,
            state.metrics.observe_batch,
            on_death=on_fatal,
        )
        engine.start()
        state.engine = engine
    else:
        batcher = DynamicBatcher(
            served, options.max_batch_size, options.max_wait_ms, options.max_queue, state.metrics.observe_batch
        )
        await batcher.start()
        state.batcher = batcher
    state.served = served


def create_app(load: Callable[[], Any], options: ServeOptions, on_fatal: Callable | None = None) -> FastAPI:
    """The app serving what `load()` returns (called once, in a thread, after the server starts); `on_fatal(err)`
    when it can serve nothing more (the model failed to load, or the generation engine died)."""
    state = ServerState(options)

    async def load_in_background() -> None:
        try:
            await load_served(state, load, on_fatal)
        except Exception as err:  # a model that cannot be loaded: the server stops with the error
            state.load_error = err
            if on_fatal is not None:
                on_fatal(err)

    @asynccontextmanager
    async def lifespan(app):
        loading = asyncio.create_task(load_in_background())
        yield
        await loading
        if state.engine is not None:
            await asyncio.to_thread(state.engine.stop)
        if state.batcher is not None:
            await state.batcher.stop()

    app = FastAPI(title="tuneforge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    @app.exception_handler(oa.ApiError)
    async def api_error(request: Request, err: oa.ApiError):
        return _error(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        status = 422 if request.url.path == "/predict" else 400
        errors = err.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            return _error(oa.ApiError(400, f"the request body is not valid JSON: {first.get('msg')}"))
        if first.get("type") == "model_attributes_type" or (first.get("loc") == ("body",)):
            return _error(oa.ApiError(status, "the request body must be a JSON object"))
        param = _param(tuple(first.get("loc", ())))
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return _error(oa.ApiError(status, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        message = f"no route {request.method} {request.url.path}" if err.status_code in (404, 405) else err.detail
        return _error(oa.ApiError(err.status_code, message, kind=kind))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception):  # a bug: still the error shape, and logged by uvicorn
        return _error(oa.ApiError(500, "the server failed on this request; see its log", kind="server_error"))

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health():
        if state.load_error is not None or (state.engine is not None and state.engine.error is not None):
            return JSONResponse({"status": "error"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "1"})
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
        served = state.served
        info: dict[str, Any] = {
            "status": "ok",
            "model": options.model_dir,
            "served_model_name": options.served_model_name,
        }
        info["max_batch_size"] = options.max_batch_size
        if state.engine is not None:
            has_template = bool(getattr(served.tokenizer, "chat_template", None))
            info.update(kind="generate", family=served.family, chat=has_template, context=state.context)
            info.update(
                task=served.info.get("task"), running=state.engine.running_rows, waiting=state.engine.queue_depth
            )
        else:
            b = state.batcher
            info.update(kind="predict", task=served.task, labels=served.labels, regression=served.regression)
            info.update(accepts=list(served.accepts), max_wait_ms=b.max_wait_s * 1000)
            info.update(requests=b.requests, batches=b.batches, largest_batch=b.largest_batch)
        return info

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/predict")
    async def predict(request: PredictRequest):
        return await answer_predict(state, request)

    @app.get("/v1/models")
    async def models():
        return oa.models_body(options.served_model_name, state.created)

    def check_generation(body: oa._Sampling) -> Generator:
        state.require_ready()
        if state.engine is None:
            raise oa.ApiError(400, "this server serves a classifier: use POST /predict")
        oa.refuse_unencodable(body)  # before the model's name is compared (and echoed)
        if body.model != options.served_model_name:
            raise oa.ApiError(
                404,
                f"model {body.model!r} is not served here; this server serves {options.served_model_name!r}",
                "model",
                kind="not_found_error",
                code="model_not_found",
            )
        body.refuse_unsupported()
        return state.served

    def sampling(
        body: oa._Sampling, prompts: list[list[int]], max_tokens: int | None, fields: tuple[str, str], default
    ):
        """The request's SamplingParams; `fields`: the names of its prompt and max-tokens fields (for errors)."""
        prompt_field, field = fields
        longest = max(map(len, prompts))
        context = state.context
        if state.engine.family == "clm" and context is not None:
            if longest >= context:
                raise oa.ApiError(
                    400,
                    f"the prompt has {longest} tokens; the model's context is {context}: shorten it",
                    prompt_field,
                )
            room = context - longest
            if max_tokens is not None and max_tokens > room:
                raise oa.ApiError(
                    400,
                    f"{field} {max_tokens} plus the prompt's {longest} tokens is above the model's context of "
                    f"{context} tokens; ask for at most {room}",
                    field,
                )
            default = min(default, room)
        elif context is not None and max_tokens is not None and max_tokens >= context:  # a decoder's positions
            raise oa.ApiError(400, f"{field} {max_tokens} is above the model's limit of {context - 1} tokens", field)
        return SamplingParams(
            max_tokens=max_tokens or default,
            temperature=oa.greedy_below_eps(body.temperature),
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=body.stop_strings(),
            seed=body.seed,
        )

    async def run(body: oa._Sampling, request: Request, gen: Generation, chat: bool):
        try:
            state.engine.submit(gen.seqs)
        except QueueFull as err:
            raise oa.ApiError(503, f"the server is busy ({err}); retry later", kind="server_busy") from None
        except EngineDied:  # it died since require_ready: as require_ready would now say
            raise oa.ApiError(503, "the model failed; see the server's log", kind="server_error") from None
        rid, created, name = oa.new_id("chatcmpl" if chat else "cmpl"), oa.now(), options.served_model_name
        deadline = time.monotonic() + options.request_timeout_s
        if not body.stream:
            texts, reasons = [[] for _ in gen.seqs], [None] * len(gen.seqs)
            try:
                async for index, text, reason in _events(gen, request, deadline):
                    texts[index].append(text)
                    reasons[index] = reason or reasons[index]
            finally:
                gen.cancel()
            choices = [("".join(t), r) for t, r in zip(texts, reasons)]
            use = oa.usage(gen.prompt_tokens, gen.completion_tokens)
            return (oa.chat_body if chat else oa.completion_body)(rid, name, created, choices, use)

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def stream():
            try:
                if chat:
                    for i in range(len(gen.seqs)):
                        yield _sse(oa.chat_chunk(rid, name, created, i, {"role": "assistant", "content": ""}, None))
                async for index, text, reason in _events(gen, None, deadline):
                    if text:
                        delta = {"content": text} if chat else text
                        make = oa.chat_chunk if chat else oa.completion_chunk
                        yield _sse(make(rid, name, created, index, delta, None))
                    if reason is not None:
                        end = {} if chat else ""
                        yield _sse(
                            (oa.chat_chunk if chat else oa.completion_chunk)(rid, name, created, index, end, reason)
                        )
                if include_usage:
                    use = oa.usage(gen.prompt_tokens, gen.completion_tokens)
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    yield _sse(oa.usage_chunk(rid, name, created, obj, use))
            except oa.ApiError as err:
                yield _sse(err.body())
            finally:
                gen.cancel()
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(body: oa.CompletionRequest, request: Request):
        served = check_generation(body)
        texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        n = body.n or 1
        if not texts:
            raise oa.ApiError(400, "prompt is empty; send a text", "prompt")
        if len(texts) * n > MAX_PROMPT_ROWS:
            raise oa.ApiError(
                400, f"{len(texts)} prompts x n={n} is above {MAX_PROMPT_ROWS} sequences per request", "prompt"
            )
        for i, t in enumerate(texts):
            if not t:
                where = "prompt" if isinstance(body.prompt, str) else f"prompt[{i}]"
                raise oa.ApiError(400, f"{where} is empty; send a text", where)
        prompts = [tokenize(served, t, "prompt", state.context) for t in texts]
        params = sampling(body, prompts, body.max_tokens, ("prompt", "max_tokens"), 16)
        seeds = [params if params.seed is None else _nth(params, i * n) for i in range(len(prompts))]
        return await run(body, request, Generation(prompts, seeds, n), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: oa.ChatRequest, request: Request):
        served = check_generation(body)
        if not getattr(served.tokenizer, "chat_template", None):
            raise oa.ApiError(
                400, "this model has no chat template; use POST /v1/completions (or train it with --task sft)"
            )
        if not body.messages:
            raise oa.ApiError(400, "messages is empty; send at least one message", "messages")
        if (body.n or 1) > MAX_PROMPT_ROWS:
            raise oa.ApiError(400, f"n is above {MAX_PROMPT_ROWS}", "n")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        if not any(m["content"].strip() for m in messages):
            raise oa.ApiError(400, "every message is empty; send some text", "messages")
        try:
            text = served.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # the template's own checks (e.g. roles that must alternate)
            raise oa.ApiError(400, f"the chat template refused these messages: {err}", "messages") from None
        prompt = tokenize(served, text, "messages", state.context, special=False)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling(body, [prompt], max_tokens, ("messages", field), options.default_max_tokens)
        return await run(body, request, Generation([prompt], [params], body.n or 1), chat=True)

    app.add_middleware(Gate, state=state)
    return app
