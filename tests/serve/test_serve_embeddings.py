"""`tuneforge serve` of a sentence encoder (a model exported by `--task embedding`): OpenAI's POST /v1/embeddings on a
real server (its own process on 127.0.0.1) asked by the official `openai` client. The vectors equal SentenceEncoder's
within 1e-5, as floats and as base64 (little-endian float32), whole or cut to `dimensions` (renormalised); token ids
embed as their text; usage counts the tokens the model read; concurrent requests share a batch (one forward pass);
every hostile request is a 4xx with OpenAI's error body naming the field, and so is whatever the fuzz of
test_serve_fuzz.py makes of the route's schema while a known-good request keeps its answer."""

import base64
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from conftest import save_tiny_classifier, serving, start_server, stop_server
from test_serve_generate import app_server, wait_ready

NAME = "tiny-encoder"
TEXTS = [
    "a wonderful, moving film",
    "dull",
    "the plot makes no sense at all and the ending drags on and on, long past the point where anyone in the room "
    "still cared about any of it",  # beyond max_length 24: truncated
    "fine",
    "Ein schöner Film über Füchse 🦊",
    "i wanted my money back",
    "an uplifting delight",
    "boring, slow and far too long",
]


@pytest.fixture(scope="module")
def server(tiny_encoder):
    limits = dict(max_batch_size=64, max_wait_ms=300, max_body_bytes=100_000)
    with serving(tiny_encoder, served_model_name=NAME, **limits) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def encoder(tiny_encoder):
    from tuneforge.tasks.sentence_encoder import SentenceEncoder

    return SentenceEncoder(tiny_encoder, device="cpu")


def tokens_read(encoder, texts: list[str]) -> int:
    """The tokens the model reads of `texts`: special tokens included, truncated at max_length."""
    return sum(len(ids) for ids in encoder.tokenizer(texts, truncation=True, max_length=24)["input_ids"])


def vectors(answer) -> np.ndarray:
    assert [d.index for d in answer.data] == list(range(len(answer.data)))
    assert {d.object for d in answer.data} == {"embedding"} and answer.object == "list" and answer.model == NAME
    return np.array([d.embedding for d in answer.data], dtype=np.float32)


def test_health_says_what_is_served(server):
    health = httpx.get(f"{server}/health", timeout=10).json()
    assert health["status"] == "ok" and health["kind"] == "embed" and health["task"] == "embedding"
    assert health["dimensions"] == 32 and health["matryoshka_dims"] == [16, 8] and health["max_length"] == 24


def test_the_server_leaves_its_event_loop_a_core(tiny_encoder):
    """`tuneforge serve` of an encoder on 2 threads' worth of cores runs its forwards on one (the HTTP event loop
    keeps the other: OpenMP's idle threads would spin on it)."""
    with serving(tiny_encoder, env={**os.environ, "OMP_NUM_THREADS": "2"}) as url:
        assert httpx.get(f"{url}/health", timeout=10).json()["threads"] == 1


def test_a_bf16_server_answers_vectors_close_to_float32_ones(tiny_encoder, encoder):
    """--precision bf16: /health says so, and every vector is bf16's own (not float32's) yet unit length and within
    cosine 0.999 of the float32 one."""
    with serving(tiny_encoder, served_model_name=NAME, precision="bf16") as url:
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["precision"] == "bf16" and health["packed_layers"] >= 0  # the shapes this CPU runs faster packed
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        got = vectors(client.embeddings.create(model=NAME, input=TEXTS))
    want = encoder.encode(TEXTS)
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert (got * want).sum(1).min() > 0.999 and np.abs(got - want).max() > 1e-5


def test_auto_precision_is_bf16_where_the_cpu_does_bf16_natively(tiny_encoder):
    """`auto` (serve's default): bf16 autocast over bf16 linear weights on AMX / AVX512-BF16 CPUs, else the float32
    weights as loaded."""
    import torch

    from tuneforge.backends.precision import cpu_has_native_bf16
    from tuneforge.tasks.sentence_encoder import EmbeddingPredictor

    predictor = EmbeddingPredictor(tiny_encoder, device="cpu")
    native = cpu_has_native_bf16()
    assert predictor.precision.use("auto") == ("bf16" if native else "fp32")
    linear_dtypes = {m.weight.dtype for m in predictor.encoder.model.modules() if type(m) is torch.nn.Linear}
    assert linear_dtypes == {torch.bfloat16 if native else torch.float32}
    assert predictor.precision.dtype == (torch.bfloat16 if native else None)


