"""Log-probs through the OpenAI routes: completions' `logprobs`, `echo` (with `max_tokens: 0`) and token-id prompts,
chat's `logprobs`/`top_logprobs`, and `best_of`, each checked against a direct forward pass of the same model folder
(within 1e-4), by the official `openai` client against the real server (in-process uvicorn, serve/app.py)."""

from __future__ import annotations

import json
import math

import openai
import pytest
import torch

from test_serve_generate import KEY, NAME, Reference, app_server, wait_ready
from tuneforge.serve.logprobs import TokenTexts

TOL = 1e-4
PROMPT = "Two children are watching a small boat"


@pytest.fixture(scope="module")
def url(chat_model):
    with app_server(chat_model, api_key=KEY, max_batch_size=8) as url:
        wait_ready(url)
        yield url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ref(chat_model) -> Reference:
    return Reference(chat_model)


def name(ref: Reference, token_id: int) -> str:
    """How the server names a token (its text, or `bytes:\\x..` for a part of a character: test_token_names)."""
    return TokenTexts(ref.tokenizer).text(token_id)


def test_token_names_are_their_text_or_for_a_part_of_a_character_its_bytes(ref):
    texts = TokenTexts(ref.tokenizer)
    assert texts.text(ref.ids("dog")[-1]) == ref.tokenizer.decode(ref.ids("dog")[-1:])
    parts = ref.tokenizer("\u20ac", add_special_tokens=False)["input_ids"]  # the euro sign: 3 bytes, byte tokens
    assert len(parts) > 1 and all(texts.text(t).startswith("bytes:\\x") for t in parts)
    assert bytes(b for t in parts for b in texts.bytes(t)).decode() == "\u20ac"
    assert "".join(texts.text(t) for t in parts) == "".join(
        "bytes:" + "".join(f"\\x{b:02x}" for b in texts.bytes(t)) for t in parts
    )
    assert texts.bytes(ref.ids("dog")[-1]) == list(texts.text(ref.ids("dog")[-1]).encode())


