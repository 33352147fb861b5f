"""The OpenAI-compatible routes: GET /v1/models, POST /v1/completions and /v1/chat/completions. Each turns its
request into prompts and hands them to the server's GenerationService (serve/generation.py). No
`from __future__ import annotations`: FastAPI reads the request models from the evaluated annotations."""

import logging

from fastapi import APIRouter, Request

from tuneforge.serve import openai_api as oa
from tuneforge.serve.generation import MAX_PROMPT_ROWS, Generation, GenerationService, nth_choice

router = APIRouter()
log = logging.getLogger(__name__)


def generation_service(request: Request, body: oa.SamplingRequest) -> GenerationService:
    """The server's generation service, once the request may use it (ready, a generative model, the served
    model's name, no option this server does not implement)."""
    state = request.app.state.server
    state.require_ready()
    service = state.generation
    if service is None:
        raise oa.ApiError(400, "this server serves a classifier: use POST /predict")
    oa.refuse_unencodable(body)  # before the model's name is compared (and echoed)
    if body.model != service.name:
        raise oa.ApiError(
            404,
            f"model {body.model!r} is not served here; this server serves {service.name!r}",
            "model",
            kind="not_found_error",
            code="model_not_found",
        )
    body.refuse_unsupported()
    if unknown := body.unknown_fields():  # named as ascii, the first ten, cut short: a client's text in our log
        named = ", ".join(ascii(name)[:40] for name in unknown[:10]) + (" and more" if len(unknown) > 10 else "")
        log.warning("%s: ignored the fields this server does not know: %s", request.url.path, named)
    return service


@router.get("/v1/models")
async def models(request: Request):
    state = request.app.state.server
    return oa.models_body(state.options.served_model_name, state.created)


def prompt_texts(body: oa.CompletionRequest) -> list[str]:
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
    return texts


@router.post("/v1/completions")
async def completions(body: oa.CompletionRequest, request: Request):
    service = generation_service(request, body)
    texts, n = prompt_texts(body), body.n or 1
    prompts = [service.encode(t, "prompt") for t in texts]
    params = service.sampling(body, prompts, body.max_tokens, ("prompt", "max_tokens"), 16)
    seeds = [params if params.seed is None else nth_choice(params, i * n) for i in range(len(prompts))]
    return await service.run(body, request, Generation(prompts, seeds, n), chat=False)


def chat_prompt(service: GenerationService, body: oa.ChatRequest) -> str:
    """The messages rendered by the model's chat template."""
    if not service.has_chat_template:
        raise oa.ApiError(
            400, "this model has no chat template; use POST /v1/completions (or fine-tune it on conversations)"
        )
    if not body.messages:
        raise oa.ApiError(400, "messages is empty; send at least one message", "messages")
    if (body.n or 1) > MAX_PROMPT_ROWS:
        raise oa.ApiError(400, f"n is above {MAX_PROMPT_ROWS}", "n")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    if not any(m["content"].strip() for m in messages):
        raise oa.ApiError(400, "every message is empty; send some text", "messages")
    tokenizer = service.generator.tokenizer
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # the template's own checks (e.g. roles that must alternate)
        raise oa.ApiError(400, f"the chat template refused these messages: {err}", "messages") from None


@router.post("/v1/chat/completions")
async def chat_completions(body: oa.ChatRequest, request: Request):
    service = generation_service(request, body)
    prompt = service.encode(chat_prompt(service, body), "messages", special=False)
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    default = request.app.state.server.options.default_max_tokens
    params = service.sampling(body, [prompt], max_tokens, ("messages", field), default)
    return await service.run(body, request, Generation([prompt], [params], body.n or 1), chat=True)
