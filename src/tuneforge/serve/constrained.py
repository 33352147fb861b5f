"""Constrained decoding for `response_format` (`json_object`, `json_schema`): what owns it here is turning an OpenAI
`response_format` into a per-sequence `Constraint` that masks each next-token logits row to the tokens the JSON
grammar allows, and advancing it with each chosen token.

The grammar engine is llguidance (the guidance project's core: a Rust library with abi3 wheels, nothing to
compile): it compiles a JSON Schema into a grammar and computes the allowed-token bitmask on the CPU in 5-20 µs per
token, with no precomputation over the vocabulary per schema, and is a structured-output backend of vLLM, SGLang
and transformers. Chosen over xgrammar, whose wheels and GPU kernels are built against a given torch version
(tuneforge pins its own torch), and over outlines, whose regex-to-automaton index is built per schema over the whole
vocabulary (it can take seconds for a large schema, at request time) and whose JSON Schema coverage is smaller.

- `tokenizer_for(hf_tokenizer, eos_ids)`: the model's `Vocab` (llguidance's view of the tokenizer and the
  end-of-sequence ids), cached per tokenizer; build it once per model.
- `compile_response_format(response_format, vocab)`: None for `{"type": "text"}` (or no response_format), else a
  fresh `Constraint`; any JSON object for `json_object`; the schema of `{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}` (enforced whatever `strict` says, as vLLM does). A bad or unsupported format
  raises `ResponseFormatError` (a ValueError) naming the field, at request time: the schema is compiled and
  checked here, never mid-generation. Compiling can take up to about a second for schemas near the size cap and
  releases the GIL: call it off the event loop.
- `Constraint.mask(row)` / `masks(constraints, logits)`: disallowed ids (and ids past the tokenizer's vocabulary,
  where the logits are wider) at -inf, on any device; `accept(token)` advances and raises `ConstraintError` for a
  token the mask did not allow; `is_finished()`: the JSON value is complete and nothing may follow it (the engine
  ends the sequence with finish_reason "stop"); from then on the mask allows the end-of-sequence ids only.
  JSON is generated compact (no whitespace between tokens), as OpenAI's and vLLM's outputs are by default; where
  max_tokens ends a sequence first, its text is a JSON prefix that does not parse (finish_reason "length"), as
  with OpenAI.
One engine thread drives a Constraint; `copy()` gives an independent one (`n` > 1 choices of one request).
"""

from __future__ import annotations

import functools
import json
import os
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import llguidance
import llguidance.hf
import torch
from llguidance import LLMatcher, LLTokenizer
from llguidance.torch import fill_next_token_bitmask, fill_next_token_bitmask_par

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# what a schema may hold, so that compiling it takes a second at most (OpenAI's strict mode allows 5000 properties)
MAX_SCHEMA_CHARS = 256 * 1024  # the schema as compact JSON
MAX_SCHEMA_DEPTH = 64  # nested JSON objects and arrays in the schema; llguidance's own JSON reader stops at 128
MAX_PROPERTIES = 5000  # properties named by all its objects together
MAX_OPTIONAL = 1000  # of those, the optional ones
ANY_OBJECT = {"type": "object"}
# compact output, every keyword enforced (an unsupported one is refused rather than ignored)
JSON_OPTIONS = {"whitespace_flexible": False, "lenient": False}
LIMITS = llguidance.LLParserLimits(verbose_errors=False)  # errors name the schema problem, not parser internals


class ResponseFormatError(ValueError):
    """A response_format that cannot be honoured; the message names the field (the server answers 400)."""

    param = "response_format"


class ConstraintError(RuntimeError):
    """A sequence went where its grammar does not allow (a token the mask excluded)."""


@dataclass(frozen=True)
class Vocab:
    """llguidance's tokenizer for one model and the model's end-of-sequence ids."""

    tokenizer: LLTokenizer
    eos_ids: tuple[int, ...]


_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_for(hf_tokenizer, eos_ids: Iterable[int] | None = None) -> Vocab:
    """The `Vocab` of a Hugging Face fast tokenizer, built once per (tokenizer, eos ids) (about 0.6 s for a 49k
    vocabulary). `eos_ids`: the ids that end a sequence (default: the tokenizer's eos_token_id). The logits' width
    is read from the logits themselves: ids past the tokenizer's vocabulary (a model's vocab_size rounded up) are
    masked."""
    eos = tuple(sorted(set(eos_ids))) if eos_ids is not None else (hf_tokenizer.eos_token_id,)
    if not eos or any(not isinstance(i, int) for i in eos):
        raise ResponseFormatError("response_format json_object/json_schema needs the model's end-of-sequence token id")
    cached = _VOCABS.setdefault(hf_tokenizer, {})
    if eos not in cached:
        try:
            ll = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=list(eos))
        except ValueError as err:  # llguidance reads fast (Rust `tokenizers`) tokenizers only
            raise ResponseFormatError(
                f"response_format json_object/json_schema needs a fast tokenizer; this model has "
                f"{type(hf_tokenizer).__name__} ({err})"
            ) from None
        cached[eos] = Vocab(ll, eos)
    return cached[eos]


