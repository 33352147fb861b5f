"""Tool-calling SFT (`--task sft` on rows whose assistant turns hold `tool_calls`, whose `tool` turns hold results,
with a `tools` column): the loss mask token by token (the assistant's calls and replies only; tool results, user
and system turns and the tools' definitions masked), the data read through the task, a short training run through
the CLI, and every bad input as one line naming the column.

The template is tests/fixtures/tool_chat.jinja (Hermes/Qwen-style; see tests/test_tool_calls.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from test_task_sft import chats, sft_args, sft_task, write_jsonl

from conftest import run_cli
from test_bad_input import assert_refused, in_process
from test_tool_calls import PLAIN_TEMPLATE, TOOL_TEMPLATE, WEATHER, save_tool_model

FIXTURE = Path(__file__).parents[1] / "fixtures" / "tool_chat.jinja"
CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Rome"]
WEATHERS = ["sunny", "rainy", "windy", "cold"]


def tool_row(city: str, weather: str, tools_as_text: bool = False) -> dict:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    return {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": f"weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": weather},
            {"role": "assistant", "content": f"it is {weather} in {city}"},
        ],
        "tools": json.dumps([WEATHER]) if tools_as_text else [WEATHER],
    }


def tool_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [tool_row(rng.choice(CITIES), rng.choice(WEATHERS), tools_as_text=i % 2 == 1) for i in range(n)]


def marked_runs(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The texts of the runs of tokens that carry the loss, in order."""
    runs, current = [], []
    for t, y in zip(ids, labels):
        if y != -100:
            assert y == t
            current.append(t)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory, tiny_llama) -> str:
    """tiny_llama with room for the tools in its prompts (512 positions) and no template of its own."""
    return save_tool_model(tmp_path_factory.mktemp("sft-tools") / "model", tiny_llama, template=None, context=512)


def test_the_loss_covers_the_assistants_calls_and_replies_only(tool_model, cache_dir, tmp_path):
    from tuneforge.data.chat import encode_conversation, read_chats

    tokenizer = sft_task(tool_model, FIXTURE, cache_dir).load_tokenizer()
    assert tokenizer.chat_template == TOOL_TEMPLATE
    ((conversation, tools),) = read_chats(write_jsonl(tmp_path / "rows.jsonl", [tool_row("Paris", "sunny")]))
    ids, labels = encode_conversation(tokenizer, conversation, tools)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False)
    assert "<tools>" in tokenizer.decode(ids)  # the tools are in the prompt ...
    # ... and the loss is on the call (as the template writes it) and the reply, each with its end of turn
    assert marked_runs(tokenizer, ids, labels) == [CALL_TEXT, "it is sunny in Paris\n"]


def test_tool_rows_go_through_the_task_with_tools_as_a_list_or_json_text(tool_model, cache_dir, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [tool_row("Paris", "sunny"), tool_row("Paris", "sunny", True)])
    task = sft_task(tool_model, FIXTURE, cache_dir, train_file=str(train), validation_file=str(train), block_size=512)
    tokenizer = task.load_tokenizer()
    feats = task.tokenize(task.load_raw(), tokenizer, log=lambda _: None)["train"]
    assert len(feats) == 2  # each row whole (a block holds one: the tools make them long)
    for block in feats:  # the same features: the tools read alike from a list or from JSON text
        assert block["input_ids"] == feats[0]["input_ids"] and block["labels"] == feats[0]["labels"]
        assert marked_runs(tokenizer, block["input_ids"], block["labels"]) == [CALL_TEXT, "it is sunny in Paris\n"]


def test_a_tiny_tool_calling_sft_run_trains(tool_model, cache_dir, tmp_path):
    model = tool_model
    train = write_jsonl(tmp_path / "train.jsonl", tool_rows(8, seed=1))
    valid = write_jsonl(tmp_path / "valid.jsonl", tool_rows(2, seed=2))
    args = ["train", "--task", "sft", "--model", model, "--train-file", train, "--validation-file", valid]
    args += [
        "--chat-template",
        FIXTURE,
        "--block-size",
        "512",
        "--output-dir",
        tmp_path / "run",
        "--cache-dir",
        cache_dir,
    ]
    proc = run_cli(*map(str, args), "--max-steps", "2", "--batch-size", "4", "--lr", "5e-3", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 conversations" in proc.stdout + proc.stderr  # every row kept, none cut
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loss"] > 0
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "run" / "model").chat_template == TOOL_TEMPLATE


# ---- bad input: one line naming the column, exit 2, nothing written ----------------------------------------
def plain_template(tmp_path) -> Path:
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN_TEMPLATE)
    return path