def forward_logprobs(ref: Reference, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits over `ids` in one forward pass: row j predicts token j + 1."""
    with torch.no_grad():
        return torch.log_softmax(ref.model(torch.tensor([ids])).logits[0].float(), -1)


def assert_token_logprobs(ref: Reference, ids: list[int], start: int, logprobs: list, top: list | None, k: int):
    """`logprobs[j]` is the log-prob of ids[start + j] given the tokens before it, `top[j]` holds the k most likely
    and the chosen token (by their texts) with their log-probs: as one forward pass over `ids` gives them."""
    want = forward_logprobs(ref, ids)
    assert len(logprobs) == len(ids) - start
    for j, got in enumerate(logprobs):
        token, row = ids[start + j], want[start + j - 1]
        assert abs(got - float(row[token])) < TOL, (j, got, float(row[token]))
        if top is None:
            continue
        values, best = row.topk(k)
        texts = {name(ref, t): float(v) for t, v in zip(best.tolist(), values.tolist())}
        texts[name(ref, token)] = float(row[token])
        assert top[j].keys() == texts.keys()
        assert all(abs(top[j][t] - texts[t]) < TOL for t in texts), (j, top[j], texts)


def assert_offsets_index(text: str, lp) -> None:
    """Each token's text_offset is where its text starts in `text` (a token named by its bytes: within the text)."""
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    for token, offset in zip(lp.tokens, lp.text_offset):
        assert token.startswith("bytes:") or text[offset:].startswith(token), (token, offset)


def test_echo_with_no_new_tokens_gives_each_prompt_tokens_logprob(client, ref):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, max_tokens 0 (and 1: its own), logprobs."""
    ids = ref.ids(PROMPT)
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0)
    [choice] = out.choices
    lp = choice.logprobs
    assert choice.text == ref.tokenizer.decode(ids) and choice.finish_reason == "length"
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    assert lp.tokens == [name(ref, t) for t in ids]
    assert_token_logprobs(ref, ids, 1, lp.token_logprobs[1:], lp.top_logprobs[1:], 2)
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    harness = client.completions.create(model=NAME, prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0)
    [generated] = harness.choices[0].logprobs.token_logprobs[len(ids) :]
    assert harness.choices[0].logprobs.token_logprobs[: len(ids)] == pytest.approx(lp.token_logprobs, abs=TOL)
    assert generated == pytest.approx(float(forward_logprobs(ref, ids)[-1].max()), abs=TOL)  # greedy: the top one


def test_a_prompt_that_fills_the_context_is_scored_with_no_new_tokens(client, ref):
    """Its context's worth of positions, each token's log-prob (as vLLM takes prompt + max_tokens up to the
    context); one token more, or a token to generate, is refused."""
    context = ref.model.config.max_position_embeddings
    ids = (ref.ids(PROMPT) * context)[:context]
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=0, temperature=0)
    assert_token_logprobs(ref, ids, 1, out.choices[0].logprobs.token_logprobs[1:], None, 0)
    for prompt, max_tokens in ((ids + ids[:1], 0), (ids, 1)):
        with pytest.raises(openai.BadRequestError, match="context"):
            client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=0)


def greedy_ids(ref: Reference, ids: list[int], steps: int) -> list[int]:
    out = list(ids)
    for _ in range(steps):
        out.append(int(forward_logprobs(ref, out)[-1].argmax()))
    return out[len(ids) :]


def test_generated_tokens_logprobs_equal_a_forward_pass_over_prompt_and_answer(client, ref):
    ids = ref.ids(PROMPT)
    out = client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=6, logprobs=3, temperature=0, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    answer = greedy_ids(ref, ids, 6)
    assert lp.tokens == [name(ref, t) for t in answer]
    assert_offsets_index(out.choices[0].text, lp)
    assert_token_logprobs(ref, ids + answer, len(ids), lp.token_logprobs, lp.top_logprobs, 3)


def test_sampled_tokens_carry_the_models_logprobs_not_the_sampling_distributions(client, ref):
    """Temperature 1.8 and top_k 5 change what is drawn, not the log-prob reported (vLLM's raw log-probs)."""
    ids = ref.ids(PROMPT)
    want = forward_logprobs(ref, ids)[-1]
    for seed in range(3):
        out = client.completions.create(
            model=NAME, prompt=PROMPT, max_tokens=1, logprobs=0, temperature=1.8, seed=seed, extra_body={"top_k": 5}
        )
        lp = out.choices[0].logprobs
        [(token, logprob)] = lp.top_logprobs[0].items()  # logprobs 0: the chosen token alone
        assert token == lp.tokens[0] and logprob == lp.token_logprobs[0]
        chosen = [t for t in want.topk(5).indices.tolist() if name(ref, t) == token]
        assert any(abs(float(want[t]) - logprob) < TOL for t in chosen), (token, logprob)


def test_echo_of_a_text_prompt_streams_as_it_answers(client, ref):
    ask = dict(model=NAME, prompt=[PROMPT, "The dog"], max_tokens=4, echo=True, logprobs=1, temperature=0)
    whole = client.completions.create(**ask)
    texts, tokens, logprobs = {}, {}, {}
    for chunk in client.completions.create(**ask, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
                logprobs.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    for c in whole.choices:
        assert c.text.startswith([PROMPT, "The dog"][c.index]) and texts[c.index] == c.text
        assert tokens[c.index] == c.logprobs.tokens
        assert [x is None for x in logprobs[c.index]] == [x is None for x in c.logprobs.token_logprobs]
        assert [x for x in logprobs[c.index] if x is not None] == pytest.approx(
            [x for x in c.logprobs.token_logprobs if x is not None], abs=TOL
        )


def test_text_offsets_index_the_choices_text_past_tokens_named_by_their_bytes(client):
    """Each token's text_offset is where its character starts in the choice's text, streamed or not: a token named
    `bytes:\\xe2` stands for one character at most (its name's length once pushed every later offset past the end
    of the text, and streamed offsets differed)."""
    ask = dict(model=NAME, prompt="The dog costs 5\u20ac a day", max_tokens=8, echo=True, logprobs=0, temperature=0)
    whole = client.completions.create(**ask).choices[0]
    text, lp = whole.text, whole.logprobs
    assert any(t.startswith("bytes:") for t in lp.tokens) and "\u20ac" in text
    assert_offsets_index(text, lp)
    assert text[lp.text_offset[lp.tokens.index("bytes:\\xe2")] :].startswith("\u20ac a day")
    streamed = [
        o
        for c in client.completions.create(**ask, stream=True)
        if c.choices[0].logprobs
        for o in c.choices[0].logprobs.text_offset
    ]
    assert streamed == lp.text_offset


def test_chat_logprobs_and_top_logprobs(client, ref):
    messages = [{"role": "user", "content": "where is the dog"}]
    ask = dict(model=NAME, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    out = client.chat.completions.create(**ask, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    assert bytes(b for t in content for b in t.bytes).decode(errors="replace") == out.choices[0].message.content
    prompt = ref.chat_ids(messages)
    answer = greedy_ids(ref, prompt, 5)
    want = forward_logprobs(ref, prompt + answer)[len(prompt) - 1 : -1]
    assert [t.token for t in content] == [name(ref, t) for t in answer]
    for j, entry in enumerate(content):
        assert entry.logprob == pytest.approx(float(want[j, answer[j]]), abs=TOL)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(want[j].topk(2).values.tolist(), abs=TOL)
        assert entry.bytes == TokenTexts(ref.tokenizer).bytes(answer[j]) and len(entry.top_logprobs) == 2
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == out.choices[0].message.content
    streamed = client.chat.completions.create(**ask, extra_body={"ignore_eos": True}, stream=True)
    got = [t for chunk in streamed for c in chunk.choices if c.logprobs for t in c.logprobs.content]
    assert [t.token for t in got] == [t.token for t in content]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in content], abs=TOL)


def test_best_of_answers_with_the_candidates_of_highest_average_logprob(client):
    """The reference: the same seeded candidates asked for as n choices (candidate j draws with seed + j), ranked by
    their mean token log-prob."""
    ask = dict(model=NAME, prompt=PROMPT, max_tokens=5, temperature=1.3, seed=11)
    candidates = client.completions.create(**ask, n=4, logprobs=0).choices
    mean = {c.text: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in candidates}
    ranked = sorted(mean, key=mean.get, reverse=True)
    best = client.completions.create(**ask, n=2, best_of=4)
    assert [c.text for c in best.choices] == ranked[:2] and [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)  # not asked for: not shown
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in candidates)  # all were generated


def test_token_id_prompts_answer_as_their_text_does(client, ref):
    texts = [PROMPT, "The dog"]
    by_text = client.completions.create(model=NAME, prompt=texts, max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=NAME, prompt=[ref.ids(t) for t in texts], max_tokens=4, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert by_ids.usage == by_text.usage


def raw(url: str, body: dict):
    import httpx

    return httpx.post(f"{url}/v1/completions", json={"model": NAME, **body}, headers={"Authorization": f"Bearer {KEY}"})


BAD = [
    ("logprobs above 20", dict(prompt="a", logprobs=21), "logprobs"),
    ("logprobs as a bool", dict(prompt="a", logprobs=True), "logprobs"),
    ("nothing to do", dict(prompt="a", max_tokens=0), "max_tokens"),
    ("best_of below n", dict(prompt="a", n=3, best_of=2), "best_of"),
    ("best_of streamed", dict(prompt="a", n=1, best_of=2, stream=True), "best_of"),
    ("a token past the vocabulary", dict(prompt=[1, 2, 10**6]), "prompt"),
    ("a negative token id", dict(prompt=[[1, 2], [-1]]), "prompt[1]"),
    ("an empty id list", dict(prompt=[[1, 2], []]), "prompt[1]"),
    ("ids and text mixed", dict(prompt=["a", 5]), "prompt"),
    ("a token id as a float", dict(prompt=[1, 2.0]), "prompt"),
    ("too many candidates", dict(prompt=["a"] * 5, best_of=16), "prompt"),
]


@pytest.mark.parametrize("what, body, param", BAD, ids=[b[0] for b in BAD])
def test_bad_logprob_requests_are_refused_naming_the_field(url, what, body, param):
    r = raw(url, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_prompt_of_no_accepted_form_is_named_with_the_forms_it_takes(url):
    """Not `prompt.str: Input should be a valid string` (the first union member's complaint) for bad token ids."""
    message = raw(url, dict(prompt=[1, "x"])).json()["error"]["message"]
    assert message == "prompt: matches none of the forms it takes: str, list[str], list[int], list[list[int]]"


def test_chat_refuses_top_logprobs_without_logprobs_and_best_of(url):
    import httpx

    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    auth = {"Authorization": f"Bearer {KEY}"}
    for extra, param in [({"top_logprobs": 2}, "top_logprobs"), ({"best_of": 2}, "best_of")]:
        r = httpx.post(f"{url}/v1/chat/completions", json={**chat, **extra}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_echo_is_refused_for_a_model_that_reads_its_prompt(tiny_t5):
    with app_server(tiny_t5) as url:
        wait_ready(url)
        r = raw(url, dict(prompt="translate: a dog", echo=True, max_tokens=2))
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
    assert json.loads(r.text)["error"]["message"].startswith("echo needs a model that continues its prompt")


def test_a_log_prob_of_minus_infinity_is_shown_as_vllm_shows_it_and_nan_as_null(ref):
    """A token the model rules out has a log-prob of -inf, and fp16 logits that overflowed give nan: neither has a
    JSON spelling (a bare -Infinity or NaN breaks JSON.parse, and Starlette refuses it: a 500). -inf is -9999.0, as
    vLLM's OpenAI server clamps it; nan is null."""
    from fastapi.responses import JSONResponse

    from tuneforge.serve import openai_api as oa
    from tuneforge.serve.logprobs import TokenLogprob

    texts = TokenTexts(ref.tokenizer)
    a, b = ref.ids("dog")[-1], ref.ids("boat")[-1]
    entries = [
        TokenLogprob(a, None, ()),
        TokenLogprob(b, -math.inf, ((a, -0.1), (b, -math.inf))),
        TokenLogprob(a, math.nan, ((a, math.nan),)),
    ]
    completion = oa.completion_logprobs(entries, texts)
    assert completion["token_logprobs"] == [None, -9999.0, None]
    assert completion["top_logprobs"][1:] == [{name(ref, a): -0.1, name(ref, b): -9999.0}, {name(ref, a): None}]
    chat = oa.chat_logprobs(entries[1:], texts, 2)["content"]
    assert [c["logprob"] for c in chat] == [-9999.0, None]
    assert [t["logprob"] for t in chat[0]["top_logprobs"]] == [-0.1, -9999.0]
    JSONResponse({"completion": completion, "chat": chat})  # renders: Starlette's JSON refuses nan and infinity
