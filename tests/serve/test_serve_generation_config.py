"""A served model's own sampling defaults (`--generation-config auto`, as vLLM's default): the fields of its
generation_config.json a request leaves out, on /v1/completions and /v1/chat/completions alike; a request's own
value wins; `none` keeps OpenAI's; values outside the API's bounds (and a file that is not JSON) are left out with a
note in the start-up line, never a crash. The tiny chat Llama of test_serve_generate with a generation_config.json
written per test: top_k 1 (or temperature 0) makes a sampled answer the greedy one, an observable of the defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from conftest import cli_main
from test_serve_generate import NAME, PROMPTS, Reference, app_server, wait_ready

MESSAGES = [{"role": "user", "content": "Tell me about the dog"}]


def with_generation_config(chat_model: str, folder: Path, text: str) -> str:
    """A copy of `chat_model` whose generation_config.json is `text` (its end-of-text ids kept when it is JSON)."""
    shutil.copytree(chat_model, folder)
    (folder / "generation_config.json").write_text(text)
    return str(folder)


def settings(**fields) -> str:
    return json.dumps({"bos_token_id": 0, "eos_token_id": 0, **fields})


def post(url: str, path: str, **body) -> dict:
    answer = httpx.post(f"{url}{path}", json={"model": NAME, **body}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def completion_text(url: str, **body) -> str:
    return post(url, "/v1/completions", prompt=PROMPTS[0], **body)["choices"][0]["text"]


def chat_text(url: str, **body) -> str:
    return post(url, "/v1/chat/completions", messages=MESSAGES, **body)["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def ref(chat_model) -> Reference:
    return Reference(chat_model)


def test_the_models_top_k_and_temperature_are_the_defaults_of_both_routes_and_a_requests_own_value_wins(
    chat_model, ref, tmp_path
):
    greedy = ref.greedy(ref.ids(PROMPTS[0]), 10)[0]
    greedy_chat = ref.greedy(ref.chat_ids(MESSAGES), 10)[0]
    with app_server(chat_model) as url:  # no sampling fields in its generation config: OpenAI's defaults
        wait_ready(url)
        drawn = completion_text(url, max_tokens=10, seed=7)
        drawn_chat = chat_text(url, max_tokens=10, seed=7)
    assert drawn != greedy and drawn_chat != greedy_chat  # a seeded draw at temperature 1 is not greedy
    top_k_one = with_generation_config(chat_model, tmp_path / "top-k", settings(do_sample=True, top_k=1))
    with app_server(top_k_one) as url:
        wait_ready(url)
        assert completion_text(url, max_tokens=10, seed=7, temperature=1.0) == greedy
        assert chat_text(url, max_tokens=10, seed=7) == greedy_chat
        assert completion_text(url, max_tokens=10, seed=7, top_k=0) == drawn  # the request's own top_k
        assert httpx.get(f"{url}/health", timeout=10).json()["sampling_defaults"] == {"top_k": 1}
    cold = with_generation_config(chat_model, tmp_path / "cold", settings(temperature=0.0))
    with app_server(cold) as url:
        wait_ready(url)
        assert completion_text(url, max_tokens=10, seed=7) == greedy
        assert chat_text(url, max_tokens=10, seed=7) == greedy_chat
        assert chat_text(url, max_tokens=10, seed=7, temperature=1.0) == drawn_chat
    with app_server(top_k_one, generation_config="none") as url:  # OpenAI's defaults, as before
        wait_ready(url)
        assert completion_text(url, max_tokens=10, seed=7) == drawn
        assert httpx.get(f"{url}/health", timeout=10).json()["sampling_defaults"] == {}


def test_the_models_max_new_tokens_is_the_default_max_tokens(chat_model, ref, tmp_path):
    """Chat: in place of --default-max-tokens; completions: at most OpenAI's 16, as vLLM takes it."""
    assert ref.greedy(ref.ids(PROMPTS[0]), 16)[1] == 16 and ref.greedy(ref.chat_ids(MESSAGES), 40)[1] > 20
    short = with_generation_config(chat_model, tmp_path / "short", settings(max_new_tokens=5))
    with app_server(short) as url:
        wait_ready(url)
        assert post(url, "/v1/completions", prompt=PROMPTS[0], temperature=0)["usage"]["completion_tokens"] == 5
        assert post(url, "/v1/chat/completions", messages=MESSAGES, temperature=0)["usage"]["completion_tokens"] == 5
        asked = post(url, "/v1/chat/completions", messages=MESSAGES, temperature=0, max_tokens=8)
        assert asked["usage"]["completion_tokens"] == 8
    long = with_generation_config(chat_model, tmp_path / "long", settings(max_new_tokens=20))
    with app_server(long, default_max_tokens=4) as url:
        wait_ready(url)
        assert post(url, "/v1/completions", prompt=PROMPTS[0], temperature=0)["usage"]["completion_tokens"] == 16
        assert post(url, "/v1/chat/completions", messages=MESSAGES, temperature=0)["usage"]["completion_tokens"] == 20


