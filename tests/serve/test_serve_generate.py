"""`tuneforge serve` of a generative model: the OpenAI routes driven by the official `openai` client against the
real server on 127.0.0.1 (a `tuneforge serve` process; in-process uvicorn servers for the settings one test
needs), compared token for token with `transformers`' own greedy `generate` on the same tiny model folder.

The main server serves a tiny random Llama marked as a chat SFT export (tuneforge.json task "sft", a chat
template), with its API key from TUNEFORGE_API_KEY.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import torch

from conftest import cli_main, serving, start_server

KEY = "test-key-7f3a"
NAME = "tiny-chat"
TEMPLATE = (  # compact: the tiny byte-level tokenizer spells ChatML's markers in many pieces
    "{% for m in messages %}{{ m['role'][0] }}>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a>\n{% endif %}"
)
PROMPTS = ["A man is riding", "The dog", "Two children are watching a small boat", "A woman", "The old man is", "A"]


def save_chat_model(out: Path, tiny_llama: str) -> str:
    """`tiny_llama` with a chat template, marked as exported by `--task sft`."""
    from transformers import AutoTokenizer

    shutil.copytree(tiny_llama, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    (out / "tuneforge.json").write_text(json.dumps({"task": "sft"}))
    return str(out)


@contextmanager
def app_server(model_dir: str, load=None, **options):
    """`create_app` for `model_dir` under uvicorn in a thread, on a free port of 127.0.0.1; yields its URL once it
    listens. `load`: what the app loads (default: `load_servable(model_dir)`); `on_fatal`: create_app's."""
    import uvicorn

    from tuneforge.predict import load_servable
    from tuneforge.serve.app import ServeOptions, create_app

    on_fatal = options.pop("on_fatal", None)
    options.setdefault("precision", "fp32")  # answers equal an fp32 reference whatever the CPU
    settings = ServeOptions(model_dir=model_dir, served_model_name=options.pop("served_model_name", NAME), **options)
    app = create_app(load or (lambda: load_servable(model_dir)), settings, on_fatal)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


def wait_ready(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the model did not load"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(chat_model):
    """`tuneforge serve` in its own process, the key from the environment; stopped at the end of the module."""
    before = os.environ.get("TUNEFORGE_API_KEY")
    os.environ["TUNEFORGE_API_KEY"] = KEY
    try:
        with serving(chat_model, max_batch_size=8, served_model_name=NAME, max_body_bytes=100_000) as url:
            yield url
    finally:
        if before is None:
            os.environ.pop("TUNEFORGE_API_KEY", None)
        else:
            os.environ["TUNEFORGE_API_KEY"] = before


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


AUTH = {"Authorization": f"Bearer {KEY}"}


class Reference:
    """transformers' own greedy generate on the same folder."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def ids(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt)["input_ids"]

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def greedy(self, ids: list[int], max_new_tokens: int, **generate) -> tuple[str, int]:
        """(text, tokens generated, the end-of-sequence token not counted); `generate`: more of generate's
        arguments (its logits processors)."""
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **generate
            )[0, len(ids) :].tolist()
        eos = self.tokenizer.eos_token_id
        new = out[: out.index(eos)] if eos in out else out
        return self.tokenizer.decode(new, skip_special_tokens=True), len(new)


@pytest.fixture(scope="module")
def ref(chat_model) -> Reference:
    return Reference(chat_model)


def metric(text: str, name: str) -> float:
    """The value of one sample line (`name` with its labels, as written) of a /metrics page; 0 when absent."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def concurrently(ask, n: int) -> None:
    """`ask(0)` ... `ask(n - 1)`, each in its own thread, all started before any is waited for."""
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)


