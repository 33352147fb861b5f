"""The OpenAI API shapes `tuneforge serve` speaks: request models (validated strictly: a number sent as a
string is refused, as OpenAI does), response and stream-chunk bodies, and the error body
`{"error": {"message", "type", "param", "code"}}` every refusal uses.

The sampling fields of OpenAI (presence and frequency penalties, logit_bias, best_of) and vLLM (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos) are honoured (serve/logit_rules.py), and so are log-probs (completions'
`logprobs` and `echo`, token-id prompts; chat's `logprobs` and `top_logprobs`: serve/logprobs.py). Known fields
this server does not honour (NOT_HONOURED: beam search, vLLM's guided decoding, tokenizer and chat-template fields,
audio, ...) are refused with a 400 naming the field when set to anything but their neutral value, and so are
inconsistent ones (stream_options without stream, tool_choice without tools), as vLLM refuses them. Harmless
metadata (user, metadata, store, service_tier, ...) is accepted; any other field is ignored and named in one
warning line of the server's log (`unknown_fields`). Every number has finite, stated bounds (no NaN or infinity, which
Python's JSON reader accepts), and `unencodable_field` finds text the tokenizer cannot take (lone surrogates,
which JSON's escapes and pydantic accept but UTF-8 cannot carry).
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from tuneforge import tool_calls
from tuneforge.serve.engine import SAMPLING_EPS  # a temperature below it is greedy, as vLLM's _SAMPLING_EPS
from tuneforge.serve.logprobs import MAX_LOGPROBS, TokenLogprob, character_starts

MAX_CHOICES = 16  # n
LOWEST_LOGPROB = -9999.0  # a log-prob of -inf (a token the model rules out), as vLLM's OpenAI server shows it
# stop strings: OpenAI allows 4, lm-evaluation-harness sends a task's (up to 5) and the end-of-text, vLLM takes any
MAX_STOPS = 16
MAX_TOKENS = 1 << 20  # max_tokens' bound before the model's own context (checked per model) lowers it
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # a torch.long, as vLLM bounds it (torch.Generator takes it)
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
REQUEST = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)  # a request's unknown fields are kept, to name

# field -> its neutral values (those that change nothing): anything else is refused. Declared fields are read as
# declared (their bounds checked first), the rest from the request's extra fields.
NOT_HONOURED = {
    # vLLM's decoding extras (its top_k, min_p, repetition_penalty, min_tokens and ignore_eos are honoured)
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "stop_token_ids": (None, []),
    "include_stop_str_in_output": (None, False),
    "prompt_logprobs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    # vLLM's tokenizer and detokenizer extras: the text is decoded with special tokens skipped, as vLLM's default
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "return_tokens_as_token_ids": (None, False),
}
NOT_HONOURED_CHAT = {
    "best_of": (None, 1),  # a completions field (OpenAI's chat has none)
    "functions": (None, []),  # OpenAI's deprecated functions API: refused pointing to tools (ChatRequest)
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
    # vLLM's chat-template extras: the prompt is the model's own template with the generation prompt, as by default
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None, []),
    "add_special_tokens": (None, False),
    "echo": (None, False),
}
NOT_HONOURED_COMPLETION = {"suffix": (None, ""), "add_special_tokens": (None, True)}
# accepted and without effect here (what they ask for is bookkeeping on OpenAI's side)
METADATA = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "parallel_tool_calls")


def is_neutral(value: Any, neutral: tuple) -> bool:
    """`value` equals one of `neutral` of the same kind (True is not 1, as JSON tells them apart)."""
    return any(isinstance(value, bool) == isinstance(n, bool) and value == n for n in neutral)


class ApiError(Exception):
    """A refusal: HTTP `status` with the OpenAI error body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", code=None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def model_not_found(asked: str, served: str) -> ApiError:
    """The 404 of a request (or a model card) naming a model this server does not serve."""
    return ApiError(
        404,
        f"model {asked!r} is not served here; this server serves {served!r}",
        "model",
        kind="not_found_error",
        code="model_not_found",
    )


