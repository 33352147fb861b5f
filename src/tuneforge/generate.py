"""Text generation from a fine-tuned causal LM or seq2seq model: a Python API and `tuneforge generate`.

    Generator("runs/x/model").generate(["Once upon a time"], max_new_tokens=40, do_sample=True, top_p=0.9)
    tuneforge generate runs/x/model --prompt "Once upon a time" --do-sample --top-p 0.9 --seed 0

Greedy by default; sampling with temperature / top-k / top-p; beam search with --num-beams (`Sampling`: the
decoding settings and their bounds, shared with `tuneforge chat`; `GenerateOptions`: the command's arguments). A
setting left out is the model's generation config's, as transformers' `generate` reads it, each held to the serving
API's bounds at load (generation_defaults.py: a value outside them is left out with a `note:` line; a temperature of
0 there samples greedily, as `serve` reads it).
A causal LM returns the continuation of each prompt; a seq2seq model its output for each input, decoded with the
settings it was trained and evaluated with (its tuneforge.json: the source prefix put in front, inputs truncated to
max_length, beam search of num_beams, up to generation_max_length new tokens: the outputs `eval` scored), each
said in one line on stderr; a flag overrides (--do-sample leaves beam search to --num-beams).

Generation never runs past the model's context (its position embeddings): a prompt that fills it is refused
in one line, and a continuation that would run past it stops there, with a `note:` line on stderr saying so.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tuneforge import slot_cache
from tuneforge.adapters import load_pretrained_model
from tuneforge.artifacts import (
    FAMILY_CAUSAL,
    FAMILY_SEQ2SEQ,
    check_max_length_fits,
    check_model_path,
    context_length,
    from_pretrained,
    generation_family,
    inference_device,
    load_tokenizer,
    read_model_info,
    trained_settings_line,
)
from tuneforge.errors import ConfigError, DataError
from tuneforge.flags import POSITIONAL, add_model_flags, input_max_length_field, parse_options
from tuneforge.generation_defaults import SAMPLING_EPS, checked_defaults
from tuneforge.options import PATH
from tuneforge.running_batch import CausalBatch, Seq2SeqBatch, SlotBatch

MAX_NEW_TOKENS = 1 << 20  # a bound before the model's context (when it has one) lowers it
MAX_BEAMS = 1000  # as seq2seq's --num-beams: more only fails allocating the beams' caches
MAX_SEED = (1 << 32) - 1  # transformers' set_seed seeds numpy too, which takes 32 bits
BETWEEN = "{flag} must be between {ge} and {le} (got {value})"
AT_LEAST = "{flag} must be at least {ge} (got {value})"

# the decoding settings, shared by `tuneforge generate` and `tuneforge chat`: bounds and the wording of a refusal
MaxNewTokens = Annotated[
    int,
    Field(
        ge=1,
        le=MAX_NEW_TOKENS,
        description="most new tokens after each prompt (fewer where the model's context ends)",
        json_schema_extra={"refusal": BETWEEN},
    ),
]
Temperature = Annotated[
    float | None,
    Field(
        ge=SAMPLING_EPS,  # the logits divided by a smaller one overflow (vLLM samples greedily below it)
        description="sampling temperature (with --do-sample)",
        json_schema_extra={
            "refusal": {
                "non_finite": "{flag} must be a finite number (got {value})",
                "low": "{flag} must be at least {ge} (got {value}); without --do-sample decoding is greedy",
            }
        },
    ),
]
TopP = Annotated[
    float | None,
    Field(
        gt=0,
        le=1,
        description="sample from the likeliest tokens that add up to this probability (with --do-sample)",
        json_schema_extra={"refusal": "{flag} must be in ({gt}, {le}] (got {value})"},
    ),
]
Seed = Annotated[
    int | None,
    Field(ge=0, le=MAX_SEED, description="makes sampling reproducible", json_schema_extra={"refusal": BETWEEN}),
]


def check_sampling_asked(options: BaseModel) -> BaseModel:
    """A model validator: temperature, top-k or top-p without do_sample is refused, as other settings that would do
    nothing are: greedy and beam search read none of them (transformers' generate warns and ignores them)."""
    given = [
        f"--{name.replace('_', '-')}" for name in ("temperature", "top_k", "top_p") if getattr(options, name, None)
    ]
    if given and not options.do_sample:
        raise ValueError(
            f"{' and '.join(given)} {'sets' if len(given) == 1 else 'set'} how to sample, but decoding is greedy "
            "without --do-sample: add --do-sample, or leave them out"
        )
    return options


class Sampling(BaseModel):
    """How one `Generator.generate` call decodes: greedy by default, sampling with --do-sample, beam search with
    --num-beams. Checked in one step: a bad value is one line naming its flag."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    _sampling_asked = model_validator(mode="after")(check_sampling_asked)

    max_new_tokens: MaxNewTokens = 50
    do_sample: bool = Field(False, description="sample instead of greedy / beam search")
    temperature: Temperature = None
    top_k: int | None = Field(
        None,
        ge=1,
        description="sample from the k likeliest tokens (with --do-sample)",
        json_schema_extra={"refusal": AT_LEAST},
    )
    top_p: TopP = None
    num_beams: int = Field(
        1, ge=1, le=MAX_BEAMS, description="beam search with this many beams", json_schema_extra={"refusal": BETWEEN}
    )
    seed: Seed = None


class GenerateOptions(Sampling):
    """`tuneforge generate`'s arguments: the model, the prompts, how to decode and print."""

    model_dir: str = Field(
        description="HF model folder (e.g. OUTPUT_DIR/model of a run that generates text)",
        json_schema_extra={**POSITIONAL, **PATH},
    )
    prompt: list[str] = Field(description="input text; repeat for several")
    max_length: int | None = input_max_length_field(
        "truncate inputs (default: the training max_length); a causal LM's prompt is never cut"
    )
    print_json: bool = Field(
        False,
        description="one JSON line: {generations: [{prompt, generated}]}",
        json_schema_extra={"flag": "--json"},
    )


def model_family(model_dir: str, model_config, info: dict) -> str:
    """FAMILY_CAUSAL or FAMILY_SEQ2SEQ for a model that generates text (`artifacts.generation_family`: what its
    tuneforge.json declares, else its architecture); ConfigError for anything else."""
    family = generation_family(model_config, info)
    if family is None:
        task = info.get("task")
        archs = getattr(model_config, "architectures", None) or []
        kind = archs[0] if archs else model_config.model_type
        what = f"a {kind} trained for {task!r}" if task else f"a {kind}"
        raise ConfigError(
            f"model {model_dir!r} is {what}, not a text-generation model; generating text needs a causal LM "
            "or a sequence-to-sequence model (one trained to generate text); for classifiers use `tuneforge predict`"
        )
    return family


def not_utf8(text: str) -> str | None:
    """Why `text` is not UTF-8 text (a byte sent in another encoding reaches Python's argv and stdin as a lone
    surrogate, which no tokenizer takes), None when it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate \\u{code:04x}"
        return f"is not UTF-8 text ({what} at character {err.start + 1})"
    return None


class CausalFamily:
    """A causal LM: the output continues the prompt, and prompt and continuation share the model's positions."""

    name = FAMILY_CAUSAL
    auto_class = "AutoModelForCausalLM"
    continues_prompt = True
    padding_side = "left"  # prompts end where generation starts

    def prompt_text(self, text: str, info: dict) -> str:
        return text

    def encode(self, tokenizer, text: str, info: dict, add_special_tokens: bool) -> list[int]:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def max_prompt_tokens(self, info: dict) -> int | None:
        return None

    def trained_settings(self, info: dict) -> dict:
        return {}

    def positions_used(self, prompt_tokens: int, generated: int) -> int:
        return prompt_tokens + generated

    def batch(self, model, pad_id: int):
        return SlotBatch(model, pad_id) if slot_cache.supports(model) else CausalBatch(model, pad_id)


class Seq2SeqFamily:
    """An encoder-decoder model: its encoder reads the prompt (with the source prefix it was trained with), its
    decoder has the positions for itself."""

    name = FAMILY_SEQ2SEQ
    auto_class = "AutoModelForSeq2SeqLM"
    continues_prompt = False
    padding_side = None  # the tokenizer's own

    def prompt_text(self, text: str, info: dict) -> str:
        return (info.get("source_prefix") or "") + text

    def encode(self, tokenizer, text: str, info: dict, add_special_tokens: bool) -> list[int]:
        """With the source prefix, truncated to the training max_length; the tokenizer's special tokens always."""
        limit = self.max_prompt_tokens(info)
        text = self.prompt_text(text, info)
        return list(tokenizer(text, truncation=limit is not None, max_length=limit)["input_ids"])

    def max_prompt_tokens(self, info: dict) -> int | None:
        return info.get("max_length")

    def trained_settings(self, info: dict) -> dict:
        """How the run that trained it read and decoded inputs in evaluation: {name in tuneforge.json: value}."""
        settings = {"source_prefix": info.get("source_prefix") or None, "max_length": info.get("max_length")}
        settings.update({name: info.get(name) for name in SEQ2SEQ_DECODING.values()})
        return {name: value for name, value in settings.items() if value is not None}

    def positions_used(self, prompt_tokens: int, generated: int) -> int:
        return generated

    def batch(self, model, pad_id: int):
        return Seq2SeqBatch(model, pad_id)


FAMILIES = {f.name: f for f in (CausalFamily(), Seq2SeqFamily())}
# a Sampling setting -> the seq2seq tuneforge.json key of the value evaluation decoded with (tasks/seq2seq.py)
SEQ2SEQ_DECODING = {"num_beams": "num_beams", "max_new_tokens": "generation_max_length"}


class Generator:
    """A model and its tokenizer ready to generate: loaded from a folder, or (`from_model`) a live model, e.g. the
    one being trained, used as it is (no copy of its weights)."""

    def __init__(self, model_dir: str | Path, device: str | None = None, max_length: int | None = None) -> None:
        """`max_length`: a seq2seq model's inputs are truncated to it, not to the training max_length (serve's
        --max-length); a causal LM's prompt is never cut, so it is refused for one."""
        import transformers

        model_dir = str(model_dir)
        check_model_path(model_dir)
        info = read_model_info(model_dir)
        model_config = from_pretrained(transformers.AutoConfig, model_dir, "the model config")
        family = FAMILIES[model_family(model_dir, model_config, info)]
        if max_length is not None:
            if family.continues_prompt:
                raise ConfigError(
                    f"--max-length {max_length}: model {model_dir!r} is a causal LM, whose prompt is never cut (one "
                    "longer than its context is refused); --max-length truncates the inputs of other models: leave "
                    "it out"
                )
            check_max_length_fits(max_length, model_config)
            info = {**info, "max_length": max_length}
        tokenizer = load_tokenizer(model_dir)
        if max_length is not None:
            from tuneforge.data.tokenize import check_room_for_text  # (datasets loads with it: not at every import)

            check_room_for_text(max_length, tokenizer)
        model = load_pretrained_model(getattr(transformers, family.auto_class), model_dir, "the model").eval()
        model.to(inference_device(device))
        self._bind(model, tokenizer, family, info, model_dir)

    @classmethod
    def from_model(cls, model, tokenizer, family: str | None = None, info: dict | None = None) -> Generator:
        """A generator over a live `model` (the very object: it sees every later change of its weights); `family`
        FAMILY_CAUSAL or FAMILY_SEQ2SEQ (default: from the model's config)."""
        generator = cls.__new__(cls)
        encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
        family = family or (FAMILY_SEQ2SEQ if encoder_decoder else FAMILY_CAUSAL)
        generator._bind(model, tokenizer, FAMILIES[family], info or {})
        return generator

    def _bind(self, model, tokenizer, family, info: dict, model_dir: str | None = None) -> None:
        self.model, self.tokenizer, self.kind, self.info = model, tokenizer, family, info
        self.family, self.model_dir = family.name, model_dir
        # the model's own sampling defaults, each within the API's bounds (one outside is dropped, with a note)
        vocab_size = getattr(model.config.get_text_config(), "vocab_size", None)
        self.defaults = checked_defaults(getattr(model, "generation_config", None), model_dir, vocab_size)
        self.device = next(model.parameters()).device
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        if family.padding_side is not None:
            tokenizer.padding_side = family.padding_side

    @property
    def context(self) -> int | None:
        """The model's context: the positions it has (None: no limit)."""
        return context_length(self.model.config)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """One prompt's token ids as this model reads them (a seq2seq model's source prefix in front, truncated
        to its training max_length)."""
        return self.kind.encode(self.tokenizer, text, self.info, add_special_tokens)

    def context_room(self, lengths: list[int], max_new_tokens: int) -> tuple[int, str]:
        """(the new tokens that fit after prompts of `lengths` tokens, why fewer than asked or ""); DataError for a
        prompt that leaves no room."""
        return context_room(self.kind.continues_prompt, self.context, lengths, max_new_tokens)

    def room_in_context(self, lengths: list[int], max_new_tokens: int) -> int:
        """`max_new_tokens`, or fewer where the model's context ends first (a `note:` line on stderr)."""
        room, why = self.context_room(lengths, max_new_tokens)
        if why:
            print(f"note: {why}, not {max_new_tokens}", file=sys.stderr, flush=True)
        return room

    def _encode_batch(self, prompts: Sequence[str], add_special_tokens: bool):
        """The prompts as one padded batch on the model's device; DataError for a prompt that is not UTF-8 text or
        has nothing to continue."""
        for i, text in enumerate(prompts, start=1):
            problem = not_utf8(text)
            if problem:
                raise DataError(f"prompt {i} {problem}; pass it as UTF-8")
        texts = [self.kind.prompt_text(t, self.info) for t in prompts]
        max_length = self.kind.max_prompt_tokens(self.info)
        enc = self.tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=max_length is not None,
            max_length=max_length,
            return_token_type_ids=False,
            add_special_tokens=add_special_tokens,
        ).to(self.device)
        if self.kind.continues_prompt:
            lengths = enc["attention_mask"].sum(1).tolist()
            empty = [i for i, n in enumerate(lengths) if n == 0]
            if empty:  # no BOS token either: nothing to continue from (transformers fails deep inside generate)
                raise DataError(
                    f"prompt {empty[0] + 1} ({prompts[empty[0]]!r}) has no tokens; a causal language model continues "
                    "a text, so give it at least a word"
                )
        return enc

    def trained_sampling(self, given: dict) -> dict:
        """The Sampling settings the model was evaluated with ({} for a causal LM): a seq2seq model's beams (unless
        `given` asks to sample) and new tokens, from its tuneforge.json, as `eval` generated its scored outputs."""
        trained = self.kind.trained_settings(self.info)
        settings = {key: trained[name] for key, name in SEQ2SEQ_DECODING.items() if is_count(trained.get(name))}
        if given.get("do_sample"):  # sampling asked for: beam search only where --num-beams says
            settings.pop("num_beams", None)
        return settings

    def trained_settings_line(self, given: dict) -> str | None:
        """The one line saying which settings of the model's training its generation takes (as `eval` says them),
        those a flag in `given` overrides left out (a `max_length` given: the one of `given`, not its training's);
        None when it takes none."""
        taken = dict(self.kind.trained_settings(self.info))
        for key, name in SEQ2SEQ_DECODING.items():
            if key not in self.trained_sampling(given) or given.get(key) is not None:
                taken.pop(name, None)
        if given.get("max_length") is not None:
            taken.pop("max_length", None)
        if not taken:
            return None
        return trained_settings_line(taken)

    def make_batch(self, pad_id: int):
        """The engine's running batch for this model's family."""
        return self.kind.batch(self.model, pad_id)

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[str],
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        num_beams: int | None = None,
        seed: int | None = None,
        add_special_tokens: bool = True,
    ) -> list[str]:
        """The generated text for each prompt (without the prompt itself). A setting left out (None): the one the
        model was evaluated with (`trained_sampling`: a seq2seq model's num_beams and generation_max_length), else
        Sampling's default (greedy, 50 new tokens). `add_special_tokens=False` for prompts that carry their own (a
        chat template's rendering)."""
        if isinstance(prompts, str):  # a str is a sequence too: each character would be a prompt
            raise TypeError(f"prompts is a list of texts, not one text: generate([{prompts[:40]!r}])")
        given = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "num_beams": num_beams, "seed": seed}
        given.update({k: v for k, v in self.trained_sampling(given).items() if given[k] is None})
        settings = parse_options(Sampling, {**given, "temperature": temperature, "top_k": top_k, "top_p": top_p})
        if not prompts:
            return []
        if settings.seed is not None:
            from transformers import set_seed

            set_seed(settings.seed)
        enc = self._encode_batch(prompts, add_special_tokens)
        lengths = enc["attention_mask"].sum(1).tolist()
        options = settings.model_dump(include={"num_beams", "do_sample"})
        if settings.temperature is None and self.defaults.values.get("temperature", 1.0) < SAMPLING_EPS:
            options["do_sample"] = False  # the model's temperature 0 is greedy, as the server reads it (vLLM too)
        options["max_new_tokens"] = self.room_in_context(lengths, settings.max_new_tokens)
        options["pad_token_id"] = self.tokenizer.pad_token_id
        if settings.do_sample:  # only sampling reads these; greedy/beam would warn about them
            options.update(settings.model_dump(include={"temperature", "top_k", "top_p"}, exclude_none=True))
        out = self.model.generate(**enc, **options)
        if self.kind.continues_prompt:  # the prompt (left-padded to one width) comes first
            return self._continuations(enc["input_ids"], out)
        return self.tokenizer.batch_decode(out, skip_special_tokens=True)

    def _continuations(self, prompt_ids: torch.Tensor, out: torch.Tensor) -> list[str]:
        """What each prompt is continued with: the whole row's text past the prompt's text, as transformers'
        text-generation pipeline cuts it (a SentencePiece tokenizer drops the leading space of a text's first token,
        so the new tokens decoded alone would glue " Paris" to the prompt as "Paris")."""
        texts = []
        for prompt, row in zip(prompt_ids, out):
            start = self.tokenizer.decode(prompt, skip_special_tokens=True)
            whole = self.tokenizer.decode(row, skip_special_tokens=True)
            alone = self.tokenizer.decode(row[len(prompt) :], skip_special_tokens=True)
            texts.append(whole[len(start) :] if whole.startswith(start) else alone)  # (a prompt decoding apart)
        return texts


