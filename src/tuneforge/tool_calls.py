"""Tool calling (OpenAI's `tools`) through Hugging Face chat templates, shared by `--task sft` (data/chat.py) and
`tuneforge serve` (serve/): checking `tools` and `tool_choice`, turning OpenAI-shaped messages into what chat
templates read, whether a template renders tools at all, and parsing a model's reply back into tool calls.

- `check_tools` / `check_tool_choice`: OpenAI's shapes (`[{type: "function", function: {name, description?,
  parameters?, strict?}}]`; `"none" | "auto" | "required" | {type: "function", function: {name}}`); a bad one is a
  `ToolsError` / `ToolChoiceError` (ValueErrors) whose `field` and message name where it is (`tools[1].function.name`).
- `to_template_messages`: assistant messages' `tool_calls` with `arguments` as dicts (OpenAI sends a JSON string;
  transformers' chat templating guide, "Tool use", has templates read a dict, which they render with `tojson`), a
  `tool` message named after the call it answers; `ToolMessageError` names the message and field.
- `supports_tools`: the template renders a `tools=` list (a probe tool's name shows up in a rendered prompt).
- `template_family` + `parse_tool_calls`: a parser per template family, chosen from the template's text:
  `hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: Hermes 2 Pro, Qwen2.5/Qwen3 and most
  ChatML tool templates; also the fallback), `llama3_json` (Llama 3.1/3.2: `{"name": ..., "parameters": {...}}`,
  several joined by `;`, after `<|python_tag|>`) and `mistral` (`[TOOL_CALLS] [{"name": ..., "arguments": ...}]`,
  or `[TOOL_CALLS]name[ARGS]{...}` of newer tokenizers). A call whose JSON does not parse stays in the content as
  text (never an error): the reply is what the model wrote. A detokenizer that skips special tokens drops
  `[TOOL_CALLS]` and `<|python_tag|>`, so those parsers also take the bare JSON.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

FAMILIES = ("hermes", "llama3_json", "mistral")
MAX_TOOLS = 128  # as OpenAI allows
MAX_DEPTH = 32  # nesting of a tool's parameters (the template renders them recursively)
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
TOOL_KEYS, FUNCTION_KEYS = {"type", "function"}, {"name", "description", "parameters", "strict"}
PROBE_NAME = "tuneforge_probe_tool"
PROBE_TOOL = {
    "type": "function",
    "function": {"name": PROBE_NAME, "description": "probe", "parameters": {"type": "object", "properties": {}}},
}


class ToolSpecError(ValueError):
    """A bad tool definition, tool choice or tool message; `field` names where (a JSON path such as
    `tools[0].function.name`), and the message starts with it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field


class ToolsError(ToolSpecError):
    pass


class ToolChoiceError(ToolSpecError):
    pass


class ToolMessageError(ToolSpecError):
    pass


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: `arguments` is the JSON text of an object, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id(family: str = "hermes") -> str:
    """OpenAI's `call_` + 24 hex digits; Mistral's templates refuse anything but 9 letters or digits."""
    if family == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- checking tools and tool_choice ---------------------------------------------------------------------------
def _depth(value: Any, limit: int) -> int:
    """How deep lists and dicts nest in `value`, counted up to `limit + 1` (iteratively: no recursion to blow)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > limit:
                return depth
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _check_parameters(schema: Any, field: str) -> None:
    """A function's `parameters`: a JSON Schema of an object (its shape only: the keys OpenAI reads)."""
    if not isinstance(schema, dict):
        raise ToolsError(field, 'must be a JSON Schema object (a dict), e.g. {"type": "object", "properties": {}}')
    if _depth(schema, MAX_DEPTH) > MAX_DEPTH:
        raise ToolsError(field, f"nests deeper than {MAX_DEPTH} levels")
    if "type" in schema and schema["type"] != "object":
        raise ToolsError(f"{field}.type", f"must be 'object' (the arguments are an object), not {schema['type']!r:.40}")
    if "properties" in schema and not (
        isinstance(schema["properties"], dict) and all(isinstance(p, dict) for p in schema["properties"].values())
    ):
        raise ToolsError(f"{field}.properties", "must map each argument's name to its JSON Schema (a dict)")
    required = schema.get("required", [])
    if not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise ToolsError(f"{field}.required", "must be a list of argument names")


def _check_function(function: Any, field: str) -> dict:
    if not isinstance(function, dict):
        raise ToolsError(field, "must be an object with name, and optionally description, parameters and strict")
    if unknown := sorted(set(function) - FUNCTION_KEYS):
        raise ToolsError(field, f"has unknown keys {', '.join(ascii(k)[:40] for k in unknown[:5])}")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolsError(f"{field}.name", "must be 1 to 64 letters, digits, underscores or dashes")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise ToolsError(f"{field}.description", "must be a string")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise ToolsError(f"{field}.strict", "must be true or false")
    if function.get("parameters") is not None:
        _check_parameters(function["parameters"], f"{field}.parameters")
    return {k: v for k, v in function.items() if v is not None}