def test_serving_threads_are_every_core_but_one_only_in_the_servers_own_process():
    import torch

    from tuneforge.serve.app import serving_threads

    assert serving_threads(generates=False, threads=None, owns_process=True) == max(1, torch.get_num_threads() - 1)
    assert serving_threads(generates=False, threads=3, owns_process=True) == 3  # --threads
    assert serving_threads(generates=False, threads=3, owns_process=False) == 3
    assert serving_threads(generates=False, threads=None, owns_process=False) is None  # an app built in-process
    assert serving_threads(generates=True, threads=None, owns_process=True) is None  # generation: as it is


def test_the_openai_client_gets_sentence_encoder_vectors_as_floats_and_base64(server, client, encoder):
    want = encoder.encode(TEXTS)
    floats = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    got = vectors(floats)
    assert got.shape == (len(TEXTS), 32) and np.abs(got - want).max() < 1e-5
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens_read(encoder, TEXTS)
    assert floats.usage.prompt_tokens < sum(len(encoder.tokenizer(t)["input_ids"]) for t in TEXTS)  # one truncated
    # the client's default: base64, which it decodes itself
    assert np.array_equal(vectors(client.embeddings.create(model=NAME, input=TEXTS)), got)
    # on the wire: base64 of the little-endian float32 bytes
    body = {"model": NAME, "input": TEXTS, "encoding_format": "base64"}
    raw = httpx.post(f"{server}/v1/embeddings", json=body, timeout=60).json()
    wire = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
    assert np.array_equal(wire, got)
    # as floats, each number the shortest text of its float32 (at most 9 significant digits), not of a double (17)
    text = httpx.post(f"{server}/v1/embeddings", json={**body, "encoding_format": "float"}, timeout=60).text
    written = [n for d in json.loads(text, parse_float=str)["data"] for n in d["embedding"]]
    digits = [len(n.lstrip("-").split("e")[0].replace(".", "").lstrip("0")) for n in written]
    assert max(digits) <= 9 and np.array_equal(np.array(written, dtype=np.float32).reshape(got.shape), got)


def test_dimensions_keep_the_first_ones_renormalised(client, encoder):
    short = vectors(client.embeddings.create(model=NAME, input=TEXTS, dimensions=8, encoding_format="float"))
    assert short.shape == (len(TEXTS), 8)
    assert np.abs(short - encoder.encode(TEXTS, dims=8)).max() < 1e-5
    assert np.allclose(np.linalg.norm(short, axis=1), 1, atol=1e-5)
    whole = vectors(client.embeddings.create(model=NAME, input=TEXTS[:2], dimensions=32, encoding_format="float"))
    assert np.abs(whole - encoder.encode(TEXTS[:2])).max() < 1e-5
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=NAME, input=TEXTS[:2], dimensions=33)
    assert refused.value.status_code == 400 and refused.value.body["param"] == "dimensions"
    assert "above this model's 32" in refused.value.body["message"]


def test_a_text_alone_and_token_ids_embed_as_texts_do(client, encoder):
    want = encoder.encode(TEXTS[:2])
    one = client.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="float")
    assert np.abs(vectors(one) - want[:1]).max() < 1e-5 and one.usage.prompt_tokens == tokens_read(encoder, TEXTS[:1])
    ids = encoder.tokenizer(TEXTS[:2])["input_ids"]  # as the model's tokenizer gives them: special tokens included
    alone = client.embeddings.create(model=NAME, input=ids[0], encoding_format="float")
    assert np.abs(vectors(alone) - want[:1]).max() < 1e-5 and alone.usage.prompt_tokens == len(ids[0])
    both = client.embeddings.create(model=NAME, input=ids, encoding_format="float")
    assert np.abs(vectors(both) - want).max() < 1e-5 and both.usage.total_tokens == len(ids[0]) + len(ids[1])


