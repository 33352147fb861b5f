"""The text of generated tokens (serve/detokenize.py) is what the prompt continues with, `decode(prompt + ids)` past
`decode(prompt)`, as vLLM's detokenizer gives it: checked token by token on real tokenizers, and through the real
server (in-process uvicorn) by the official `openai` client on a tiny random Llama whose SentencePiece (Metaspace)
tokenizer drops the leading space of a text's first token, streamed and not, with echo, stop strings and chat."""

from __future__ import annotations

import random

import openai
import pytest
import torch

from test_serve_generate import NAME, app_server, save_chat_model, wait_ready
from tuneforge.serve.detokenize import IncrementalText

PROMPTS = ["A woman", "The man is", "Two children are watching a"]


def continuation(tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The text `ids` add to `prompt`: the reference the server's text is held to."""
    before = tokenizer.decode(prompt, skip_special_tokens=True)
    return tokenizer.decode(prompt + ids, skip_special_tokens=True)[len(before) :]


@pytest.mark.parametrize("model_fixture", ["metaspace_llama", "tiny_llama"])
def test_incremental_text_is_what_the_prompt_continues_with_at_every_token(model_fixture, request):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue(model_fixture))
    rng = random.Random(0)
    for prompt_text in PROMPTS:
        prompt = tokenizer(prompt_text)["input_ids"]
        ids = [rng.randrange(len(tokenizer)) for _ in range(40)]
        text = IncrementalText(tokenizer, prompt)
        for k, token in enumerate(ids, start=1):
            assert text.add(token).rstrip("\ufffd") == continuation(tokenizer, prompt, ids[:k]).rstrip("\ufffd")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, metaspace_llama) -> str:
    return save_chat_model(tmp_path_factory.mktemp("metaspace-chat") / "model", metaspace_llama)


@pytest.fixture(scope="module")
def client(model_dir) -> openai.OpenAI:
    with app_server(model_dir) as url:
        wait_ready(url)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def greedy_ids(model_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_completions_keep_the_leading_space_of_the_first_token_streamed_or_not(client, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spaced = 0
    for prompt_text in PROMPTS:
        prompt = tokenizer(prompt_text)["input_ids"]
        expected = continuation(tokenizer, prompt, greedy_ids(model_dir, prompt, 8))
        spaced += expected.startswith(" ")
        asked = dict(model=NAME, prompt=prompt_text, max_tokens=8, temperature=0)
        assert client.completions.create(**asked).choices[0].text == expected
        streamed = client.completions.create(**asked, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == expected
        assert client.completions.create(**asked, echo=True).choices[0].text == prompt_text + expected
        stop = expected[:2]  # begins with the first token's space: it stops there, before any text
        stopped = client.completions.create(**asked, stop=[stop]).choices[0]
        assert (stopped.text, stopped.finish_reason) == (expected[: expected.find(stop)], "stop")
    assert spaced, "no reply begins with a space: the prompts test nothing"


def test_chat_replies_are_the_text_the_rendered_prompt_continues_with(client, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "A woman"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    (the,) = tokenizer("the", add_special_tokens=False)["input_ids"]  # "\u2581the": a word with its space
    expected = continuation(tokenizer, prompt, [the] * 4)
    assert expected == " the the the the"
    asked = dict(model=NAME, messages=messages, max_tokens=4, temperature=0, logit_bias={str(the): 100})
    assert client.chat.completions.create(**asked).choices[0].message.content == expected
    streamed = client.chat.completions.create(**asked, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == expected


def test_in_process_generation_decodes_the_generated_tokens_alone_as_trl_does(metaspace_llama):
    """engine.generate (GRPO's rollouts) gives the text TRL's rewards read: batch_decode of the completion ids."""
    from tuneforge.serve.engine import GenerationEngine, SamplingParams

    engine = GenerationEngine.from_model(*load(metaspace_llama))
    prompts = [engine.tokenizer(p)["input_ids"] for p in PROMPTS]
    completions = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    texts = engine.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    assert [c.text for c in completions] == texts
    assert any(continuation(engine.tokenizer, p, c.token_ids) != c.text for p, c in zip(prompts, completions))


def load(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