# ---- the routes, with the official client ------------------------------------------------------------
def test_health_is_open_and_every_other_route_needs_the_key(server, client):
    health = httpx.get(f"{server}/health", timeout=10)
    assert health.status_code == 200
    assert health.json()["kind"] == "generate" and health.json()["chat"] is True and health.json()["context"] == 64
    for headers, code in (({}, None), ({"Authorization": "Bearer wrong"}, "invalid_api_key")):  # as OpenAI's
        r = httpx.get(f"{server}/v1/models", headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
        assert r.json()["error"]["code"] == code
        assert r.headers["WWW-Authenticate"].startswith("Basic")
    assert httpx.get(f"{server}/metrics", timeout=10).status_code == 401
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{server}/v1/models", headers={"X-API-Key": KEY}, timeout=10).status_code == 200
    assert httpx.get(f"{server}/v1/models", auth=("anyone", KEY), timeout=10).status_code == 200  # the page's login
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()


def test_models_retrieve_gives_the_served_models_card_and_404_for_another_name(server, client):
    card = client.models.retrieve(NAME)
    assert card == client.models.list().data[0] and (card.id, card.object) == (NAME, "model")
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.retrieve(NAME)
    page = httpx.get(f"{server}/metrics", headers=AUTH, timeout=10).text
    assert metric(page, 'tuneforge_requests_total{route="/v1/models/{model}",status="200"}') >= 1


def test_models_retrieve_of_a_served_name_with_slashes(chat_model):
    """The client sends the name's "/" as %2F: the route still reads the whole name."""
    with app_server(chat_model, served_model_name="org/tiny-chat") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.models.retrieve("org/tiny-chat").id == "org/tiny-chat"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("org")


def test_every_answer_has_its_own_x_request_id_as_openais(server, client):
    """OpenAI sends x-request-id (the client's `_request_id`, an error's `request_id`); one a client sends is
    echoed back, as vLLM's --enable-request-id-headers does."""
    ask = dict(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    ids = [
        client.chat.completions.create(**ask)._request_id,
        client.completions.create(model=NAME, prompt="hi", max_tokens=2)._request_id,
        client.models.retrieve(NAME)._request_id,
        client.chat.completions.create(**ask, stream=True).response.headers["x-request-id"],
    ]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**{**ask, "max_tokens": 0})
    ids.append(refused.value.request_id)
    ids.append(httpx.get(f"{server}/v1/models", timeout=10).headers["x-request-id"])  # a 401 of the gate
    assert all(re.fullmatch(r"req_[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == len(ids), ids
    mine = client.chat.completions.create(**ask, extra_headers={"X-Request-Id": "trace-7"})
    assert mine._request_id == "trace-7"


def test_completions_equal_transformers_greedy_and_count_usage(client, ref):
    for prompt in PROMPTS[:2]:
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
        text, n = ref.greedy(ref.ids(prompt), 8)
        assert out.choices[0].text == text
        assert out.choices[0].finish_reason == ("length" if n == 8 else "stop")
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ref.ids(prompt)), n)
        assert out.usage.total_tokens == out.usage.prompt_tokens + n
    many = client.completions.create(model=NAME, prompt=PROMPTS[:3], max_tokens=5, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [ref.greedy(ref.ids(p), 5)[0] for p in PROMPTS[:3]]


def test_concurrent_requests_decode_together_and_each_gets_its_own_answer(server, client, ref):
    before = httpx.get(f"{server}/metrics", headers=AUTH, timeout=10).text
    answers: dict[int, str] = {}
    start = threading.Barrier(len(PROMPTS))

    def ask(i: int) -> None:
        start.wait(timeout=30)
        time.sleep(0.01 * i)  # staggered: later requests arrive while earlier ones decode
        out = client.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=10 + 4 * i, temperature=0)
        answers[i] = out.choices[0].text

    concurrently(ask, len(PROMPTS))
    for i, prompt in enumerate(PROMPTS):
        assert answers[i] == ref.greedy(ref.ids(prompt), 10 + 4 * i)[0], i
    after = httpx.get(f"{server}/metrics", headers=AUTH, timeout=10).text
    steps = metric(after, "tuneforge_batch_size_count") - metric(before, "tuneforge_batch_size_count")
    single = metric(after, 'tuneforge_batch_size_bucket{le="1"}') - metric(
        before, 'tuneforge_batch_size_bucket{le="1"}'
    )
    assert steps > single, "no forward pass held more than one sequence"
    # one row per token: far fewer forward passes than tokens generated
    assert steps < sum(10 + 4 * i for i in range(len(PROMPTS)))


def test_chat_streams_the_same_answer_as_without_streaming(server, client, ref):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "where is the dog"}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    text, n = ref.greedy(ref.chat_ids(messages), 12)
    assert whole.choices[0].message.content == text and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ref.chat_ids(messages)) and whole.usage.completion_tokens == n

    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # token by token
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n

    body = {"model": NAME, "messages": messages, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_per_request_sampling_parameters(client, ref):
    prompt = PROMPTS[0]
    sampled = dict(model=NAME, prompt=prompt, max_tokens=10, temperature=1.0, seed=7)
    first = client.completions.create(**sampled).choices[0].text
    assert client.completions.create(**sampled).choices[0].text == first  # a seed reproduces
    three = client.completions.create(**sampled, n=3).choices
    assert len(three) == 3 and three[0].text == first and len({c.text for c in three}) > 1
    # top_p that keeps only the most likely token samples greedily
    nucleus = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=1.0, top_p=1e-6)
    greedy, _ = ref.greedy(ref.ids(prompt), 10)
    assert nucleus.choices[0].text == greedy

    stop = greedy[3:5]
    cut = greedy[: greedy.index(stop)]
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, stop=[stop, "never"])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    # lm-evaluation-harness sends a task's stop strings and the end-of-text, up to six (OpenAI allows four)
    harness_stops = ["never", "Question:", "</s>", "<|im_end|>", "\n\n\n", stop]
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, stop=harness_stops)
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=10, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut  # the stop string's start was held back

    short = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


# ---- bad requests ---------------------------------------------------------------------------------
def completion(**changes) -> dict:
    return {"model": NAME, "prompt": "A man is", "max_tokens": 4, **changes}


def chat(**changes) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": "where is the dog"}], "max_tokens": 4, **changes}


