"""tuneforge/tool_calls.py: checking `tools` and `tool_choice`, OpenAI messages turned into what chat templates read,
whether a real tokenizer's template renders tools, and the parsers of each template family on crafted replies
(a tiny random model never writes a call), fuzzed with Hypothesis: malformed input is content or a ToolSpecError
naming its field, never another exception.

Also the shared helpers of the tool-calling tests (tests/tasks/test_task_sft_tools.py, tests/serve/test_serve_tools.py):
TOOL_TEMPLATE, a compact Hermes/Qwen-style template (tests/fixtures/tool_chat.jinja, written after the layout of
Qwen2.5-Instruct's own: tools as JSON, calls in <tool_call>, results in <tool_response>), and `save_tool_model`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tuneforge import tool_calls as tc

TOOL_TEMPLATE = (Path(__file__).parent / "fixtures" / "tool_chat.jinja").read_text()
PLAIN_TEMPLATE = (  # the serve and sft tests' template: no tools
    "{% for m in messages %}{{ m['role'][0] }}>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a>\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_ID = re.compile(r"call_[0-9a-f]{24}")
FUZZ = settings(deadline=None, derandomize=True, database=None, max_examples=300)


def save_tool_model(out: Path, tiny_llama: str, template: str = TOOL_TEMPLATE, context: int = 1024) -> str:
    """`tiny_llama` with `template` as its chat template and room for tools in its prompts (`context` positions:
    rotary, so the random weights do not change), marked as exported by `--task sft`."""
    from transformers import AutoTokenizer

    shutil.copytree(tiny_llama, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    (out / "tuneforge.json").write_text(json.dumps({"task": "sft"}))
    return str(out)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = TOOL_TEMPLATE
    return tok


def with_template(tokenizer, template):
    from copy import deepcopy

    tok = deepcopy(tokenizer)
    tok.chat_template = template
    return tok


# ---- the template ------------------------------------------------------------------------------------------
def test_supports_tools_is_true_only_for_a_template_that_renders_them(tokenizer):
    assert tc.supports_tools(tokenizer)
    assert not tc.supports_tools(with_template(tokenizer, PLAIN_TEMPLATE))
    assert not tc.supports_tools(with_template(tokenizer, None))
    refusing = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}{{ messages[0]['content'] }}"
    assert not tc.supports_tools(with_template(tokenizer, refusing))
    # a template whose tools block lies in a "tool_use" template of several (as Hermes 2 Pro ships them)
    named = {"default": PLAIN_TEMPLATE, "tool_use": TOOL_TEMPLATE}
    assert tc.supports_tools(with_template(tokenizer, named))


@pytest.mark.parametrize(
    "marker, family",
    [
        ("<tool_call>{{ x }}</tool_call>", "hermes"),
        ("[TOOL_CALLS] {{ x }}", "mistral"),
        ("<|python_tag|>{{ x }}", "llama3_json"),
        ('<|start_header_id|>ipython<|end_header_id|>{"name": x, "parameters": y}', "llama3_json"),
        ("{{ tools | tojson }}", "hermes"),  # nothing to tell by: the most common convention
    ],
)
def test_the_family_is_told_from_the_template(tokenizer, marker, family):
    assert tc.template_family(with_template(tokenizer, marker)) == family


def test_a_conversation_with_calls_and_results_renders_through_the_template(tokenizer):
    messages = tc.to_template_messages(
        [
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    )
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    }
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"}
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert text == (
        f"s>\n<tools>{json.dumps(WEATHER)}</tools>\nu>\nweather in Paris?\na>\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        "t>\n<tool_response>sunny</tool_response>\na>\n"
    )
    # what the template wrote is what the parser reads back
    call_text = text.split("a>\n")[1].split("t>")[0]
    content, calls = tc.parse_tool_calls(call_text, "hermes")
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


# ---- tools and tool_choice ----------------------------------------------------------------------------------
def test_good_tools_are_kept_with_openai_keys_only():
    bare = {"type": "function", "function": {"name": "now"}}
    assert tc.check_tools([WEATHER, bare]) == [WEATHER, bare]
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True, "description": None}}
    kept = tc.check_tools([strict])[0]["function"]
    assert kept == {"name": "get_weather", "parameters": WEATHER["function"]["parameters"], "strict": True}
    assert tc.check_tools(None) is None and tc.check_tools([]) is None


def fn(**function) -> dict:
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    "tools, field, words",
    [
        ({"type": "function"}, "tools", "must be a list"),
        ([WEATHER] * 2, "tools[1].function.name", "is also tools[0]"),
        ([{"function": WEATHER["function"]}], "tools[0]", "type 'function'"),
        ([{**WEATHER, "extra": 1}], "tools[0]", "unknown keys 'extra'"),
        ([fn(name="has space")], "tools[0].function.name", "1 to 64 letters"),
        ([fn(name="x" * 65)], "tools[0].function.name", "1 to 64"),
        ([fn(name=5)], "tools[0].function.name", "1 to 64"),
        ([fn(name="f", description=3)], "tools[0].function.description", "must be a string"),
        ([fn(name="f", strict="yes")], "tools[0].function.strict", "true or false"),
        ([fn(name="f", parameters="{}")], "tools[0].function.parameters", "JSON Schema object"),
        ([fn(name="f", parameters={"type": "string"})], "tools[0].function.parameters.type", "must be 'object'"),
        ([fn(name="f", parameters={"properties": []})], "tools[0].function.parameters.properties", "JSON Schema"),
        ([fn(name="f", parameters={"required": "city"})], "tools[0].function.parameters.required", "argument names"),
        ([fn(name="f", parameters=json.loads("[" * 40 + "]" * 40))], "tools[0].function.parameters", "JSON Schema"),
        (
            [fn(name="f", parameters={"a": json.loads('{"b":' * 40 + "1" + "}" * 40)})],
            "tools[0].function.parameters",
            "deeper",
        ),
        ([fn(name="f", nonsense=1)], "tools[0].function", "unknown keys 'nonsense'"),
        ([fn(name=f"f{i}") for i in range(129)], "tools", "at most 128"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(tools, field, words):
    with pytest.raises(tc.ToolsError) as err:
        tc.check_tools(tools)
    assert err.value.field == field and str(err.value).startswith(field) and words in str(err.value)


@pytest.mark.parametrize(
    "choice, tools, field, words",
    [
        ("auto", None, "tool_choice", "only allowed with tools"),
        ("required", None, "tool_choice", "only allowed with tools"),
        ("sometimes", [WEATHER], "tool_choice", "'none', 'auto', 'required'"),
        ({"type": "function"}, [WEATHER], "tool_choice", "named function"),
        ({"type": "function", "function": {"name": "nope"}}, [WEATHER], "tool_choice.function.name", "get_weather"),
        (["auto"], [WEATHER], "tool_choice", "named function"),
        (7, [WEATHER], "tool_choice", "named function"),
    ],
)
def test_bad_tool_choices_are_refused_naming_the_field(choice, tools, field, words):
    with pytest.raises(tc.ToolChoiceError) as err:
        tc.check_tool_choice(choice, tools)
    assert err.value.field == field and words in str(err.value)


def test_good_tool_choices():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert [tc.check_tool_choice(c, [WEATHER]) for c in (None, "none", "auto", "required", named)] == [
        None,
        "none",
        "auto",
        "required",
        named,
    ]
    assert tc.check_tool_choice("none", None) == "none"


@pytest.mark.parametrize(
    "message, field, words",
    [
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
            ".function.arguments",
            "not valid JSON",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
            ".function.arguments",
            "JSON object",
        ),
        ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, ".function.name", "function's name"),
        ({"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}, "[0]", "type"),
        ({"role": "assistant", "tool_calls": ["f()"]}, "[0]", '"function"'),
        ({"role": "assistant", "tool_calls": [{"id": 3, "function": {"name": "f"}}]}, ".id", "string"),
        ({"role": "assistant", "tool_calls": {"function": {"name": "f"}}}, "messages[0].tool_calls", "a list"),
        ({"role": "user", "tool_calls": [{"function": {"name": "f"}}]}, "messages[0].tool_calls", "assistant"),
        ({"role": "tool", "content": "x", "tool_call_id": 5}, "messages[0].tool_call_id", "string"),
    ],
)
def test_bad_tool_messages_are_refused_naming_the_field(message, field, words):
    with pytest.raises(tc.ToolMessageError) as err:
        tc.to_template_messages([message])
    assert err.value.field.startswith("messages[0]") and err.value.field.endswith(field) and words in str(err.value)


# ---- the parsers ------------------------------------------------------------------------------------------
def call(name: str, arguments: dict, key: str = "arguments") -> str:
    return json.dumps({"name": name, key: arguments})


def named(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_calls_with_text_before_and_between():
    text = f"Let me look.\n<tool_call>\n{call('get_weather', {'city': 'Paris'})}\n</tool_call>\n"
    text += f"<tool_call>{call('get_weather', {'city': 'Köln'})}</tool_call>"
    content, calls = tc.parse_tool_calls(text, "hermes")
    assert content == "Let me look."
    assert named(calls) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Köln"})]
    assert all(CALL_ID.fullmatch(c.id) for c in calls) and calls[0].id != calls[1].id
    assert calls[1].arguments == '{"city": "Köln"}'  # JSON text, as OpenAI sends arguments
    assert calls[0].openai() == {
        "id": calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("just text, <b>no</b> calls  \n", "just text, <b>no</b> calls  \n", []),  # untouched, whitespace too
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
        (
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            [],
        ),
        # a malformed call stays as content beside a good one
        (
            '<tool_call>{bad</tool_call>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>',
            "<tool_call>{bad</tool_call>",
            [("f", {})],
        ),
        # cut off before its closing tag (a stop string, the end of the tokens)
        ('Sure <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', "Sure", [("f", {"a": 1})]),
        # arguments written as a JSON string; no arguments at all; Hermes-style "parameters"
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>', None, [("f", {"a": 2})]),
        ('<tool_call>{"name": "f"}</tool_call>', None, [("f", {})]),
        ('<tool_call>{"name": "f", "parameters": {"b": true}}</tool_call>', None, [("f", {"b": True})]),
        ("<tool_call></tool_call>", "<tool_call></tool_call>", []),
        ("", "", []),
    ],
)
def test_hermes_replies(text, content, calls):
    got_content, got_calls = tc.parse_tool_calls(text, "hermes")
    assert (got_content, named(got_calls)) == (content, calls)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (call("f", {"x": 1}, "parameters"), None, [("f", {"x": 1})]),
        (
            f"<|python_tag|>{call('f', {}, 'parameters')}; {call('g', {'y': 'z'}, 'parameters')}",
            None,
            [("f", {}), ("g", {"y": "z"})],
        ),
        (call("f", {"x": 1}), None, [("f", {"x": 1})]),  # "arguments" too
        ("Hello {there}", "Hello {there}", []),
        (
            f"{call('f', {}, 'parameters')} and then some words",
            f"{call('f', {}, 'parameters')} and then some words",
            [],
        ),
        ('{"name": "f", "parameters": ', '{"name": "f", "parameters": ', []),
        ('{"not": "a call"}', '{"not": "a call"}', []),
    ],
)
def test_llama3_json_replies(text, content, calls):
    got_content, got_calls = tc.parse_tool_calls(text, "llama3_json")
    assert (got_content, named(got_calls)) == (content, calls)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (f"[TOOL_CALLS] [{call('f', {'a': 1})}, {call('g', {})}]", None, [("f", {"a": 1}), ("g", {})]),
        (f"Sure.[TOOL_CALLS][{call('f', {})}]", "Sure.", [("f", {})]),
        (f"[{call('f', {'a': 1})}]", None, [("f", {"a": 1})]),  # the marker dropped by the detokenizer
        ('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', None, [("f", {"a": 1}), ("g", {})]),
        ("[TOOL_CALLS] [{broken", "[TOOL_CALLS] [{broken", []),
        ("[TOOL_CALLS]f[ARGS]{broken", "[TOOL_CALLS]f[ARGS]{broken", []),
        ("[1, 2, 3]", "[1, 2, 3]", []),
        ("[citation needed]", "[citation needed]", []),
    ],
)
def test_mistral_replies(text, content, calls):
    got_content, got_calls = tc.parse_tool_calls(text, "mistral")
    assert (got_content, named(got_calls)) == (content, calls)
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in got_calls)  # Mistral's templates take no other


def test_an_unknown_family_is_refused():
    with pytest.raises(ValueError, match="unknown tool-call family 'yaml'"):
        tc.parse_tool_calls("x", "yaml")


def test_forced_calls_follow_vllms_schema():
    weather_args = WEATHER["function"]["parameters"]
    schema = tc.forced_schema([WEATHER], "required")
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"] == {
        "name": {"type": "string", "enum": ["get_weather"]},
        "parameters": weather_args,
    }
    named_choice = {"type": "function", "function": {"name": "get_weather"}}
    assert tc.forced_schema([WEATHER], named_choice) == weather_args
    reply = json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo"}}])
    assert named(tc.forced_calls(reply, "required")) == [("get_weather", {"city": "Oslo"})]
    assert named(tc.forced_calls('{"city": "Oslo"}', named_choice)) == [("get_weather", {"city": "Oslo"})]
    assert tc.forced_calls('[{"name": "get_weather", "parame', "required") == []  # cut by max_tokens


# ---- fuzz: never an exception other than the field-naming ones ----------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
TOOLISH = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "code"]) | JSON},
    optional={
        "function": st.fixed_dictionaries(
            {},
            optional={
                "name": st.from_regex(r"[a-z_]{1,8}", fullmatch=True) | JSON,
                "description": JSON,
                "parameters": st.fixed_dictionaries({}, optional={"type": JSON, "properties": JSON, "required": JSON})
                | JSON,
                "strict": JSON,
            },
        )
        | JSON
    },
)


@FUZZ
@given(tools=st.lists(TOOLISH, max_size=4) | JSON, choice=JSON | st.sampled_from(["auto", "required", "none"]))
def test_any_tools_and_tool_choice_are_checked_or_refused_by_field(tools, choice):
    try:
        checked = tc.check_tools(tools)
        tc.check_tool_choice(choice, checked)
    except tc.ToolSpecError as err:
        assert str(err).startswith(err.field) and err.field.startswith(("tools", "tool_choice"))


MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "system"])},
    optional={
        "content": JSON,
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "id": JSON,
                    "type": JSON,
                    "function": st.fixed_dictionaries(
                        {}, optional={"name": JSON, "arguments": JSON | JSON.map(json.dumps)}
                    )
                    | JSON,
                },
            ),
            max_size=3,
        )
        | JSON,
        "tool_call_id": JSON,
    },
)


@FUZZ
@given(messages=st.lists(MESSAGE, max_size=4))
def test_any_messages_convert_or_are_refused_by_field(messages):
    try:
        converted = tc.to_template_messages(messages)
    except tc.ToolMessageError as err:
        assert err.field.startswith("messages[")
        return
    for m in converted:
        for c in m.get("tool_calls", []):
            assert isinstance(c["function"]["arguments"], dict)


@settings(
    deadline=None, derandomize=True, database=None, max_examples=500, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    text=st.text(max_size=60)
    | st.lists(
        st.sampled_from(["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", ";", " ", "x"])
        | JSON.map(json.dumps)
        | st.just(call("f", {"a": 1})),
        max_size=8,
    ).map("".join),
    family=st.sampled_from(tc.FAMILIES),
)
def test_any_reply_parses_to_text_or_calls(text, family):
    content, calls = tc.parse_tool_calls(text, family)
    if not calls:
        assert content == text
    for c in calls:
        assert c.name and isinstance(json.loads(c.arguments), dict)
