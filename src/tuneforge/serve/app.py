"""The FastAPI app of `tuneforge serve`: the server's state (its phase, the loaded model), the app factory that
wires the routes, the gate (serve/gate.py) and the error handlers, and the server's own routes (/, /health,
/metrics). The routes of each API live in their modules (serve/routes_openai.py, serve/routes_predict.py,
serve/routes_embeddings.py) over a generation service (serve/generation.py) or the dynamic batcher
(serve/batching.py). Every route is mounted; what the served model can do decides which answer (`use_instead`
names the routes that do).

    GET  /                      the playground page (serve/static/index.html)
    GET  /health                200 {"status": "ok", ...} once the model is loaded; 503 while loading or draining
    GET  /metrics               Prometheus text
    POST /predict               classifiers, taggers, qa, multiple choice (dynamic batching, serve/batching.py)
    POST /v1/embeddings         sentence encoders (dynamic batching)
    GET  /v1/models             the served model's name
    GET  /v1/models/{model}     its card (404 for another name)
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
import re
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tuneforge.generate import Generator
from tuneforge.serve import openai_api as oa
from tuneforge.serve import routes_embeddings, routes_openai, routes_predict
from tuneforge.serve.access_log import AccessLog
from tuneforge.serve.batching import DynamicBatcher
from tuneforge.serve.engine import GenerationEngine
from tuneforge.serve.gate import RETRY_AFTER_S, Gate, error_response
from tuneforge.serve.generation import GenerationService, served_context, trained_settings_line
from tuneforge.serve.metrics import Metrics
from tuneforge.serve.options import ServeOptions
from tuneforge.serve.packed_linear import pack_linear_layers
from tuneforge.tasks.base import ServingPrecision

PAGE = Path(__file__).with_name("static") / "index.html"
# the page's own Content-Security-Policy is a <meta> tag, which cannot say who may frame the page: another site
# framing it (a click-jacking of the chat) is refused here, a page of the same origin may; no MIME sniffing
PAGE_HEADERS = {"Content-Security-Policy": "frame-ancestors 'self'", "X-Content-Type-Options": "nosniff"}


class ServerState:
    """What the routes share: the loaded model and its batcher or engine, the metrics, the server's phase."""

    def __init__(self, options: ServeOptions, owns_process: bool = False) -> None:
        self.options = options
        self.metrics = Metrics()
        self.access_log = AccessLog(options.log_format)
        self.served = None  # a Generator or a predictor, once loaded
        self.owns_process = owns_process  # tuneforge serve's own process: its torch threads may be set
        self.threads: int | None = None  # torch's CPU threads while serving (serving_threads)
        self.packed_layers = 0  # linear layers on oneDNN-packed weights (pack_weights)
        self.precision: str | None = None  # a Generator's weights as served (serving_precision)
        self.engine: GenerationEngine | None = None
        self.generation: GenerationService | None = None
        self.batcher: DynamicBatcher | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.created = oa.now()
        self.metrics.gauges = self.gauges

    def begin_draining(self) -> None:
        """Stop taking new requests (SIGTERM): those in flight finish."""
        if not self.draining:
            self.access_log.event("draining: the requests in flight finish; new ones get 503 until the server stops")
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

    @property
    def phase(self) -> str:
        """'error' (the model failed to load, or the engine died), 'draining', 'loading' or 'ok'."""
        if self.load_error is not None or (self.engine is not None and self.engine.error is not None):
            return "error"
        if self.draining:
            return "draining"
        return "ok" if self.served is not None else "loading"

    def use_instead(self) -> str:
        """What a request for an API the served model does not speak is told: the routes that serve it."""
        if self.generation is not None:
            return "this server serves a text-generation model: use POST /v1/completions or /v1/chat/completions"
        if routes_embeddings.embeds(self.served):
            return "this server serves a sentence encoder: use POST /v1/embeddings"
        return "this server serves a classifier: use POST /predict"

    def require_ready(self) -> None:
        """ApiError 503 unless the model is loaded and working (draining is the gate's refusal)."""
        if self.phase == "error":
            raise oa.ApiError(503, "the model failed; see the server's log", kind="server_error")
        if self.served is None:
            raise oa.ApiError(503, "the model is still loading; retry in a moment", kind="server_busy")


# ---- the server's own routes --------------------------------------------------------------------
server_routes = APIRouter()


@server_routes.get("/", response_class=HTMLResponse)
async def page():
    return HTMLResponse(PAGE.read_text(encoding="utf-8"), headers=PAGE_HEADERS)


