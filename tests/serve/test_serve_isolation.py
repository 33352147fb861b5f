"""`tuneforge serve` isolates failure: a request that cannot be served fails alone, with a 4xx in the OpenAI error
shape naming its field, and the requests batched with it are answered exactly as if it had never come; the
server stays healthy. Real in-process servers on 127.0.0.1 (one per model, shared by the module): the tiny chat
Llama of test_serve_generate.py, a tiny BERT question-answering model and a tiny BERT multiple-choice model.

The numbered failures of issue 23 each have a test here: (1) a temperature of 1e-45 killed the engine;
(2) a bad /predict input in a batch failed the good ones with a plain-text 500; (5) lone surrogates were a 500
on every route; and a seed of 10**30 was a 500."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from conftest import save_tiny_bert
from test_serve_generate import NAME, Reference, app_server, completion, save_chat_model, wait_ready


@pytest.fixture(scope="module")
def gen_url(chat_model):
    with app_server(chat_model) as url:
        wait_ready(url)
        yield url


@pytest.fixture(scope="module")
def ref(chat_model) -> Reference:
    return Reference(chat_model)


def save_bert_task_model(out, minilm_dir: str, model_class, info: dict) -> str:
    """A random tiny BERT head (`model_class`) saved as a model folder tuneforge exported for `info["task"]`."""
    import torch

    torch.manual_seed(0)
    save_tiny_bert(out, minilm_dir, model_class, initializer_range=0.3)
    (out / "tuneforge.json").write_text(json.dumps(info))
    return str(out)


@pytest.fixture(scope="module")
def qa_model(tmp_path_factory, minilm_dir) -> str:
    from transformers import BertForQuestionAnswering

    out = tmp_path_factory.mktemp("isolation-qa")
    return save_bert_task_model(out, minilm_dir, BertForQuestionAnswering, {"task": "qa", "max_length": 64})


@pytest.fixture(scope="module")
def choice_model(tmp_path_factory, minilm_dir) -> str:
    from transformers import BertForMultipleChoice

    out = tmp_path_factory.mktemp("isolation-choice")
    return save_bert_task_model(out, minilm_dir, BertForMultipleChoice, {"task": "multiple-choice", "max_length": 32})


def post(url: str, path: str, body) -> httpx.Response:
    """POST `body` as JSON (Python's json.dumps writes a lone surrogate as its escape, \\ud800, as JSON allows)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=raw, headers={"Content-Type": "application/json"}, timeout=60)


def assert_error(r: httpx.Response, status: int, param: str | None, kind: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert (error["param"], error["type"]) == (param, kind), error
    return error


def together(url: str, path: str, bodies: list) -> list[httpx.Response]:
    """The bodies posted at the same moment from threads (a batcher waiting long enough puts them in one batch)."""
    answers: list = [None] * len(bodies)
    start = threading.Barrier(len(bodies))

    def send(i: int) -> None:
        start.wait(timeout=30)
        answers[i] = post(url, path, bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return answers


def healthy(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"


# ---- 1: a temperature below any meaning is greedy, and nothing a request sends stops the engine -------
def test_a_temperature_of_1e_45_is_greedy_and_the_server_goes_on(gen_url, ref):
    want = ref.greedy(ref.ids("A man is"), 6)[0]
    for temperature in (1e-45, 5e-324, 1e-6):
        r = post(gen_url, "/v1/completions", completion(max_tokens=6, temperature=temperature))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    assert healthy(gen_url)
    r = post(gen_url, "/v1/completions", completion(max_tokens=6, temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


# ---- 2: a bad /predict input fails alone, with a 422 in the error shape -------------------------------
def test_an_empty_qa_question_fails_alone_in_its_batch(qa_model):
    from tuneforge.predict import load_predictor

    good = {"pairs": [["where is the dog", "the dog is in the garden behind the house"]]}
    bad = {"pairs": [["  ", "the dog is in the garden"]]}
    with app_server(qa_model, max_wait_ms=150, max_batch_size=8) as url:
        wait_ready(url)
        before = httpx.get(f"{url}/health", timeout=10).json()["batches"]
        for _ in range(3):
            ok, refused = together(url, "/predict", [good, bad])
            assert ok.status_code == 200, ok.text
            error = assert_error(refused, 422, "pairs")
            assert "question is empty" in error["message"]
        assert healthy(url)
        assert httpx.get(f"{url}/health", timeout=10).json()["batches"] - before == 3  # the good ones only
    [want] = load_predictor(qa_model).predict([tuple(good["pairs"][0])])
    assert ok.json()["predictions"][0] == pytest.approx(want)


def test_a_multiple_choice_input_with_one_choice_fails_alone(choice_model):
    from tuneforge.predict import load_predictor

    good = {"inputs": [{"question": "the dog", "choices": ["runs in the park", "is a boat", "reads a book"]}]}
    bad = {"inputs": [{"question": "the cat", "choices": ["sleeps"]}]}
    with app_server(choice_model, max_wait_ms=150, max_batch_size=8) as url:
        wait_ready(url)
        for _ in range(3):
            ok, refused = together(url, "/predict", [good, bad])
            assert ok.status_code == 200, ok.text
            assert "at least 2" in assert_error(refused, 422, "inputs")["message"]
        for inputs, param in (
            ([{"choices": ["a", 2]}], "inputs"),
            ([{"question": ["x"], "choices": ["a", "b"]}], "inputs"),
            (["text"], "inputs[0]"),
        ):
            assert_error(post(url, "/predict", {"inputs": inputs}), 422, param)
        assert healthy(url)
    [want] = load_predictor(choice_model).predict(good["inputs"])
    got = ok.json()["predictions"][0]
    assert (got["label"], got["choice"]) == (want["label"], want["choice"])
    assert got["scores"] == pytest.approx(want["scores"], abs=1e-5)


# ---- 5: text the tokenizer cannot encode is refused naming the field ---------------------------------
SURROGATE = "a \ud800 b"
CHAT = {"model": NAME, "max_tokens": 3}
PART = {"type": "text", "text": SURROGATE}
UNENCODABLE = [
    ("/v1/completions", completion(prompt=SURROGATE), "prompt"),
    ("/v1/completions", completion(prompt=["fine", SURROGATE]), "prompt[1]"),
    ("/v1/completions", completion(stop=["x", SURROGATE]), "stop[1]"),
    ("/v1/completions", completion(model=SURROGATE), "model"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": SURROGATE}]}, "messages[0].content"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [PART]}]},
        "messages[1].content[0].text",
    ),
]


@pytest.mark.parametrize("path, body, param", UNENCODABLE, ids=[p for _, _, p in UNENCODABLE])
def test_lone_surrogates_are_refused_naming_the_field(gen_url, path, body, param):
    error = assert_error(post(gen_url, path, body), 400, param)
    assert "UTF-8" in error["message"]


def deeply_nested_choice(leaf: str) -> bytes:
    """A multiple-choice request whose input holds `leaf` under 600 nested objects: valid JSON that Python reads."""
    nested = '{"a": ' * 600 + leaf + "}" * 600
    return ('{"inputs": [{"question": "q", "choices": ["a", "b"], "x": ' + nested + "}]}").encode()


def test_lone_surrogates_to_predict_are_a_422(qa_model, choice_model):
    with app_server(qa_model) as url:
        wait_ready(url)
        assert_error(post(url, "/predict", {"pairs": [["q", "c"], ["where", SURROGATE]]}), 422, "pairs[1][1]")
        assert healthy(url)
    with app_server(choice_model) as url:
        wait_ready(url)
        body = {"inputs": [{"question": "q", "choices": ["a", SURROGATE]}]}
        assert_error(post(url, "/predict", body), 422, "inputs[0].choices[1]")
        # an input's value nested as deep as Python's JSON reader goes (it was a RecursionError: a 500): a key the
        # input does not have, refused as such
        deep = assert_error(post(url, "/predict", deeply_nested_choice("1")), 422, "inputs")
        assert deep["message"].startswith("input 1: unknown key 'x'"), deep
        surrogate_deep_down = deeply_nested_choice('"\\ud800"')
        error = assert_error(post(url, "/predict", surrogate_deep_down), 422, "inputs[0].x" + ".a" * 600)
        assert "UTF-8" in error["message"]
        assert healthy(url)


# ---- seeds and every other number: finite, stated bounds ---------------------------------------------
@pytest.mark.parametrize(
    "changes, param",
    [
        ({"seed": 10**30}, "seed"),
        ({"seed": -(10**30)}, "seed"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"n": 10**30}, "n"),
        ({"temperature": 1e308}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"presence_penalty": 1e308}, "presence_penalty"),
    ],
)
def test_numbers_out_of_their_bounds_are_a_400(gen_url, changes, param):
    assert_error(post(gen_url, "/v1/completions", completion(**changes)), 400, param)


@pytest.mark.parametrize("literal, param", [("NaN", "temperature"), ("Infinity", "top_p"), ("-Infinity", "seed")])
def test_non_finite_json_numbers_are_a_400(gen_url, literal, param):
    raw = json.dumps(completion()).replace('"max_tokens": 4', f'"max_tokens": 4, "{param}": {literal}').encode()
    assert_error(post(gen_url, "/v1/completions", raw), 400, param)


def test_the_largest_seed_samples_and_reproduces(gen_url):
    body = completion(max_tokens=5, temperature=1.0, seed=2**63 - 1, n=3)
    first = post(gen_url, "/v1/completions", body)
    assert first.status_code == 200, first.text
    assert post(gen_url, "/v1/completions", body).json()["choices"] == first.json()["choices"]


# ---- the engine itself dies: /health says so, the process exits non-zero --------------------------------
def broken_generator(model_dir: str):
    """The model folder's Generator with a forward pass that always fails (a lost device, say)."""
    from tuneforge.predict import load_servable

    generator = load_servable(model_dir)

    def broken(*args, **kwargs):
        raise RuntimeError("the device is gone")

    generator.model.forward = broken
    return generator


def test_a_dead_engine_shows_on_health_and_is_reported_once(chat_model):
    deaths: list[BaseException] = []
    with app_server(chat_model, load=lambda: broken_generator(chat_model), on_fatal=deaths.append) as url:
        wait_ready(url)
        assert_error(post(url, "/v1/completions", completion()), 500, None, "server_error")
        health = httpx.get(f"{url}/health", timeout=10)
        assert (health.status_code, health.json()) == (503, {"status": "error"})
        assert_error(post(url, "/v1/completions", completion()), 503, None, "server_error")
    assert len(deaths) == 1 and "the device is gone" in str(deaths[0])


BROKEN_SERVE = """
import sys
import tuneforge.predict

def broken_generator(model_dir, max_length=None):
    generator = load(model_dir)

    def broken(*args, **kwargs):
        raise RuntimeError("the device is gone")

    generator.model.forward = broken
    return generator

load, tuneforge.predict.load_servable = tuneforge.predict.load_servable, broken_generator
from tuneforge.cli import main
sys.exit(main(sys.argv[1:]))
"""  # broken_generator's, in a fresh `tuneforge serve` process


def test_a_dead_engine_ends_the_serve_process_with_one_line_and_exit_1(chat_model):
    """`tuneforge serve` (its CLI entry point in a fresh process) whose model's forward pass fails: the first
    request kills the engine, and the process exits 1 with one `error:` line, for a supervisor to restart it."""
    import subprocess
    import sys
    import time

    from conftest import REPO, free_port

    port = free_port()
    args = [sys.executable, "-c", BROKEN_SERVE, "serve", chat_model, "--port", str(port)]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        r = post(url, "/v1/completions", {**completion(), "model": chat_model})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    errors = [line for line in err.splitlines() if line.startswith("error:")]  # the request's failure: a log line
    assert "Traceback" not in err and len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert errors[0].startswith("error: the generation engine stopped (EngineDied: ") and "device is gone" in errors[0]


def test_seq2seq_never_runs_past_its_positions(tiny_bart):
    """A BART of 128 positions: an input longer than the encoder's is a 400 (it crashed the engine before), as is a
    max_tokens the decoder has no positions for; the longest allowed generation runs to its end."""
    long = " ".join(["a man is riding a red bike"] * 30)
    with app_server(tiny_bart) as url:
        wait_ready(url)
        error = assert_error(post(url, "/v1/completions", completion(prompt=long)), 400, "prompt")
        assert "reads at most 128" in error["message"]
        assert_error(post(url, "/v1/completions", completion(max_tokens=128)), 400, "max_tokens")
        r = post(url, "/v1/completions", completion(max_tokens=127, temperature=0))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 127, r.text
        assert healthy(url)


SYSTEM_FIRST = "{% if messages[0]['role'] == 'system' %}"


@pytest.mark.parametrize(
    "template, message",
    [
        (
            SYSTEM_FIRST + "{{ raise_exception('System role not supported') }}{% endif %}{}",
            "the chat template refused these messages: System role not supported",
        ),
        (  # it said "messages has no tokens; give the model some text", of a request that gave text
            SYSTEM_FIRST + "{% else %}{}{% endif %}",
            "the model's chat template renders nothing of these messages",
        ),
    ],
)
def test_a_template_that_refuses_a_system_message_is_a_400_for_that_request(tmp_path, tiny_llama, template, message):
    """As Gemma's and Mistral's templates refuse a system message (or a template writes nothing of it): a 400 with
    the template's own words, and the same server answers the next conversation."""
    from transformers import AutoTokenizer

    model = save_chat_model(tmp_path / "model", tiny_llama)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = template.replace("{}", tokenizer.chat_template)
    tokenizer.save_pretrained(model)
    user = {"role": "user", "content": "where is the dog"}
    with app_server(model) as url:
        wait_ready(url)
        body = {**CHAT, "messages": [{"role": "system", "content": "be brief"}, user]}
        error = assert_error(post(url, "/v1/chat/completions", body), 400, "messages")
        assert error["message"] == message
        assert post(url, "/v1/chat/completions", {**CHAT, "messages": [user]}).status_code == 200


def test_a_batch_that_fails_is_run_again_request_by_request(choice_model):
    """The batcher's own isolation, for a predictor without input checks (the multiple-choice one's predict alone):
    the bad request's error joins the batch, the batch fails, and the batcher runs each
    request alone, so only the bad one fails and the good one gets exactly its own answer."""
    import asyncio

    from tuneforge.errors import DataError
    from tuneforge.serve.batching import DynamicBatcher
    from tuneforge.tasks.multiple_choice import ChoicePredictor

    class PredictOnly:  # a predictor without input checks: only predict() finds the bad input
        def __init__(self, predictor) -> None:
            self.predict = predictor.predict

    predictor = ChoicePredictor(choice_model)
    good = [{"question": "the dog", "choices": ["runs in the park", "is a boat"]}]
    bad = [{"question": "the cat", "choices": ["sleeps"]}]
    sizes: list[int] = []

    async def both():
        batcher = DynamicBatcher(PredictOnly(predictor), max_batch_size=8, max_wait_ms=300, on_batch=sizes.append)
        await batcher.start()
        try:
            return await asyncio.gather(batcher.submit(good), batcher.submit(bad), return_exceptions=True), batcher
        finally:
            await batcher.stop()

    (answer, error), batcher = asyncio.run(both())
    assert isinstance(error, DataError) and "at least 2" in str(error)
    assert answer == predictor.predict(good)
    assert (batcher.batches, sizes) == (1, [1])  # the good request, run alone after the shared batch failed
