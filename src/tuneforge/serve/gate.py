"""The gate every HTTP request passes first (pure ASGI middleware): the metrics and access-log line of every
response (serve/access_log.py), its `x-request-id` header (as OpenAI sends one), the API key,
draining, and the body size limit (413 from the Content-Length header or while the body arrives, before anything
parses it)."""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import time
import uuid

from fastapi.responses import JSONResponse

from tuneforge.serve import openai_api as oa
from tuneforge.serve.access_log import Access

ROUTES = (
    "/",
    "/health",
    "/metrics",
    "/predict",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
)
OPEN_ROUTES = ("/health",)  # answered without the API key
MAX_CLIENT_REQUEST_ID = 128  # bytes of a client's own X-Request-Id echoed back (a longer one gets a fresh id)
RETRY_AFTER_S = 1  # what a 503 (busy, loading, shutting down) asks the client to wait


def route_label(path: str) -> str:
    """The route a request's metrics count under: its path, a model card's route, or "other" (any path a client
    sends would otherwise be a label of its own)."""
    if path in ROUTES:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


def error_response(err: oa.ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The OpenAI error body every refusal shares; a 503 asks the client to retry after RETRY_AFTER_S."""
    if err.status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_S), **(headers or {})}
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def request_id(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The id an answer carries in `x-request-id`: the client's own X-Request-Id, echoed as vLLM's
    --enable-request-id-headers echoes it, else a fresh `req_` + 32 hex digits, as OpenAI's ids look."""
    given = next((value for name, value in headers if name == b"x-request-id"), b"")
    return given if 0 < len(given) <= MAX_CLIENT_REQUEST_ID else f"req_{uuid.uuid4().hex}".encode()


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

    def __init__(self, app, state) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, rid = scope["path"], request_id(scope["headers"])
        start, status, done, refusal_body = time.perf_counter(), [500], [False], [b""]

        def finished() -> None:
            done[0] = True
            seconds = time.perf_counter() - start
            self.state.metrics.observe_request(route_label(path), status[0], seconds)
            gen = scope.get("state", {}).get("generation")  # set by a generation route (serve/generation.py)
            tokens = (gen.prompt_tokens, gen.completion_tokens) if gen is not None else (None, None)
            error = _error_message(refusal_body[0]) if status[0] >= 400 else None
            ms = round(seconds * 1000, 1)
            access = Access(scope["method"], path, status[0], ms, *tokens, error, rid.decode("latin-1"))
            self.state.access_log.request(access)

        async def send_observed(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            elif status[0] >= 400 and message["type"] == "http.response.body" and len(refusal_body[0]) < 4096:
                refusal_body[0] += message.get("body", b"")  # an error body (small): its message is logged
            if message["type"] == "http.response.body" and not message.get("more_body") and not done[0]:
                finished()  # before the last bytes go: a client that has its answer finds its line in the log
            await send(message)

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
                finished()

    def _refusal(self, scope, path: str) -> JSONResponse | None:
        options = self.state.options
        if options.api_key and path not in OPEN_ROUTES:
            headers = dict(scope["headers"])
            given = _given_key(headers)
            if not hmac.compare_digest(given.encode(), options.api_key.encode()):
                extra = {"WWW-Authenticate": 'Basic realm="tuneforge"'}  # a browser asks for it (the key as password)
                # OpenAI's own 401s: invalid_request_error, with code invalid_api_key for a key that is wrong
                said = "wrong API key" if given else "no API key"
                message = f"{said}: send Authorization: Bearer KEY"
                return error_response(oa.ApiError(401, message, code="invalid_api_key" if given else None), extra)
        if self.state.draining and path not in OPEN_ROUTES:
            return error_response(oa.ApiError(503, "the server is shutting down", kind="server_busy"))
        return None

    async def _read_body(self, scope, receive) -> bytes | JSONResponse:
        limit = self.state.options.max_body_bytes
        too_large = oa.ApiError(
            413, f"the request body is larger than {limit} bytes; send less per request", kind="request_too_large"
        )
        if _declared_too_large(scope, limit):
            return error_response(too_large, {"Connection": "close"})
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b""
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return error_response(too_large, {"Connection": "close"})
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)


def _error_message(body: bytes) -> str | None:
    """The message of an OpenAI error body (every refusal has one), cut short for the log."""
    try:
        return str(json.loads(body)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return None


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
