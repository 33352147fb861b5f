"""Property-based fuzzing of `tuneforge serve`'s HTTP API: requests generated from the app's own OpenAPI schema
(`app.openapi()`), sent to real servers on 127.0.0.1 (in-process uvicorn, one per model, shared by the module):
the tiny chat Llama (completions, chat), a tiny BERT classifier, a question-answering and a multiple-choice
model (/predict), and every GET route. Whatever arrives: never a 5xx, every refusal in the OpenAI error shape,
every stream ends with `data: [DONE]`, the server healthy after; and a known-good greedy request sent over and
over from another thread while the fuzzing runs (so it shares batches with the fuzz) is answered exactly as
before the fuzzing, every time.

The requests mix (a) bodies valid under the schema (the served model's name put in most, so that they reach the
model), (b) such a body with one field replaced by an adversarial or arbitrary JSON value (lone surrogates,
NUL, huge and non-finite numbers, nested values), and (c) arbitrary JSON. Targeted cases the generator would
find only by luck (no body, the wrong content type, invalid UTF-8, deep nesting, a 5000-digit number, ...) are
listed at the end.

Why Hypothesis strategies built here from the schema, not schemathesis or hypothesis-jsonschema: FastAPI's
schema for these models uses a small subset of JSON Schema (objects, anyOf, arrays, prefixItems, numeric
bounds, $ref), which `schema_strategy` covers in a few lines; hypothesis-jsonschema (0.23, the latest) fails
against current Hypothesis (`'many' object has no attribute 'more'`), and schemathesis would bring its own
runner, CLI and many dependencies to `make test` where we need our own servers (module fixtures), our own
invariant (the interleaved known-good request) and a budget we choose per route. Examples are derandomized:
`make test` sees the same requests every run (no flaky CI); the budget is in max_examples per route.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import save_tiny_classifier
from test_serve_generate import NAME, app_server, wait_ready
from test_serve_isolation import save_bert_task_model

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
ERROR_KEYS = {"message", "type", "param", "code"}


# ---- strategies from the OpenAPI schema -----------------------------------------------------------------
TEXT = st.text(st.characters(codec=None, categories=["L", "M", "N", "P", "S", "Z", "Cc", "Cs"]), max_size=12)
ADVERSARIAL = st.sampled_from(
    [
        "\ud800",
        "a\udfffb",
        "\x00",
        "nul\x00in the middle",
        "",
        " ",
        "\ufeffbom",
        "\u202eright to left",
        "x" * 3000,
        10**30,
        -(10**30),
        2**63,
        -(2**63) - 1,
        2**64,
        1e308,
        -1e308,
        -0.0,
        5e-324,
        1e-45,
        float("nan"),
        float("inf"),
        float("-inf"),
        True,
        None,
        [],
        {},
        [[[[[[[[[[]]]]]]]]]],
        {"a": {"b": {"c": {"d": [1, "\ud800"]}}}},
    ]
)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | TEXT | ADVERSARIAL
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


def schema_strategy(schema: dict, components: dict) -> st.SearchStrategy:
    """Values valid under `schema` (the JSON Schema subset FastAPI emits for these models); `components`: the
    OpenAPI document's, for $ref."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: schema_strategy(components[name], components))
    if "anyOf" in schema:
        return st.one_of([schema_strategy(s, components) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        return st.integers(None if low is None else int(low), None if high is None else int(high))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(
            low,
            schema.get("maximum"),
            exclude_min="exclusiveMinimum" in schema,
            allow_nan=False,
            allow_infinity=False,
        )
    if kind == "string":
        return TEXT
    if kind == "array":
        if "prefixItems" in schema:
            return st.tuples(*[schema_strategy(s, components) for s in schema["prefixItems"]]).map(list)
        return st.lists(schema_strategy(schema.get("items", {}), components), max_size=4)
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        fields = {k: schema_strategy(v, components) for k, v in props.items()}
        fixed = st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        )
        if not props and schema.get("additionalProperties", True):
            return st.dictionaries(TEXT, JSON_VALUES, max_size=4)
        return fixed
    return JSON_VALUES  # no type: Any


SHORT = st.none() | st.integers(1, 24)  # max_tokens that the tiny model's context takes, and the fuzz's time


def request_bodies(path: str, model: str | None = None, reaching: tuple[str, ...] = ()) -> st.SearchStrategy:
    """What the fuzz sends to POST `path`: bodies valid under its schema, and mostly of those that reach the model
    (only the `reaching` fields, the served `model`, a short max_tokens); such bodies with one field made
    adversarial; and arbitrary JSON."""
    from tuneforge.serve.app import ServeOptions, create_app

    spec = create_app(lambda: None, ServeOptions(model_dir="fuzz", served_model_name=NAME)).openapi()
    schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    components = spec["components"]["schemas"]
    fields = list(components[schema["$ref"].rsplit("/", 1)[-1]]["properties"])
    valid = schema_strategy(schema, components)
    focused = valid
    if reaching:
        keep = lambda body, tokens: {  # noqa: E731
            **{k: v for k, v in body.items() if k in reaching and "max" not in k},
            "model": model,
            "max_tokens": tokens,
        }
        focused = st.builds(keep, valid, SHORT)
    spoiled = st.builds(lambda body, key, value: {**body, key: value}, focused, st.sampled_from(fields), JSON_VALUES)
    return st.one_of(focused, focused, focused, valid, spoiled, spoiled, JSON_VALUES)


SAMPLING = ("temperature", "top_p", "n", "stop", "seed", "stream", "stream_options", "user")
SAMPLING += ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")
SAMPLING += ("min_tokens", "ignore_eos", "logprobs", "top_logprobs", "echo", "best_of")
CHAT_ONLY = ("response_format", "tools", "tool_choice")  # their values reach the grammar and the template
REACHING = {"/v1/completions": ("prompt", *SAMPLING), "/v1/chat/completions": ("messages", *SAMPLING, *CHAT_ONLY)}


# ---- the invariants -----------------------------------------------------------------------------------
def send(url: str, method: str, path: str, body=None, headers: dict | None = None) -> httpx.Response:
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()  # NaN as NaN, \ud800 escaped
    sent = {"Content-Type": "application/json", **(headers or {})}
    return httpx.request(method, f"{url}{path}", content=raw, headers=sent, timeout=60)


def check(r: httpx.Response) -> None:
    """No 5xx; a refusal in the OpenAI error shape; a stream that ends with [DONE] and carries no server error."""
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS and body["error"]["message"], body
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and '"server_error"' not in r.text, r.text[-500:]


@contextmanager
def known_good_meanwhile(url: str, path: str, body: dict):
    """Sends `body` again and again from a thread while the block runs; every answer must equal the first one,
    taken before the block."""
    want = send(url, "POST", path, body)
    assert want.status_code == 200, want.text
    answers: list[httpx.Response] = []
    done = threading.Event()

    def again() -> None:
        while not done.is_set():
            answers.append(send(url, "POST", path, body))
            time.sleep(0.02)

    thread = threading.Thread(target=again, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=60)
    assert len(answers) >= 3, "the known-good request was not interleaved"
    for r in answers:
        assert r.status_code == 200, r.text
        assert_same_answer(r.json(), want.json())
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def assert_same_answer(got: dict, want: dict) -> None:
    """Generation (greedy): the same texts. /predict: the same labels and answers; scores equal to float
    rounding (a batch shared with other inputs pads, and padding moves the last bits)."""
    if "choices" in want:
        texts = lambda body: [c.get("text", c.get("message")) for c in body["choices"]]  # noqa: E731
        assert texts(got) == texts(want)
        return
    for g, w in zip(got["predictions"], want["predictions"], strict=True):
        assert g.keys() == w.keys()
        for key, value in w.items():
            if key.startswith("score"):
                assert g[key] == pytest.approx(value, abs=1e-5), key
            else:
                assert g[key] == value, key


# ---- the servers ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gen_url(chat_model):
    with app_server(chat_model, max_batch_size=8) as url:
        wait_ready(url)
        yield url


@pytest.fixture(scope="module")
def classifier_url(tmp_path_factory, minilm_dir):
    model = save_tiny_classifier(tmp_path_factory.mktemp("fuzz-classifier"), minilm_dir, {0: "neg", 1: "pos"})
    with app_server(model, max_wait_ms=2) as url:
        wait_ready(url)
        yield url


GOOD_COMPLETION = {"model": NAME, "prompt": "A man is riding", "max_tokens": 8, "temperature": 0}
GOOD_CHAT = {"model": NAME, "messages": [{"role": "user", "content": "where is the dog"}], "max_tokens": 8}


# ---- the fuzz, route by route ---------------------------------------------------------------------------
def fuzz_posts(url: str, path: str, bodies: st.SearchStrategy, examples: int) -> None:
    """`examples` bodies drawn from `bodies` POSTed to `path`, each response checked."""

    @settings(FUZZ, max_examples=examples)
    @given(body=bodies)
    def fuzz(body) -> None:
        check(send(url, "POST", path, body))

    fuzz()


def test_fuzz_completions(gen_url):
    bodies = request_bodies("/v1/completions", NAME, REACHING["/v1/completions"])
    with known_good_meanwhile(gen_url, "/v1/completions", GOOD_COMPLETION):
        fuzz_posts(gen_url, "/v1/completions", bodies, 150)


def test_fuzz_chat_completions(gen_url):
    bodies = request_bodies("/v1/chat/completions", NAME, REACHING["/v1/chat/completions"])
    with known_good_meanwhile(gen_url, "/v1/chat/completions", {**GOOD_CHAT, "temperature": 0}):
        fuzz_posts(gen_url, "/v1/chat/completions", bodies, 150)


def test_fuzz_predict_on_a_classifier(classifier_url):
    bodies = request_bodies("/predict")
    with known_good_meanwhile(classifier_url, "/predict", {"texts": ["a wonderful, moving film", "dull"]}):
        fuzz_posts(classifier_url, "/predict", bodies, 100)


@pytest.mark.parametrize("task", ["qa", "multiple-choice"])
def test_fuzz_predict_on_qa_and_multiple_choice(task, tmp_path, minilm_dir):
    from transformers import BertForMultipleChoice, BertForQuestionAnswering

    head = BertForQuestionAnswering if task == "qa" else BertForMultipleChoice
    model = save_bert_task_model(tmp_path / task, minilm_dir, head, {"task": task, "max_length": 48})
    good = (
        {"pairs": [["where is the dog", "the dog is in the garden"]]}
        if task == "qa"
        else {"inputs": [{"question": "the dog", "choices": ["runs", "is a boat"]}]}
    )
    with app_server(model, max_wait_ms=2) as url:
        wait_ready(url)
        with known_good_meanwhile(url, "/predict", good):
            fuzz_posts(url, "/predict", request_bodies("/predict"), 50)


GET_ROUTES = ["/", "/health", "/metrics", "/v1/models", "/v1/completions", "/predict", "/nowhere"]


def test_fuzz_every_get_route_and_method(gen_url):
    headers = st.dictionaries(
        st.sampled_from(["Authorization", "X-API-Key", "Accept", "Content-Length", "Content-Type"]),
        st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20),
        max_size=3,
    )

    @settings(FUZZ, max_examples=60)
    @given(
        method=st.sampled_from(["GET", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"]),
        path=st.sampled_from(GET_ROUTES),
        query=st.dictionaries(st.sampled_from(["a", "model", "stream"]), TEXT.filter(str.isprintable), max_size=2),
        headers=headers,
    )
    def fuzz(method, path, query, headers):
        # httpx sets Content-Length, and refuses to send a value with spaces around it
        headers = {k: v.strip() for k, v in headers.items() if k != "Content-Length"}
        r = httpx.request(method, f"{gen_url}{path}", params=query, headers=headers, timeout=60)
        assert r.status_code < 500, (method, path, r.status_code, r.text[:300])
        if r.status_code >= 400 and r.status_code != 503 and method != "HEAD":
            assert set(r.json()["error"]) == ERROR_KEYS

    with known_good_meanwhile(gen_url, "/v1/completions", GOOD_COMPLETION):
        fuzz()


# ---- targeted cases: what a generator finds only by luck -----------------------------------------------
RAW = [
    ("no body", None, {}),
    ("empty body", b"", {}),
    ("text/plain", b'{"model": "tiny-chat", "prompt": "hi"}', {"Content-Type": "text/plain"}),
    ("form", b"model=tiny-chat&prompt=hi", {"Content-Type": "application/x-www-form-urlencoded"}),
    ("invalid UTF-8", b'{"model": "tiny-chat", "prompt": "\xff\xfe"}', {}),
    ("a byte-order mark", b'\xef\xbb\xbf{"model": "tiny-chat", "prompt": "hi"}', {}),
    ("UTF-16", '{"model": "tiny-chat", "prompt": "hi"}'.encode("utf-16"), {}),
    ("truncated", b'{"model": "tiny-chat", "prompt": "hi', {}),
    ("deeply nested", b"[" * 100_000 + b"]" * 100_000, {}),
    ("nested objects", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, {}),
    ("a 5000-digit number", b'{"model": "tiny-chat", "prompt": "hi", "seed": ' + b"9" * 5000 + b"}", {}),
    ("NaN", b'{"model": "tiny-chat", "prompt": "hi", "temperature": NaN}', {}),
    ("duplicate keys", b'{"model": "tiny-chat", "prompt": "hi", "prompt": ["\\ud800"]}', {}),
    ("a lone low surrogate", b'{"model": "tiny-chat", "prompt": "\\udc00"}', {}),
    ("NUL in the model name", b'{"model": "tiny\\u0000chat", "prompt": "hi"}', {}),
    ("a string body", b'"just a string"', {}),
    ("null", b"null", {}),
    ("a huge max_tokens", b'{"model": "tiny-chat", "prompt": "hi", "max_tokens": 1e308}', {}),
    ("negative zero", b'{"model": "tiny-chat", "prompt": "hi", "temperature": -0.0, "max_tokens": 2}', {}),
    ("the smallest float", b'{"model": "tiny-chat", "prompt": "hi", "temperature": 5e-324, "max_tokens": 2}', {}),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("what, raw, headers", RAW, ids=[r[0] for r in RAW])
def test_raw_adversarial_bodies(gen_url, path, what, raw, headers):
    r = send(gen_url, "POST", path, raw, headers)
    check(r)
    assert r.status_code in (200, 400, 404), (r.status_code, r.text[:300])


@pytest.mark.parametrize("what, raw, headers", RAW[:12], ids=[r[0] for r in RAW[:12]])
def test_raw_adversarial_bodies_to_predict(classifier_url, what, raw, headers):
    r = send(classifier_url, "POST", "/predict", raw, headers)
    check(r)
    assert r.status_code in (400, 422), (r.status_code, r.text[:300])
