"""Structured output through `tuneforge serve` (serve/constrained.py in the continuous batch): `response_format`
json_object and json_schema, and tool_choice "required" or a named function (the call constrained by the tools'
schema, as vLLM does), asked of a tiny RANDOM model by the official `openai` client. A random model writes no JSON
by itself: every reply that parses and validates is the grammar's doing."""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import openai
import pytest

from test_serve_generate import NAME, app_server, wait_ready
from test_tool_calls import WEATHER

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["color", "count", "ok", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
MODE = {
    "type": "function",
    "function": {
        "name": "set_mode",
        "parameters": {
            "type": "object",
            "properties": {"mode": {"enum": ["on", "off"]}, "level": {"type": "integer", "minimum": 1, "maximum": 3}},
            "required": ["mode", "level"],
            "additionalProperties": False,
        },
    },
}
FAN = {
    "type": "function",
    "function": {
        "name": "set_fan",
        "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]},
    },
}
ASK = [{"role": "user", "content": "describe a thing"}]


@pytest.fixture(scope="module")
def url(tool_model):
    with app_server(tool_model, max_batch_size=8) as url:
        wait_ready(url)
        yield url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_json_schema_replies_parse_and_validate_greedy_and_sampled_in_one_batch(client):
    """Eight requests at once (one batch): greedy, sampled with seeds, n=2, and a plain one beside them."""
    answers: dict[int, object] = {}

    def ask(i: int) -> None:
        extra = dict(temperature=0) if i == 0 else dict(temperature=1.0, seed=i)
        if i == 7:
            answers[i] = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=8, temperature=0)
            return
        answers[i] = client.chat.completions.create(
            model=NAME, messages=ASK, max_tokens=80, response_format=JSON_SCHEMA, n=2 if i == 1 else 1, **extra
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(answers) == 8
    replies = [c for i in range(7) for c in answers[i].choices]
    for choice in replies:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert len({c.message.content for c in replies}) > 1  # seeded draws differ: the grammar allows, it does not pick
    plain = answers[7].choices[0].message.content
    with pytest.raises(json.JSONDecodeError):  # beside them, an unconstrained row of the same batch writes no JSON
        json.loads(plain)


def test_json_object_and_streaming(client):
    stream = client.chat.completions.create(
        model=NAME,
        messages=ASK,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
        stream=True,
        extra_body={"min_p": 0.2},  # a random model's long strings end sooner among its likelier tokens
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    if reasons == ["stop"]:
        assert isinstance(json.loads(text), dict)
    else:  # max_tokens came first: a JSON prefix, as OpenAI answers then
        assert reasons == ["length"] and text.startswith("{")


def test_a_reply_cut_by_max_tokens_is_an_unfinished_json_prefix(client):
    cut = client.chat.completions.create(
        model=NAME, messages=ASK, max_tokens=3, temperature=0, response_format=JSON_SCHEMA
    )
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


def test_tool_choice_required_and_named_make_a_call_that_validates(tool_model, client):
    from transformers import AutoTokenizer

    # greedy, a random model adds call after call to the array: a bias towards "]" closes it once the grammar lets it
    close = AutoTokenizer.from_pretrained(tool_model).convert_tokens_to_ids("]")
    required = client.chat.completions.create(
        model=NAME,
        messages=ASK,
        max_tokens=120,
        temperature=0,
        tools=[MODE, FAN],
        tool_choice="required",
        logit_bias={str(close): 100},
    )
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls and all(
        c.function.name in ("set_mode", "set_fan") for c in choice.message.tool_calls
    )
    forced = dict(
        model=NAME,
        messages=ASK,
        max_tokens=60,
        temperature=0,
        tools=[WEATHER, MODE],
        tool_choice={"type": "function", "function": {"name": "set_mode"}},
    )
    named = client.chat.completions.create(**forced)
    [call] = named.choices[0].message.tool_calls
    # "stop", not "tool_calls", for a named function, as OpenAI answers it (streamed or not; vLLM PR #25054)
    assert named.choices[0].finish_reason == "stop" and call.function.name == "set_mode"
    jsonschema.validate(json.loads(call.function.arguments), MODE["function"]["parameters"])
    chunks = [c for c in client.chat.completions.create(**forced, stream=True) if c.choices]
    calls = [t for c in chunks if c.choices[0].delta.tool_calls for t in c.choices[0].delta.tool_calls]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("set_mode", json.loads(call.function.arguments))
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_parallel_tool_calls_false_ends_a_required_reply_after_its_first_call(client):
    """OpenAI: parallel_tool_calls false "ensures exactly zero or one tool is called". Greedy, the random model
    would add call after call until max_tokens cut the array (no call at all); here the array holds one."""
    request = dict(model=NAME, messages=ASK, max_tokens=120, temperature=0, tools=[MODE, FAN], tool_choice="required")
    one = client.chat.completions.create(**request, parallel_tool_calls=False)
    choice = one.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert one.usage.completion_tokens < 120
    [call] = choice.message.tool_calls
    if call.function.name == "set_mode":
        jsonschema.validate(json.loads(call.function.arguments), MODE["function"]["parameters"])
    streamed = client.chat.completions.create(**request, parallel_tool_calls=False, stream=True)
    calls = [t for c in streamed if c.choices and c.choices[0].delta.tool_calls for t in c.choices[0].delta.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in calls] == [(call.function.name, call.function.arguments)]


BAD = [
    ("not an object", "json", "response_format"),
    ("unknown type", {"type": "yaml"}, "response_format"),
    ("json_schema without a schema", {"type": "json_schema"}, "response_format"),
    (
        "a schema that is no schema",
        {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}},
        "response_format",
    ),
    (
        "10,000 levels deep",
        '{"type": "json_schema", "json_schema": {"name": "x", "schema": '
        + '{"items": ' * 10_000
        + "{}"
        + "}" * 10_000
        + "}}",
        None,  # refused before it reaches the grammar: by the body's own nesting, or by the schema's depth
    ),
    (
        "a huge enum",
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [str(i) for i in range(100_000)]}}},
        None,
    ),
]


@pytest.mark.parametrize("what, response_format, param", BAD, ids=[b[0] for b in BAD])
def test_bad_response_formats_are_refused_fast_and_the_server_goes_on(url, client, what, response_format, param):
    body = {"model": NAME, "messages": ASK, "max_tokens": 4, "response_format": "FORMAT"}
    raw = (
        response_format
        if isinstance(response_format, str) and response_format != "json"
        else json.dumps(response_format)
    )
    content = json.dumps(body).replace('"FORMAT"', raw)  # a body too deep for json.dumps is written as text
    headers = {"Content-Type": "application/json"}
    r = httpx.post(f"{url}/v1/chat/completions", content=content, headers=headers, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.text
    ok = client.chat.completions.create(
        model=NAME, messages=ASK, max_tokens=40, temperature=0, response_format=JSON_SCHEMA
    )
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_a_forced_call_refuses_a_response_format_beside_it(url):
    body = {
        "model": NAME,
        "messages": ASK,
        "tools": [MODE],
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_a_plain_text_request_does_not_import_the_grammar_library():
    """llguidance is loaded for a response_format only: a lent GPU machine lacking it answered plain chat with 500."""
    import subprocess
    import sys

    probe = (
        "import asyncio, sys\n"
        "from tuneforge.serve.generation import GenerationService\n"
        "assert asyncio.run(GenerationService.constraint(None, None)) is None\n"
        "print(sorted(m for m in sys.modules if m.startswith(('llguidance', 'tuneforge.serve.constrained'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