BAD = [
    ("malformed json", "/v1/completions", b'{"model": "tiny-chat", "prompt": ', 400, None),
    ("not an object", "/v1/completions", [1, 2], 400, None),
    ("a message that is a string", "/v1/chat/completions", chat(messages=["hi"]), 400, "messages[0]"),
    (
        "stream_options not an object",
        "/v1/chat/completions",
        chat(stream=True, stream_options="x"),
        400,
        "stream_options",
    ),
    ("max_tokens as a string", "/v1/completions", completion(max_tokens="4"), 400, "max_tokens"),
    ("temperature too high", "/v1/completions", completion(temperature=3), 400, "temperature"),
    ("empty prompt", "/v1/completions", completion(prompt=""), 400, "prompt"),
    ("no prompt", "/v1/completions", {"model": NAME}, 400, "prompt"),
    ("above the context", "/v1/completions", completion(max_tokens=1000), 400, "max_tokens"),
    ("unknown model", "/v1/completions", completion(model="gpt-4"), 404, "model"),
    ("too many inputs", "/v1/completions", completion(prompt=["a"] * 65), 400, "prompt"),
    ("n of zero", "/v1/completions", completion(n=0), 400, "n"),
    ("seventeen stop strings", "/v1/completions", completion(stop=list("abcdefghijklmnopq")), 400, "stop"),
    ("logprobs above 20", "/v1/completions", completion(logprobs=21), 400, "logprobs"),
    # vLLM's sampling fields and OpenAI's that this server does not honour: refused, never silently ignored
    ("beam search", "/v1/completions", completion(use_beam_search=True), 400, "use_beam_search"),
    ("guided decoding", "/v1/completions", completion(guided_regex="[0-9]+"), 400, "guided_regex"),
    ("special tokens kept", "/v1/completions", completion(skip_special_tokens=False), 400, "skip_special_tokens"),
    ("no bos token", "/v1/completions", completion(add_special_tokens=False), 400, "add_special_tokens"),
    (
        "template variables",
        "/v1/chat/completions",
        chat(chat_template_kwargs={"enable_thinking": False}),
        400,
        "chat_template_kwargs",
    ),
    ("no generation prompt", "/v1/chat/completions", chat(add_generation_prompt=False), 400, "add_generation_prompt"),
    (
        "continue the last message",
        "/v1/chat/completions",
        chat(continue_final_message=True),
        400,
        "continue_final_message",
    ),
    ("a template of its own", "/v1/chat/completions", chat(chat_template="{{ 'x' }}"), 400, "chat_template"),
    ("chat echo", "/v1/chat/completions", chat(echo=True), 400, "echo"),
    # the sampling fields it honours, outside their bounds
    ("top_k below -1", "/v1/completions", completion(top_k=-2), 400, "top_k"),
    ("top_k of True", "/v1/completions", completion(top_k=True), 400, "top_k"),  # strict: a bool is no number
    ("min_p above 1", "/v1/completions", completion(min_p=1.5), 400, "min_p"),
    ("repetition_penalty of 0", "/v1/completions", completion(repetition_penalty=0), 400, "repetition_penalty"),
    ("min_tokens above max_tokens", "/v1/completions", completion(min_tokens=5), 400, "min_tokens"),
    ("logit_bias key no token id", "/v1/completions", completion(logit_bias={"the": 5}), 400, "logit_bias"),
    (
        "logit_bias key past the vocabulary",
        "/v1/completions",
        completion(logit_bias={"99999999": 5}),
        400,
        "logit_bias",
    ),
    ("logit_bias above 100", "/v1/completions", completion(logit_bias={"5": 101}), 400, "logit_bias"),
    ("stream_options without stream", "/v1/completions", completion(stream_options={}), 400, "stream_options"),
    ("functions", "/v1/chat/completions", chat(functions=[{"name": "f", "parameters": {}}]), 400, "functions"),
    ("function_call", "/v1/chat/completions", chat(function_call="auto"), 400, "function_call"),
    ("tool_choice without tools", "/v1/chat/completions", chat(tool_choice="required"), 400, "tool_choice"),
    ("audio out", "/v1/chat/completions", chat(modalities=["text", "audio"]), 400, "modalities"),
    (
        "a message's name",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "hi", "name": "ann"}]),
        400,
        "messages[0].name",
    ),
    (
        "a tool result",
        "/v1/chat/completions",
        chat(messages=[{"role": "tool", "content": "42", "tool_call_id": "c1"}]),
        400,
        "messages[0]",
    ),
    (
        "an image part",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]),
        400,
        "messages[0]",
    ),
    ("no messages", "/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages"),
    (
        "unknown role",
        "/v1/chat/completions",
        {"model": NAME, "messages": [{"role": "robot", "content": "hi"}]},
        400,
        "messages[0].role",
    ),
    ("classifier route", "/predict", {"texts": ["a"]}, 400, None),
    ("oversize body", "/v1/completions", completion(prompt="word " * 30_000), 413, None),
]


def send(url: str, path: str, body) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "Content-Type": "application/json"}
    return httpx.post(f"{url}{path}", content=raw, headers=headers, timeout=60)


