"""POST /predict: classifiers, taggers, qa and multiple choice, through the dynamic batcher (serve/batching.py).
No `from __future__ import annotations`: FastAPI reads the request model from the evaluated annotations."""

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from tuneforge.errors import UserError
from tuneforge.files import finite_or_null
from tuneforge.serve import openai_api as oa
from tuneforge.serve.engine import QueueFull

router = APIRouter()


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    texts: list[str] | None = Field(None, description="one text per input")
    pairs: list[tuple[str, str]] | None = Field(None, description="text pairs (sentence pairs; question and context)")
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


async def answer_predict(state, request: PredictRequest) -> dict:
    """/predict: the request's inputs checked (text, then the predictor's own checks) before they join a batch;
    an input the predictor refuses is a 422 naming the field, for this request alone."""
    state.require_ready()
    if state.batcher is None or not state.served.accepts:  # a generative model, or one answering with vectors
        raise oa.ApiError(400, state.use_instead())
    oa.refuse_unencodable(request, 422)
    items = _predict_items(request, tuple(state.served.accepts), state.options.max_request_items)
    kind = next(k for k in ("texts", "pairs", "inputs") if getattr(request, k) is not None)
    try:
        return {"predictions": finite_or_null(await state.batcher.submit(items))}  # a score of inf (fp16) as null
    except QueueFull as err:
        raise oa.ApiError(503, f"the server is busy ({err}); retry later", kind="server_busy") from None
    except UserError as err:  # the predictor's own checks: this request's inputs
        raise oa.ApiError(422, str(err), kind) from None


@router.post("/predict")
async def predict(body: PredictRequest, request: Request):
    return await answer_predict(request.app.state.server, body)
