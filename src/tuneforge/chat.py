"""`tuneforge chat MODEL_DIR`: talk to a chat model in the terminal, each turn rendered with the model's
chat template (the conversation so far, then the generation prompt); an empty line or end of input ends it.

The model folder is any causal LM with a chat template: an `--task sft` run's OUTPUT_DIR/model (an
adapter folder too), or the merged export of one. This module also owns the checks of a model's chat template
that `serve` shares: a template that does not parse is one line naming its file at start-up
(`check_chat_template`); one that refuses a conversation (as Gemma's and Mistral's refuse a system message) is
one line naming the file, the turn and the template's own message. A conversation that fills the model's
context ends with one line saying so; a reply stops at the context (generate.py says so in a `note:` line). A line
(or --system) that is not UTF-8 text ends it in one line naming the line and the byte.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tuneforge.artifacts import context_length
from tuneforge.errors import ConfigError, DataError
from tuneforge.flags import POSITIONAL, add_model_flags, parse_options
from tuneforge.generate import Generator, MaxNewTokens, Seed, Temperature, TopP, check_sampling_asked, not_utf8
from tuneforge.options import PATH


class ChatOptions(BaseModel):
    """`tuneforge chat`'s arguments (the decoding settings' bounds are generate.py's), checked before the model
    loads."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    _sampling_asked = model_validator(mode="after")(check_sampling_asked)

    model_dir: str = Field(
        description="a chat model folder (OUTPUT_DIR/model of an --task sft run)",
        json_schema_extra={**POSITIONAL, **PATH},
    )
    system: str | None = Field(None, description="a system message put first")
    max_new_tokens: MaxNewTokens = 200
    do_sample: bool = Field(False, description="sample instead of greedy decoding")
    temperature: Temperature = None
    top_p: TopP = None
    seed: Seed = None


def template_file(model_dir: str) -> str:
    """Where a model folder keeps its chat template: chat_template.jinja (transformers 5), else the tokenizer's
    config."""
    for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
        if (Path(model_dir) / name).is_file():
            return str(Path(model_dir) / name)
    return model_dir


def check_chat_template(tokenizer, model_dir: str) -> None:
    """ConfigError naming the file when the tokenizer's chat template (each, when it has several) does not parse."""
    templates = getattr(tokenizer, "chat_template", None)
    if not templates:
        return
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:  # another transformers: its own error, at the first conversation, is the check
        return
    for name, template in templates.items() if isinstance(templates, dict) else [("", templates)]:
        try:
            compile_template(template)
        except Exception as err:
            where = f"line {err.lineno}: " if getattr(err, "lineno", None) else ""
            which = f" (the one named {name!r})" if name else ""
            message = getattr(err, "message", None) or err
            raise ConfigError(
                f"the chat template in {template_file(model_dir)}{which} does not parse: {where}{message}; fix the "
                "template (or train again with a --chat-template file that parses)"
            ) from None


def render(generator: Generator, messages: list[dict], turn: int) -> str:
    """The conversation through the chat template; ConfigError naming the file, the turn and the template's own
    message when the template refuses it, or naming the template when it renders nothing."""
    try:
        text = generator.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # the template's raise_exception(...), or an error in the template's own code
        raise ConfigError(
            f"the chat template in {template_file(generator.model_dir)} refused the conversation at turn {turn}: {err}"
        ) from None
    if not text.strip():  # not the user's empty text, as the generator would say
        raise ConfigError(
            f"the chat template in {template_file(generator.model_dir)} renders nothing of the conversation at turn "
            f"{turn}; fix the template"
        )
    return text


def check_room(generator: Generator, prompt: str, turn: int) -> None:
    """DataError when the conversation so far leaves the model no room to answer."""
    context = context_length(generator.model.config)
    n = len(generator.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if context is not None and n >= context:
        raise DataError(
            f"the conversation is {n} tokens at turn {turn}; the model's context is {context}: start a new chat "
            "(shorter messages, or a shorter --system)"
        )


def chat(
    generator: Generator,
    lines: TextIO,
    out: TextIO,
    system: str | None = None,
    **options,
) -> list[dict]:
    """Answer each line of `lines` in turn; returns the conversation."""
    tokenizer = generator.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "this model's tokenizer has no chat template; train it with --task sft (--chat-template FILE)"
        )
    check_chat_template(tokenizer, generator.model_dir)
    if system and not_utf8(system):
        raise DataError(f"--system {not_utf8(system)}; pass it as UTF-8")
    messages = [{"role": "system", "content": system}] if system else []
    print("you> ", end="", file=out, flush=True)
    for turn, line in enumerate(lines, start=1):
        text = line.strip()
        if not text:
            break
        if not_utf8(line):
            raise DataError(f"line {turn} {not_utf8(line)}; type it as UTF-8")
        messages.append({"role": "user", "content": text})
        prompt = render(generator, messages, turn)
        check_room(generator, prompt, turn)
        (reply,) = generator.generate([prompt], add_special_tokens=False, **options)
        reply = reply.strip()
        messages.append({"role": "assistant", "content": reply})
        print(f"model> {reply}\nyou> ", end="", file=out, flush=True)
    print(file=out, flush=True)
    return messages


def cmd_chat(ns: argparse.Namespace) -> int:
    options = parse_options(ChatOptions, ns)  # every flag checked before the model loads
    generator = Generator(options.model_dir)
    for note in generator.defaults.notes:
        print(f"note: {note}", file=sys.stderr, flush=True)
    if not generator.kind.continues_prompt:
        raise ConfigError(f"model {options.model_dir!r} is a seq2seq model; `tuneforge chat` talks to causal LMs")
    if hasattr(sys.stdin, "reconfigure"):  # a byte that is not UTF-8: refused by its line (chat), not a crash here
        sys.stdin.reconfigure(errors="surrogateescape")
    # temperature and top-p only when sampling: greedy decoding would warn about them
    decoding = {"max_new_tokens", "do_sample", "seed"} | ({"temperature", "top_p"} if options.do_sample else set())
    chat(generator, sys.stdin, sys.stdout, system=options.system, **options.model_dump(include=decoding))
    return 0


def add_arguments(p) -> None:
    """`tuneforge chat`'s arguments: ChatOptions' fields."""
    add_model_flags(p, ChatOptions)
    p.set_defaults(func=cmd_chat)