def test_concurrent_requests_share_a_batch(server, client, encoder):
    """Each client's one text leaves at the same moment: the batcher runs them through the model together (fewer
    batches, each one forward pass of at most 64 rows, than requests), and each caller gets its own vector."""
    before = httpx.get(f"{server}/health", timeout=10).json()
    answers = [None] * len(TEXTS)
    start = threading.Barrier(len(TEXTS))

    def ask(i: int) -> None:
        start.wait(timeout=30)
        answers[i] = client.embeddings.create(model=NAME, input=[TEXTS[i]], encoding_format="float")

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(TEXTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    after = httpx.get(f"{server}/health", timeout=10).json()
    assert after["requests"] - before["requests"] == len(TEXTS)
    assert after["batches"] - before["batches"] < len(TEXTS) and after["largest_batch"] > 1, after
    got = np.concatenate([vectors(a) for a in answers])
    assert np.abs(got - encoder.encode(TEXTS)).max() < 1e-5  # each caller its own text's vector
    metrics = httpx.get(f"{server}/metrics", timeout=10).text
    assert 'tuneforge_requests_total{route="/v1/embeddings",status="200"}' in metrics


def request(**fields) -> dict:
    return {"model": NAME, "input": ["a cat"], **fields}


BAD = [
    ("no input", {"model": NAME}, 400, "input"),
    ("no model", {"input": "a cat"}, 400, "model"),
    ("empty text", request(input=""), 400, "input"),
    ("empty list", request(input=[]), 400, "input"),
    ("an empty text in a list", request(input=["a cat", ""]), 400, "input[1]"),
    ("an empty token-id list", request(input=[[]]), 400, "input[0]"),
    ("a token id past the vocabulary", request(input=[[101, 99_999_999, 102]]), 400, "input[0]"),
    ("a negative token id", request(input=[-1]), 400, "input"),
    ("more token ids than max_length", request(input=[101] + [2000] * 40 + [102]), 400, "input"),
    ("a float token", request(input=[1.5]), 400, "input"),  # none of input's forms: the whole field is named
    ("texts and ids mixed", request(input=[1, "a"]), 400, "input"),
    ("an object", request(input={"text": "a cat"}), 400, "input"),
    ("a number", request(input=5), 400, "input"),
    ("a boolean", request(input=True), 400, "input"),
    ("a null", request(input=None), 400, "input"),
    ("too many inputs", request(input=["a"] * 1025), 400, "input"),
    ("a lone surrogate", b'{"model": "tiny-encoder", "input": ["ok", "\\ud800"]}', 400, "input[1]"),
    ("unknown encoding", request(encoding_format="int8"), 400, "encoding_format"),
    ("zero dimensions", request(dimensions=0), 400, "dimensions"),
    ("dimensions as a string", request(dimensions="8"), 400, "dimensions"),
    ("dimensions as a float", request(dimensions=8.0), 400, "dimensions"),
    ("dimensions above the model's", request(dimensions=33), 400, "dimensions"),
    ("huge dimensions", request(dimensions=2**62), 400, "dimensions"),
    ("another model", request(model="text-embedding-3-small"), 404, "model"),
    ("a model name not text", request(model=7), 400, "model"),
    ("not JSON", b'{"model": "tiny-encoder", "input": ', 400, None),
    ("a list body", b'[{"model": "tiny-encoder", "input": "a"}]', 400, None),
    ("oversize body", request(input=["word " * 30_000]), 413, None),
]


def send(url: str, path: str, body) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=raw, headers={"Content-Type": "application/json"}, timeout=60)


