"""Text generation from a fine-tuned causal LM or seq2seq model: a Python API and `tuneforge generate`.

    Generator("runs/x/model").generate(["Once upon a time"], max_new_tokens=40, do_sample=True, top_p=0.9)
    tuneforge generate runs/x/model --prompt "Once upon a time" --do-sample --top-p 0.9 --seed 0

Greedy by default; sampling with temperature / top-k / top-p; beam search with --num-beams.
A causal LM returns the continuation of each prompt; a seq2seq model its output for each input
(the source prefix it was trained with, from tuneforge.json, is put in front).

Generation never runs past the model's context (its position embeddings): a prompt that fills it is refused
in one line, and a continuation that would run past it stops there, with a `note:` line on stderr saying so.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from tuneforge.errors import ConfigError, DataError
from tuneforge.export import read_model_info

NOT_GENERATIVE_HEADS = (
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
    "ForMaskedLM",
)


def generates_text(model_config, info: dict) -> bool:
    """Whether a model folder (its config and tuneforge.json) holds a model that generates text."""
    archs = getattr(model_config, "architectures", None) or []
    return info.get("task") in ("clm", "seq2seq", "sft") or bool(
        archs
        and not any(a.endswith(NOT_GENERATIVE_HEADS) for a in archs)
        and any(
            a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "EncoderDecoderModel")) for a in archs
        )
    )


def model_family(model_dir: str, model_config, info: dict) -> str:
    """'clm' or 'seq2seq' for a model that can generate; ConfigError for anything else."""
    task = info.get("task")
    archs = getattr(model_config, "architectures", None) or []
    kind = archs[0] if archs else model_config.model_type
    if task == "sft":  # a chat model is a causal LM
        return "clm"
    if not generates_text(model_config, info):
        what = f"a {kind} trained for {task!r}" if task else f"a {kind}"
        raise ConfigError(
            f"model {model_dir!r} is {what}, not a text-generation model; `tuneforge generate` needs a causal LM "
            "(--task clm) or seq2seq model (--task seq2seq); for classifiers use `tuneforge predict`"
        )
    if task in ("clm", "seq2seq"):
        return task
    return "seq2seq" if getattr(model_config, "is_encoder_decoder", False) else "clm"


class Generator:
    def __init__(self, model_dir: str | Path, device: str | None = None) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

        from tuneforge.tasks.base import check_model_path, from_pretrained, load_tokenizer

        model_dir = str(model_dir)
        check_model_path(model_dir)
        self.model_dir = model_dir
        self.info = read_model_info(model_dir)
        model_config = from_pretrained(AutoConfig, model_dir, "the model config")
        self.family = model_family(model_dir, model_config, self.info)
        auto = AutoModelForSeq2SeqLM if self.family == "seq2seq" else AutoModelForCausalLM
        self.tokenizer = load_tokenizer(model_dir)
        self.model = from_pretrained(auto, model_dir, "the model").eval()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model.to(self.device)
        if self.tokenizer.pad_token is None and self.tokenizer.eos_token is not None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.family == "clm":
            self.tokenizer.padding_side = "left"  # prompts end where generation starts

    def room_in_context(self, lengths: list[int], max_new_tokens: int) -> int:
        """`max_new_tokens`, or fewer where the model's context ends first (a `note:` line on stderr)."""
        from tuneforge.tasks.base import context_length

        room, why = context_room(self.family, context_length(self.model.config), lengths, max_new_tokens)
        if why:
            print(f"note: {why}, not {max_new_tokens}", file=sys.stderr, flush=True)
        return room

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[str],
        max_new_tokens: int = 50,
        do_sample: bool = False,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        num_beams: int = 1,
        seed: int | None = None,
        add_special_tokens: bool = True,
    ) -> list[str]:
        """The generated text for each prompt (without the prompt itself). `add_special_tokens=False` for
        prompts that carry their own (a chat template's rendering)."""
        check_generation_options(max_new_tokens, temperature, top_k, top_p, num_beams, seed)
        if not prompts:
            return []
        if seed is not None:
            from transformers import set_seed

            set_seed(seed)
        texts = list(prompts)
        if self.family == "seq2seq":
            prefix = self.info.get("source_prefix") or ""
            texts = [prefix + t for t in texts]
        max_length = self.info.get("max_length") if self.family == "seq2seq" else None
        enc = self.tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=max_length is not None,
            max_length=max_length,
            return_token_type_ids=False,
            add_special_tokens=add_special_tokens,
        ).to(self.device)
        lengths = enc["attention_mask"].sum(1).tolist()
        if self.family == "clm":
            empty = [i for i, n in enumerate(lengths) if n == 0]
            if empty:  # no BOS token either: nothing to continue from (transformers fails deep inside generate)
                raise DataError(
                    f"prompt {empty[0] + 1} ({prompts[empty[0]]!r}) has no tokens; a causal language model continues "
                    "a text, so give it at least a word"
                )
        max_new_tokens = self.room_in_context(lengths, max_new_tokens)
        options = {
            "max_new_tokens": max_new_tokens,
            "num_beams": num_beams,
            "do_sample": do_sample,
            "pad_token_id": self.tokenizer.pad_token_id,
        }
        if do_sample:  # only sampling reads these; greedy/beam would warn about them
            options.update(
                {k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)) if v is not None}
            )
        out = self.model.generate(**enc, **options)
        if self.family == "clm":  # the prompt (left-padded to one width) comes first: drop it
            out = out[:, enc["input_ids"].shape[1] :]
        return self.tokenizer.batch_decode(out, skip_special_tokens=True)


