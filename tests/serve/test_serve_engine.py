"""The generation engine of `tuneforge serve` on a real tiny GPT-2, without HTTP: a request that arrives while
another decodes joins the running batch at the next step (it finishes first), and every row still produces
exactly what `transformers`' greedy `generate` produces for its prompt alone."""

from __future__ import annotations

import time

import torch


def test_a_newcomer_joins_the_running_batch_at_the_next_step(tiny_gpt2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tuneforge.generate import Generator
    from tuneforge.serve.engine import GenerationEngine, SamplingParams, Sequence

    rows_per_step: list[int] = []
    engine = GenerationEngine(Generator(tiny_gpt2), max_batch_size=4, context=64, on_step=rows_per_step.append)
    finished: dict[str, tuple[float, str]] = {}
    texts: dict[str, list[str]] = {"long": [], "short": []}

    def emit_for(name: str):
        def emit(text: str, reason: str | None) -> None:
            texts[name].append(text)
            if reason is not None:
                finished[name] = (time.monotonic(), reason)

        return emit

    tokenizer = engine.tokenizer
    prompts = {"long": "A man is riding", "short": "Two children are watching a small boat"}
    lengths = {"long": 40, "short": 5}
    seqs = {
        name: Sequence(
            tokenizer(p)["input_ids"], SamplingParams(max_tokens=lengths[name], temperature=0), emit_for(name)
        )
        for name, p in prompts.items()
    }
    engine.start()
    try:
        engine.submit([seqs["long"]])
        deadline = time.monotonic() + 30
        while len(seqs["long"].token_ids) < 5:  # the long one is decoding
            assert time.monotonic() < deadline
            time.sleep(0.001)
        engine.submit([seqs["short"]])
        while len(finished) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        engine.stop()
    assert finished["short"][0] < finished["long"][0], "the newcomer waited for the running request to end"
    assert 2 in rows_per_step  # the two decoded in one forward pass
    assert engine.running_rows == 0 and engine.queue_depth == 0

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval()
    reference = AutoTokenizer.from_pretrained(tiny_gpt2)
    for name, prompt in prompts.items():
        ids = reference(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=lengths[name], do_sample=False, pad_token_id=0)
        new = out[0, ids["input_ids"].shape[1] :].tolist()
        if reference.eos_token_id in new:
            new = new[: new.index(reference.eos_token_id)]
        assert "".join(texts[name]) == reference.decode(new, skip_special_tokens=True), name


def test_a_full_waiting_list_is_refused(tiny_gpt2):
    import pytest

    from tuneforge.generate import Generator
    from tuneforge.serve.engine import GenerationEngine, QueueFull, SamplingParams, Sequence

    engine = GenerationEngine(Generator(tiny_gpt2), max_batch_size=1, max_queue=2)  # not started: nothing leaves
    seq = lambda: Sequence([5, 6], SamplingParams(max_tokens=2), lambda text, reason: None)  # noqa: E731
    engine.submit([seq(), seq()])
    with pytest.raises(QueueFull):
        engine.submit([seq()])
    assert engine.queue_depth == 2