def error_body(message: str, kind: str, param: str | None = None, code=None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None


class SamplingRequest(BaseModel):
    """What completions and chat completions share."""

    model_config = REQUEST
    not_honoured: ClassVar[dict[str, tuple]] = NOT_HONOURED

    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2, description=f"below {SAMPLING_EPS:g}: greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # what they do to the next token's logits: serve/logit_rules.py
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKENS, description="0 or -1: every token (vLLM)")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    ignore_eos: bool | None = None

    def bias(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs; ApiError 400 for a key that is no token id or a bias outside
        [-100, 100], as OpenAI refuses them."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and int(key) < vocab_size):
                raise ApiError(400, f"logit_bias key {key[:20]!r} is not a token id below {vocab_size}", "logit_bias")
            if not -100 <= value <= 100:
                raise ApiError(400, f"logit_bias[{key!r}] {value!r} is outside [-100, 100]", "logit_bias")
            pairs.append((int(key), float(value)))
        return tuple(pairs)

    def field_value(self, name: str) -> Any:
        return getattr(self, name) if name in type(self).model_fields else (self.model_extra or {}).get(name)

    def refuse_unsupported(self) -> None:
        for name, neutral in self.not_honoured.items():
            if not is_neutral(self.field_value(name), neutral):
                raise ApiError(400, f"{name} is not supported by this server; leave it out", name)
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")

    def unknown_fields(self) -> list[str]:
        """The fields sent that this server neither knows nor refuses (ignored, as vLLM ignores them)."""
        known = {*self.not_honoured, *METADATA}
        return sorted(name for name in self.model_extra or {} if name not in known)

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
        if any(not s for s in stops):
            raise ApiError(400, "stop strings must not be empty", "stop")
        return tuple(stops)


class CompletionRequest(SamplingRequest):
    not_honoured: ClassVar[dict[str, tuple]] = {**NOT_HONOURED, **NOT_HONOURED_COMPLETION}

    # a text, texts, token ids (lm-evaluation-harness sends them) or lists of token ids
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS, description="0 only with echo")
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="the k most likely tokens of each")
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens 0 asks for nothing; it is allowed with echo only", "max_tokens")
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise ApiError(400, f"best_of {self.best_of} is below n {self.n}: it must be at least n", "best_of")
        if self.stream and (self.best_of or 1) > (self.n or 1):
            raise ApiError(400, "best_of above n cannot stream: the best are known at the end", "best_of")


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class OtherPart(BaseModel):
    """A content part of another kind (image_url, input_audio, file): known, so that its refusal can name it."""

    model_config = STRICT
    type: str


