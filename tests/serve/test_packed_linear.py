"""Serving's linear layers on oneDNN-packed weights (tuneforge/serve/packed_linear.py): a packed layer computes what
the layer computes, a real tiny Llama with its layers swapped generates what it generated, a sentence encoder with
its layers swapped embeds what it embedded (in float32 and under a bf16 predictor's autocast), only the shapes judged
faster are swapped (each judged once), and what cannot be packed keeps its layer."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 48), (2, 7, 48), (33, 48), (1, 48)])
def test_a_packed_layer_computes_what_the_layer_computes(bias, shape):
    from tuneforge.serve.packed_linear import PackedLinear

    torch.manual_seed(0)
    layer, x = torch.nn.Linear(48, 80, bias=bias), torch.randn(*shape)
    with torch.inference_mode():
        assert torch.allclose(PackedLinear(layer, rows=32)(x), layer(x), atol=1e-5)  # any rows, packed for 32


@pytest.fixture
def llama(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


def greedy(model, prompt: list[int], tokens: int = 12) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_a_model_with_every_layer_packed_generates_what_it_generated(llama):
    from tuneforge.serve.packed_linear import PackedLinear, pack_linear_layers

    prompt = [5, 17, 42, 99, 7]
    before = greedy(llama, prompt)
    with torch.inference_mode():
        logits = llama(torch.tensor([prompt])).logits
    linears = sum(1 for m in llama.modules() if type(m) is torch.nn.Linear)
    assert pack_linear_layers(llama, rows=4, faster=lambda layer, rows: True) == linears > 0
    assert not any(type(m) is torch.nn.Linear for m in llama.modules())
    assert sum(1 for m in llama.modules() if isinstance(m, PackedLinear)) == linears
    with torch.inference_mode():
        assert torch.allclose(llama(torch.tensor([prompt])).logits, logits, atol=1e-5)
    assert greedy(llama, prompt) == before


def test_a_model_that_reads_its_layers_weight_dtype_runs_packed(tiny_t5):
    """T5's feed-forward casts its input to `self.wo.weight.dtype` in every forward: with its layers packed it
    failed each one ('PackedLinear' object has no attribute 'weight'; a served T5 answered 500 and the server
    exited); the packed layer tells its weight's dtype and shape, and T5 generates what it generated."""
    from transformers import AutoModelForSeq2SeqLM

    from tuneforge.serve.packed_linear import pack_linear_layers

    t5 = AutoModelForSeq2SeqLM.from_pretrained(tiny_t5).eval()
    ids = torch.tensor([[5, 17, 42, 9, 1]])
    with torch.inference_mode():
        before = t5.generate(ids, max_new_tokens=8, do_sample=False)
        assert pack_linear_layers(t5, rows=4, faster=lambda layer, rows: True) > 0
        assert t5.generate(ids, max_new_tokens=8, do_sample=False).tolist() == before.tolist()


def packs_bf16() -> bool:
    """Whether this CPU's oneDNN packs bf16 weights at all (it needs avx512bw/vl/dq or avx_ne_convert: not on an
    AVX2-only CPU, where `packs_faster` then judges every bf16 layer unpackable and the server keeps it)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), 4)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-5), ("bf16", 2e-3)])
def test_a_predictor_with_every_layer_packed_embeds_what_it_embedded(tiny_encoder, precision, tolerance):
    """A predictor's layers after `ServingPrecision.use`, as the server packs them: bf16 weights take the float32
    inputs autocast would have cast for them (the norms' outputs)."""
    from tuneforge.predict import load_predictor

    if precision == "bf16" and not packs_bf16():
        pytest.skip("this CPU's oneDNN packs no bf16 weights (AVX2 only): nothing to force-pack")
    from tuneforge.serve.packed_linear import PackedLinear, pack_linear_layers

    texts = ["a wonderful, moving film", "dull", "the plot makes no sense at all"]
    predictor = load_predictor(tiny_encoder)
    assert predictor.precision.use(precision) == precision
    before = predictor.encode(texts)
    model = predictor.precision.model
    linears = sum(1 for m in model.modules() if type(m) is torch.nn.Linear)
    assert pack_linear_layers(model, rows=32, faster=lambda layer, rows: True) == linears > 0
    assert {m.dtype for m in model.modules() if isinstance(m, PackedLinear)} == {
        predictor.precision.dtype or torch.float32
    }
    after = predictor.encode(texts)
    assert abs(after - before).max() < tolerance and (after * before).sum(1).min() > 0.9999


def test_only_the_shapes_judged_faster_are_swapped_each_judged_once(llama):
    from tuneforge.serve.packed_linear import pack_linear_layers

    judged = []

    def wide_outputs(layer, rows):
        judged.append((layer.in_features, layer.out_features, rows))
        return layer.out_features > 32  # the MLP's up and gate projections and the output layer, not attention's

    wide = sum(1 for m in llama.modules() if type(m) is torch.nn.Linear and m.out_features > 32)
    assert pack_linear_layers(llama, rows=8, faster=wide_outputs) == wide > 0
    assert len(judged) == len(set(judged)) and all(rows == 8 for *_, rows in judged)
    assert all(m.out_features <= 32 for m in llama.modules() if type(m) is torch.nn.Linear)


def test_what_cannot_be_packed_keeps_its_layers(llama):
    """fp16 weights (packed only on CPUs with avx_ne_convert) keep every layer, whatever the timing would say. (The
    timing's verdict itself depends on the machine: not asserted; every served generation test runs it.)"""
    from tuneforge.serve.packed_linear import pack_linear_layers

    half = llama.to(torch.float16)
    assert pack_linear_layers(half, rows=4, faster=lambda layer, rows: True) == 0
    assert any(type(m) is torch.nn.Linear for m in half.modules())


def test_a_bf16_layer_gets_a_verdict_where_this_cpu_cannot_pack_it():
    """`packs_faster` of a bf16 layer is a verdict on every CPU, never an error: no where oneDNN packs no bf16
    weights (AVX2 only), so `serve --precision bf16` starts there with those layers as they are."""
    from tuneforge.serve.packed_linear import packs_faster

    verdict = packs_faster(torch.nn.Linear(48, 80).to(torch.bfloat16), rows=4)
    assert verdict is False or (verdict is True and packs_bf16())