@pytest.mark.parametrize(
    "text, taken, notes",
    [
        (
            settings(temperature=-1.0, top_p="0.9", top_k=1, min_p=True),
            "top_k 1",
            [
                "generation_config.json's temperature -1.0 is left out (input should be greater than or equal to 0)",
                "generation_config.json's top_p '0.9' is left out (input should be a valid number)",
                "generation_config.json's min_p True is left out (input should be a valid number)",
            ],
        ),
        ('{"temperature": NaN, "top_k": 1, "repetition_penalty": 11}', "top_k 1", ["temperature nan", "repetition"]),
        ("{top_k: 1", "none", ["generation_config.json is not JSON (Expecting property name"]),
    ],
)
def test_values_outside_the_apis_bounds_are_left_out_with_a_note_in_the_start_up_line(
    chat_model, ref, tmp_path, capfd, text, taken, notes
):
    folder = with_generation_config(chat_model, tmp_path / "model", text)
    greedy = ref.greedy(ref.ids(PROMPTS[0]), 10)[0]
    with app_server(folder) as url:
        wait_ready(url)
        answer = completion_text(url, max_tokens=10, seed=7)
        (line,) = [line for line in capfd.readouterr().err.splitlines() if line.startswith("sampling defaults")]
    assert (answer == greedy) == (taken == "top_k 1")  # what was taken applies; nothing else failed
    assert f"--generation-config none for OpenAI's): {taken};" in line
    assert all(note in line for note in notes), line


def test_generate_leaves_out_a_bad_value_of_the_file_with_a_note_instead_of_failing(chat_model, tmp_path, capsys):
    """transformers' generate failed on them (an internal error): a negative temperature, a string top_p."""
    bad = with_generation_config(chat_model, tmp_path / "bad", settings(temperature=-1.0, top_p="0.9"))
    code, out, err = cli_main(capsys, "generate", bad, "--prompt", "The dog", "--do-sample", "--seed", "1")
    assert code == 0 and out.startswith("The dog"), err
    assert "note: generation_config.json's temperature -1.0 is left out" in err
    assert "note: generation_config.json's top_p '0.9' is left out" in err


def test_the_models_temperature_0_makes_generate_do_sample_greedy(chat_model, tmp_path, capsys):
    """As the server reads it (vLLM too); transformers refused a temperature of 0 with do_sample."""
    cold = with_generation_config(chat_model, tmp_path / "cold", settings(temperature=0.0))
    greedy = cli_main(capsys, "generate", chat_model, "--prompt", "The dog", "--max-new-tokens", "8")
    sampled = cli_main(capsys, "generate", cold, "--prompt", "The dog", "--max-new-tokens", "8", "--do-sample")
    assert sampled[0] == 0 and sampled[1] == greedy[1], sampled[2]
