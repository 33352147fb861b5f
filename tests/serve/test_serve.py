"""`tuneforge serve` of a classifier: a real HTTP server on 127.0.0.1 in a subprocess. Concurrent requests are
batched together, and every caller gets the same answers as `Predictor`. (Generative models:
test_serve_generate.py; the page: test_serve_page.py.)"""

import json
import os
import socket
import threading

import httpx
import pytest

from conftest import run_cli, save_tiny_classifier, serving, start_server, stop_server
from tuneforge.predict import Predictor

LABELS = {0: "neg", 1: "pos"}
TEXTS = [
    "a wonderful, moving film",
    "dull",
    "the plot makes no sense at all and the ending drags on",
    "fine",
    "great acting and a clever plot",
    "i wanted my money back",
    "an uplifting delight",
    "boring, slow and far too long",
]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, minilm_dir):
    return save_tiny_classifier(tmp_path_factory.mktemp("serve-classifier"), minilm_dir, LABELS)


@pytest.fixture(scope="module")
def served(classifier):
    """The server in its own process, started as a user starts it, and its log, where Python lists each module an
    import statement of the process loads (PYTHONPROFILEIMPORTTIME); stopped (SIGTERM, then kill) at the end of the
    module."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    proc, url = start_server(classifier, env=env, max_batch_size=64, max_wait_ms=400)
    try:
        yield url, proc.log
    finally:
        stop_server(proc)
        proc.log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def post(url, body):
    return httpx.post(f"{url}/predict", json=body, timeout=60)


def test_health(server, classifier):
    health = httpx.get(f"{server}/health", timeout=10).json()
    assert health["status"] == "ok" and health["model"] == classifier
    assert health["labels"] == ["neg", "pos"] and health["max_batch_size"] == 64


def test_a_loaded_server_has_imported_no_library_of_training_data(served):
    """Once its model is loaded, a server of a folder that names no task (every task's module is asked whether it
    claims it) has imported none of what training reads data with, nor optuna, mlflow, lm_eval or deepspeed:
    `datasets` alone was a second of its start-up."""
    url, log = served
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    lines = log.read_text().splitlines()
    imported = {line.rpartition("|")[2].strip() for line in lines if line.startswith("import time:")}
    assert {"transformers", "tuneforge.serve.app", "tuneforge.data.squad"} <= imported  # (squad: qa's, asked too)
    assert sorted(imported & {"datasets", "pandas", "pyarrow", "optuna", "mlflow", "lm_eval", "deepspeed"}) == []


def test_concurrent_requests_are_batched_and_match_predictor(server, classifier):
    before = httpx.get(f"{server}/health", timeout=10).json()
    n = len(TEXTS)
    answers = [None] * n
    start = threading.Barrier(n)

    def client(i):
        start.wait(timeout=30)  # all requests leave together
        answers[i] = post(server, {"texts": [TEXTS[i]]})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert all(r is not None and r.status_code == 200 for r in answers), [getattr(r, "text", None) for r in answers]

    after = httpx.get(f"{server}/health", timeout=10).json()
    requests, batches = after["requests"] - before["requests"], after["batches"] - before["batches"]
    assert requests == n
    assert batches < n and after["largest_batch"] > 1, after  # requests shared batches

    expected = Predictor(classifier).predict(TEXTS)
    for answer, want in zip(answers, expected):
        (got,) = answer.json()["predictions"]
        assert got["label"] == want["label"] and got["label_id"] == want["label_id"]
        assert got["score"] == pytest.approx(want["score"], abs=1e-4)
        assert got["scores"] == pytest.approx(want["scores"], abs=1e-4)
    # each text has its own score, so answers handed to the wrong caller would not match above
    assert len({round(a.json()["predictions"][0]["score"], 4) for a in answers}) == n


def test_many_texts_and_pairs_in_one_request(server, classifier):
    predictor = Predictor(classifier)
    r = post(server, {"texts": TEXTS * 3})
    assert r.status_code == 200
    assert [p["label"] for p in r.json()["predictions"]] == [p["label"] for p in predictor.predict(TEXTS * 3)]
    pairs = [[a, b] for a, b in zip(TEXTS, reversed(TEXTS))]
    r = post(server, {"pairs": pairs})
    assert r.status_code == 200
    got = r.json()["predictions"]
    want = predictor.predict([tuple(p) for p in pairs])
    assert [p["label"] for p in got] == [p["label"] for p in want]
    assert [p["score"] for p in got] == pytest.approx([p["score"] for p in want], abs=1e-4)


def test_a_bf16_server_answers_scores_close_to_float32_ones(classifier):
    """--precision bf16: /health says so; every label is float32's, every score bf16's own (not float32's to the
    6th digit) yet within 2e-2 of it."""
    with serving(classifier, precision="bf16") as url:
        health = httpx.get(f"{url}/health", timeout=10).json()
        got = post(url, {"texts": TEXTS}).json()["predictions"]
    want = Predictor(classifier).predict(TEXTS)
    assert health["precision"] == "bf16"
    assert [p["label"] for p in got] == [p["label"] for p in want]
    gaps = [abs(g["score"] - w["score"]) for g, w in zip(got, want)]
    assert max(gaps) < 2e-2 and max(gaps) > 1e-6


def test_auto_precision_is_bf16_where_the_cpu_does_bf16_natively(classifier):
    """`auto` (serve's default): the linear layers in bf16 on AMX / AVX512-BF16 CPUs, else float32 as loaded."""
    import torch

    from tuneforge.backends.precision import cpu_has_native_bf16

    predictor = Predictor(classifier)
    native = cpu_has_native_bf16()
    assert predictor.precision.use("auto") == ("bf16" if native else "fp32")
    linear_dtypes = {m.weight.dtype for m in predictor.model.modules() if type(m) is torch.nn.Linear}
    assert linear_dtypes == {torch.bfloat16 if native else torch.float32}
    assert predictor.predict(TEXTS[:2])[0]["label"] in LABELS.values()


@pytest.mark.parametrize(
    "body,needle",
    [
        ({}, "exactly one"),
        ({"texts": []}, "empty"),
        ({"texts": ["a"], "pairs": [["a", "b"]]}, "exactly one"),
        ({"pairs": [["only one"]]}, "pairs"),
        ({"texts": "not a list"}, "texts"),
    ],
)
def test_bad_requests_get_422(server, body, needle):
    r = post(server, body)
    assert r.status_code == 422
    assert needle in r.text


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_a_json_body_sent_without_its_content_type_is_told_to_send_one(server, content_type):
    """`curl -d '{...}'` without -H sends a form's Content-Type, and the server does not read the body as JSON: the
    refusal says so (it said the body "must be a JSON object", which it was)."""
    body = json.dumps({"texts": ["a good one"]})
    r = httpx.post(f"{server}/predict", content=body, headers={"Content-Type": content_type}, timeout=60)
    assert r.status_code == 422, r.text
    message = r.json()["error"]["message"]
    assert "Content-Type: application/json" in message and content_type in message


def test_bad_requests_use_the_openai_error_shape_and_generation_routes_say_where_to_go(server):
    assert post(server, {"texts": ["a good one"]}).status_code == 200  # counted below, whatever ran before
    r = post(server, {"texts": "not a list"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "texts"
    r = httpx.post(f"{server}/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=60)
    assert r.status_code == 400 and "POST /predict" in r.json()["error"]["message"]
    metrics = httpx.get(f"{server}/metrics", timeout=10).text
    assert 'tuneforge_requests_total{route="/predict",status="200"}' in metrics
    assert "tuneforge_batch_size_count" in metrics and "tuneforge_queue_depth" in metrics


def test_serve_refuses_a_busy_port(classifier, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = run_cli("serve", classifier, "--port", str(port), timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: cannot listen on 127.0.0.1:{port}")


def test_a_score_that_is_no_finite_number_is_null_not_a_500(tmp_path, minilm_dir):
    """fp16 forwards of a regression scoring past fp16's range give inf, which Starlette's JSON refuses: the request
    was a 500 with a traceback in the log. It is answered, the score null (as `predict` writes it)."""
    from test_predict import overflowing_regressor

    model = overflowing_regressor(tmp_path / "reg", minilm_dir)
    with serving(model, precision="fp16") as url:
        answer = post(url, {"texts": ["hello world", "a house by the sea"]})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"predictions": [{"score": None}, {"score": None}]}
