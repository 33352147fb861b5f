"""The generation engine of `tuneforge serve` on a real tiny GPT-2 (its left-padded running batch) and a real tiny
Llama (the slotted one, newcomers joining in the running rows' pass), without HTTP: a request that arrives while
another decodes joins the running batch at the next step (it finishes first), and every row still produces
exactly what `transformers`' greedy `generate` produces for its prompt alone (sliding-window models too)."""

from __future__ import annotations

import time

import pytest
import torch

BATCH_KINDS = pytest.mark.parametrize("model_fixture", ["tiny_gpt2", "tiny_llama"])


@BATCH_KINDS
def test_a_newcomer_joins_the_running_batch_at_the_next_step(model_fixture, request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tuneforge.generate import Generator
    from tuneforge.serve.engine import GenerationEngine, SamplingParams, Sequence

    tiny_gpt2 = request.getfixturevalue(model_fixture)
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


def drive(engine, steps: int, joining: dict | None = None) -> None:
    """`steps` of the engine's loop run by hand (admit what waits, one step), `joining[step]` submitted before it."""
    for step in range(steps):
        if joining and step in joining:
            engine.submit(joining[step])
        with engine._wake:
            admitted = engine._admit()
        engine._step(admitted)


def sliding_window_model(folder, family: str) -> str:
    """A tiny random causal LM attending within a window of 4 tokens: Mistral (every layer), or Gemma 2 (every
    other layer, soft-capped attention and output logits)."""
    import transformers as T

    from conftest import save_tiny_causal_lm

    sizes = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    sizes.update(max_position_embeddings=64, sliding_window=4)
    if family == "mistral":
        return save_tiny_causal_lm(folder, T.MistralForCausalLM, T.MistralConfig, **sizes)
    capped = dict(head_dim=8, attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
    return save_tiny_causal_lm(folder, T.Gemma2ForCausalLM, T.Gemma2Config, **sizes, **capped)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_rows_of_different_lengths_decode_as_each_alone(family, tmp_path):
    """A sliding-window model's rows (prompts of 2 to 30 tokens, past the window of 4; some joining while others
    decode) each produce exactly what `generate` produces for the prompt alone, and an echoed prompt's log-probs
    equal a forward pass within 1e-4. The model's own cache kept a window's keys only, which the batch's mask did
    not match: Mistral's short row answered other text, Gemma 2's rows failed at the first decode step."""
    from tuneforge.generate import Generator
    from tuneforge.serve.engine import GenerationEngine, SamplingParams, Sequence

    generator = Generator(sliding_window_model(tmp_path, family))
    engine = GenerationEngine(generator, max_batch_size=3, context=64)
    model = generator.model
    prompts = [[5 + i % 200 for i in range(7 * n, 8 * n)] for n in (2, 30, 9, 17)]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)] * 2
    params += [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (6, 10)]
    seqs = [Sequence(p, sp, lambda text, reason: None) for p, sp in zip(prompts, params)]
    with torch.inference_mode():
        engine.submit(seqs[:2])
        drive(engine, 40, joining={3: seqs[2:]})  # one joins at step 3, the last when a row leaves
        for seq, prompt in zip(seqs, prompts):
            ids = torch.tensor([prompt])
            alone = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=seq.params.max_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            assert (seq.finish_reason, seq.token_ids) == ("length", alone[0, len(prompt) :].tolist())
            if seq.prompt_logprobs is not None:
                logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
                expected = [float(logp[j, token]) for j, token in enumerate(prompt[1:])]
                got = [entry.logprob for entry in seq.prompt_logprobs[1:]]
                torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=0)