def check_tools(tools: Any, field: str = "tools") -> list[dict] | None:
    """`tools` checked (ToolsError naming the field otherwise) and copied with only OpenAI's keys; None (or an
    empty list) means no tools."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ToolsError(field, 'must be a list of {"type": "function", "function": {...}} objects')
    if len(tools) > MAX_TOOLS:
        raise ToolsError(field, f"has {len(tools)} tools; at most {MAX_TOOLS} are allowed")
    checked, seen = [], {}
    for i, tool in enumerate(tools):
        where = f"{field}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolsError(where, "must be an object with type 'function' and a function")
        if unknown := sorted(set(tool) - TOOL_KEYS):
            raise ToolsError(where, f"has unknown keys {', '.join(ascii(k)[:40] for k in unknown[:5])}")
        function = _check_function(tool.get("function"), f"{where}.function")
        if function["name"] in seen:
            raise ToolsError(
                f"{where}.function.name", f"{function['name']!r} is also {field}[{seen[function['name']]}]"
            )
        seen[function["name"]] = i
        checked.append({"type": "function", "function": function})
    return checked


def check_tool_choice(choice: Any, tools: list[dict] | None, field: str = "tool_choice") -> str | dict | None:
    """`tool_choice` checked against the (checked) tools: "none" and None always; "auto", "required" or a named
    function ({type: "function", function: {name}}) only with tools, the name one of theirs."""
    if choice is None or choice == "none":
        return choice
    if not tools:
        raise ToolChoiceError(field, "is only allowed with tools")
    if choice in ("auto", "required"):
        return choice
    if isinstance(choice, str):
        raise ToolChoiceError(field, f"must be 'none', 'auto', 'required' or a named function, not {choice!r:.40}")
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(function, dict)):
        raise ToolChoiceError(
            field,
            "must be 'none', 'auto', 'required' or a named function "
            '{"type": "function", "function": {"name": ...}}',
        )
    names = [t["function"]["name"] for t in tools]
    if function.get("name") not in names:
        raise ToolChoiceError(f"{field}.function.name", f"must name one of the tools ({', '.join(names[:10])})")
    return {"type": "function", "function": {"name": function["name"]}}


def forced_schema(tools: list[dict], choice: str | dict, parallel: bool = True) -> dict:
    """The JSON Schema a reply is constrained to when tool_choice forces a call, as vLLM constrains it: for
    "required", a non-empty array of {"name": a tool's name, "parameters": its arguments} (of one call only
    without `parallel`: parallel_tool_calls false, so the reply ends after its first call); for a named function,
    that function's arguments. `forced_calls` reads such a reply back."""
    if isinstance(choice, dict):
        tool = next(t for t in tools if t["function"]["name"] == choice["function"]["name"])
        return tool["function"].get("parameters") or {"type": "object"}
    any_of = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": any_of}}
    return schema if parallel else {**schema, "maxItems": 1}


def forced_calls(text: str, choice: str | dict, family: str = "hermes") -> list[ToolCall]:
    """The calls of a reply constrained by `forced_schema` (none where it does not parse: cut by max_tokens)."""
    value = _loads(text)
    if isinstance(choice, dict):
        if not isinstance(value, dict):
            return []
        return [ToolCall(new_call_id(family), choice["function"]["name"], json.dumps(value, ensure_ascii=False))]
    calls = [_call(item, family, ("parameters",)) for item in value] if isinstance(value, list) else []
    return [call for call in calls if call is not None]


# ---- messages for the template ----------------------------------------------------------------------------------
def _template_call(call: Any, field: str) -> dict:
    """One OpenAI tool call (`arguments` a JSON string, or already a dict as datasets hold them) for a template."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") not in ("function", None):
        raise ToolMessageError(field, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not name:
        raise ToolMessageError(f"{field}.function.name", "must be the called function's name")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as err:
            raise ToolMessageError(f"{field}.function.arguments", f"is not valid JSON ({err})") from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ToolMessageError(f"{field}.function.arguments", "must be a JSON object")
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise ToolMessageError(f"{field}.id", "must be a string")
        out["id"] = call["id"]
    return out


def to_template_messages(messages: list[dict], field: str = "messages") -> list[dict]:
    """OpenAI-shaped messages (dicts) as chat templates read them: {role, content} for each; an assistant's
    `tool_calls` with dict arguments (its content "" when it has none); a tool message's `tool_call_id` kept and,
    where it answers a call made earlier, the `name` of that call. ToolMessageError names the bad field."""
    out, names = [], {}
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        converted = {"role": role, "content": "" if content is None else content}
        calls = message.get("tool_calls")
        if calls is not None and calls != []:
            if role != "assistant":
                raise ToolMessageError(f"{field}[{i}].tool_calls", "belongs to assistant messages only")
            if not isinstance(calls, list):
                raise ToolMessageError(f"{field}[{i}].tool_calls", "must be a list of tool calls")
            converted["tool_calls"] = [_template_call(c, f"{field}[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
            names.update((c["id"], c["function"]["name"]) for c in converted["tool_calls"] if "id" in c)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise ToolMessageError(f"{field}[{i}].tool_call_id", "must be a string")
            if call_id is not None:
                converted["tool_call_id"] = call_id
            name = message.get("name") or names.get(call_id)
            if name:
                converted["name"] = name
        out.append(converted)
    return out


def uses_tools(messages: list[dict]) -> bool:
    """Whether a conversation holds tool calls or tool results."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


