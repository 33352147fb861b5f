"""A model's own sampling defaults: the fields of its generation config (generation_config.json) that vLLM takes as
the defaults of a request that leaves them out (`ModelConfig.get_diff_sampling_param`: temperature, top_p, top_k,
min_p, repetition_penalty, and max_new_tokens as max_tokens), which transformers' `generate` reads too.

`checked_defaults` holds each to the bounds of the OpenAI API that `tuneforge serve` speaks (the numbers of
serve/openai_api.py's SamplingRequest): one outside them or of the wrong kind (a string, a boolean, NaN) is dropped
from the model's generation config with a note, so that neither the server nor `tuneforge generate`/`chat` samples
with it or fails on it; so is a token setting that names a token outside the model's vocabulary. A
generation_config.json that is not JSON gets a note too (transformers reads none of it). Imports nothing heavy."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

FILE = "generation_config.json"
MAX_TOKENS = 1 << 20  # serve/openai_api.py's bound of max_tokens and top_k
SAMPLING_EPS = 1e-5  # a temperature below it samples greedily (vLLM's _SAMPLING_EPS): dividing by it overflows


class Bounds(BaseModel):
    """The API's bounds of each field (serve/openai_api.py's SamplingRequest; tests hold them equal)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKENS)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    max_new_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)


FIELDS = tuple(Bounds.model_fields)


@dataclass(frozen=True)
class ModelDefaults:
    """The checked defaults ({field: value}, in the generation config's names) and the notes on what was left out."""

    values: dict
    notes: tuple[str, ...] = ()

    def served(self) -> dict:
        """The defaults in the OpenAI API's names (max_new_tokens is max_tokens)."""
        return {("max_tokens" if k == "max_new_tokens" else k): v for k, v in self.values.items()}

    def line(self) -> str | None:
        """The server's start-up line saying what it takes (None: nothing taken, nothing to note)."""
        if not self.values and not self.notes:
            return None
        taken = ", ".join(f"{k} {v}" for k, v in self.values.items()) or "none"
        line = (
            f"sampling defaults from the model's {FILE} (a request's own values win; --generation-config none for "
            f"OpenAI's): {taken}"
        )
        return line + "".join(f"; {note}" for note in self.notes)


def checked_defaults(generation_config, model_dir: str | None = None, vocab_size: int | None = None) -> ModelDefaults:
    """The sampling defaults of a model's `generation_config` (transformers' GenerationConfig, None: none), each
    value outside the API's bounds dropped from it (set to None, transformers' unset) with a note; `model_dir`:
    where its generation_config.json is, noted when that is not JSON; `vocab_size`: the model's tokens, outside which
    a token setting (`TOKEN_FIELDS`) is dropped so too."""
    notes = [] if model_dir is None else unreadable_file(Path(model_dir) / FILE)
    if vocab_size is not None and generation_config is not None:
        notes += tokens_outside_vocabulary(generation_config, vocab_size)
    values = {}
    for name in FIELDS:
        value = getattr(generation_config, name, None)
        if value is None:
            continue
        try:
            values[name] = getattr(Bounds.model_validate({name: value}), name)
        except ValidationError as err:
            why = err.errors()[0]["msg"]
            notes.append(f"{FILE}'s {name} {value!r} is left out ({why[:1].lower() + why[1:]})")
        setattr(generation_config, name, values.get(name))  # a checked float for an int (transformers wants one)
    return ModelDefaults(values, tuple(notes))


# token settings transformers' generate indexes the logits with (an id outside them: an IndexError or ValueError at
# the first generate call)
TOKEN_FIELDS = (
    "forced_bos_token_id",
    "forced_eos_token_id",
    "bad_words_ids",
    "suppress_tokens",
    "begin_suppress_tokens",
    "sequence_bias",
)


def token_ids(value, name: str = "") -> list:
    """The ids of a token setting: an id, a list of ids, a list of lists (bad_words_ids), or sequence_bias's
    [[ids], bias] pairs (their form checked when the folder was: artifacts.check_generation_config_file)."""
    if name == "sequence_bias" and isinstance(value, list):
        return token_ids([pair[0] for pair in value])
    if isinstance(value, (list, tuple)):
        return [each for part in value for each in token_ids(part)]
    return [value]


def tokens_outside_vocabulary(generation_config, vocab_size: int) -> list[str]:
    """Notes on the token settings (`TOKEN_FIELDS`) naming a token the model does not have, each dropped."""
    notes = []
    for name in TOKEN_FIELDS:
        value = getattr(generation_config, name, None)
        outside = [i for i in token_ids(value, name) if type(i) is not int or not 0 <= i < vocab_size]
        if value is not None and outside:
            notes.append(
                f"{FILE}'s {name} {value!r} is left out (token {outside[0]!r} is outside the model's {vocab_size} "
                "tokens)"
            )
            setattr(generation_config, name, None)
    return notes


def unreadable_file(path: Path) -> list[str]:
    """A note when `path` exists and is not JSON (transformers then falls back to the model's config)."""
    if not path.is_file():
        return []
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        return [f"{path} is not JSON ({str(err)[:80]}): none of it is read"]
    return []