def test_t5_rows_join_the_running_batch_and_decode_as_each_alone(tiny_t5):
    """A T5's requests waited for the whole running batch to end (seq2seq rows were admitted only into an empty
    batch), so one long answer held every other request back. Its decoder's positions are relative: newcomers join
    at the next step, inputs narrower and wider than the running rows', and every row, those that stay after others
    leave too, produces exactly what `generate` produces for its input alone."""
    from tuneforge.generate import Generator
    from tuneforge.serve.engine import GenerationEngine, SamplingParams, Sequence

    generator = Generator(tiny_t5)
    engine = GenerationEngine(generator, max_batch_size=3)
    prompts = [[5 + i % 200 for i in range(7 * n, 8 * n)] + [1] for n in (4, 30, 2, 9)]
    seqs = [
        Sequence(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True), lambda text, reason: None)
        for p, m in zip(prompts, (30, 6, 12, 8))
    ]
    with torch.inference_mode():
        engine.submit(seqs[:1])
        drive(engine, 4, joining={3: seqs[1:]})  # two join at step 3, the last when a row leaves
        assert [len(s.token_ids) for s in seqs[:3]] == [5, 2, 2]  # the first decodes with them, not to its end first
        drive(engine, 36)
    assert engine.running_rows == 0
    for seq, prompt in zip(seqs, prompts):
        ids = torch.tensor([prompt])
        alone = generator.model.generate(ids, max_new_tokens=seq.params.max_tokens, do_sample=False, eos_token_id=None)
        assert (seq.finish_reason, seq.token_ids) == ("length", alone[0, 1:].tolist())


@pytest.mark.parametrize("family", ["mamba", "lfm2"])
def test_a_model_with_recurrent_state_is_refused_in_one_line(family, tmp_path):
    """A model that keeps a recurrent or convolutional state beside (or instead of) keys and values per position
    (Mamba; LFM2's convolution layers) cannot be left-padded, joined or cut as the running batch does: the engine
    is refused when it is made, in one ConfigError naming the layers (`tuneforge serve` says it in one error:
    line), where every request got a 500 from a server that said it was healthy."""
    import transformers as T

    from conftest import save_tiny_causal_lm
    from tuneforge.errors import ConfigError
    from tuneforge.generate import Generator
    from tuneforge.serve.engine import GenerationEngine

    if family == "mamba":
        sizes = dict(hidden_size=32, num_hidden_layers=2, state_size=4, intermediate_size=64)
        folder = save_tiny_causal_lm(tmp_path, T.MambaForCausalLM, T.MambaConfig, **sizes)
    else:
        sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
        layers = dict(max_position_embeddings=64, layer_types=["conv", "full_attention"])
        folder = save_tiny_causal_lm(tmp_path, T.Lfm2ForCausalLM, T.Lfm2Config, **sizes, **layers)
    generator = Generator(folder)
    with pytest.raises(ConfigError, match="recurrent state") as refused:
        GenerationEngine(generator)
    assert "\n" not in str(refused.value) and "tuneforge generate" in str(refused.value)
    assert str(refused.value).startswith(f"a model of the {family} family keeps")  # no 'a' before a family's name


def test_a_full_waiting_list_is_refused(tiny_gpt2):
    from tuneforge.generate import Generator
    from tuneforge.serve.engine import GenerationEngine, QueueFull, SamplingParams, Sequence

    engine = GenerationEngine(Generator(tiny_gpt2), max_batch_size=1, max_queue=2)  # not started: nothing leaves
    seq = lambda: Sequence([5, 6], SamplingParams(max_tokens=2), lambda text, reason: None)  # noqa: E731
    engine.submit([seq(), seq()])
    with pytest.raises(QueueFull):
        engine.submit([seq()])
    assert engine.queue_depth == 2


# ---- a request fails alone ------------------------------------------------------------------------------
def wait_for(seqs, timeout: float = 30) -> None:
    """Until each sequence is finished and, for a `collecting` one, its last text heard: the engine sets the finish
    reason just before it emits the rest of the text (a test that read the texts at the reason alone lost the last
    piece now and then: 'inginging' against 'inginging\ufffd\ufffd')."""
    deadline = time.monotonic() + timeout
    while any(s.finish_reason is None or not getattr(s.emit, "heard", [True]) for s in seqs):
        assert time.monotonic() < deadline, "the engine did not finish"
        time.sleep(0.005)