# ---- the template ----------------------------------------------------------------------------------------------
def supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a `tools=` list: a probe tool's name in the rendered prompt."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    probe = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(probe, tools=[PROBE_TOOL], tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that refuses tools (raise_exception) or fails on them renders none
        return False
    return isinstance(text, str) and PROBE_NAME in text


def template_family(tokenizer) -> str:
    """The parser a template's replies need, from the markers the template writes (`hermes` when none is known)."""
    try:
        text = tokenizer.get_chat_template(tools=[PROBE_TOOL])
    except Exception:  # no template, or several without a default: nothing to tell by
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or ('"parameters"' in text and "<|start_header_id|>" in text):
        return "llama3_json"
    return "hermes"


# ---- parsing replies -----------------------------------------------------------------------------------------
HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)  # the last one may be cut off by a stop


def _call(obj: Any, family: str, keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """A ToolCall from a decoded {"name": ..., "arguments" (or `keys`): {...}}; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = next((obj[k] for k in keys if k in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(family), obj["name"], json.dumps(arguments, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls, kept, end = [], [], 0
    for match in HERMES_CALL.finditer(text):
        call = _call(_loads(match.group(1).strip()), "hermes", ("arguments", "parameters"))
        if call is None:  # malformed: stays in the content as the model wrote it
            continue
        kept.append(text[end : match.start()])
        end = match.end()
        calls.append(call)
    if not calls:
        return text, []
    content = "".join([*kept, text[end:]]).strip()
    return content or None, calls


def _json_sequence(body: str, family: str, keys: tuple[str, ...], separators: str) -> list[ToolCall] | None:
    """The calls in `body`: JSON objects (or lists of them), one after another with `separators` between; None
    unless all of it is calls."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        for item in obj if isinstance(obj, list) else [obj]:
            call = _call(item, family, keys)
            if call is None:
                return None
            calls.append(call)
        while pos < len(body) and (body[pos].isspace() or body[pos] in separators):
            pos += 1
    return calls or None


def _llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = _json_sequence(body, "llama3_json", ("parameters", "arguments"), ";")
    return (None, calls) if calls else (text, [])


def _mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    before, marker, after = text.partition("[TOOL_CALLS]")
    if not marker:  # the marker is a special token: a detokenizer may have dropped it
        before, after = "", text
        if not text.strip().startswith("["):
            return text, []
    after = after.strip()
    calls = _json_sequence(after, "mistral", ("arguments",), ",") if after.startswith(("[", "{")) else None
    if calls is None and marker:  # [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]...
        calls = []
        for part in filter(None, (p.strip() for p in after.split("[TOOL_CALLS]"))):
            name, args, rest = part.partition("[ARGS]")
            call = _call({"name": name.strip(), "arguments": _loads(rest)}, "mistral") if args else None
            if call is None:
                return text, []
            calls.append(call)
    if not calls:
        return text, []
    return before.strip() or None, calls


PARSERS = {"hermes": _hermes, "llama3_json": _llama3, "mistral": _mistral}


def parse_tool_calls(text: str, family: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a model's reply: without a call that parses, (text unchanged, []); with calls, the text
    around them (stripped; None when there is none) and each call with a fresh id."""
    if family not in PARSERS:
        raise ValueError(f"unknown tool-call family {family!r}; one of {', '.join(FAMILIES)}")
    return PARSERS[family](text)


def read_reply(
    text: str, family: str, forced: str | dict | None = None, parallel: bool = True
) -> tuple[str | None, list[ToolCall]]:
    """A reply's content and calls: a forced call's JSON (`forced`: tool_choice "required" or a named function,
    `forced_calls`), else the calls the template family's parser finds in its text. Without `parallel`
    (parallel_tool_calls false: "zero or one tool is called", OpenAI's function-calling guide) only the first
    call is kept, as vLLM's maybe_filter_parallel_tool_calls keeps it."""
    if forced is not None:
        content, calls = (None, found) if (found := forced_calls(text, forced, family)) else (text, [])
    else:
        content, calls = parse_tool_calls(text, family)
    return content, calls if parallel else calls[:1]


def finish_reason(reason: str, calls: list[ToolCall], forced: str | dict | None = None) -> str:
    """A reply's finish_reason once read for calls: "tool_calls" where it made some and stopped, except a call
    forced by naming its function, which keeps the engine's own ("stop"), as OpenAI answers it (vLLM PR #25054
    lists OpenAI's answers; its resolve_finish_reason does the same). A reply max_tokens cut keeps "length", calls
    or not, as OpenAI's and vLLM's unstreamed answer: the calls read may be the ones before a cut one."""
    return "tool_calls" if calls and reason == "stop" and not isinstance(forced, dict) else reason
