"""`tuneforge chat` on a tiny chat Llama (context 64), in-process with stdin given: a reply stops at the model's
context (a `note:` line says so), a conversation that fills it ends with one `error:` line, and a chat template
that refuses a conversation (as Gemma's and Mistral's refuse a system message) or does not parse is one line
naming the template's file and its own message, in `chat` and in `serve`."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest

from conftest import cli_main

TEMPLATE = (  # as test_serve_generate.py's, but refusing a system message as Gemma's template does
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{{ m['role'][0] }}>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a>\n{% endif %}"
)


def chat_model_with(out: Path, tiny_llama: str, template: str) -> str:
    from transformers import AutoTokenizer

    shutil.copytree(tiny_llama, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, tiny_llama) -> str:
    return chat_model_with(tmp_path_factory.mktemp("chat") / "model", tiny_llama, TEMPLATE)


def chat(capsys, monkeypatch, model: str, lines: list[str], *flags: str) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    return cli_main(capsys, "chat", model, *flags)


def test_a_reply_stops_at_the_context_and_a_full_conversation_ends_in_one_line(chat_model, capsys, monkeypatch):
    long = " ".join(["the dog is riding a red bike"] * 12)
    code, out, err = chat(capsys, monkeypatch, chat_model, ["hello", long], "--max-new-tokens", "500")
    assert code == 2 and out.count("model> ") == 1, err
    lines = err.strip().splitlines()
    assert lines[0].startswith("note: generation stops at the model's context of 64 tokens: ")
    assert lines[0].endswith(", not 500")
    assert lines[-1].startswith("error: the conversation is ")
    assert " tokens at turn 2; the model's context is 64: start a new chat" in lines[-1]
    assert [line for line in lines if line.startswith("error:")] == lines[-1:]


def test_a_template_that_refuses_a_system_message_is_one_line(chat_model, capsys, monkeypatch):
    code, out, err = chat(capsys, monkeypatch, chat_model, ["hello"], "--system", "be brief")
    file = Path(chat_model) / "chat_template.jinja"
    assert code == 2 and file.is_file()
    want = f"error: the chat template in {file} refused the conversation at turn 1: System role not supported"
    assert err.strip() == want
    code, out, err = chat(capsys, monkeypatch, chat_model, ["hello"], "--max-new-tokens", "3")  # no system: fine
    assert code == 0 and out.count("model> ") == 1, err


def test_a_template_that_does_not_parse_is_one_line_in_chat_and_serve(tmp_path, tiny_llama, capsys, monkeypatch):
    model = chat_model_with(tmp_path / "model", tiny_llama, "{% for m in messages %}{{ m['content'] }}")
    file = Path(model) / "chat_template.jinja"
    want = f"error: the chat template in {file} does not parse: line 1: Unexpected end of template."
    code, out, err = chat(capsys, monkeypatch, model, ["hello"])
    assert code == 2 and err.strip().startswith(want), err
    assert len(err.strip().splitlines()) == 1
    code, out, err = cli_main(capsys, "serve", model, "--port", "0")  # at start-up, never a 500 per request
    assert code == 2 and err.strip().splitlines()[-1].startswith(want), err
    assert "Traceback" not in err


@pytest.mark.parametrize("strict", [False, True])
def test_a_line_that_is_not_utf8_is_one_line(chat_model, capsys, monkeypatch, strict):
    # the terminal's bytes as Python reads them: undecodable ones kept as lone surrogates (a C or C.UTF-8
    # locale), or a UnicodeDecodeError (PYTHONIOENCODING=utf-8)
    stdin = io.TextIOWrapper(
        io.BytesIO(b"hello\ncaf\xe9\n"), encoding="utf-8", errors=None if strict else "surrogateescape"
    )
    monkeypatch.setattr("sys.stdin", stdin)
    code, out, err = cli_main(capsys, "chat", chat_model, "--max-new-tokens", "3")
    assert code == 2 and out.count("model> ") == 1, err
    assert err.strip() == "error: line 2 is not UTF-8 text (byte 0xe9 at character 4); type it as UTF-8"


def test_a_system_message_that_is_not_utf8_is_one_line(tmp_path, tiny_llama, capsys, monkeypatch):
    model = chat_model_with(tmp_path / "model", tiny_llama, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    code, out, err = chat(capsys, monkeypatch, model, ["hello"], "--system", "caf\udce9")
    assert code == 2 and "model> " not in out, err
    assert err.strip() == "error: --system is not UTF-8 text (byte 0xe9 at character 4); pass it as UTF-8"


def test_a_template_that_renders_nothing_is_named(tmp_path, tiny_llama, capsys, monkeypatch):
    # it said "prompt 1 ('') has no tokens; a causal language model continues a text", of the line typed
    model = chat_model_with(tmp_path / "model", tiny_llama, "{% if add_generation_prompt %}{% endif %}")
    code, out, err = chat(capsys, monkeypatch, model, ["hello"])
    file = Path(model) / "chat_template.jinja"
    want = f"error: the chat template in {file} renders nothing of the conversation at turn 1; fix the template"
    assert code == 2 and err.strip() == want, err
