"""encoder_attention: each family it is used for computes what that family's own eager attention does (outputs and
gradients, padded and packed masks, attention dropout drawing the same numbers), and `auto` picks it only there."""

import copy
from types import SimpleNamespace

import pytest
import torch

from tuneforge import encoder_attention
from tuneforge.run import set_attention

TINY = dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
FAMILIES = {
    "bert": TINY,
    "roberta": TINY,
    "xlm-roberta": TINY,
    "camembert": TINY,
    "electra": {**TINY, "embedding_size": 16},
    "albert": {**TINY, "embedding_size": 16},
    "distilbert": dict(vocab_size=512, dim=32, n_layers=2, n_heads=4, hidden_dim=64),
}


def family_pair(model_type: str, dropout: float = 0.0):
    """A tiny random model of the family with its own eager attention, and a copy on encoder_attention (eval mode)."""
    from transformers import AutoConfig, AutoModel

    probs = {"attention_dropout": dropout} if model_type == "distilbert" else {"attention_probs_dropout_prob": dropout}
    config = AutoConfig.for_model(model_type, **FAMILIES[model_type], **probs)
    torch.manual_seed(0)
    eager = AutoModel.from_config(config, attn_implementation="eager").eval()
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(encoder_attention.register())
    assert ours.config._attn_implementation == encoder_attention.ATTENTION
    return eager, ours


def outputs_and_grads(model, ids, mask, seed=0):
    torch.manual_seed(seed)
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    (hidden * torch.linspace(-1, 1, hidden.shape[-1])).sum().backward()
    return hidden.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_the_families_are_the_registered_plain_ones():
    assert set(FAMILIES) == set(encoder_attention.PLAIN_EAGER)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_each_family_computes_its_own_eager_attention(model_type, dropout):
    eager, ours = family_pair(model_type, dropout)
    eager.train(), ours.train()
    ids = torch.randint(5, 500, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # padding: the mask function's additive mask
    mask[2, 3:] = 0
    want, want_grads = outputs_and_grads(eager, ids, mask)
    got, got_grads = outputs_and_grads(ours, ids, mask)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 10
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_a_packed_rows_4d_additive_mask_is_honoured():
    from tuneforge.tasks.embedding import embed, embed_packed

    eager, ours = family_pair("bert")
    ids = torch.randint(5, 500, (4, 9))
    mask = (torch.arange(9)[None, :] < torch.tensor([[9], [4], [6], [2]])).long()
    with torch.no_grad():
        alone = embed(eager, ids, mask)
        packed = embed_packed(ours, ids, mask, width=12)  # rows of several texts, a mask between them
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_bf16_autocast_errs_as_eager_does():
    eager, ours = family_pair("bert")
    ids = torch.randint(5, 500, (2, 16))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        exact = eager(input_ids=ids, attention_mask=mask).last_hidden_state
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager_bf16 = eager(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            ours_bf16 = ours(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    assert ours_bf16.dtype == torch.float32 and not torch.equal(ours_bf16, exact)
    assert (ours_bf16 - exact).abs().max() < 2 * (eager_bf16 - exact).abs().max() + 1e-3


def test_auto_picks_it_for_plain_families_under_bf16_only(tiny_bert, tiny_llama):
    from tests.backends.test_precision_and_layouts import single_backend
    from transformers import AutoModel, AutoModelForCausalLM

    padded = SimpleNamespace(pads_batches=True)
    chosen = {}
    for name, folder, loader in (("bert", tiny_bert, AutoModel), ("llama", tiny_llama, AutoModelForCausalLM)):
        for precision in ("bf16", "fp32"):
            model = loader.from_pretrained(folder)
            set_attention(model, "auto", single_backend(precision=precision), padded)
            chosen[name, precision] = model.config._attn_implementation
        model = loader.from_pretrained(folder)
        set_attention(model, "eager", single_backend(precision="bf16"), padded)  # asked for by name: as asked
        chosen[name, "eager by name"] = model.config._attn_implementation
    assert chosen == {
        ("bert", "bf16"): encoder_attention.ATTENTION,
        ("bert", "fp32"): "sdpa",
        ("bert", "eager by name"): "eager",
        ("llama", "bf16"): "eager",  # its family's eager (grouped keys) stays
        ("llama", "fp32"): "sdpa",
        ("llama", "eager by name"): "eager",
    }
