"""Chat / instruction data: conversations read from json or jsonl, rendered with a chat template, the
assistant's tokens marked for the loss, and several conversations packed into one block.

Rows hold `messages` (`[{"role": "system" | "user" | "assistant" | "tool", "content": ...}]`), ShareGPT's
`conversations` (`[{"from": "system" | "human" | "gpt", "value": ...}]`), TRL's `prompt` and `completion`
(message lists, joined; or two texts: [user: prompt, assistant: completion]) or the Alpaca fields
`instruction`, `input` (optional) and `output`; `--chat-format auto` tells them apart by the first row.
Alpaca rows become [user: instruction (+ blank line + input), assistant: output]. A content may be OpenAI's
list of text parts (`[{"type": "text", "text": ...}]`, joined); another kind of part is refused.

Tool calling: an assistant turn may hold OpenAI's `tool_calls` (`[{"id", "type": "function", "function":
{"name", "arguments"}}]`, arguments a JSON string or an object; its content then may be null) and a `tool` turn
the result of a call (`tool_call_id`); a `tools` column (a list of OpenAI tool definitions, bare
`{name, description, parameters}` functions too, or that list as a JSON string) is rendered through the
template's `tools=`. tuneforge/tool_calls.py checks them and converts them for the template (arguments as dicts).

The mask: a conversation is rendered once with the tokenizer's chat template (`--chat-template FILE`
where the tokenizer has none) and tokenized with character offsets; for each assistant turn the
template also renders the conversation up to that turn (with the generation prompt) and through
it: the characters in between are the assistant's reply (its tool calls, as the template writes them, too) and
its end-of-turn marker, and the tokens starting there carry the loss. Everything else (system, user, tool
results, the tools' definitions, the template's markup) gets -100.

Packing: conversations are laid into blocks of `block_size` tokens whole, in order, a new block
when the next one does not fit; each keeps its own positions (0, 1, ...) and a block's attention is
block-diagonal (the collator builds it), so no token sees another conversation.
"""

from __future__ import annotations

import gzip
import io
import json
import math
from pathlib import Path

from tuneforge import tool_calls
from tuneforge.errors import ConfigError, DataError

ROLES = ("system", "user", "assistant", "tool")
IGNORE = -100


def read_rows(path: str | Path, what: str = "chat data", reader: str = "--task sft") -> list[dict]:
    """The rows of a .jsonl (one JSON object a line) or .json (a list of objects) file, gzip'd or not."""
    from tuneforge.data.sources import decode_text, read_text_file

    p = Path(path)
    hint = "pass a .jsonl or .json file (or one gzip'd: .jsonl.gz)"
    suffix = p.suffix.lower()
    if suffix == ".gz":  # hh-rlhf ships as .jsonl.gz
        if not p.is_file():
            read_text_file(p, f"{what} file", hint)  # raises: missing, or a folder
        try:
            data = gzip.decompress(p.read_bytes())
        except (OSError, EOFError) as err:
            raise DataError(f"{str(p)!r} is not a readable gzip file ({err})") from None
        text = decode_text(data, p, f"{what} file")
        suffix = Path(p.stem).suffix.lower()
    else:
        text = read_text_file(p, f"{what} file", hint)
    if suffix == ".json":
        try:
            rows = json.loads(text)
        except ValueError as err:
            raise DataError(
                f"{str(p)!r} is not valid JSON ({err}); give a JSON list of rows or a .jsonl file"
            ) from None
        if not isinstance(rows, list):
            raise DataError(f"{str(p)!r} holds a JSON {type(rows).__name__}, not a list of rows")
        numbered = list(enumerate(rows, 1))
    elif suffix == ".jsonl":
        numbered = list(numbered_lines(io.StringIO(text, newline=None), p))
    else:
        raise DataError(f"{what} {str(p)!r}: {reader} reads .jsonl or .json files (or those gzip'd: .jsonl.gz)")
    for n, row in numbered:
        if not isinstance(row, dict):
            raise DataError(f"row {n} of {str(p)!r} is a {type(row).__name__}, not a JSON object")
    if not numbered:
        raise DataError(f"{str(p)!r} holds no rows")
    return [row for _, row in numbered]


def numbered_lines(lines, p: Path):
    """(line number, object) of each non-blank JSON line of `lines` (a text stream: lines end at \\n, \\r\\n or
    \\r only, so a JSON string holding U+2028 stays one row); one DataError line for a line that is not JSON."""
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except ValueError as err:
            raise DataError(f"line {n} of {str(p)!r} is not valid JSON ({err}); fix or drop that line") from None