def test_tool_rows_with_a_template_without_tools_are_refused_naming_the_column(capfd, tmp_path, tiny_llama):
    plain = ["--chat-template", str(plain_template(tmp_path))]
    train = write_jsonl(tmp_path / "train.jsonl", [*chats(2), tool_row("Oslo", "cold")])
    proc = in_process(capfd, *sft_args(tmp_path, tiny_llama, train, "--validation-file", str(train), *plain))
    assert_refused(proc, tmp_path, "row 3 of", "`tools` column", "does not render tools", "--chat-template FILE")
    no_tools = {"messages": tool_row("Oslo", "cold")["messages"]}  # tool_calls and a tool turn, no tools column
    write_jsonl(train, [*chats(2), no_tools])
    proc = in_process(capfd, *sft_args(tmp_path, tiny_llama, train, "--validation-file", str(train), *plain))
    assert_refused(proc, tmp_path, "row 3 of", "`messages` (tool_calls or a tool turn) column", "does not render tools")


def broken(path: str, value) -> dict:
    """tool_row with one field replaced: `path` as `messages.2.tool_calls.0.function.arguments` or `tools`."""
    row = tool_row("Oslo", "cold")
    *parents, last = path.split(".")
    node = row
    for key in parents:
        node = node[int(key) if key.isdigit() else key]
    node[int(last) if last.isdigit() else last] = value
    return row


@pytest.mark.parametrize(
    "row, needles",
    [
        (
            broken("messages.2.tool_calls.0.function.arguments", "{city"),
            ("row 3 of", "messages[2].tool_calls[0].function.arguments", "not valid JSON"),
        ),
        (broken("messages.2.tool_calls.0.function.arguments", "[1]"), ("row 3 of", "arguments", "JSON object")),
        (broken("messages.2.tool_calls", [{"function": {}}]), ("row 3 of", "messages[2].tool_calls[0].function.name")),
        (
            broken("messages.1.tool_calls", [{"function": {"name": "f"}}]),
            ("row 3 of", "messages[1].tool_calls", "assistant"),
        ),
        (broken("messages.2.content", 5), ("row 3 of", "message 3", "text content")),
        (broken("messages.3.content", None), ("row 3 of", "message 4", "text content")),
        (broken("tools", "[{not json"), ("row 3 of", "`tools` is not valid JSON")),
        (
            broken("tools", [{"type": "function", "function": {"name": "bad name"}}]),
            ("row 3 of", "`tools`[0].function.name"),
        ),
        (broken("tools", {"name": "f"}), ("row 3 of", "`tools` must be a list")),
    ],
)
def test_bad_tool_rows_are_refused(capfd, tmp_path, tiny_llama, row, needles):
    train = write_jsonl(tmp_path / "train.jsonl", [*chats(2), row])
    proc = in_process(capfd, *sft_args(tmp_path, tiny_llama, train, "--chat-template", str(FIXTURE)))
    assert_refused(proc, tmp_path, *needles)


def test_a_template_that_drops_the_calls_is_refused(tool_model, cache_dir, tmp_path):
    """A template that renders the tools but not the assistant's tool_calls would train the model to answer a
    call with nothing: refused."""
    from tuneforge.errors import ConfigError

    template = tmp_path / "drops.jinja"
    template.write_text("{{ tools | tojson }}\n" + PLAIN_TEMPLATE)
    train = write_jsonl(tmp_path / "train.jsonl", [tool_row("Oslo", "cold")])
    task = sft_task(tool_model, template, cache_dir, train_file=str(train), validation_file=str(train), block_size=512)
    with pytest.raises(ConfigError, match="does not write the assistant's tool call 'get_weather'"):
        task.tokenize(task.load_raw(), task.load_tokenizer(), log=lambda _: None)


def test_a_datasets_split_with_tool_rows_reads_as_the_same_rows_from_a_file(tool_model, cache_dir, tmp_path):
    """A datasets.Dataset (fit's train_dataset, a hub source) stores each column as one Arrow type: a struct holds
    every key of every row, None where a row has none. Each row's calls and tools must still be its own, not
    padded with the other rows' arguments and properties."""
    import datasets

    from tuneforge.data.chat import read_chats

    search = {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}},
        },
    }
    searched = tool_row("Oslo", "cold")
    searched["messages"][2]["tool_calls"][0]["function"] = {"name": "search", "arguments": {"query": "x", "limit": 3}}
    searched["tools"] = [search]
    weather = tool_row("Paris", "sunny")
    function = weather["messages"][2]["tool_calls"][0]["function"]
    function["arguments"] = json.loads(function["arguments"])  # an object, as a dataset holds it
    rows = [weather, searched]
    split = datasets.Dataset.from_list(rows)
    task = sft_task(tool_model, FIXTURE, cache_dir)
    raw = task.prepare_raw({"train": split, "validation": split})["train"]
    from_file = read_chats(write_jsonl(tmp_path / "rows.jsonl", rows))
    assert [(json.loads(c), json.loads(t)) for c, t in zip(raw["conversation"], raw["tools"])] == from_file
