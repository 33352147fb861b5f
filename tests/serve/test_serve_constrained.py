"""Constrained decoding for response_format (tuneforge.serve.constrained): plain decoding loops (forward, mask,
pick, accept) with the tiny random models' real tokenizers produce JSON that parses and validates against the
schema; max_tokens before the end leaves invalid JSON; bad and hostile formats are refused fast, naming the field."""

from __future__ import annotations

import inspect
import json

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tuneforge.serve.constrained import (
    MAX_OPTIONAL,
    MAX_PROPERTIES,
    MAX_SCHEMA_DEPTH,
    ConstraintError,
    ResponseFormatError,
    compile_response_format,
    masks,
    tokenizer_for,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "integer", "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}
# short enough for tiny_gpt2's 64 positions
FLAG = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "level": {"enum": ["low", "high"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "level", "n"],
    "additionalProperties": False,
}


def json_schema(schema, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def llama(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama).eval(), AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def gpt2(tiny_gpt2):
    return AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval(), AutoTokenizer.from_pretrained(tiny_gpt2)


@pytest.fixture(scope="module")
def vocab(llama):
    return tokenizer_for(llama[1])


def decode(model, tokenizer, constraint, max_tokens: int, temperature: float = 0.0, seed: int = 0, pad_to=None):
    """A plain decoding loop with a key/value cache: forward, mask, pick (greedy or sampled), accept; the text and
    the finish reason the engine would give ("stop" at the grammar's end or an end-of-sequence token, else
    "length"). `pad_to`: logits widened to that many ids, the extra ones most likely of all (a model whose
    vocab_size is rounded up past its tokenizer's)."""
    kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    generator = torch.Generator().manual_seed(seed)
    ids, cache, out = torch.tensor([tokenizer("the answer is").input_ids]), None, []
    eos = set(constraint.vocab.eos_ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            result = model(input_ids=ids, use_cache=True, **{kwarg: cache})
            cache = getattr(result, "cache", None) or result.past_key_values
            logits = result.logits[0, -1]
            if pad_to:
                logits = torch.cat([logits, torch.full((pad_to - logits.numel(),), 1e4)])
            row = constraint.mask(logits)
            if temperature == 0:
                token = int(row.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(row / temperature, -1), 1, generator=generator))
            if token in eos:
                return tokenizer.decode(out), "stop"
            constraint.accept(token)
            out.append(token)
            if constraint.is_finished():
                return tokenizer.decode(out), "stop"
            ids = torch.tensor([[token]])
    return tokenizer.decode(out), "length"


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (1.0, 0), (1.0, 1), (0.7, 2)])
def test_json_schema_output_validates(llama, vocab, temperature, seed):
    model, tokenizer = llama
    text, finish = decode(model, tokenizer, compile_response_format(json_schema(PERSON), vocab), 200, temperature, seed)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (1.0, 3)])
def test_json_schema_with_gpt2(gpt2, temperature, seed):
    model, tokenizer = gpt2
    constraint = compile_response_format(json_schema(FLAG), tokenizer_for(tokenizer))
    text, finish = decode(model, tokenizer, constraint, 56, temperature, seed)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), FLAG)


def test_json_object_gives_objects_or_runs_out(llama, vocab):
    """A random model writes any JSON object; those that end parse as objects, those that max_tokens cuts short
    do not parse (finish "length")."""
    model, tokenizer = llama
    constraints = [compile_response_format({"type": "json_object"}, vocab) for _ in range(8)]
    results = [decode(model, tokenizer, constraint, 150, 1.0, seed) for seed, constraint in enumerate(constraints)]
    finished = [json.loads(text) for text, finish in results if finish == "stop"]
    assert finished and all(isinstance(value, dict) for value in finished)
    assert any(value for value in finished), "only empty objects: the constraint may be stopping too early"
    for text, finish in results:
        if finish == "length":
            with pytest.raises(json.JSONDecodeError):
                json.loads(text)