def context_room(family: str, context: int | None, lengths: list[int], max_new_tokens: int) -> tuple[int, str]:
    """(the new tokens that fit the model's `context` after prompts of `lengths` tokens, why fewer than asked or
    ""); DataError for a prompt that leaves no room. A causal LM's prompt and continuation share the positions,
    a seq2seq model's encoder reads the prompt and its decoder has the positions for itself."""
    if context is None:
        return max_new_tokens, ""
    longest = max(lengths, default=0)
    which = lengths.index(longest) + 1 if lengths else 1
    if family == "seq2seq":
        if longest > context:
            raise DataError(f"input {which} has {longest} tokens; the model reads at most {context}: shorten it")
        room = context - 1  # the decoder's start token takes a position
    else:
        if longest >= context:
            raise DataError(
                f"prompt {which} has {longest} tokens; the model's context is {context}, which leaves no room to "
                "continue it: shorten it"
            )
        room = context - longest
    if max_new_tokens <= room:
        return max_new_tokens, ""
    whose = f"after prompt {which}'s {longest} tokens " if family == "clm" else ""
    return room, f"generation stops at the model's context of {context} tokens: {room} new tokens {whose}at most"


MAX_NEW_TOKENS = 1 << 20  # a bound before the model's context (when it has one) lowers it
MAX_SEED = (1 << 32) - 1  # transformers' set_seed seeds numpy too, which takes 32 bits


def check_generation_options(max_new_tokens, temperature, top_k, top_p, num_beams, seed=None) -> None:
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ConfigError(f"--max-new-tokens must be between 1 and {MAX_NEW_TOKENS} (got {max_new_tokens})")
    if temperature is not None and not math.isfinite(temperature):
        raise ConfigError(f"--temperature must be a finite number (got {temperature})")
    if temperature is not None and temperature <= 0:
        raise ConfigError(f"--temperature must be above 0 (got {temperature}); for greedy decoding drop --do-sample")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k must be at least 1 (got {top_k})")
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1] (got {top_p})")
    if num_beams < 1:
        raise ConfigError(f"--num-beams must be at least 1 (got {num_beams})")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"--seed must be between 0 and {MAX_SEED} (got {seed})")


# ---- CLI ---------------------------------------------------------------------------------
def cmd_generate(ns: argparse.Namespace) -> int:
    check_generation_options(ns.max_new_tokens, ns.temperature, ns.top_k, ns.top_p, ns.num_beams, ns.seed)  # first
    generator = Generator(ns.model_dir)
    outputs = generator.generate(
        ns.prompt,
        max_new_tokens=ns.max_new_tokens,
        do_sample=ns.do_sample,
        temperature=ns.temperature,
        top_k=ns.top_k,
        top_p=ns.top_p,
        num_beams=ns.num_beams,
        seed=ns.seed,
    )
    for prompt, text in zip(ns.prompt, outputs):
        shown = prompt + text if generator.family == "clm" else text
        if not ns.json:
            print(shown, flush=True)
    if ns.json:
        print(
            json.dumps({"generations": [{"prompt": p, "generated": t} for p, t in zip(ns.prompt, outputs)]}), flush=True
        )
    return 0


def add_arguments(p) -> None:
    """`tuneforge generate`'s arguments (the CLI lists the command and its help)."""
    p.add_argument("model_dir", help="HF model folder (e.g. OUTPUT_DIR/model of a clm or seq2seq run)")
    p.add_argument("--prompt", action="append", required=True, help="input text; repeat for several")
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy / beam search")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--num-beams", type=int, default=1)
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--json", action="store_true", help="one JSON line: {generations: [{prompt, generated}]}")
    p.set_defaults(func=cmd_generate)