def iter_chats(path: str | Path, fmt: str = "auto"):
    """read_chats of a JSON-lines file read a line at a time (a file larger than memory): the same rows, checks
    and messages, each row's (conversation, tools) as it is read."""
    p = Path(path)
    with open(p, encoding="utf-8-sig", newline=None) as fh:
        n = 0
        for line_number, row in numbered_lines(fh, p):
            if not isinstance(row, dict):
                raise DataError(f"row {line_number} of {str(p)!r} is a {type(row).__name__}, not a JSON object")
            n += 1
            fmt = detect_format([row], str(p), fmt) if n == 1 else fmt
            where = f"row {n} of {str(p)!r}"
            yield to_conversation(row, fmt, where, tools=True), to_tools(row.get("tools"), where)
    if n == 0:
        raise DataError(f"{str(p)!r} holds no rows")


# ShareGPT's speakers (`from`) as roles; "human"/"gpt" are the format's own, the rest what its copies write
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def detect_format(rows: list[dict], path: str, wanted: str = "auto") -> str:
    """'messages', 'sharegpt', 'prompt-completion' or 'alpaca': as asked, or from the first row's fields."""
    if wanted != "auto":
        return wanted
    first = rows[0]
    for fmt, keys in (
        ("messages", ("messages",)),
        ("sharegpt", ("conversations",)),
        ("prompt-completion", ("prompt", "completion")),
        ("alpaca", ("instruction", "output")),
    ):
        if all(k in first for k in keys):
            return fmt
    raise DataError(
        f"{path!r}: the first row has none of `messages`, `conversations`, `prompt` + `completion` or `instruction` + "
        f"`output` (it has: {', '.join(first) or 'no fields'}); give chat rows, ShareGPT, prompt-completion or "
        "Alpaca rows"
    )


def _given_messages(row: dict, fmt: str, where: str) -> list:
    """The row's messages as its format gives them (not yet checked)."""
    if fmt == "alpaca":
        missing = [k for k in ("instruction", "output") if not isinstance(row.get(k), str)]
        if missing:
            raise DataError(
                f"{where} has no text in {' and '.join(missing)}; every Alpaca row needs instruction and output"
            )
        given = row.get("input")
        if given is not None and not isinstance(given, str):
            raise DataError(f"{where}: `input` is a {type(given).__name__}; give it as text (or leave it out)")
        prompt = row["instruction"] + (f"\n\n{given}" if (given or "").strip() else "")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
    if fmt == "prompt-completion":
        prompt, completion = row.get("prompt"), row.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        if isinstance(prompt, list) and isinstance(completion, list):
            return prompt + completion
        raise DataError(f"{where}: `prompt` and `completion` are both texts or both lists of {{role, content}} objects")
    key = "conversations" if fmt == "sharegpt" else "messages"
    messages = row.get(key)
    if not isinstance(messages, list):
        raise DataError(f"{where}: `{key}` is not a list of {{role, content}} objects")
    if fmt == "sharegpt":  # {"from", "value"} turns (copies with {"role", "content"} are read as they are)
        return [
            _sharegpt_turn(m, where, n) if isinstance(m, dict) and "from" in m else m for n, m in enumerate(messages)
        ]
    return messages


def _sharegpt_turn(turn: dict, where: str, n: int) -> dict:
    role = SHAREGPT_ROLES.get(turn["from"]) if isinstance(turn["from"], str) else None
    if role is None:
        raise DataError(
            f"{where}, message {n + 1}: unknown speaker {turn['from']!r}; ShareGPT's are {', '.join(SHAREGPT_ROLES)}"
        )
    return {"role": role, "content": turn.get("value")}


def _text_content(message, where: str, i: int):
    """The message with a content of OpenAI's text parts joined into one text; another kind of part refused."""
    parts = message.get("content") if isinstance(message, dict) else None
    if not isinstance(parts, list):
        return message
    kinds = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in parts]
    other = next((k for k, p in zip(kinds, parts) if k != "text" or not isinstance(p.get("text"), str)), None)
    if other is not None or not parts:
        raise DataError(
            f"{where}, message {i + 1}: a content part of kind {other!r}; text is what trains here, as a string "
            "or a list of {type: text, text} parts"
        )
    return {**message, "content": "".join(p["text"] for p in parts)}


