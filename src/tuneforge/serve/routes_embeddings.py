"""POST /v1/embeddings, OpenAI's embeddings API, for a served sentence encoder: a predictor with an
`embedding_size` (`embeds`; tasks/sentence_encoder.py's EmbeddingPredictor). The request's inputs, texts or token-id
lists (as the model's tokenizer gives them, special tokens included), are checked before they join a batch of the
dynamic batcher (serve/batching.py, running the predictor's `embed`), so that concurrent requests share the model's
forward passes.

Each answer: the L2-normalised vector (`dimensions`: its first N, renormalised, as sentence-transformers'
truncate_dim; above the model's size a 400), as floats or as base64 of its little-endian float32 bytes
(`encoding_format`, as OpenAI encodes it), and `usage`: the tokens the model read (special tokens included, after
truncation at max_length: a text is truncated as sentence-transformers truncates it; token ids beyond max_length
are refused). Limits and refusals as the other routes: at most `max_request_items` inputs, the gate's body size
limit (413), the served model's name (404), and OpenAI's error body with a 400 naming the field (an empty text or
list, a token id outside the vocabulary, a wrong type). No `from __future__ import annotations`: FastAPI reads the
request model from the evaluated annotations.
"""

import base64
import logging
from typing import Literal

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from tuneforge.errors import UserError
from tuneforge.serve import openai_api as oa
from tuneforge.serve.engine import QueueFull

router = APIRouter()
log = logging.getLogger(__name__)
# OpenAI's `object` of each vector in the answer: the wire format's word, which tests/test_imports.py lets this
# file (and only this one) write
VECTOR_OBJECT = "embedding"
MAX_DIMENSIONS = 1 << 20


def embeds(served) -> bool:
    """Whether the served model answers with vectors: the capability that this route serves."""
    return isinstance(getattr(served, "embedding_size", None), int)


class EmbeddingRequest(BaseModel):
    model_config = oa.REQUEST

    model: str
    # a text, texts, token ids, or lists of token ids (as OpenAI takes them)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1, le=MAX_DIMENSIONS)
    user: str | None = None


def sentence_encoder(request: Request, body: EmbeddingRequest):
    """The served encoder, once the request may use it: the model loaded, one that embeds, the served model's name;
    fields this server does not know are named in one warning line (and ignored, as the other routes do)."""
    state = request.app.state.server
    state.require_ready()
    if not embeds(state.served):
        raise oa.ApiError(400, state.use_instead())
    oa.refuse_unencodable(body)  # before the model's name is compared (and echoed)
    name = state.options.served_model_name
    if body.model != name:
        raise oa.model_not_found(body.model, name)
    if unknown := sorted(set(body.model_extra or {}) - set(oa.METADATA)):
        named = ", ".join(ascii(field)[:40] for field in unknown[:10]) + (" and more" if len(unknown) > 10 else "")
        log.warning("%s: ignored the fields this server does not know: %s", request.url.path, named)
    return state.served


def input_items(body: EmbeddingRequest, encoder, max_items: int) -> list:
    """The request's inputs (a text or token ids alone is one), each checked by the encoder; ApiError 400 naming
    the first bad one (`input`, `input[3]`), none or too many."""
    given = body.input
    single = isinstance(given, str) or (bool(given) and isinstance(given[0], int))
    items = [given] if single else list(given)
    if not items:
        raise oa.ApiError(400, "input is empty; send a text, a list of texts or token ids", "input")
    if len(items) > max_items:
        raise oa.ApiError(400, f"input holds {len(items)} items, above {max_items} per request; split it", "input")
    for i, item in enumerate(items):
        where = "input" if single else f"input[{i}]"
        problem = encoder.input_problem(item)
        if problem:
            raise oa.ApiError(400, f"{where} {problem}", where)
    return items


def kept_dimensions(dimensions: int | None, size: int) -> int | None:
    """The leading dimensions to keep (None: all of them); ApiError 400 above the model's size."""
    if dimensions is not None and dimensions > size:
        raise oa.ApiError(400, f"dimensions {dimensions} is above this model's {size}; give 1 to {size}", "dimensions")
    return None if dimensions == size else dimensions


def embeddings_body(rows: list, dimensions: int | None, encoding: str, model: str) -> bytes:
    """OpenAI's answer as JSON: a vector per row (`rows`: the encoder's Embedded, in the request's order) and the
    usage. Floats are written by orjson from the float32 array, each as the shortest text that reads back as the same
    float32 (Python's json module wrote each as a double: 25x slower, on the event loop, and 1.7x the bytes; a
    1,024-text answer held the loop 0.5 s). A nan or inf is a 500 (orjson would write null)."""
    vectors = np.stack([row.vector for row in rows]).astype(np.float32)
    if dimensions is not None:  # the first dimensions, renormalised (as torch's F.normalize: eps 1e-12)
        vectors = vectors[:, :dimensions]
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), np.float32(1e-12))
    if not np.isfinite(vectors).all():
        log.error("the model produced a non-finite vector (nan or inf) for this request")
        raise oa.ApiError(500, "the model produced a non-finite vector; see the server's log", kind="server_error")
    if encoding == "base64":
        little = vectors.astype("<f4")
        values = [base64.b64encode(row.tobytes()).decode("ascii") for row in little]
    else:
        values = list(vectors)  # float32 rows, which orjson writes itself
    data = [{"object": VECTOR_OBJECT, "index": i, "embedding": value} for i, value in enumerate(values)]
    tokens = sum(row.tokens for row in rows)
    body = {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    state = request.app.state.server
    encoder = sentence_encoder(request, body)
    items = input_items(body, encoder, state.options.max_request_items)
    dimensions = kept_dimensions(body.dimensions, encoder.embedding_size)
    try:
        rows = await state.batcher.submit(items)
    except QueueFull as err:
        raise oa.ApiError(503, f"the server is busy ({err}); retry later", kind="server_busy") from None
    except UserError as err:  # the encoder's own checks (passed above: a defect if it comes to this)
        raise oa.ApiError(400, str(err), "input") from None
    # the body as JSON at once: FastAPI's encoder would walk every float of every vector again
    answer = embeddings_body(rows, dimensions, body.encoding_format or "float", body.model)
    return Response(answer, media_type="application/json")