def collecting():
    """(an emit callback, the texts it got, the finish reasons it got)."""
    texts, reasons = [], []

    def emit(text: str, reason: str | None) -> None:
        texts.append(text)
        if reason is not None:
            reasons.append(reason)

    emit.heard = reasons  # wait_for waits for the finishing emit, not only the finish reason
    return emit, texts, reasons


def greedy_reference(model_dir: str, prompt: str, max_new_tokens: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    new = out[0, ids["input_ids"].shape[1] :].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id)]
    return tokenizer.decode(new, skip_special_tokens=True)


@BATCH_KINDS
def test_a_row_whose_sampling_fails_and_a_prefill_that_fails_fail_alone(model_fixture, request):
    """A NaN temperature (past the HTTP checks) fails that row's sampling; a token id beyond the vocabulary
    fails its prefill (its group is retried sequence by sequence). The good rows batched with them answer
    exactly, the engine lives on."""
    from tuneforge.generate import Generator
    from tuneforge.serve.engine import GenerationEngine, SamplingParams, Sequence

    tiny_gpt2 = request.getfixturevalue(model_fixture)
    generator = Generator(tiny_gpt2)
    engine = GenerationEngine(generator, max_batch_size=4, context=64)
    prompt = generator.tokenizer("A man is riding")["input_ids"]
    good, good_texts, good_reasons = collecting()
    nan, _, nan_reasons = collecting()
    beyond, _, beyond_reasons = collecting()
    seqs = [
        Sequence(prompt, SamplingParams(max_tokens=8, temperature=float("nan")), nan),
        Sequence(prompt, SamplingParams(max_tokens=8, temperature=0), good),
        Sequence([5, 10_000], SamplingParams(max_tokens=8, temperature=0), beyond),
    ]
    engine.submit(seqs)  # before the engine starts: the three are admitted in one prefill
    engine.start()
    try:
        wait_for(seqs)
        assert nan_reasons == ["error"] and beyond_reasons == ["error"]
        assert good_reasons and good_reasons[0] in ("stop", "length")
        assert "".join(good_texts) == greedy_reference(tiny_gpt2, "A man is riding", 8)
        assert engine.error is None
        again, again_texts, _ = collecting()  # and it goes on serving
        later = Sequence(prompt, SamplingParams(max_tokens=8, temperature=0), again)
        engine.submit([later])
        wait_for([later])
        assert "".join(again_texts) == "".join(good_texts) and engine.error is None
    finally:
        engine.stop()


def test_the_engine_dies_when_the_model_itself_fails(tiny_gpt2):
    from tuneforge.generate import Generator
    from tuneforge.serve.engine import EngineDied, GenerationEngine, SamplingParams, Sequence

    generator = Generator(tiny_gpt2)

    def broken(*args, **kwargs):
        raise RuntimeError("the device is gone")

    generator.model.forward = broken
    deaths: list[BaseException] = []
    engine = GenerationEngine(generator, max_batch_size=4, context=64, on_death=deaths.append)
    emits = [collecting() for _ in range(3)]
    seqs = [Sequence([5, 6, 7], SamplingParams(max_tokens=4, temperature=0), emit) for emit, _, _ in emits]
    engine.submit(seqs)
    engine.start()
    wait_for(seqs)
    engine.stop()
    assert [reasons for _, _, reasons in emits] == [["error"]] * 3
    assert len(deaths) == 1 and isinstance(deaths[0], EngineDied) and engine.error is deaths[0]
    assert "the device is gone" in str(deaths[0])
    with pytest.raises(EngineDied):  # nothing would take it: refused, never left waiting
        engine.submit([Sequence([5], SamplingParams(max_tokens=1), lambda text, reason: None)])


