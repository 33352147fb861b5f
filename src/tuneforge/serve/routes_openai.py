"""The OpenAI-compatible routes: GET /v1/models and /v1/models/{model} (the served model's card), POST
/v1/completions and /v1/chat/completions. Each turns its request into prompts and hands them to the server's
GenerationService (serve/generation.py). No `from __future__ import annotations`: FastAPI reads the request models
from the evaluated annotations."""

import dataclasses
import logging

from fastapi import APIRouter, Request

from tuneforge import tool_calls
from tuneforge.serve import openai_api as oa
from tuneforge.serve.generation import MAX_PROMPT_ROWS, Generation, GenerationService, Shape, nth_choice

router = APIRouter()
log = logging.getLogger(__name__)


def generation_service(request: Request, body: oa.SamplingRequest) -> GenerationService:
    """The server's generation service, once the request may use it (ready, a generative model, the served
    model's name, no option this server does not implement)."""
    state = request.app.state.server
    state.require_ready()
    service = state.generation
    if service is None:
        raise oa.ApiError(400, state.use_instead())
    oa.refuse_unencodable(body)  # before the model's name is compared (and echoed)
    if body.model != service.name:
        raise oa.model_not_found(body.model, service.name)
    body.refuse_unsupported()
    if unknown := body.unknown_fields():  # named as ascii, the first ten, cut short: a client's text in our log
        named = ", ".join(ascii(name)[:40] for name in unknown[:10]) + (" and more" if len(unknown) > 10 else "")
        log.warning("%s: ignored the fields this server does not know: %s", request.url.path, named)
    return service


@router.get("/v1/models")
async def models(request: Request):
    state = request.app.state.server
    return oa.models_body(state.options.served_model_name, state.created)


@router.get("/v1/models/{model:path}")  # a path: a served name may hold "/" (the client sends it as %2F)
async def model_card(model: str, request: Request):
    """The served model's card (the client's `models.retrieve`); 404 model_not_found for any other name."""
    state = request.app.state.server
    if model != state.options.served_model_name:
        raise oa.model_not_found(model, state.options.served_model_name)
    return oa.model_card(model, state.created)


def prompt_list(body: oa.CompletionRequest) -> list:
    """The request's prompts: texts, or token-id lists; ApiError 400 for none, an empty one, or too many."""
    prompt = body.prompt
    single = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
    prompts = [prompt] if single else prompt
    rows = len(prompts) * max(body.n or 1, body.best_of or 1)
    if not prompts:
        raise oa.ApiError(400, "prompt is empty; send a text", "prompt")
    if rows > MAX_PROMPT_ROWS:
        raise oa.ApiError(
            400, f"{len(prompts)} prompts x n (or best_of) is {rows}, above {MAX_PROMPT_ROWS} per request", "prompt"
        )
    for i, p in enumerate(prompts):
        if not p:
            where = "prompt" if single else f"prompt[{i}]"
            raise oa.ApiError(400, f"{where} is empty; send a text or token ids", where)
    return prompts


def prompt_ids(service: GenerationService, prompt, where: str) -> list[int]:
    """A prompt's token ids: a text encoded, or ids checked against the model's vocabulary."""
    if isinstance(prompt, str):
        return service.encode(prompt, where)
    for j, token in enumerate(prompt):
        if not 0 <= token < service.vocab_size:
            raise oa.ApiError(400, f"{where}[{j}] {token} is not a token id below {service.vocab_size}", where)
    return service.check_ids(list(prompt), where)