def test_max_tokens_before_the_end_is_length_and_invalid_json(llama, vocab):
    model, tokenizer = llama
    constraint = compile_response_format(json_schema(PERSON), vocab)
    text, finish = decode(model, tokenizer, constraint, 6)
    assert finish == "length" and not constraint.is_finished() and text.startswith('{"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_logits_wider_than_the_tokenizer_never_pick_the_extra_ids(llama, vocab):
    model, tokenizer = llama
    text, finish = decode(model, tokenizer, compile_response_format(json_schema(PERSON), vocab), 200, pad_to=384)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_only_end_of_sequence_ids_once_finished(llama):
    tokenizer = llama[1]
    eos_ids = (tokenizer.eos_token_id, 7)
    vocab = tokenizer_for(tokenizer, eos_ids=eos_ids)
    constraint = compile_response_format(json_schema({"enum": ["yes", "no"]}), vocab)
    start = constraint.mask(torch.zeros(len(tokenizer)))
    assert all(start[i] == -torch.inf for i in eos_ids), "end of sequence allowed before any JSON"
    for token in tokenizer('"no"', add_special_tokens=False).input_ids:
        assert not constraint.is_finished()
        constraint.accept(token)
    assert constraint.is_finished() and constraint.eos_allowed()
    row = constraint.mask(torch.zeros(len(tokenizer) + 5, dtype=torch.bfloat16))
    assert row.dtype == torch.bfloat16
    assert sorted(torch.nonzero(row == 0).flatten().tolist()) == sorted(eos_ids)
    constraint.accept(eos_ids[1])


def test_a_token_the_mask_excluded_is_refused(vocab, llama):
    tokenizer = llama[1]
    constraint = compile_response_format({"type": "json_object"}, vocab)
    row = constraint.mask(torch.zeros(len(tokenizer)))
    assert torch.isfinite(row).sum() >= 1 and row[tokenizer.convert_tokens_to_ids("{")] == 0
    refused = tokenizer("hello", add_special_tokens=False).input_ids[0]
    assert row[refused] == -torch.inf
    copy = constraint.copy()
    with pytest.raises(ConstraintError, match=f"token {refused} is not allowed"):
        constraint.accept(refused)
    with pytest.raises(ConstraintError):
        constraint.mask(torch.zeros(len(tokenizer)))
    copy.accept(tokenizer.convert_tokens_to_ids("{"))  # the copy is independent of the failed original


def test_batched_masks_equal_row_masks_and_leave_free_rows(vocab, llama):
    tokenizer = llama[1]
    a = compile_response_format(json_schema(PERSON), vocab)
    b = compile_response_format({"type": "json_object"}, vocab)
    for token in tokenizer('{"name":"', add_special_tokens=False).input_ids:
        a.accept(token)
    logits = torch.randn(3, len(tokenizer) + 64, generator=torch.Generator().manual_seed(0))
    batched = masks([a, None, b], logits)
    assert torch.equal(batched[0], a.mask(logits[0])) and torch.equal(batched[2], b.mask(logits[2]))
    assert torch.equal(batched[1], logits[1])
    kept = torch.isfinite(batched[0])
    assert 0 < kept.sum() < len(tokenizer) and torch.equal(batched[0][kept], logits[0][kept])
    assert torch.isinf(batched[0, len(tokenizer) :]).all() and torch.isinf(batched[2, len(tokenizer) :]).all()
    free = logits[:2]
    assert masks([None, None], free) is free


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_masks_on_cuda(vocab, llama):
    tokenizer = llama[1]
    constraint = compile_response_format({"type": "json_object"}, vocab)
    row = torch.randn(len(tokenizer) + 32)
    assert torch.equal(constraint.mask(row.cuda()).cpu(), constraint.mask(row))
    assert torch.equal(masks([constraint], row[None].cuda()).cpu(), masks([constraint], row[None]))


@pytest.mark.parametrize("text", [None, {"type": "text"}])
def test_text_is_unconstrained(vocab, text):
    assert compile_response_format(text, vocab) is None


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def many_properties(n: int, required: bool = False) -> dict:
    names = [f"p{i}" for i in range(n)]
    return {"type": "object", "properties": dict.fromkeys(names, {"type": "integer"}), "required": names * required}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "response_format,message",
    [
        ("json_object", "response_format must be an object"),
        (["json_object"], "response_format must be an object"),
        ({}, "response_format.type must be one of text, json_object, json_schema"),
        ({"type": "xml"}, 'response_format.type must be one of text, json_object, json_schema; got "xml"'),
        ({"type": "json_schema"}, '"json_schema" needs "json_schema"'),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema must be a JSON Schema object"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "json_schema.name must be"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "schema must be a JSON Schema object"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
            "json_schema.strict must be true or false",
        ),
        (json_schema({"type": "foo"}), "response_format.json_schema.schema cannot be enforced: Invalid type: foo"),
        (json_schema({"type": "integer", "minimum": 5, "maximum": 1}), "minimum (5) is greater than maximum (1)"),
        (json_schema({"$ref": "#/$defs/missing"}), "does not exist"),
        (json_schema({"type": "string", "format": "not-a-format"}), "Unknown format: not-a-format"),
        (json_schema(deep_schema(10_000)), f"more than {MAX_SCHEMA_DEPTH} levels deep"),
        (json_schema({"enum": [f"value-{i}" for i in range(100_000)]}), "characters as JSON; at most"),
        (json_schema(many_properties(MAX_PROPERTIES + 1, required=True)), f"names more than {MAX_PROPERTIES} prop"),
        (json_schema(many_properties(MAX_OPTIONAL + 1)), f"more than {MAX_OPTIONAL} optional properties"),
    ],
    ids=lambda value: None if isinstance(value, str) else "",
)
def test_bad_formats_are_refused_naming_the_field(vocab, response_format, message):
    with pytest.raises(ResponseFormatError) as caught:
        compile_response_format(response_format, vocab)
    assert message in str(caught.value)
    assert str(caught.value).startswith("response_format")
    assert isinstance(caught.value, ValueError) and caught.value.param == "response_format"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "schema",
    [
        deep_schema(MAX_SCHEMA_DEPTH // 2 - 1),
        many_properties(MAX_PROPERTIES, required=True),
        many_properties(MAX_OPTIONAL),
    ],
    ids=["deepest", "most-properties", "most-optional"],
)
def test_schemas_at_the_limits_compile(vocab, schema):
    assert compile_response_format(json_schema(schema), vocab) is not None


def test_pydantic_style_schema_with_defs_and_nullable(vocab, llama):
    schema = {
        "$defs": {
            "Item": {
                "title": "Item",
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 3}},
                "required": ["sku"],
                "additionalProperties": False,
            }
        },
        "title": "Order",
        "description": "an order",
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "maxItems": 2},
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4}], "default": None},
        },
        "required": ["items", "note"],
        "additionalProperties": False,  # pydantic's extra="forbid"
    }
    model, tokenizer = llama
    text, finish = decode(model, tokenizer, compile_response_format(json_schema(schema), vocab), 120, 1.0, 5)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)