def compile_response_format(response_format, vocab: Vocab) -> Constraint | None:
    """A fresh `Constraint` for `response_format` (an OpenAI chat request's field), None for text; raises
    `ResponseFormatError` for a format or schema that cannot be honoured."""
    schema = schema_of(response_format)
    if schema is None:
        return None
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as err:
        raise ResponseFormatError(f"{_where(response_format)}: {err}") from None
    matcher = LLMatcher(vocab.tokenizer, grammar, log_level=0, limits=LIMITS)  # compiles and checks the grammar
    if matcher.is_error():
        raise ResponseFormatError(f"{_where(response_format)} cannot be enforced: {matcher.get_error()}")
    return Constraint(matcher, vocab)


def schema_of(response_format) -> str | None:
    """The JSON Schema (compact JSON text) that `response_format` asks for, None for text; checks its shape."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ResponseFormatError(
            f'response_format must be an object such as {{"type": "json_object"}}, not {_kind(response_format)}'
        )
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        given = json.dumps(kind, default=str)[:80]
        raise ResponseFormatError(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}; got {given}"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps(ANY_OBJECT)
    return _checked_schema(response_format.get("json_schema"))


def _checked_schema(spec) -> str:
    if not isinstance(spec, Mapping):
        raise ResponseFormatError(
            'response_format of type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}'
        )
    name, schema, strict = spec.get("name"), spec.get("schema"), spec.get("strict")
    if not isinstance(name, str) or not name:
        raise ResponseFormatError("response_format.json_schema.name must be a non-empty string")
    if strict is not None and not isinstance(strict, bool):
        raise ResponseFormatError("response_format.json_schema.strict must be true or false")
    if not isinstance(schema, Mapping):
        raise ResponseFormatError(
            f"response_format.json_schema.schema must be a JSON Schema object; got {_kind(schema)}"
        )
    for value, limit, what in schema_size(schema):
        if value > limit:
            raise ResponseFormatError(f"response_format.json_schema.schema {what}")
    text = json.dumps(schema, separators=(",", ":"))
    if len(text) > MAX_SCHEMA_CHARS:
        raise ResponseFormatError(
            f"response_format.json_schema.schema is {len(text)} characters as JSON; at most {MAX_SCHEMA_CHARS}"
        )
    return text


def schema_size(schema: Mapping) -> list[tuple[int, int, str]]:
    """What makes a schema slow to compile, each as (value, limit, what passing the limit means): how deeply its
    dicts and lists nest, how many properties its objects name and how many of those are optional (llguidance's
    time grows with the square of an object's optional properties). Walked without recursion, stopping once a
    limit is passed (so a hostile 10,000-level schema costs little)."""
    depth = properties = optional = 0
    stack = [(schema, 1)]
    while stack and depth <= MAX_SCHEMA_DEPTH and properties <= MAX_PROPERTIES and optional <= MAX_OPTIONAL:
        node, level = stack.pop()
        if not isinstance(node, (Mapping, list)):
            continue
        depth = max(depth, level)
        if isinstance(node, Mapping) and isinstance(node.get("properties"), Mapping):
            names = node["properties"]
            required = node.get("required") if isinstance(node.get("required"), list) else []
            properties += len(names)
            optional += len(set(names) - {name for name in required if isinstance(name, str)})
        stack.extend((child, level + 1) for child in (node.values() if isinstance(node, Mapping) else node))
    return [
        (depth, MAX_SCHEMA_DEPTH, f"nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep"),
        (properties, MAX_PROPERTIES, f"names more than {MAX_PROPERTIES} properties"),
        (optional, MAX_OPTIONAL, f"has more than {MAX_OPTIONAL} optional properties (list them in required)"),
    ]


def _where(response_format) -> str:
    return "response_format.json_schema.schema" if response_format.get("type") == "json_schema" else "response_format"


def _kind(value) -> str:
    """How JSON names the kind of `value` (parsed from JSON)."""
    if value is None:
        return "null"
    names = {bool: "a boolean", str: "a string", list: "an array", int: "a number", float: "a number"}
    return names.get(type(value), "an object" if isinstance(value, Mapping) else type(value).__name__)


class Constraint:
    """One sequence's grammar state: which next tokens keep its output inside the grammar."""

    def __init__(self, matcher: LLMatcher, vocab: Vocab) -> None:
        self.matcher, self.vocab = matcher, vocab
        self._bitmask = torch.zeros((1, (vocab.tokenizer.vocab_size + 31) // 32), dtype=torch.int32)

    def copy(self) -> Constraint:
        """An independent Constraint in the same state (another choice of the same request)."""
        return Constraint(self.matcher.deep_copy(), self.vocab)

    def mask(self, logits_row: torch.Tensor) -> torch.Tensor:
        """`logits_row` (1-D, any float dtype and device) with every token the grammar does not allow next at -inf
        (a new tensor)."""
        self.raise_if_failed()
        fill_next_token_bitmask(self.matcher, self._bitmask)
        width, vocab_size = logits_row.shape[-1], self.vocab.tokenizer.vocab_size
        return logits_row + biases(self._bitmask, vocab_size, width, logits_row.dtype, logits_row.device)[0]

    def accept(self, token_id: int) -> None:
        """Advance past `token_id`; raises `ConstraintError` when the grammar did not allow it."""
        self.raise_if_failed()
        if not self.matcher.consume_token(int(token_id)):
            raise ConstraintError(f"token {token_id} is not allowed here by the response_format grammar")

    def is_finished(self) -> bool:
        """The output is a complete JSON value that nothing may extend: only the end-of-sequence ids remain."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def eos_allowed(self) -> bool:
        """The output so far is complete JSON (an end-of-sequence token may come next)."""
        return self.matcher.is_accepting()

    def raise_if_failed(self) -> None:
        if self.matcher.is_error():
            raise ConstraintError(f"the response_format grammar failed: {self.matcher.get_error()}")


_EXECUTOR: llguidance.LLExecutor | None = None
# llguidance's thread pool fills the rows' bitmasks in parallel; measured (benchmarks/constrained_mask.py), it pays
# from about 16 rows on 16 cores (32 rows: 0.35 ms against 0.53 ms one after another) and never on 2 shared cores
POOL_MIN_ROWS, POOL_MIN_CPUS = 16, 8


def masks(constraints: Sequence[Constraint | None], logits: torch.Tensor) -> torch.Tensor:
    """`logits` (rows × width, any float dtype and device) with each row masked by its Constraint (rows whose entry
    is None unchanged), in one pass over the batch (a new tensor; `logits` itself when no row is constrained)."""
    global _EXECUTOR
    rows = [(i, c) for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return logits
    for _, constraint in rows:
        constraint.raise_if_failed()
    sizes = [c.vocab.tokenizer.vocab_size for _, c in rows]
    bitmask = torch.zeros((len(constraints), (max(sizes) + 31) // 32), dtype=torch.int32)
    if len(rows) >= POOL_MIN_ROWS and (os.cpu_count() or 1) >= POOL_MIN_CPUS:
        _EXECUTOR = _EXECUTOR or llguidance.LLExecutor()
        fill_next_token_bitmask_par(_EXECUTOR, [(c.matcher, i) for i, c in rows], bitmask)
    else:
        for i, constraint in rows:
            fill_next_token_bitmask(constraint.matcher, bitmask, i)
    bias = biases(bitmask, max(sizes), logits.shape[-1], logits.dtype, logits.device)
    for (i, _), size in zip(rows, sizes):
        if size < max(sizes):  # ids past this row's tokenizer vocabulary: never allowed
            bias[i, size:] = -torch.inf
    if len(rows) < len(constraints):
        bias[[i for i, c in enumerate(constraints) if c is None]] = 0
    return logits + bias


@functools.lru_cache(maxsize=16)
def _byte_biases(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """256 × 8: for each byte value, 0 where its bit j (little-endian) is set, else -inf."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, -torch.inf).to(dtype=dtype, device=device)


def biases(bitmask: torch.Tensor, vocab_size: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """llguidance's bitmask (rows × words, int32; bit j of word w: token 32 w + j) as additive biases (rows ×
    `width`, 0 for an allowed id, -inf for the others) in `dtype` on `device`; only the bitmask travels there.
    Ids from `vocab_size` on (past the tokenizer's vocabulary, where the logits are wider) are never allowed.
    A byte-table lookup and an add: on CPU torch's masked_fill and where over a 49k row cost ~10x more."""
    rows = bitmask.shape[0]
    table = _byte_biases(dtype, torch.device(device))
    unpacked = table.index_select(0, bitmask.to(device).view(torch.uint8).flatten().long()).view(rows, -1)
    keep = min(vocab_size, width)
    if unpacked.shape[1] >= width and keep == width:
        return unpacked[:, :width]
    out = torch.full((rows, width), -torch.inf, dtype=dtype, device=device)
    out[:, :keep] = unpacked[:, :keep]
    return out
