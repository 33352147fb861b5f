"""Tool calling through `tuneforge serve`: a real server (a `tuneforge serve` process) of a tiny random Llama whose
chat template renders tools (tests/fixtures/tool_chat.jinja, Hermes/Qwen-style), driven by the official `openai`
client: the tools, an assistant's tool_calls and role "tool" results rendered into the prompt (its token count is
that of transformers' own rendering), streaming with tools, refusals naming their field (a template without tools,
a tool_choice naming no tool, the deprecated functions API), and Hypothesis fuzzing of
tools/tool_choice/messages shapes (never a 5xx).

The tiny random model never writes a <tool_call>, so the reading of calls out of a reply is tested on the server's
own functions with crafted replies: the chat body (`openai_api.with_tool_calls`) and the stream
(`GenerationService.stream`, fed the engine's events), each read back by the `openai` client's own response types."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from conftest import serving
from test_serve_fuzz import FUZZ, JSON_VALUES, check, send
from test_serve_generate import NAME, app_server, save_chat_model, wait_ready
from test_tool_calls import MESSAGE, TOOLISH, WEATHER

QUESTION = [{"role": "user", "content": "weather in Paris?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    *QUESTION,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
REPLY = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'


@pytest.fixture(scope="module")
def url(tool_model):
    with serving(tool_model, served_model_name=NAME, max_batch_size=8) as url:
        yield url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def prompt_tokens(tool_model):
    """The number of tokens of transformers' own rendering of messages (as chat templates read them) and tools."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_model)

    def count(messages: list[dict], tools: list[dict] | None = None) -> int:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return count


def ask(client, **request):
    return client.chat.completions.create(model=NAME, max_tokens=2, temperature=0, **request)


