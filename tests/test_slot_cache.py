"""The slotted key/value cache (tuneforge/slot_cache.py, running_batch.SlotBatch) on real tiny models: rows that
join, decode and leave at different steps give exactly the logits of a plain forward pass over each row's whole
sequence alone; a failed pass keeps nothing; the model's own attention is given back; which models run on slots."""

from __future__ import annotations

import pytest
import torch


def alone_logits(model, ids: list[int]) -> torch.Tensor:
    """The next-token logits after `ids`, one plain forward pass of the model's own attention."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


@pytest.fixture(scope="module")
def llama(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


def test_rows_that_join_and_leave_match_each_row_alone(llama):
    """Three prompts join at different steps (one beside running rows, in the same pass), one leaves mid-way
    (its slot goes to the last row), the cache grows past its first capacity; every step's logits equal a plain
    forward pass of each row's sequence so far, within 1e-4."""
    from tuneforge.running_batch import SlotBatch

    batch = SlotBatch(llama, pad_id=0)
    torch.manual_seed(0)
    prompts = [torch.randint(5, 200, (n,)).tolist() for n in (7, 3, 12, 5)]
    seqs: list[list[int]] = []
    with torch.inference_mode():
        logits = batch.prefill(prompts[:2])
        seqs += [list(p) for p in prompts[:2]]
        for step in range(70):  # past the first capacity of 64 positions
            tokens = logits.argmax(-1)
            for seq, token in zip(seqs, tokens.tolist()):
                seq.append(token)
            joining = [prompts[2]] if step == 3 else [prompts[3]] if step == 9 else []
            decoded, prefilled = batch.step(tokens, joining)
            seqs += [list(p) for p in joining]
            logits = decoded if prefilled is None else torch.cat([decoded, prefilled])
            for seq, row in zip(seqs, logits):
                torch.testing.assert_close(row, alone_logits(llama, seq), atol=1e-4, rtol=1e-4)
            if step == 20:  # the first row leaves: the last row moves into its slot
                batch.keep([1, 2, 3])
                seqs, logits = seqs[1:], logits[1:]
    assert batch.cache.capacity >= 75 and batch.cached_length() == max(map(len, seqs)) == 78


def test_a_prompt_given_several_times_is_computed_once_and_each_copy_decodes_alone(llama):
    """GRPO's group (OpenAI's n): the copies of a prompt join beside a running row, the forward pass holds the
    prompt once (one span per distinct prompt) and its keys are copied to the other copies' slots; each copy then
    decodes its own tokens exactly as the sequence alone."""
    from tuneforge import running_batch
    from tuneforge.running_batch import SlotBatch

    batch = SlotBatch(llama, pad_id=0)
    running, shared, other = [9, 8, 7], [5, 6, 7, 8, 9], [11, 12]
    assert running_batch.shared_prompts([shared, other, shared, shared]) == {2: 0, 3: 0}
    spans = []
    packed = running_batch.pack
    running_batch.pack = lambda *a, **k: spans.append(a[3]) or packed(*a, **k)  # records the packed prompt sizes
    try:
        with torch.inference_mode():
            first = batch.prefill([running]).argmax(-1)
            decoded, prefilled = batch.step(first, [shared, other, shared, shared])
            seqs = [running + [int(first[0])], list(shared), list(other), list(shared), list(shared)]
            logits = torch.cat([decoded, prefilled])
            for row, seq in zip(logits, seqs):
                torch.testing.assert_close(row, alone_logits(llama, seq), atol=1e-4, rtol=1e-4)
            for step in range(4):  # the copies take different tokens: their slots are their own
                tokens = torch.tensor([(7 * r + step) % 150 + 3 for r in range(len(seqs))])
                for seq, token in zip(seqs, tokens.tolist()):
                    seq.append(token)
                for row, seq in zip(batch.decode(tokens), seqs):
                    torch.testing.assert_close(row, alone_logits(llama, seq), atol=1e-4, rtol=1e-4)
    finally:
        running_batch.pack = packed
    assert spans[1] == [5, 2]  # the second pass: the shared prompt once, the other once


def test_echoed_prompts_get_every_positions_logits(llama):
    """`every_position` (an echoed prompt's log-probs): each prompt's logits at every position, right-aligned
    like CausalBatch's left-padded prefill, beside a running row."""
    from tuneforge.running_batch import SlotBatch

    batch = SlotBatch(llama, pad_id=0)
    running, prompts = [9, 8, 7], [[5, 6, 7, 8, 9], [11, 12]]
    with torch.inference_mode():
        first = batch.prefill([running]).argmax(-1)
        decoded, prefilled = batch.step(first, prompts, every_position=True)
        full = llama(input_ids=torch.tensor([prompts[0]])).logits[0]
        short = llama(input_ids=torch.tensor([prompts[1]])).logits[0]
    assert prefilled.shape[:2] == (2, 5)
    torch.testing.assert_close(prefilled[0], full, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(prefilled[1, 3:], short, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decoded[0], alone_logits(llama, running + [int(first[0])]), atol=1e-4, rtol=1e-4)


def test_a_failed_pass_keeps_nothing_and_gives_the_attention_back(llama):
    """A newcomer with a token beyond the vocabulary fails the joined pass: the running rows' lengths are as
    before, the model's attention is its own again, and the next pass is exact."""
    from tuneforge.running_batch import SlotBatch

    batch = SlotBatch(llama, pad_id=0)
    before = llama.config._attn_implementation
    with torch.inference_mode():
        tokens = batch.prefill([[5, 6, 7], [8, 9]]).argmax(-1)
        lengths = list(batch.lengths)
        with pytest.raises(IndexError):
            batch.step(tokens, [[5, 10_000_000]])
        assert batch.lengths == lengths and batch.slot_of_row == [0, 1]
        assert llama.config._attn_implementation == before
        logits = batch.decode(tokens)
    torch.testing.assert_close(logits[1], alone_logits(llama, [8, 9, int(tokens[1])]), atol=1e-4, rtol=1e-4)
    batch.keep([])
    assert batch.cache.slots == 0 and not batch.cache.keys  # an empty batch gives its memory back


def test_which_models_run_on_slots(tiny_llama, tiny_gpt2):
    """Llama runs on slots; GPT-2 (its attention not on the interface's rotary path), a sliding window, a
    flash-attention model do not (they keep running_batch.CausalBatch)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, MistralForCausalLM

    from tuneforge.generate import Generator
    from tuneforge.running_batch import CausalBatch, SlotBatch
    from tuneforge.slot_cache import supports

    assert isinstance(Generator(tiny_llama).make_batch(0), SlotBatch)
    assert isinstance(Generator(tiny_gpt2).make_batch(0), CausalBatch)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=99)
    assert not supports(MistralForCausalLM(MistralConfig(sliding_window=16, **sizes)))
    assert supports(MistralForCausalLM(MistralConfig(sliding_window=None, **sizes)))
    eager = AutoModelForCausalLM.from_config(LlamaConfig(**sizes), attn_implementation="eager")
    assert supports(eager)
    eager.config._attn_implementation = "flash_attention_2"
    assert not supports(eager)