@router.post("/v1/completions")
async def completions(body: oa.CompletionRequest, request: Request):
    service = generation_service(request, body)
    texts, n, best_of = prompt_list(body), body.n or 1, body.best_of or body.n or 1
    single = len(texts) == 1 and body.prompt is not texts
    prompts = [prompt_ids(service, t, "prompt" if single else f"prompt[{i}]") for i, t in enumerate(texts)]
    if body.echo and not service.generator.kind.continues_prompt:
        raise oa.ApiError(400, "echo needs a model that continues its prompt; this one reads it (encoder)", "echo")
    params = service.sampling(
        body, prompts, body.max_tokens, ("prompt", "max_tokens"), service.default_max_tokens(16, cap=True)
    )
    logprobs = body.logprobs if body.logprobs is not None or best_of == n else 0  # best_of ranks by them
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    params = dataclasses.replace(params, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    seeds = [params if params.seed is None else nth_choice(params, i * best_of) for i in range(len(prompts))]
    echo = [t if isinstance(t, str) else service.generator.tokenizer.decode(t) for t in texts] if body.echo else None
    shape = Shape(chat=False, logprobs=body.logprobs, echo=echo)
    return await service.run(body, request, Generation(prompts, seeds, n, best_of), shape)


def chat_prompt(service: GenerationService, body: oa.ChatRequest) -> str:
    """The messages (tool calls and tool results too) and the request's tools rendered by the model's chat
    template; ApiError 400 when tools are asked of a template that does not render them, or it renders nothing."""
    if not service.has_chat_template:
        raise oa.ApiError(
            400, "this model has no chat template; use POST /v1/completions (or fine-tune it on conversations)"
        )
    if not body.messages:
        raise oa.ApiError(400, "messages is empty; send at least one message", "messages")
    if (body.n or 1) > MAX_PROMPT_ROWS:
        raise oa.ApiError(400, f"n is above {MAX_PROMPT_ROWS}", "n")
    messages = [m.openai() for m in body.messages]
    if not any(m["content"].strip() or m.get("tool_calls") for m in messages):
        raise oa.ApiError(400, "every message is empty; send some text", "messages")
    tokenizer = service.generator.tokenizer
    tools = body.tool_specs()
    if tools or tool_calls.uses_tools(messages):
        messages = tool_messages(service.renders_tools, messages, tools)
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # the template's own checks (e.g. roles that must alternate)
        raise oa.ApiError(400, f"the chat template refused these messages: {err}", "messages") from None
    if not text.strip():  # the messages hold text (checked above): the template wrote none of it
        raise oa.ApiError(400, "the model's chat template renders nothing of these messages", "messages")
    return text


def tool_messages(renders_tools: bool, messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages with tool calls or results (or sent with tools) as the template reads them; ApiError 400 naming
    the field for a template that does not render tools (`renders_tools` False), or a bad tool call."""
    if not renders_tools:
        first = next((i for i, m in enumerate(messages) if tool_calls.uses_tools([m])), None)
        field = "tools" if tools else f"messages[{first}]"
        raise oa.ApiError(
            400,
            f"{field}: this model's chat template does not render tools, so it takes no tools, tool calls or tool "
            "results; serve a model whose template does (one that writes <tool_call>, as Qwen2.5's), or send none",
            field,
        )
    try:
        return tool_calls.to_template_messages(messages)
    except tool_calls.ToolSpecError as err:
        raise oa.ApiError(400, str(err), err.field) from None


async def reply_constraint(service: GenerationService, body: oa.ChatRequest):
    """The grammar a chat reply is held to: its response_format's, or the schema of the call its tool_choice
    forces. A forced tool whose arguments cannot be enforced is named (`tools[1].function.parameters`), not the
    response_format the request never sent."""
    try:
        return await service.constraint(body.structured())
    except oa.ApiError as err:
        forced = body.forced_tool_choice()
        if forced is None:
            raise
        raise await forced_tool_error(service, body.tool_specs(), forced, err) from None


async def forced_tool_error(service: GenerationService, tools: list[dict], forced, err: oa.ApiError) -> oa.ApiError:
    """The refusal of a forced call's schema, naming the first forced tool whose arguments cannot be enforced
    alone (compiled again, on this error path only); `tools` when only their union for "required" fails."""
    said = "response_format.json_schema.schema"
    for i, tool in enumerate(tools):
        if isinstance(forced, dict) and tool["function"]["name"] != forced["function"]["name"]:
            continue
        field = f"tools[{i}].function.parameters"
        schema = tool_calls.forced_schema([tool], {"type": "function", "function": {"name": tool["function"]["name"]}})
        try:
            await service.constraint({"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}})
        except oa.ApiError as own:
            return oa.ApiError(400, own.message.replace(said, field, 1), field)
    return oa.ApiError(400, err.message.replace(said, "the schema of tool_choice 'required' (all tools)", 1), "tools")


@router.post("/v1/chat/completions")
async def chat_completions(body: oa.ChatRequest, request: Request):
    service = generation_service(request, body)
    prompt = service.encode(chat_prompt(service, body), "messages", special=False)
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    default = service.default_max_tokens(request.app.state.server.options.default_max_tokens)
    params = service.sampling(body, [prompt], max_tokens, ("messages", field), default)
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = dataclasses.replace(params, logprobs=top)
    constraint = await reply_constraint(service, body)
    gen = Generation([prompt], [params], body.n or 1, eos_logprob=False, constraint=constraint)
    family = service.tool_family if body.parses_tool_calls() else None
    forced, parallel = body.forced_tool_choice(), body.parallel_calls()
    shape = Shape(chat=True, logprobs=top, tool_family=family, forced=forced, parallel=parallel)
    return await service.run(body, request, gen, shape)