def to_conversation(row: dict, fmt: str, where: str, need_assistant: bool = True, tools: bool = False) -> list[dict]:
    """One row as a checked list of {role, content} messages; `where` names the row in errors. `tools`: tool
    turns and assistants' tool_calls taken too (as the template reads them), else the roles are the first three.
    `need_assistant` (SFT): an assistant turn, and not as the first message."""
    roles = ROLES if tools else ROLES[:3]
    messages = [_text_content(m, where, i) for i, m in enumerate(_given_messages(row, fmt, where))]
    if not messages:
        raise DataError(f"{where} is an empty conversation; drop it or give it messages")
    for i, m in enumerate(messages):
        calls = tools and isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls")
        if not isinstance(m, dict) or not (isinstance(m.get("content"), str) or (calls and m.get("content") is None)):
            raise DataError(f"{where}, message {i + 1}: needs a role and a text content")
        if m.get("role") not in roles:
            raise DataError(f"{where}, message {i + 1}: unknown role {m.get('role')!r}; roles are {', '.join(roles)}")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where} has no assistant turn: nothing to learn from; add one or drop the row")
    if need_assistant and messages[0]["role"] == "assistant":  # a reply's tokens follow its prompt's rendering
        raise DataError(
            f"{where}, message 1: the conversation starts with the assistant, so no prompt comes before that reply "
            "and its tokens cannot be told from the template's markup; put a system or user turn first"
        )
    if not (tools and tool_calls.uses_tools(messages)):
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    try:
        return tool_calls.to_template_messages(messages)
    except tool_calls.ToolSpecError as err:
        raise DataError(f"{where}: {err}") from None


def to_tools(value, where: str) -> list[dict] | None:
    """A row's `tools` (None, a list of tool definitions or that list as JSON text), checked as OpenAI's; a bare
    function ({name, description, parameters}, as many datasets hold them) is wrapped as {type, function}."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except ValueError as err:
            raise DataError(f"{where}: `tools` is not valid JSON ({err})") from None
    if isinstance(value, list):
        value = [{"type": "function", "function": t} if isinstance(t, dict) and "type" not in t else t for t in value]
    try:
        return tool_calls.check_tools(value, "`tools`")
    except tool_calls.ToolSpecError as err:
        raise DataError(f"{where}: {err}") from None


def without_arrow_nulls(value):
    """A row's value as read from a datasets.Dataset, without the None-valued keys Arrow adds: a struct column
    holds every key that any row has, None where a row has none, so each tool call's arguments and each tool's
    schema come back padded with the other rows' keys. A null the data itself holds is dropped alike (Arrow cannot
    tell the two apart); arguments given as JSON text keep theirs."""
    if isinstance(value, dict):
        return {key: without_arrow_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_arrow_nulls(item) for item in value]
    return value


def read_chats(path: str | Path, fmt: str = "auto") -> list[tuple[list[dict], list[dict] | None]]:
    """Each row's (conversation, tools): tools from its `tools` column (None when it has none)."""
    rows = read_rows(path)
    fmt = detect_format(rows, str(path), fmt)
    chats = []
    for n, row in enumerate(rows, 1):
        where = f"row {n} of {str(path)!r}"
        chats.append((to_conversation(row, fmt, where, tools=True), to_tools(row.get("tools"), where)))
    return chats


def read_conversations(path: str | Path, fmt: str = "auto") -> list[list[dict]]:
    return [conversation for conversation, _ in read_chats(path, fmt)]


def set_chat_template(tokenizer, template_file: str | None, model: str) -> None:
    """Use `--chat-template FILE` (a Jinja template); without one the tokenizer must have its own."""
    if template_file:
        from tuneforge.data.sources import read_text_file

        p = Path(template_file)
        if not p.exists():
            raise ConfigError(f"--chat-template {template_file!r} does not exist; pass a Jinja template file")
        tokenizer.chat_template = read_text_file(p, "--chat-template", "pass a Jinja template file")
        if not tokenizer.chat_template.strip():  # transformers would take it for no template at all
            raise ConfigError(f"--chat-template {template_file!r} is empty; pass a Jinja chat template file")
        check_template_parses(tokenizer.chat_template, template_file)
    elif not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"the tokenizer of {model!r} has no chat template; pass --chat-template FILE (a Jinja template, e.g. "
            "ChatML) or train from a chat model"
        )