def test_a_bad_newcomer_joining_running_rows_fails_alone(tiny_llama, caplog):
    """On slots a newcomer's prompt runs in the running rows' pass; a prompt that fails it (a token beyond the
    vocabulary) makes the engine prefill and decode apart: the newcomer fails alone, the running row answers
    exactly what it answers alone, and a good newcomer after it joins as before."""
    from tuneforge.generate import Generator
    from tuneforge.serve.engine import GenerationEngine, SamplingParams, Sequence

    rows_per_step: list[int] = []
    generator = Generator(tiny_llama)
    engine = GenerationEngine(generator, max_batch_size=4, context=64, on_step=rows_per_step.append)
    prompt = generator.tokenizer("A man is riding")["input_ids"]
    (good, good_texts, _), (bad, _, bad_reasons), (late, late_texts, _) = collecting(), collecting(), collecting()
    running = Sequence(prompt, SamplingParams(max_tokens=30, temperature=0), good)
    engine.start()
    try:
        engine.submit([running])
        deadline = time.monotonic() + 30
        while len(running.token_ids) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        beyond = Sequence([5, 10_000_000], SamplingParams(max_tokens=4, temperature=0), bad)
        later = Sequence(prompt, SamplingParams(max_tokens=8, temperature=0), late)
        engine.submit([beyond])
        wait_for([beyond])
        engine.submit([later])
        wait_for([running, later])
    finally:
        engine.stop()
    assert bad_reasons == ["error"] and engine.error is None
    assert "a joined step failed" in caplog.text  # the joined pass was tried, then the two apart
    assert "".join(good_texts) == greedy_reference(tiny_llama, "A man is riding", 30)
    assert "".join(late_texts) == greedy_reference(tiny_llama, "A man is riding", 8)
    assert 2 in rows_per_step  # the good newcomer joined the running row's pass


def test_a_logit_bias_over_the_whole_vocabulary_is_applied_to_its_row():
    """A request may bias every token (the body limit allows SmolLM2's 49,152 of them): its row is sampled from the
    biased logits (built into tensors once per request: a loop over the pairs at every step, 0.3 s, held up every
    row batched with it; benchmarks, not a timed test, measure that), and an id given twice adds up."""
    from tuneforge.serve.engine import SamplingParams, Sequence, sample

    vocabulary = 49_152
    logits = torch.randn(2, vocabulary, generator=torch.Generator().manual_seed(0))
    bias = tuple((token, 50.0 if token == 7 else -float(token % 3)) for token in range(vocabulary))
    rows = [Sequence([1, 2], SamplingParams(max_tokens=4, temperature=0, logit_bias=bias), None)] * 2
    assert sample(logits, rows) == [7, 7]
    twice = ((5, 30.0), (5, 30.0), (7, 50.0))  # 60 on token 5 beats 50 on token 7
    assert sample(logits[:1], [Sequence([1], SamplingParams(max_tokens=1, temperature=0, logit_bias=twice), None)]) == [
        5
    ]


def test_top_p_counts_its_mass_before_min_p_drops_tokens_as_transformers_does():
    """transformers' warpers run top_k, top_p, then min_p (vLLM's sampler too). Of probabilities 0.4, 0.3, 0.2,
    0.1, top_p 0.75 keeps the first three and min_p 0.3 drops only the last (below 0.12): three tokens can be
    drawn. top_p counted over what min_p left (0.44, 0.33, 0.22) kept two."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopPLogitsWarper

    from tuneforge.serve.engine import SamplingParams, sample_row

    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    warped = MinPLogitsWarper(0.3)(None, TopPLogitsWarper(0.75)(None, logits[None]))[0]
    allowed = set(torch.isfinite(warped).nonzero()[:, 0].tolist())
    params = SamplingParams(max_tokens=1, top_p=0.75, min_p=0.3)
    drawn = {sample_row(logits, params, torch.Generator().manual_seed(seed)) for seed in range(200)}
    assert drawn == allowed == {0, 1, 2}