@pytest.mark.parametrize("what, body, status, param", BAD, ids=[b[0] for b in BAD])
def test_hostile_requests_get_an_openai_error_naming_the_field(server, what, body, status, param):
    r = send(server, "/v1/embeddings", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"], error
    assert error["type"] == {404: "not_found_error", 413: "request_too_large"}.get(status, "invalid_request_error")


def test_the_server_still_answers_after_the_hostile_requests(client, encoder):
    got = vectors(client.embeddings.create(model=NAME, input=TEXTS[:3], encoding_format="float"))
    assert np.abs(got - encoder.encode(TEXTS[:3])).max() < 1e-5


def test_metadata_is_accepted_and_unknown_fields_ignored(server):
    r = send(server, "/v1/embeddings", request(user="u1", frobnicate={"x": 1}, encoding_format=None))
    assert r.status_code == 200 and len(r.json()["data"]) == 1


@pytest.mark.parametrize("path", ["/predict", "/v1/completions", "/v1/chat/completions"])
def test_the_other_apis_point_to_the_embeddings_route(server, path):
    body = {"texts": ["a"]} if path == "/predict" else {"model": NAME, "prompt": "a", "messages": []}
    r = send(server, path, body)
    assert r.status_code == 400 and "POST /v1/embeddings" in r.json()["error"]["message"], r.text


def test_a_classifier_server_points_from_embeddings_to_predict(tmp_path, minilm_dir):
    classifier = save_tiny_classifier(tmp_path / "classifier", minilm_dir, {0: "neg", 1: "pos"})
    with app_server(classifier) as url:
        wait_ready(url)
        r = send(url, "/v1/embeddings", {"model": "tiny-chat", "input": "a cat"})
    assert r.status_code == 400 and "POST /predict" in r.json()["error"]["message"], r.text


def test_fuzz_embeddings_while_a_known_good_request_keeps_its_answer(tiny_encoder, encoder):
    """Bodies drawn from the route's own schema (valid ones, ones with a field spoiled, arbitrary JSON: the
    strategies of test_serve_fuzz.py) and its raw adversarial bodies, while a known-good request is sent again and
    again from another thread (sharing batches with the fuzz): never a 5xx, every refusal in OpenAI's error shape,
    the known-good vectors unchanged, the server healthy after."""
    from test_serve_fuzz import RAW, check, fuzz_posts, request_bodies
    from test_serve_fuzz import send as send_raw
    from test_serve_generate import NAME as SERVED  # app_server's model name

    bodies = request_bodies("/v1/embeddings", SERVED, ("input", "encoding_format", "dimensions", "user"))
    good = {"model": SERVED, "input": TEXTS[:3], "encoding_format": "float"}
    answers: list[httpx.Response] = []
    done = threading.Event()

    def again(url: str) -> None:
        while not done.is_set():
            answers.append(send(url, "/v1/embeddings", good))
            time.sleep(0.02)

    with app_server(tiny_encoder, max_wait_ms=2) as url:
        wait_ready(url)
        thread = threading.Thread(target=again, args=(url,), daemon=True)
        thread.start()
        try:
            fuzz_posts(url, "/v1/embeddings", bodies, 120)
            for _, raw, headers in RAW:
                r = send_raw(url, "POST", "/v1/embeddings", raw, headers)
                check(r)
                assert r.status_code in (400, 404), (r.status_code, r.text[:300])
        finally:
            done.set()
            thread.join(timeout=60)
        health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["status"] == "ok" and len(answers) >= 3, "the known-good request was not interleaved"
    want = encoder.encode(TEXTS[:3])
    for r in answers:
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
        assert np.abs(got - want).max() < 1e-5


def test_a_model_that_gives_nan_answers_500_and_goes_on_serving(tiny_encoder, tmp_path):
    """A copy of the encoder whose embedding row of one token is nan: a text holding that token is a logged 500
    (orjson would write nan as null: a 200 with nulls for numbers), alone or with a good text; the server answers a
    good text sent at the same time (a batch of its own or shared) with a finite vector, and goes on."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    folder = tmp_path / "nan-encoder"
    shutil.copytree(tiny_encoder, folder)
    weights_file = next(folder.rglob("model.safetensors"))
    weights = load_file(weights_file)
    (name,) = [k for k in weights if k.endswith("word_embeddings.weight")]
    (poisoned,) = AutoTokenizer.from_pretrained(folder)("dull", add_special_tokens=False)["input_ids"]
    weights[name][poisoned] = float("nan")
    save_file(weights, weights_file, metadata={"format": "pt"})

    proc, url = start_server(str(folder), served_model_name=NAME, max_wait_ms=300)
    try:
        body = {"model": NAME}
        with httpx.Client(base_url=url, timeout=60) as http:
            with ThreadPoolExecutor(2) as pool:
                asked = [
                    pool.submit(http.post, "/v1/embeddings", json={**body, "input": text}) for text in ("dull", "fine")
                ]
            bad, good = [future.result() for future in asked]
            assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
            assert bad.json()["error"]["message"] == "the model produced a non-finite vector; see the server's log"
            assert good.status_code == 200 and np.isfinite(good.json()["data"][0]["embedding"]).all()
            assert http.post("/v1/embeddings", json={**body, "input": ["fine", "dull"]}).status_code == 500
            assert http.get("/health").json()["status"] == "ok"
    finally:
        stop_server(proc)
    assert "the model produced a non-finite vector" in proc.log.read_text()
    proc.log.unlink()