@pytest.mark.parametrize("what, path, body, status, param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_an_openai_error_naming_the_field(server, what, path, body, status, param):
    r = send(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]
    assert error["type"] == {404: "not_found_error", 413: "request_too_large"}.get(status, "invalid_request_error")


NEUTRAL = dict(top_k=-1, min_p=0, repetition_penalty=1, min_tokens=0, ignore_eos=False, echo=False, best_of=1)
NEUTRAL.update(skip_special_tokens=True, spaces_between_special_tokens=True, add_special_tokens=True)  # vLLM's


def test_neutral_values_and_metadata_are_accepted_and_unknown_fields_named_in_one_log_line(chat_model, caplog):
    """What changes nothing passes (the neutral values of fields this server does not honour; user, metadata,
    store); a field it does not know is ignored and named in one warning line, ascii-escaped."""
    metadata = dict(user="u1", metadata={"k": "v"}, store=False, service_tier="auto")
    with app_server(chat_model) as url:
        wait_ready(url)
        plain = send(url, "/v1/completions", completion(temperature=0)).json()
        with caplog.at_level("WARNING", logger="tuneforge.serve.routes_openai"):
            same = send(url, "/v1/completions", completion(temperature=0, **NEUTRAL, **metadata))
            assert not caplog.records
            unknown = send(url, "/v1/chat/completions", chat(temperature=0, frobnicate=1, **{"x\u00e9": 2}))
    assert same.status_code == 200 and same.json()["choices"] == plain["choices"]
    assert unknown.status_code == 200, unknown.text
    [record] = caplog.records
    assert record.getMessage() == (
        "/v1/chat/completions: ignored the fields this server does not know: 'frobnicate', 'x\\xe9'"
    )


class OpenAIPenalties:
    """OpenAI's presence and frequency penalties as a transformers logits processor (the reference): each token of
    the answer so far loses presence + frequency x its count."""

    def __init__(self, prompt_length: int, presence: float, frequency: float) -> None:
        self.start, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row, ids in enumerate(input_ids[:, self.start :]):
            tokens, counts = ids.unique(return_counts=True)
            scores[row, tokens] -= self.presence + self.frequency * counts.to(scores.dtype)
        return scores


def test_penalties_equal_transformers_greedy_with_the_same_rules(client, ref):
    """repetition_penalty as transformers' (and vLLM's): prompt and answer; presence and frequency as OpenAI
    defines them: the answer only. Greedy, token for token against transformers' generate, over answers long
    enough that the penalties change them."""
    from transformers import LogitsProcessorList

    for prompt in PROMPTS[:3]:
        ids = ref.ids(prompt)
        plain = ref.greedy(ids, 40)[0]
        extra = {"repetition_penalty": 1.8}
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0, extra_body=extra)
        assert out.choices[0].text == ref.greedy(ids, 40, repetition_penalty=1.8)[0] != plain
        out = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=40, temperature=0, presence_penalty=1.5, frequency_penalty=0.7
        )
        processor = LogitsProcessorList([OpenAIPenalties(len(ids), 1.5, 0.7)])
        assert out.choices[0].text == ref.greedy(ids, 40, logits_processor=processor)[0] != plain


def test_logit_bias_min_tokens_and_ignore_eos(client, ref):
    prompt = PROMPTS[1]
    token = ref.tokenizer("riding", add_special_tokens=False)["input_ids"][0]
    forced = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=6, temperature=0, logit_bias={str(token): 100}
    )
    assert ref.tokenizer(forced.choices[0].text, add_special_tokens=False)["input_ids"] == [token] * 6
    banned = ref.greedy(ref.ids(prompt), 1)  # the greedy first token, banned: another one comes
    first = ref.tokenizer(banned[0], add_special_tokens=False)["input_ids"][0]
    other = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert other.choices[0].text and other.choices[0].text != banned[0]
    # ignore_eos and min_tokens, with the end-of-sequence token made the likeliest (the tiny model never picks it
    # by itself): at once it ends the answer; ignore_eos runs on to max_tokens; min_tokens holds it back k tokens
    eos = {str(ref.tokenizer.eos_token_id): 100}
    ended = client.completions.create(model=NAME, prompt=prompt, max_tokens=30, temperature=0, logit_bias=eos)
    assert ended.usage.completion_tokens == 0 and ended.choices[0].finish_reason == "stop"
    whole = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=30, temperature=0, logit_bias=eos, extra_body={"ignore_eos": True}
    )
    assert whole.usage.completion_tokens == 30 and whole.choices[0].finish_reason == "length"
    ids, bias = ref.ids(prompt), {(ref.tokenizer.eos_token_id,): 100.0}
    for k in (3, 8):
        out = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=20, temperature=0, logit_bias=eos, extra_body={"min_tokens": k}
        )
        assert out.usage.completion_tokens == k and out.choices[0].finish_reason == "stop"
        assert out.choices[0].text == ref.greedy(ids, 20, min_new_tokens=k, sequence_bias=bias)[0]


def test_a_stop_string_counts_only_once_min_tokens_are_reached(client, ref):
    """A stop string that ends at the min_tokens-th token ends the answer before it (none of it shown, though its
    start came before min_tokens); one that ended before min_tokens is ignored (vLLM's min_tokens)."""
    prompt, words = PROMPTS[1], {"model": NAME, "max_tokens": 12, "temperature": 0}
    ids = ref.ids(prompt)
    with torch.no_grad():
        answer = ref.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    answer = answer[0, len(ids) :].tolist()
    whole = ref.tokenizer.decode(answer)
    # tokens j - 1 and j (whole characters) spell the stop string, which occurs nowhere else in the answer
    j = next(j for j in range(2, 10) if whole.count(two_tokens(ref, answer, j)) == 1)
    stop, before = two_tokens(ref, answer, j), ref.tokenizer.decode(answer[: j - 1])
    at = client.completions.create(prompt=prompt, stop=stop, extra_body={"min_tokens": j + 1}, **words)
    assert (at.choices[0].text, at.choices[0].finish_reason) == (before, "stop")
    after = client.completions.create(prompt=prompt, stop=stop, extra_body={"min_tokens": j + 2}, **words)
    assert (after.choices[0].text, after.choices[0].finish_reason) == (whole, "length")


def two_tokens(ref, answer: list[int], j: int) -> str:
    """The text of answer[j - 1] and answer[j]; "" where either is no whole character."""
    text = ref.tokenizer.decode(answer[j - 1 : j + 1])
    return (
        ""
        if "\ufffd" in text or ref.tokenizer.decode(answer[: j + 1]) != ref.tokenizer.decode(answer[: j - 1]) + text
        else text
    )