@server_routes.get("/health")
async def health(request: Request):
    state: ServerState = request.app.state.server
    phase = state.phase
    if phase != "ok":
        retry = {} if phase == "error" else {"Retry-After": str(RETRY_AFTER_S)}
        return JSONResponse({"status": phase}, status_code=503, headers=retry)
    options, served = state.options, state.served
    info: dict[str, Any] = {"status": "ok", "model": options.model_dir, "served_model_name": options.served_model_name}
    info["max_batch_size"] = options.max_batch_size
    info["threads"] = state.threads
    info["precision"] = state.precision  # what the forwards run in (None: a model kept as loaded)
    info["packed_layers"] = state.packed_layers
    if state.generation is not None:
        service, engine = state.generation, state.engine
        info.update(kind="generate", family=served.family, chat=service.has_chat_template, context=service.context)
        info.update(task=served.info.get("task"), running=engine.running_rows, waiting=engine.queue_depth)
        info["sampling_defaults"] = service.defaults  # the model's own, for the fields a request leaves out
        if service.trained_settings or service.trained_not_applied:  # a seq2seq model's, from its tuneforge.json
            info.update(trained_settings=service.trained_settings)
            info.update(trained_settings_not_applied=service.trained_not_applied)
    else:
        b = state.batcher
        if routes_embeddings.embeds(served):
            info.update(kind="embed", task=served.task, dimensions=served.embedding_size)
            info.update(matryoshka_dims=served.matryoshka_dims, max_length=served.max_length)
        else:
            info.update(kind="predict", task=served.task, labels=served.labels, regression=served.regression)
            info.update(accepts=list(served.accepts))
        info.update(max_wait_ms=b.max_wait_s * 1000)
        info.update(requests=b.requests, batches=b.batches, largest_batch=b.largest_batch)
    return info


@server_routes.get("/metrics")
async def metrics(request: Request):
    return PlainTextResponse(request.app.state.server.metrics.render(), media_type="text/plain; version=0.0.4")


# ---- errors: every refusal in the OpenAI error body -------------------------------------------
async def api_error(request: Request, err: oa.ApiError):
    return error_response(err)


async def invalid_request(request: Request, err: RequestValidationError):
    status = 422 if request.url.path == "/predict" else 400
    errors = err.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return error_response(oa.ApiError(400, f"the request body is not valid JSON: {first.get('msg')}"))
    if tuple(first.get("loc", ())) == ("body",):  # the body itself (a field that is no object is named below)
        return error_response(oa.ApiError(status, _body_not_an_object(request.headers.get("content-type"))))
    loc = tuple(first.get("loc", ()))
    param = _param(loc)
    forms = _union_forms(errors, loc)
    if len(forms) > 1:  # a field of several accepted forms (a text or token ids...): name them, not the first's fault
        message = f"{param}: matches none of the forms it takes: {', '.join(forms)}"
    else:
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return error_response(oa.ApiError(status, message, param))


def _body_not_an_object(content_type: str | None) -> str:
    """Why the body is no JSON object: FastAPI reads it as JSON only under no Content-Type or a JSON one (`curl -d`
    without -H sends a form's, and the JSON object in it is never read)."""
    subtype = (content_type or "").split(";")[0].strip().lower().partition("/")[2]
    if content_type and subtype != "json" and not subtype.endswith("+json"):
        return f"the request body must be JSON sent with Content-Type: application/json, not {content_type}"
    return "the request body must be a JSON object"


UNION_TAG = re.compile(r"str|int|float|bool|(list|dict|tuple|union)\[.*|[A-Z]\w*")


def _is_union_tag(part) -> bool:
    """Whether a location part names a member of a union (pydantic's `str`, `list[int]`, `TextPart`), not a field."""
    return isinstance(part, str) and bool(UNION_TAG.fullmatch(part))


def _union_forms(errors: list[dict], loc: tuple) -> list[str]:
    """The union members the errors at the first error's field tried, in order (one or none: no union)."""
    cut = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if cut is None:
        return []
    forms = []
    for e in errors:
        where = tuple(e.get("loc", ()))
        if where[:cut] == loc[:cut] and len(where) > cut and where[cut] not in forms:
            forms.append(where[cut])
    return forms


async def http_error(request: Request, err: StarletteHTTPException):
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    message = f"no route {request.method} {request.url.path}" if err.status_code in (404, 405) else err.detail
    return error_response(oa.ApiError(err.status_code, message, kind=kind))


async def unexpected(request: Request, err: Exception):  # a bug: still the error shape, and logged by uvicorn
    return error_response(oa.ApiError(500, "the server failed on this request; see its log", kind="server_error"))


ERROR_HANDLERS = {
    oa.ApiError: api_error,
    RequestValidationError: invalid_request,
    StarletteHTTPException: http_error,
    Exception: unexpected,
}


