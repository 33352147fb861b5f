"""Generation callable from training: the continuous-batching engine runs on the live model being trained (no
HTTP, no copy of the weights) and its greedy completions equal `model.generate`'s, before and after optimizer
steps that change them."""

from __future__ import annotations

import torch

PROMPTS = ["A man is riding", "Two children are watching a small boat", "The"]
MAX_TOKENS = 8


def reference_greedy(model, tokenizer, prompt: str) -> list[int]:
    """transformers' greedy continuation of one prompt alone (no padding), without its end-of-sequence token."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    model.train()
    return [t for t in out[0, ids.shape[1] :].tolist() if t != tokenizer.eos_token_id]


def test_engine_generates_from_the_live_model_before_and_after_a_training_step(tiny_gpt2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tuneforge.serve.engine import GenerationEngine, SamplingParams

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2).train()
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2)
    engine = GenerationEngine.from_model(model, tokenizer, max_batch_size=4)
    assert engine.model is model  # the live object: no copy
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)

    before = engine.generate(prompts, greedy)
    assert [c.token_ids for c in before] == [reference_greedy(model, tokenizer, p) for p in PROMPTS]
    assert [c.text for c in before] == [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in before]
    assert model.training  # given back in the mode it was in

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = tokenizer(["the boat is small and the man rides it"] * 2, return_tensors="pt")
    for _ in range(3):
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    after = engine.generate(prompts, greedy)
    assert engine.model is model
    assert [c.token_ids for c in after] == [reference_greedy(model, tokenizer, p) for p in PROMPTS]
    assert [c.token_ids for c in after] != [c.token_ids for c in before], "the step changed no completion"
    assert engine.running_rows == 0 and engine.queue_depth == 0


def test_engine_generate_waits_for_its_own_thread(tiny_gpt2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tuneforge.serve.engine import GenerationEngine, SamplingParams

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2)
    engine = GenerationEngine.from_model(model, tokenizer, max_batch_size=2)
    engine.start()
    try:
        done = engine.generate([tokenizer(p)["input_ids"] for p in PROMPTS], SamplingParams(MAX_TOKENS, 0.0))
    finally:
        engine.stop()
    assert [c.token_ids for c in done] == [reference_greedy(model, tokenizer, p) for p in PROMPTS]
    assert all(c.finish_reason in ("stop", "length") for c in done)