def test_concurrent_requests_each_sample_with_their_own_fields(client, ref):
    """Concurrent requests (decoding together in the running batch), each with its own penalties or bias; each
    answer equals transformers' generate with that request's processors alone (logit_bias: its
    SequenceBiasLogitsProcessor)."""
    from transformers import LogitsProcessorList

    token = ref.tokenizer("riding", add_special_tokens=False)["input_ids"][0]
    asks = [
        ({}, {}),
        ({"extra_body": {"repetition_penalty": 1.8}}, {"repetition_penalty": 1.8}),
        ({"logit_bias": {str(token): 4.0}}, {"sequence_bias": {(token,): 4.0}}),
        ({"presence_penalty": 1.5, "frequency_penalty": 0.7}, "openai"),
    ]
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        out = client.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=30, temperature=0, **asks[i][0])
        answers[i] = out.choices[0].text

    concurrently(ask, len(asks))
    for i, (_, generate) in enumerate(asks):
        ids = ref.ids(PROMPTS[i])
        if generate == "openai":
            generate = {"logits_processor": LogitsProcessorList([OpenAIPenalties(len(ids), 1.5, 0.7)])}
        assert answers[i] == ref.greedy(ids, 30, **generate)[0], i


def test_top_k_of_one_and_min_p_of_one_sample_the_greedy_token(client, ref):
    for prompt in PROMPTS[:4]:
        greedy = ref.greedy(ref.ids(prompt), 10)[0]
        for extra in ({"top_k": 1}, {"min_p": 1.0}):
            out = client.completions.create(
                model=NAME, prompt=prompt, max_tokens=10, temperature=1.0, seed=7, extra_body=extra
            )
            assert out.choices[0].text == greedy, extra
    wide = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=10, temperature=1.0, seed=7)
    narrow = client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=10, temperature=1.0, seed=7, extra_body={"top_k": 0, "min_p": 0}
    )
    assert wide.choices[0].text == narrow.choices[0].text  # the neutral values: the same seeded draw
    assert wide.choices[0].text != ref.greedy(ref.ids(PROMPTS[0]), 10)[0]  # the draw alone is not greedy