def _param(loc: tuple) -> str | None:
    """The field a location names, as `messages[0].content` (union members' tags left out)."""
    parts = [str(p) for p in loc if p != "body" and not _is_union_tag(p)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or None


# ---- loading and the app factory ----------------------------------------------------------------
async def load_served(state: ServerState, load: Callable[[], Any], on_fatal: Callable | None) -> None:
    """Load the model (in a thread) and start its engine or batcher; `on_fatal` hears of the engine's death."""
    import torch

    from tuneforge.backends.precision import emulated_bf16_note

    options = state.options
    served = await asyncio.to_thread(load)
    threads = serving_threads(isinstance(served, Generator), options.threads, state.owns_process)
    if threads is not None:
        torch.set_num_threads(threads)
    state.threads = torch.get_num_threads()
    model = None
    if isinstance(precision := getattr(served, "precision", None), ServingPrecision):  # a predictor's forwards
        state.precision = await asyncio.to_thread(precision.use, options.precision)
        model = precision.model
    elif isinstance(served, Generator):
        state.precision = serving_precision(served, options.precision)
        model = served.model
    if model is not None and (note := emulated_bf16_note(options.precision, next(model.parameters()).device)):
        state.access_log.event(note)  # as training says it
    if options.pack_weights and model is not None:  # timed at the batch size, on the serving threads
        state.packed_layers = await asyncio.to_thread(pack_linear_layers, model, options.max_batch_size)
    if isinstance(served, Generator):
        from tuneforge.chat import check_chat_template

        check_chat_template(served.tokenizer, options.model_dir)  # one line at start-up, not a 500 per request
        engine = GenerationEngine(
            served,
            options.max_batch_size,
            options.max_queue,
            served_context(served),
            state.metrics.observe_batch,
            on_fatal,
        )
        engine.start()
        state.engine = engine
        defaults = served.defaults.served() if options.generation_config == "auto" else {}
        if options.generation_config == "auto" and (line := served.defaults.line()):
            state.access_log.event(line)
        state.generation = GenerationService(
            served, engine, options.served_model_name, options.request_timeout_s, defaults, options.max_length
        )
        if line := trained_settings_line(state.generation.trained_settings, state.generation.trained_not_applied):
            state.access_log.event(line)
    else:
        infer = served.embed if routes_embeddings.embeds(served) else served.predict
        batcher = DynamicBatcher(
            served, options.max_batch_size, options.max_wait_ms, options.max_queue, state.metrics.observe_batch, infer
        )
        await batcher.start()
        state.batcher = batcher
    state.served = served


def serving_threads(generates: bool, threads: int | None, owns_process: bool) -> int | None:
    """The torch threads to serve with (None: as they are): --threads where given; else, in a process of the
    server's own, every core but one for the batched routes, the HTTP event loop's core left free (OpenMP's idle
    threads spin on it: benchmarks/README.md, "The server's threads"); generation as it is."""
    if threads is not None or not owns_process or generates:
        return threads
    import torch

    return max(1, torch.get_num_threads() - 1)


def serving_precision(generator: Generator, precision: str) -> str:
    """Cast a generator's weights to the precision it serves in (ServeOptions.precision): bf16 weights decode
    1.4-2.2x faster than fp32 on a CPU with AMX (benchmarks/README.md). A quantized model stays as loaded."""
    import torch

    from tuneforge.backends.precision import resolve_precision

    model = generator.model
    first = next(model.parameters())
    if getattr(model, "hf_quantizer", None) is not None or not first.is_floating_point():
        return str(first.dtype).removeprefix("torch.")
    resolved = resolve_precision(precision, first.device)
    model.to({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[resolved])
    return resolved


async def load_or_fail(state: ServerState, load: Callable[[], Any], on_fatal: Callable | None) -> None:
    try:
        await load_served(state, load, on_fatal)
    except Exception as err:  # a model that cannot be loaded: the server stops with the error
        state.load_error = err
        if on_fatal is not None:
            on_fatal(err)


def create_app(
    load: Callable[[], Any], options: ServeOptions, on_fatal: Callable | None = None, owns_process: bool = False
) -> FastAPI:
    """The app serving what `load()` returns (called once, in a thread, after the server starts); `on_fatal(err)`
    when it can serve nothing more (the model failed to load, or the generation engine died). `owns_process`
    (`tuneforge serve`): the process is the server's, and its torch threads are set as `serving_threads` says."""
    state = ServerState(options, owns_process)

    @asynccontextmanager
    async def lifespan(app):
        loading = asyncio.create_task(load_or_fail(state, load, on_fatal))
        yield
        await loading
        if state.engine is not None:
            await asyncio.to_thread(state.engine.stop)
        if state.batcher is not None:
            await state.batcher.stop()

    app = FastAPI(title="tuneforge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    for error_type, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(error_type, handler)
    for router in (server_routes, routes_predict.router, routes_openai.router, routes_embeddings.router):
        app.include_router(router)
    app.add_middleware(Gate, state=state)
    return app