def check_template_parses(template: str, template_file: str) -> None:
    """A chat template that is not valid Jinja is one line naming the file, the line and Jinja's message."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template  # transformers' own tags

    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as err:
        raise ConfigError(
            f"--chat-template {template_file!r} is not a valid Jinja template (line {err.lineno}: {err.message}); "
            "fix the template"
        ) from None


def template_name(config) -> str:
    """How an error names the chat template of a run: its --chat-template file, else the model's own."""
    given = getattr(config.task_options, "chat_template", None)
    return repr(given) if given else f"of {config.model or 'the model'!r}"


def template_error(err: Exception, template: str, row: int | None, where: str) -> ConfigError:
    """A template that raised for a row (Gemma's and Mistral's raise_exception for a system message): one line
    naming the template, the row and the template's own message."""
    message = (getattr(err, "message", None) or str(err) or type(err).__name__).strip().splitlines()[0][:200]
    at = f"row {row} of {where}" if row else where
    return ConfigError(
        f"the chat template {template} fails on {at}: {message}; change that row (e.g. drop a role the template "
        "refuses) or pass --chat-template FILE with a template that takes it"
    )


def check_tool_support(tokenizer, chats, template: str, where: str) -> None:
    """ConfigError naming the row and column when some row of `chats` ((row number, conversation, tools)) has
    tools, tool calls or tool results and the chat template does not render tools."""
    for n, conversation, tools in chats:
        if tools:
            column = "`tools`"
        elif tool_calls.uses_tools(conversation):
            column = "`messages` (tool_calls or a tool turn)"
        else:
            continue
        if not tool_calls.supports_tools(tokenizer):
            raise ConfigError(
                f"row {n} of {where} has tool calling in its {column} column, but the chat template {template} does "
                "not render tools; pass --chat-template FILE with a template that does (a Hermes/Qwen-style one that "
                "writes <tool_call>), or leave tool calling out of the data"
            )
        return


def encode_conversation(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, within: int | None = None
) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one conversation (`tools`: rendered through the template's tools=): labels are the
    ids on the assistant's tokens (its replies and tool calls), -100 elsewhere. `within`: the labels of the first
    `within` tokens only (the block the conversation is cut to) are the assistant's; the replies after them are
    not looked for but the first the template writes anything of (enough to tell a conversation cut short from one
    with no reply), since each reply renders the conversation up to it again (thousands of turns: minutes)."""

    def render(upto: int, prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tools=tools, tokenize=False, add_generation_prompt=prompt)

    text = render(len(messages), False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    past_block = offsets[within][0] if within is not None and len(ids) > within else math.inf
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start, end = _reply_span(render, text, i, m)
            spans.append((start, end))
            if start >= past_block and end > start:
                break
    labels = [IGNORE] * len(ids)
    k = 0  # spans and offsets both ascend: one pass over each
    for t, (a, _) in enumerate(offsets):
        while k < len(spans) and spans[k][1] <= a:
            k += 1
        if k < len(spans) and spans[k][0] <= a:
            labels[t] = ids[t]
    return ids, labels


def _reply_span(render, text: str, i: int, message: dict) -> tuple[int, int]:
    """The characters of `text` (the whole conversation rendered) that are assistant message `i`'s reply and its
    end-of-turn marker: from the end of the conversation before it with the generation prompt to the end of it."""
    prompted, through = render(i, True), render(i + 1, False)
    start, end = len(prompted), len(through)
    if not text.startswith(through) or start > end:
        raise ConfigError(
            "the chat template renders a conversation differently from its beginning (it is not prefix-stable), "
            "so the assistant's tokens cannot be found; pass --chat-template FILE with a plain template such as "
            "ChatML"
        )
    if not text.startswith(prompted):  # the mask would start inside the reply (or inside the template's markup)
        before = len(render(i, False))
        raise ConfigError(
            f"the chat template's generation prompt {prompted[before:]!r} is not how it begins the assistant's turn "
            f"of message {i + 1} ({text[before:start]!r}), so the assistant's tokens cannot be found (as in a "
            "template whose generation prompt opens a reasoning block that past replies drop); pass --chat-template "
            "FILE with a template whose generation prompt is what it writes before each reply"
        )
    for call in message.get("tool_calls") or []:
        if call["function"]["name"] not in text[start:end]:
            raise ConfigError(
                f"the chat template does not write the assistant's tool call {call['function']['name']!r} "
                "(`tool_calls` in `messages`), so there is nothing to learn it from; pass --chat-template FILE "
                "with a template that renders tool calls"
            )
    return start, end