class ChatMessage(BaseModel):
    """A message; an assistant's `tool_calls` (OpenAI's shape, checked by tool_calls.to_template_messages when the
    prompt is rendered) and a tool result's `tool_call_id` too."""

    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def openai(self) -> dict:
        """The message as a plain OpenAI-shaped dict (developer read as system), for tool_calls.py."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls is not None:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def refuse_unsupported(self, where: str) -> None:
        if self.role == "function":
            raise ApiError(
                400,
                f"{where}.role 'function' is OpenAI's deprecated functions API, which this server does not support; "
                "send the result as a role 'tool' message with the tool_call_id of the call it answers",
                f"{where}.role",
            )
        if self.role == "tool" and not self.tool_call_id:
            raise ApiError(
                400, f"{where}.tool_call_id is required in a tool message (the id of the call it answers)", where
            )
        if self.tool_call_id is not None and self.role != "tool":
            raise ApiError(400, f"{where}.tool_call_id belongs to tool messages only", f"{where}.tool_call_id")
        if self.tool_calls not in (None, []) and self.role != "assistant":
            raise ApiError(400, f"{where}.tool_calls belongs to assistant messages only", f"{where}.tool_calls")
        if self.name:
            raise ApiError(400, f"{where}.name is not supported by this server; leave it out", f"{where}.name")
        for j, part in enumerate(self.content if isinstance(self.content, list) else []):
            if isinstance(part, OtherPart):
                kind = ascii(part.type[:40])
                raise ApiError(400, f"{where}.content[{j}] is a {kind} part; this server reads text parts only", where)


class ChatRequest(SamplingRequest):
    not_honoured: ClassVar[dict[str, tuple]] = {**NOT_HONOURED, **NOT_HONOURED_CHAT}

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None
    parallel_tool_calls: bool | None = None  # false: one call at most (`parallel_calls`)
    # tool_specs' outcome, once checked: (the checked tools, None) or (None, the ToolSpecError)
    _checked_tools: tuple[list[dict] | None, tool_calls.ToolSpecError | None] | None = PrivateAttr(None)

    def refuse_unsupported(self) -> None:
        for name in ("functions", "function_call"):  # before the generic refusal: it says what to send instead
            if not is_neutral(self.field_value(name), NOT_HONOURED_CHAT[name]):
                raise ApiError(
                    400,
                    f"{name} is OpenAI's deprecated functions API, which this server does not support; send tools "
                    "(and tool_choice) instead",
                    name,
                )
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs is only allowed with logprobs: true", "top_logprobs")
        if self.forced_tool_choice() is not None and not is_neutral(self.response_format, (None, {"type": "text"})):
            raise ApiError(
                400, "response_format cannot be combined with a tool_choice that forces a call", "response_format"
            )
        for i, message in enumerate(self.messages):
            message.refuse_unsupported(f"messages[{i}]")

    def tool_specs(self) -> list[dict] | None:
        """The request's tools, checked (None: no tools); ApiError 400 naming the bad field. Checked on the first
        call only (a request is not changed once read): later calls give the same tools or the same refusal."""
        if self._checked_tools is None:
            try:
                self._checked_tools = (tool_calls.check_tools(self.tools), None)
            except tool_calls.ToolSpecError as err:
                self._checked_tools = (None, err)
        tools, err = self._checked_tools
        if err is not None:
            raise ApiError(400, str(err), err.field) from None
        return tools

    def checked_tool_choice(self) -> str | dict | None:
        """tool_choice checked against the tools; ApiError 400 naming the bad field."""
        tools = self.tool_specs()
        try:
            return tool_calls.check_tool_choice(self.tool_choice, tools)
        except tool_calls.ToolSpecError as err:
            raise ApiError(400, str(err), err.field) from None

    def forced_tool_choice(self) -> str | dict | None:
        """tool_choice "required" or a named function (the reply is then the call's JSON, constrained by
        tool_calls.forced_schema as vLLM constrains it); None otherwise."""
        choice = self.checked_tool_choice()
        return choice if choice == "required" or isinstance(choice, dict) else None

    def structured(self) -> Any:
        """The response_format the reply is constrained to: the request's own, or the forced call's schema."""
        forced = self.forced_tool_choice()
        if forced is None:
            return self.response_format
        schema = tool_calls.forced_schema(self.tool_specs(), forced, self.parallel_calls())
        return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema, "strict": True}}

    def parallel_calls(self) -> bool:
        """Whether a reply may make several calls: unless parallel_tool_calls is false (OpenAI: "exactly zero or
        one tool is called"; vLLM keeps the first call)."""
        return self.parallel_tool_calls is not False

    def parses_tool_calls(self) -> bool:
        """Whether the reply is read for tool calls: tools given and tool_choice not "none" (as vLLM's "auto")."""
        return bool(self.tool_specs()) and self.tool_choice != "none"


def greedy_below_eps(temperature: float | None) -> float:
    """The temperature a request samples with: 1 when not given, 0 (greedy) below SAMPLING_EPS."""
    if temperature is None:
        return 1.0
    return 0.0 if temperature < SAMPLING_EPS else temperature


def unencodable_field(value: Any, path: str = "") -> str | None:
    """The first field (as `prompt[1]`, `messages[0].content`) of a request whose text UTF-8 cannot encode (a
    lone surrogate), walking models, lists and dicts (their keys too); None when all of it can. Walked on a stack
    of its own, not by recursion: JSON nested deeper than Python's recursion limit is still valid JSON."""
    todo = [(value, path)]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            if not _encodes(value):
                return path or "body"
            continue
        if isinstance(value, BaseModel):
            children = [(getattr(value, name), _field_path(path, name)) for name in type(value).model_fields]
        elif isinstance(value, dict):
            if not all(_encodes(key) for key in value if isinstance(key, str)):
                return path or "body"  # the key itself cannot be named in the error
            children = [(item, _field_path(path, str(name))) for name, item in value.items()]
        elif isinstance(value, (list, tuple)):
            children = [(item, f"{path}[{i}]") for i, item in enumerate(value)]
        else:
            continue
        todo.extend(reversed(children))  # the first child on top: fields are named in the request's order
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _field_path(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def refuse_unencodable(body: BaseModel, status: int = 400) -> None:
    """ApiError `status` naming the first field holding text the tokenizer cannot take."""
    field = unencodable_field(body)
    if field is not None:
        raise ApiError(
            status, f"{field} is not valid UTF-8 text (a lone surrogate such as \\ud800); send real characters", field
        )


# ---- responses ------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(rid: str, model: str, created: int, choices: list[tuple[str, str]], use: dict) -> dict:
    """`choices`: (text, finish_reason) in index order."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
            for i, (text, reason) in enumerate(choices)
        ],
        "usage": use,
    }


def completion_chunk(rid: str, model: str, created: int, index: int, text: str, reason: str | None) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}],
    }


def chat_body(rid: str, model: str, created: int, choices: list[tuple[str, str]], use: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": i, "message": chat_message(text), "logprobs": None, "finish_reason": reason}
            for i, (text, reason) in enumerate(choices)
        ],
        "usage": use,
    }


def chat_message(content: str | None, calls: list[tool_calls.ToolCall] | None = None) -> dict:
    """An assistant message; with `calls`, their OpenAI shape in `tool_calls` (content None when only calls)."""
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.openai() for call in calls]
    return message


def with_tool_calls(body: dict, family: str, forced: str | dict | None = None, parallel: bool = True) -> dict:
    """A chat body with each choice's text read for tool calls (tool_calls.read_reply of the template's `family`;
    the first call only without `parallel`): a choice that made calls gets them in its message, the text around
    them as content (None when there is none) and finish_reason "tool_calls" ("stop" for a named tool_choice,
    "length" where max_tokens cut it), as OpenAI and vLLM answer."""
    for choice in body["choices"]:
        content, calls = tool_calls.read_reply(choice["message"]["content"] or "", family, forced, parallel)
        if calls:
            choice["message"] = chat_message(content, calls)
            choice["finish_reason"] = tool_calls.finish_reason(choice["finish_reason"], calls, forced)
    return body


def tool_call_delta(content: str | None, calls: list[tool_calls.ToolCall]) -> dict:
    """A stream's delta of a choice's held-back text: its content, and its calls whole (each with its `index`)."""
    delta = {} if content is None else {"content": content}
    if calls:
        delta["tool_calls"] = [{"index": k, **call.openai()} for k, call in enumerate(calls)]
    return delta


def shown_logprob(value: float | None) -> float | None:
    """A log-prob as an answer shows it (JSON has no infinity or nan): -inf as LOWEST_LOGPROB, as vLLM clamps it; a
    nan (logits that overflowed, as fp16 forwards of large ones do) as null, no value."""
    if value is None or math.isnan(value):
        return None
    return max(value, LOWEST_LOGPROB)


def completion_logprobs(entries: list[TokenLogprob], texts, offset: int = 0) -> dict:
    """OpenAI's completions `logprobs` of these tokens (an echoed prompt's first has none); `texts`: a
    serve/logprobs.py TokenTexts; `offset`: where the first token's text starts in the choice's text. A token's
    `text_offset` is where its character starts in that text (logprobs.character_starts), not the length of the
    names before it (a `bytes:\\x..` name is no text of the choice)."""
    tokens, token_logprobs, top_logprobs = [], [], []
    for entry in entries:
        tokens.append(texts.text(entry.token_id))
        token_logprobs.append(shown_logprob(entry.logprob))
        top_logprobs.append(
            None if entry.logprob is None else {texts.text(t): shown_logprob(lp) for t, lp in entry.top}
        )
    starts = character_starts([bytes(texts.bytes(entry.token_id)) for entry in entries])
    text_offset = [offset + start for start in starts]
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def chat_logprobs(entries: list[TokenLogprob], texts, top: int) -> dict:
    """OpenAI's chat `logprobs`: each token with its bytes and its `top` most likely alternatives; `texts`: a
    serve/logprobs.py TokenTexts."""

    def one(token_id: int, logprob: float) -> dict:
        return {"token": texts.text(token_id), "logprob": shown_logprob(logprob), "bytes": texts.bytes(token_id)}

    content = [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top[:top]]} for e in entries]
    return {"content": content, "refusal": None}


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict, reason: str | None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}],
    }


def usage_chunk(rid: str, model: str, created: int, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "tuneforge"}


def models_body(name: str, created: int) -> dict:
    return {"object": "list", "data": [model_card(name, created)]}


def now() -> int:
    return int(time.time())