def test_tool_results_and_image_parts_are_refused_for_a_template_without_tools(server):
    """This model's template renders no tools: a tool result is refused saying so (tests/serve/test_serve_tools.py
    serves one that does)."""
    result = [{"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    tool = send(server, "/v1/chat/completions", chat(messages=result)).json()["error"]
    assert tool["param"] == "messages[0]" and "chat template does not render tools" in tool["message"]
    unanswered = send(server, "/v1/chat/completions", chat(messages=[{"role": "tool", "content": "42"}]))
    assert unanswered.json()["error"]["message"].startswith("messages[0].tool_call_id is required in a tool message")
    parts = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    image = send(server, "/v1/chat/completions", chat(messages=[{"role": "user", "content": parts}])).json()["error"]
    assert image["message"] == "messages[0].content[1] is a 'image_url' part; this server reads text parts only"
    text_parts = [{"type": "text", "text": "where is "}, {"type": "text", "text": "the dog"}]
    joined = send(server, "/v1/chat/completions", chat(messages=[{"role": "user", "content": text_parts}]))
    assert joined.status_code == 200, joined.text


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_bf16_on_a_cpu_without_native_bf16_is_said_to_be_slower_as_train_says_it(chat_model, capfd, precision):
    from tuneforge.backends.precision import cpu_has_native_bf16

    with app_server(chat_model, precision=precision, pack_weights=False) as url:
        wait_ready(url)
        err = capfd.readouterr().err
    emulated = precision == "bf16" and not cpu_has_native_bf16() and not torch.cuda.is_available()
    assert ("note: this CPU has no native bf16 (AVX512-BF16 or AMX), so bf16 runs slower here" in err) == emulated


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_every_request_is_one_access_line_with_its_status_latency_tokens_and_refusal(chat_model, capfd, log_format):
    with app_server(chat_model, log_format=log_format) as url:
        wait_ready(url)
        capfd.readouterr()
        answered = send(url, "/v1/completions", completion(temperature=0))
        ok = answered.json()
        # (greedy: a sampled answer may end early at the end-of-turn token, and the count below is of 4)
        streamed = httpx.post(f"{url}/v1/chat/completions", json=chat(stream=True, temperature=0), timeout=60)
        assert streamed.status_code == 200
        send(url, "/v1/completions", completion(use_beam_search=True))
        httpx.get(f"{url}/no/such/route", timeout=10)
        lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 4, lines
    if log_format == "json":
        records = [json.loads(line) for line in lines]
        assert [(r["method"], r["path"], r["status"]) for r in records] == [
            ("POST", "/v1/completions", 200),
            ("POST", "/v1/chat/completions", 200),
            ("POST", "/v1/completions", 400),
            ("GET", "/no/such/route", 404),
        ]
        assert records[0]["request_id"] == answered.headers["x-request-id"]  # the line of the answer a client quotes
        assert records[0]["prompt_tokens"] == ok["usage"]["prompt_tokens"]
        assert records[0]["completion_tokens"] == ok["usage"]["completion_tokens"] == 4
        assert records[1]["completion_tokens"] == 4 and "error" not in records[1]  # the stream's, counted at its end
        assert records[2]["error"] == "use_beam_search is not supported by this server; leave it out"
        assert records[3]["error"] == "no route GET /no/such/route" and all(r["ms"] >= 0 for r in records)
        return
    usage = ok["usage"]
    tokens = f"prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']}"
    assert lines[0].startswith("POST /v1/completions 200 ") and lines[0].endswith(f" ms {tokens}")
    assert lines[1].startswith("POST /v1/chat/completions 200 ") and lines[1].endswith(" completion_tokens=4")
    assert lines[2].startswith("POST /v1/completions 400 ")
    assert lines[2].endswith(" ms: use_beam_search is not supported by this server; leave it out")
    assert lines[3].startswith("GET /no/such/route 404 ") and lines[3].endswith(": no route GET /no/such/route")


def test_oversize_body_without_a_length_is_refused_while_it_arrives(server):
    def chunks():
        for _ in range(30):
            yield b" " * 10_000

    r = httpx.post(f"{server}/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_bad_requests_during_load_leave_the_good_ones_correct(server, client, ref):
    good: dict[int, str] = {}
    bad: list[int] = []

    def ask(i: int) -> None:
        good[i] = client.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=12, temperature=0).choices[0].text

    def misbehave() -> None:
        for _, path, body, _, _ in BAD:
            bad.append(send(server, path, body).status_code)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)] + [threading.Thread(target=misbehave)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(bad) == len(BAD) and all(400 <= s < 500 for s in bad), bad
    assert good == {i: ref.greedy(ref.ids(PROMPTS[i]), 12)[0] for i in range(4)}


def test_metrics_in_prometheus_text(server, client):
    client.completions.create(model=NAME, prompt="A man", max_tokens=4, temperature=0)
    page = httpx.get(f"{server}/metrics", headers=AUTH, timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    text = page.text
    for name in (
        "tuneforge_requests_total",
        "tuneforge_request_errors_total",
        "tuneforge_request_duration_seconds_bucket",
        "tuneforge_batch_size_bucket",
        "tuneforge_queue_depth",
        "tuneforge_running_sequences",
        "tuneforge_generation_tokens_per_second",
        "tuneforge_generated_tokens_total",
    ):
        assert f"\n{name}" in text, name
    assert metric(text, 'tuneforge_requests_total{route="/v1/completions",status="200"}') >= 1
    assert metric(text, 'tuneforge_request_errors_total{route="/v1/completions"}') >= 1
    assert metric(text, "tuneforge_generated_tokens_total") >= 4


# ---- settings of their own: in-process servers -------------------------------------------------------
def test_a_full_queue_answers_503_with_retry_after(chat_model, ref):
    with app_server(chat_model, max_batch_size=1, max_queue=1) as url:
        wait_ready(url)
        results: list[httpx.Response] = []
        start = threading.Barrier(24)

        def ask() -> None:
            start.wait(timeout=30)
            results.append(
                httpx.post(f"{url}/v1/completions", json=completion(max_tokens=40, temperature=0), timeout=120)
            )

        threads = [threading.Thread(target=ask) for _ in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
    busy = [r for r in results if r.status_code == 503]
    done = [r for r in results if r.status_code == 200]
    assert len(busy) + len(done) == 24 and busy and done
    assert all(r.headers["Retry-After"] == "1" and r.json()["error"]["type"] == "server_busy" for r in busy)
    want = ref.greedy(ref.ids("A man is"), 40)[0]
    assert all(r.json()["choices"][0]["text"] == want for r in done)


def test_a_client_gone_before_its_whole_answer_stops_its_generation(tool_model):
    """A client that stops waiting for a non-streamed answer ends its sequences while tokens keep coming (they
    were checked for a gone client only when the engine went quiet for a second, so a long answer ran to its
    end for nobody)."""
    with app_server(tool_model) as url:  # 1,024 positions: room for an answer that runs for seconds
        wait_ready(url)
        long = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}
        for path, body in [("completions", completion(**long)), ("chat/completions", chat(**long))]:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/{path}", json=body, timeout=0.2)
            deadline = time.monotonic() + 60
            while httpx.get(f"{url}/health", timeout=10).json()["running"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        tokens = metric(httpx.get(f"{url}/metrics", timeout=10).text, "tuneforge_generated_tokens_total")
        assert tokens < 1000


def test_health_is_ready_only_once_the_model_is_loaded(chat_model):
    from tuneforge.predict import load_servable

    gate = threading.Event()

    def load():
        assert gate.wait(timeout=60)
        return load_servable(chat_model)

    with app_server(chat_model, load=load) as url:
        r = httpx.get(f"{url}/health", timeout=10)
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        r = httpx.post(f"{url}/v1/completions", json=completion(), timeout=10)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        gate.set()
        wait_ready(url)
        assert httpx.post(f"{url}/v1/completions", json=completion(), timeout=60).status_code == 200


def test_a_request_past_the_timeout_gets_504(chat_model):
    with app_server(chat_model, request_timeout_s=0.001) as url:
        wait_ready(url)
        r = httpx.post(f"{url}/v1/completions", json=completion(max_tokens=50), timeout=60)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # and the server goes on


def test_seq2seq_completions_equal_transformers(tiny_t5, tmp_path):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model_dir = tmp_path / "t5"
    shutil.copytree(tiny_t5, model_dir)
    prefix = "translate English to German: "
    (model_dir / "tuneforge.json").write_text(
        json.dumps({"task": "seq2seq", "source_prefix": prefix, "max_length": 64})
    )
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sources = ["A man is riding a red bike.", "The dog"]
    with app_server(str(model_dir)) as url:
        wait_ready(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        out = client.completions.create(model=NAME, prompt=sources, max_tokens=7, temperature=0)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])
    for choice, source in zip(out.choices, sources):
        ids = tokenizer(prefix + source, return_tensors="pt")
        with torch.no_grad():
            want = model.generate(**ids, max_new_tokens=7, do_sample=False)
        assert choice.text == tokenizer.decode(want[0], skip_special_tokens=True)


def test_seq2seq_takes_its_trained_length_and_says_it_decodes_without_its_trained_beams(tiny_t5, tmp_path, capfd):
    """A completion without max_tokens got OpenAI's 16 tokens, not the generation_max_length the model was evaluated
    (and `tuneforge generate` decodes) with, and nothing said that the server has no beam search: it answers
    generation_max_length tokens, /health and one start-up line say the trained settings it takes and its num_beams
    left out."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model_dir = tmp_path / "t5"
    shutil.copytree(tiny_t5, model_dir)
    prefix = "translate English to German: "
    trained = {"source_prefix": prefix, "max_length": 64, "num_beams": 2, "generation_max_length": 24}
    (model_dir / "tuneforge.json").write_text(json.dumps({"task": "seq2seq", **trained}))
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    source = "A man is riding a red bike."
    with app_server(str(model_dir)) as url:
        wait_ready(url)
        body = {"model": NAME, "prompt": source, "temperature": 0}
        whole = httpx.post(f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60).json()
        greedy = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        health = httpx.get(f"{url}/health", timeout=10).json()
        said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("settings the model")]
    assert whole["usage"]["completion_tokens"] == 24
    ids = tokenizer(prefix + source, return_tensors="pt")
    with torch.no_grad():
        want = model.generate(**ids, max_new_tokens=24, do_sample=False)
    assert greedy["choices"][0]["text"] == tokenizer.decode(want[0], skip_special_tokens=True)
    assert health["sampling_defaults"] == {"max_tokens": 24}  # the page's empty max tokens shows it
    assert health["trained_settings"] == {key: value for key, value in trained.items() if key != "num_beams"}
    assert health["trained_settings_not_applied"] == {"num_beams": 2}
    [line] = said
    assert line.startswith(
        "settings the model was trained with (its tuneforge.json): source_prefix 'translate English to German: ', "
        "max_length 64, generation_max_length 24 (the default max_tokens); its num_beams 2 is not applied: "
    )
    assert "no beam search" in line


def test_a_seq2seq_model_without_stated_positions_reads_and_writes_at_most_2048_tokens(tiny_t5):
    """A T5 (relative positions: its config names no limit) with no trained max_length took any input and any
    max_tokens: one request of 12,000 tokens held the engine for a minute (its attention's memory grows with the
    square of the length: a 4 MiB body is a million tokens) and max_tokens 100000 held every other request back
    until the timeout. As vLLM assumes for such a config, its limit is 2048 tokens, said by /health; a longer
    input or a max_tokens past it is a 400 naming the field."""
    with app_server(tiny_t5) as url:
        wait_ready(url)
        assert httpx.get(f"{url}/health", timeout=10).json()["context"] == 2048
        body = {"model": NAME, "prompt": "word " * 600, "max_tokens": 2}  # 2,401 tokens
        long_input = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        body = {"model": NAME, "prompt": "word", "max_tokens": 2048}
        long_output = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert long_input.status_code == 400 and long_input.json()["error"]["param"] == "prompt"
    assert long_input.json()["error"]["message"] == "prompt has 2401 tokens; the model reads at most 2048: shorten it"
    assert long_output.status_code == 400 and long_output.json()["error"]["param"] == "max_tokens"
    assert "above the model's limit of 2047 tokens" in long_output.json()["error"]["message"]


def test_max_length_truncates_a_seq2seq_models_inputs_and_is_refused_for_a_causal_lm(
    tiny_t5, tiny_gpt2, tmp_path, capsys
):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from tuneforge.predict import load_servable

    model_dir = tmp_path / "t5"
    shutil.copytree(tiny_t5, model_dir)
    (model_dir / "tuneforge.json").write_text(json.dumps({"task": "seq2seq", "source_prefix": "", "max_length": 64}))
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    source = "A man is riding a red bike down the long and winding road."
    # `serve --max-length 5`: the encoder reads the first 5 tokens (was the training max_length's 64, the flag dropped)
    with app_server(str(model_dir), load=lambda: load_servable(model_dir, max_length=5), max_length=5) as url:
        wait_ready(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        out = client.completions.create(model=NAME, prompt=source, max_tokens=7, temperature=0)
    ids = tokenizer(source, return_tensors="pt", truncation=True, max_length=5)
    with torch.no_grad():
        want = model.generate(**ids, max_new_tokens=7, do_sample=False)
    assert out.choices[0].text == tokenizer.decode(want[0], skip_special_tokens=True)
    assert out.usage.prompt_tokens == 5

    code, _, err = cli_main(capsys, "serve", tiny_gpt2, "--port", "0", "--max-length", "8")  # never cut: refused
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: --max-length 8: model ")
    assert "is a causal LM, whose prompt is never cut" in err


def test_max_length_past_a_seq2seq_models_positions_is_refused_at_start_up(tiny_bart, capsys):
    """`serve --max-length 500` of a BART of 128 positions started, then refused each input over 128 tokens (a 400)
    in place of cutting it as the flag says; it is one line, as predict's and serve's predictors refuse it."""
    code, _, err = cli_main(capsys, "serve", tiny_bart, "--port", "0", "--max-length", "500")
    assert code == 2 and err.strip().splitlines()[-1] == (
        "error: max_length 500 is above the model's limit of 128 positions; use --max-length 128 or less"
    )


# ---- the process: flags, SIGTERM ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-batch-size", "0"], "error: --max-batch-size must be positive, got 0"),
        (["--max-queue", "-1"], "error: --max-queue must be positive, got -1"),
        (["--request-timeout", "0"], "error: --request-timeout must be above 0 seconds, got 0"),
        (["--api-key", " "], "error: --api-key (or TUNEFORGE_API_KEY) is empty; give a key or leave it unset"),
        (["--max-wait-ms", "inf"], "error: --max-wait-ms must be between 0 and 60000, got inf"),
        (["--max-wait-ms", "nan"], "error: --max-wait-ms must be between 0 and 60000, got nan"),
        (["--request-timeout", "nan"], "error: --request-timeout must be above 0 seconds, got nan"),
        (["--request-timeout", "inf"], "error: --request-timeout must be at most 86400 seconds (a day), got inf"),
        (["--request-timeout", "1e300"], "error: --request-timeout must be at most 86400 seconds (a day), got 1e+300"),
        (["--max-batch-size", str(10**30)], f"error: --max-batch-size must be between 1 and 65536, got {10**30}"),
        (
            ["--default-max-tokens", str(2**63)],
            f"error: --default-max-tokens must be between 1 and 1048576, got {2**63}",
        ),
        (["--max-length", "0"], "error: --max-length must be between 1 and 1048576, got 0"),
        (["--threads", "0"], "error: --threads must be positive, got 0"),
        (["--threads", "5000"], "error: --threads must be between 1 and 4096, got 5000"),
        (["--host", ""], "error: --host is empty; give an address (0.0.0.0 listens on every interface)"),
    ],
)
def test_bad_serve_flags_are_one_line(chat_model, capsys, flags, message):
    code, _, err = cli_main(capsys, "serve", chat_model, *flags)
    assert code == 2 and err.strip() == message


def test_more_threads_than_cores_are_refused(chat_model, capsys):
    """`serve --threads 1000` on a machine of a few cores started 1000 torch threads, each forward slowed by them."""
    from tuneforge.processes import usable_cores

    cores = usable_cores()
    code, _, err = cli_main(capsys, "serve", chat_model, "--port", "0", "--threads", "1000")
    assert code == 2 and err.strip() == (
        f"error: --threads 1000 is above the {cores} cores this process may use; pass --threads {cores} or less"
    )


def test_more_threads_than_cores_are_refused_from_python_too():
    """The Python API's options (ServeOptions, which create_app takes) refuse them as the CLI does."""
    from pydantic import ValidationError

    from tuneforge.processes import usable_cores
    from tuneforge.serve.options import ServeOptions

    cores = usable_cores()
    with pytest.raises(ValidationError, match=f"--threads {cores + 1} is above the {cores} cores this process may"):
        ServeOptions(model_dir="model", threads=cores + 1)
    assert ServeOptions(model_dir="model", threads=cores).threads == cores


def test_sigterm_finishes_the_requests_in_flight_and_takes_no_new_ones(chat_model, ref):
    env = {k: v for k, v in os.environ.items() if k != "TUNEFORGE_API_KEY"}  # the module's server sets one
    proc, url = start_server(chat_model, env=env, max_batch_size=1, served_model_name=NAME)
    try:
        streams: dict[int, list[str]] = {}
        accepted = threading.Barrier(5)  # the four requests answered 200 (queued or decoding), and this thread

        def stream(i: int) -> None:
            body = {**completion(prompt=PROMPTS[i], max_tokens=40, temperature=0), "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                accepted.wait(timeout=60)
                streams[i] = [line for line in r.iter_lines() if line]

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        accepted.wait(timeout=60)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # the listening socket is closed
            httpx.post(f"{url}/v1/completions", json=completion(), timeout=10)
        for t in threads:
            t.join(timeout=120)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.log.read_text()  # the drain is a line of the log; each request one access line
    proc.log.unlink()
    assert "draining: the requests in flight finish" in log, log[-2000:]
    assert log.count("POST /v1/completions 200 ") == 4, log[-2000:]
    for i in range(4):  # every request in flight (running or waiting) finished whole
        events = streams[i]
        assert events[-1] == "data: [DONE]", events[-3:]
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == ref.greedy(ref.ids(PROMPTS[i]), 40)[0]


def test_bf16_weights_serve_the_answer_of_the_model_in_bf16(chat_model):
    """--precision bf16 (what auto picks on a CPU with AMX or AVX512-BF16, and on CUDA since Ampere): the weights are
    cast, /health says so, and a greedy answer is transformers' own generate of the model cast to bf16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(chat_model).to(torch.bfloat16).eval()
    ids = AutoTokenizer.from_pretrained(chat_model)(PROMPTS[2])["input_ids"]
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(ids) :]
    with app_server(chat_model, precision="bf16", pack_weights=False) as url:  # (packing: test_packed_linear.py)
        wait_ready(url)
        health = httpx.get(f"{url}/health").json()
        assert health["precision"] == "bf16" and health["packed_layers"] == 0
        body = send(url, "/v1/completions", completion(prompt=PROMPTS[2], max_tokens=8, temperature=0, ignore_eos=True))
    got = body.json()["choices"][0]["text"]
    assert got == AutoTokenizer.from_pretrained(chat_model).decode(want, skip_special_tokens=True)
