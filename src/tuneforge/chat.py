"""`tuneforge chat MODEL_DIR`: talk to a chat model in the terminal, each turn rendered with the model's
chat template (the conversation so far, then the generation prompt); an empty line or end of input ends it.

The model folder is any causal LM with a chat template: an `--task sft` run's OUTPUT_DIR/model (an
adapter folder too), or the merged export of one.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from tuneforge.errors import ConfigError
from tuneforge.generate import Generator, check_generation_options


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
    messages = [{"role": "system", "content": system}] if system else []
    print("you> ", end="", file=out, flush=True)
    for line in lines:
        text = line.strip()
        if not text:
            break
        messages.append({"role": "user", "content": text})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        (reply,) = generator.generate([prompt], add_special_tokens=False, **options)
        reply = reply.strip()
        messages.append({"role": "assistant", "content": reply})
        print(f"model> {reply}\nyou> ", end="", file=out, flush=True)
    print(file=out, flush=True)
    return messages


def cmd_chat(ns: argparse.Namespace) -> int:
    check_generation_options(ns.max_new_tokens, ns.temperature, None, ns.top_p, 1)  # before loading
    generator = Generator(ns.model_dir)
    if generator.family != "clm":
        raise ConfigError(f"model {ns.model_dir!r} is a seq2seq model; `tuneforge chat` talks to causal LMs")
    options = {"max_new_tokens": ns.max_new_tokens, "do_sample": ns.do_sample, "seed": ns.seed}
    if ns.do_sample:
        options.update(temperature=ns.temperature, top_p=ns.top_p)
    chat(generator, sys.stdin, sys.stdout, system=ns.system, **options)
    return 0


def add_arguments(p) -> None:
    """`tuneforge chat`'s arguments."""
    p.add_argument("model_dir", help="a chat model folder (OUTPUT_DIR/model of an --task sft run)")
    p.add_argument("--system", default=None, help="a system message put first")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=cmd_chat)