# ---- rendering -----------------------------------------------------------------------------------------------
def test_tools_calls_and_results_are_rendered_into_the_prompt(client, prompt_tokens):
    plain = ask(client, messages=QUESTION)
    assert plain.usage.prompt_tokens == prompt_tokens(QUESTION)
    with_tools = ask(client, messages=QUESTION, tools=[WEATHER])
    assert with_tools.usage.prompt_tokens == prompt_tokens(QUESTION, [WEATHER]) > plain.usage.prompt_tokens + 50
    assert with_tools.choices[0].message.role == "assistant"
    # "none": the tools are still shown to the model (as vLLM does), only no call is read from its reply
    unread = ask(client, messages=QUESTION, tools=[WEATHER], tool_choice="none")
    assert unread.usage.prompt_tokens == with_tools.usage.prompt_tokens
    # an assistant's call and the tool's result: rendered as the template reads them (arguments as a dict, the
    # result named after its call), by transformers' own rendering
    answered = ask(client, messages=CONVERSATION, tools=[WEATHER], tool_choice="auto")
    as_read = [
        *QUESTION,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**CALL, "function": {**CALL["function"], "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "get_weather"},
    ]
    assert answered.usage.prompt_tokens == prompt_tokens(as_read, [WEATHER])
    assert prompt_tokens(as_read, [WEATHER]) > prompt_tokens(QUESTION, [WEATHER]) + 20
    # a tool result is accepted without tools in the request, and content given as text parts
    parts = [
        {**m, "content": [{"type": "text", "text": m["content"]}]} if m["role"] == "tool" else m for m in CONVERSATION
    ]
    assert ask(client, messages=parts).usage.prompt_tokens == prompt_tokens(as_read)


def test_a_streamed_answer_with_tools_is_the_answer_without_streaming(client):
    request = dict(messages=CONVERSATION, tools=[WEATHER], max_tokens=12, temperature=0)
    whole = client.chat.completions.create(model=NAME, **request)
    chunks = list(
        client.chat.completions.create(model=NAME, stream=True, stream_options={"include_usage": True}, **request)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert texts == [whole.choices[0].message.content]  # held back, then sent in one delta
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


# ---- reading calls out of replies ----------------------------------------------------------------------------
def test_a_reply_with_calls_becomes_tool_calls_in_the_chat_body():
    from tuneforge.serve import openai_api as oa

    use = oa.usage(10, 5)
    body = oa.chat_body("chatcmpl-1", NAME, 0, [(REPLY, "stop"), ("no call <tool_call>{oops", "length")], use)
    parsed = ChatCompletion.model_validate(oa.with_tool_calls(body, "hermes"))  # as the openai client reads it
    first, second = parsed.choices
    assert first.finish_reason == "tool_calls" and first.message.content == "Let me check."
    [call] = first.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert second.finish_reason == "length" and second.message.tool_calls is None
    assert second.message.content == "no call <tool_call>{oops"  # malformed: the text as the model wrote it


def test_a_reply_cut_by_max_tokens_keeps_finish_reason_length_with_its_calls():
    """OpenAI answers "length" for a reply max_tokens cut, calls or not, and vLLM's non-streaming path relabels
    only a reply that stopped: a client must not run a call list the cut may have left short."""
    from tuneforge.serve import openai_api as oa

    half = REPLY + '<tool_call>{"name": "get_weather", "argu'
    unclosed = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    replies = [(half, "length"), (unclosed, "length"), ('[{"name": "get_weather", "parameters": {}}]', "length")]
    body = oa.chat_body("chatcmpl-1", NAME, 0, replies[:2], oa.usage(10, 5))
    cut, closed_by_cut = ChatCompletion.model_validate(oa.with_tool_calls(body, "hermes")).choices
    assert cut.finish_reason == "length" and len(cut.message.tool_calls) == 1
    assert cut.message.content.endswith('<tool_call>{"name": "get_weather", "argu')  # the cut call, as written
    assert closed_by_cut.finish_reason == "length" and len(closed_by_cut.message.tool_calls) == 1
    required = oa.chat_body("chatcmpl-1", NAME, 0, replies[2:], oa.usage(10, 5))
    [choice] = ChatCompletion.model_validate(oa.with_tool_calls(required, "hermes", "required")).choices
    assert choice.finish_reason == "length" and len(choice.message.tool_calls) == 1


def test_parallel_tool_calls_false_keeps_a_replys_first_call_only():
    """OpenAI: "exactly zero or one tool is called"; vLLM keeps the first of the calls the model wrote."""
    from tuneforge.serve import openai_api as oa

    second = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    body = oa.chat_body("chatcmpl-1", NAME, 0, [(REPLY + second, "stop")], oa.usage(10, 5))
    parsed = ChatCompletion.model_validate(oa.with_tool_calls(body, "hermes", parallel=False))
    [call] = parsed.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"} and parsed.choices[0].finish_reason == "tool_calls"
    request = oa.ChatRequest.model_validate({"model": NAME, "messages": QUESTION, "parallel_tool_calls": False})
    assert request.parallel_calls() is False and oa.ChatRequest(model=NAME, messages=[]).parallel_calls() is True


def run_stream(
    tool_model: str, pieces: list[str], take: int | None = None, reason: str = "stop"
) -> tuple[list[str], list[bool]]:
    """The server's own stream (GenerationService.stream) of a 2-choice chat with tools, fed the events the engine
    sends (choice i % 2 writes pieces[i], then both end with `reason`); the events it wrote, and whether each
    sequence was cancelled (a client gone: the stream is closed after `take` events)."""
    from tuneforge.predict import load_servable
    from tuneforge.serve.engine import SamplingParams
    from tuneforge.serve.generation import Generation, GenerationService, Shape

    service = GenerationService(load_servable(tool_model), engine=None, name=NAME, request_timeout_s=30)

    async def collect():
        gen = Generation([[1, 2]], [SamplingParams(max_tokens=64)], n=2, eos_logprob=False)
        for i, piece in enumerate(pieces):
            gen.events.put_nowait((i % 2, piece, None, []))
        for i in (0, 1):
            gen.events.put_nowait((i, "", reason, []))
        out, stream = (
            [],
            service.stream(gen, Shape(chat=True, tool_family="hermes"), "c", 0, time.monotonic() + 30, True),
        )
        async for sent in stream:
            out.append(sent)
            if take is not None and len(out) == take:
                await stream.aclose()
                break
        return out, [seq.cancelled for seq in gen.seqs]

    return asyncio.run(collect())


def test_a_streamed_reply_with_calls_becomes_one_tool_calls_delta(tool_model):
    # choice 0 writes REPLY, choice 1 plain text, in pieces that cut the markers apart
    pieces = []
    for k in range(0, len(REPLY), 7):
        pieces += [REPLY[k : k + 7], "plain " if k < 14 else ""]
    out, _ = run_stream(tool_model, pieces)
    assert out[-1] == "data: [DONE]\n\n"
    chunks = [ChatCompletionChunk.model_validate(json.loads(e[len("data: ") :])) for e in out[:-1]]
    deltas = {i: [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == i] for i in (0, 1)}
    reasons = {
        c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    }
    assert reasons == {0: "tool_calls", 1: "stop"}
    assert [d.content for d in deltas[0]] == ["", "Let me check.", None]  # role, the held text, the finish
    [call] = deltas[0][1].tool_calls
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert [d.content for d in deltas[1]] == ["", "plain plain ", None] and deltas[1][1].tool_calls is None
    cut, _ = run_stream(tool_model, pieces, reason="length")  # max_tokens ended it: "length", as unstreamed
    finishes = [json.loads(e[len("data: ") :])["choices"] for e in cut[:-1]]
    assert [c[0]["finish_reason"] for c in finishes if c and c[0]["finish_reason"]] == ["length", "length"]
    assert chunks[-1].usage is not None  # the usage chunk follows
    # a client gone mid-stream: the generation's sequences are cancelled at once
    _, cancelled = run_stream(tool_model, pieces, take=1)
    assert cancelled == [True, True]


# ---- refusals ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_url(tmp_path_factory, tiny_llama):
    with app_server(save_chat_model(tmp_path_factory.mktemp("serve-plain") / "model", tiny_llama)) as url:
        wait_ready(url)
        yield url


def chat(**changes) -> dict:
    return {"model": NAME, "messages": QUESTION, "max_tokens": 2, **changes}


def test_a_template_without_tools_gets_a_400_saying_so(plain_url):
    for body, param in [
        (chat(tools=[WEATHER]), "tools"),
        (chat(messages=CONVERSATION), "messages[1]"),
        (chat(messages=[*QUESTION, CONVERSATION[2]]), "messages[1]"),
    ]:
        r = send(plain_url, "POST", "/v1/chat/completions", body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "chat template does not render tools" in error["message"], error
    assert send(plain_url, "POST", "/v1/chat/completions", chat(tool_choice="none")).status_code == 200


def counting_probes(tool_model: str, probes: list[str]):
    """What the server loads for `tool_model`, its tokenizer's apply_chat_template and get_chat_template wrapped to
    append their name to `probes` whenever they are given tool_calls' probe tool (the wrapper is no part of what is
    tested: the renders still are the tokenizer's own)."""
    from tuneforge import tool_calls
    from tuneforge.predict import load_servable

    def load():
        served = load_servable(tool_model)
        tokenizer = served.tokenizer
        for name in ("apply_chat_template", "get_chat_template"):

            def counted(*args, _render=getattr(tokenizer, name), _name=name, **kwargs):
                if [tool_calls.PROBE_TOOL] in (*args, *kwargs.values()):
                    probes.append(_name)
                return _render(*args, **kwargs)

            setattr(tokenizer, name, counted)
        return served

    return load


def test_the_template_is_probed_for_tools_once_not_per_request(tool_model):
    probes: list[str] = []
    with app_server(tool_model, load=counting_probes(tool_model, probes)) as url:
        wait_ready(url)
        first = send(url, "POST", "/v1/chat/completions", chat(tools=[WEATHER], tool_choice="auto"))
        assert first.status_code == 200, first.text
        after_first = list(probes)
        for body in (chat(tools=[WEATHER], tool_choice="auto"), chat(messages=CONVERSATION, tools=[WEATHER])):
            r = send(url, "POST", "/v1/chat/completions", body)
            assert r.status_code == 200, r.text
    # the first request with tools probed (whether the template renders tools, and which parser its replies
    # need); the later ones read what it found
    assert after_first.count("apply_chat_template") == 1 and "get_chat_template" in after_first, after_first
    assert probes == after_first


def test_a_requests_tools_are_checked_once_and_refused_alike_each_time():
    from tuneforge.serve import openai_api as oa

    body = oa.ChatRequest.model_validate(chat(tools=[WEATHER], tool_choice="required"))
    tools = body.tool_specs()
    assert tools == [WEATHER] and body.tool_specs() is tools  # the checked tools, kept: not checked again
    assert body.parses_tool_calls() and body.forced_tool_choice() == "required"
    assert body.structured()["json_schema"]["schema"]["items"]["anyOf"][0]["properties"]["name"]["enum"] == [
        WEATHER["function"]["name"]
    ]
    bad = oa.ChatRequest.model_validate(chat(tools=[{"type": "function", "function": {"name": "get weather"}}]))
    refusals = []
    for ask_for in (bad.tool_specs, bad.parses_tool_calls, bad.structured):
        with pytest.raises(oa.ApiError) as refused:
            ask_for()
        refusals.append((refused.value.status, refused.value.param, refused.value.message))
    assert refusals == [refusals[0]] * 3 and refusals[0][:2] == (400, "tools[0].function.name"), refusals


NAMED = {"type": "function", "function": {"name": "get_weather"}}
# a tool whose arguments the grammar cannot enforce (an unknown type): refused once a tool_choice forces a call
ODD = {
    "type": "function",
    "function": {"name": "odd", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}},
}
BAD = [
    (
        "a forced tool whose arguments cannot be enforced",
        chat(tools=[WEATHER, ODD], tool_choice={"type": "function", "function": {"name": "odd"}}),
        "tools[1].function.parameters",
        "tools[1].function.parameters cannot be enforced: Invalid type: strin",
    ),
    (
        "required with a tool whose arguments cannot be enforced",
        chat(tools=[WEATHER, ODD], tool_choice="required"),
        "tools[1].function.parameters",
        "tools[1].function.parameters cannot be enforced: Invalid type: strin",
    ),
    (
        "an unknown name",
        chat(tools=[WEATHER], tool_choice={**NAMED, "function": {"name": "f"}}),
        "tool_choice.function.name",
        "get_weather",
    ),
    ("tool_choice without tools", chat(tool_choice="auto"), "tool_choice", "only allowed with tools"),
    ("functions", chat(functions=[WEATHER["function"]]), "functions", "send tools"),
    ("function_call", chat(function_call="auto"), "function_call", "send tools"),
    (
        "a function message",
        chat(messages=[*QUESTION, {"role": "function", "name": "f", "content": "1"}]),
        "messages[1].role",
        "role 'tool'",
    ),
    (
        "a tool result without its call's id",
        chat(messages=[*QUESTION, {"role": "tool", "content": "1"}]),
        "messages[1]",
        "tool_call_id is required",
    ),
    (
        "tool_calls on a user",
        chat(messages=[{**QUESTION[0], "tool_calls": [CALL]}]),
        "messages[0].tool_calls",
        "assistant messages only",
    ),
    (
        "tool_call_id on a user",
        chat(messages=[{**QUESTION[0], "tool_call_id": "c"}]),
        "messages[0].tool_call_id",
        "tool messages only",
    ),
    (
        "arguments that are no JSON",
        chat(
            messages=[
                *QUESTION,
                {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{x"}}]},
            ]
        ),
        "messages[1].tool_calls[0].function.arguments",
        "not valid JSON",
    ),
    ("tools not a list", chat(tools={"type": "function"}), "tools", "must be a list"),
    (
        "a bad function name",
        chat(tools=[{"type": "function", "function": {"name": "get weather"}}]),
        "tools[0].function.name",
        "letters",
    ),
    (
        "a tool result in an image",
        chat(messages=[*QUESTION, {"role": "tool", "tool_call_id": "c", "content": [{"type": "image_url"}]}]),
        "messages[1]",
        "text parts only",
    ),
]


@pytest.mark.parametrize("what, body, param, words", BAD, ids=[b[0] for b in BAD])
def test_bad_tool_requests_get_a_400_naming_the_field(url, what, body, param, words):
    r = send(url, "POST", "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


# ---- fuzz ----------------------------------------------------------------------------------------------------
ARGUMENTS = st.dictionaries(st.text(max_size=6), st.integers() | st.text(max_size=6), max_size=3).map(json.dumps)
VALID_CALL = st.fixed_dictionaries(
    {
        "id": st.text(min_size=1, max_size=8),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.from_regex(r"[a-z_]{1,8}", fullmatch=True), "arguments": ARGUMENTS | st.text(max_size=8)}
        ),
    }
)
VALIDISH_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]), "content": st.text(max_size=12)}),
    st.fixed_dictionaries(
        {"role": st.just("assistant")},
        optional={"content": st.none() | st.text(max_size=12), "tool_calls": st.lists(VALID_CALL, max_size=2)},
    ),
    st.fixed_dictionaries(
        {"role": st.just("tool"), "content": st.text(max_size=12)}, optional={"tool_call_id": st.text(max_size=8)}
    ),
)
MESSAGES = st.one_of(
    st.sampled_from([QUESTION, CONVERSATION]),
    st.lists(VALIDISH_MESSAGE, min_size=1, max_size=4).map(lambda msgs: [*QUESTION, *msgs]),
    st.lists(MESSAGE, min_size=1, max_size=3),  # tests/test_tool_calls.py's: any JSON in each field
    JSON_VALUES,
)
BODIES = st.fixed_dictionaries(
    {"model": st.just(NAME), "max_tokens": st.just(1), "messages": MESSAGES},
    optional={
        "tools": st.just([WEATHER]) | st.lists(TOOLISH, max_size=3) | JSON_VALUES,
        "tool_choice": st.sampled_from(["none", "auto", "required", NAMED]) | JSON_VALUES,
        "stream": st.booleans(),
    },
)


@settings(FUZZ, max_examples=120)
@given(body=BODIES)
def test_any_tools_tool_choice_and_tool_messages_never_get_a_5xx(url, body):
    r = send(url, "POST", "/v1/chat/completions", body)
    check(r)
    event(f"{r.status_code} {(r.json()['error']['param'] or '')[:12] if r.status_code >= 400 else ''}")