def is_count(value) -> bool:
    """`value` is a positive int (a hand-edited tuneforge.json may hold anything)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def context_room(
    continues_prompt: bool, context: int | None, lengths: list[int], max_new_tokens: int
) -> tuple[int, str]:
    """(the new tokens that fit the model's `context` after prompts of `lengths` tokens, why fewer than asked or
    ""); DataError for a prompt that leaves no room. A causal LM's prompt and continuation share the positions,
    a seq2seq model's encoder reads the prompt and its decoder has the positions for itself."""
    if context is None:
        return max_new_tokens, ""
    longest = max(lengths, default=0)
    which = lengths.index(longest) + 1 if lengths else 1
    if not continues_prompt:
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
    whose = f"after prompt {which}'s {longest} tokens " if continues_prompt else ""
    return room, f"generation stops at the model's context of {context} tokens: {room} new tokens {whose}at most"


# ---- CLI ---------------------------------------------------------------------------------
def cmd_generate(ns: argparse.Namespace) -> int:
    options = parse_options(GenerateOptions, ns)  # every flag checked before the model loads
    generator = Generator(options.model_dir, max_length=options.max_length)
    for note in generator.defaults.notes:
        print(f"note: {note}", file=sys.stderr, flush=True)
    given = {key: getattr(ns, key, None) for key in Sampling.model_fields}  # None: the flag was left out
    line = generator.trained_settings_line({**given, "max_length": options.max_length})
    if line:
        print(line, file=sys.stderr, flush=True)
    outputs = generator.generate(options.prompt, **given)
    if options.print_json:
        generations = [{"prompt": p, "generated": t} for p, t in zip(options.prompt, outputs)]
        print(json.dumps({"generations": generations}), flush=True)
        return 0
    for prompt, text in zip(options.prompt, outputs):
        print(prompt + text if generator.kind.continues_prompt else text, flush=True)
    return 0


def add_arguments(p) -> None:
    """`tuneforge generate`'s arguments: GenerateOptions' fields (the CLI lists the command and its help)."""
    add_model_flags(p, GenerateOptions)
    p.set_defaults(func=cmd_generate)
