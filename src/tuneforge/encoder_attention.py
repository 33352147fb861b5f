"""The eager attention an encoder trains with under bf16 on a CPU: transformers' eager form, with less work per score.

Under bf16 autocast on a CPU, eager attention is faster than torch's SDPA kernel for padded and packed batches
(`Precision.default_attention`). Eager as the model families write it scales every score (`(q @ k.T) * scale`, a
pass over the batch x heads x length x length scores, and one more in the backward) and adds the mask into a new
tensor. `encoder_attention` scales the query instead (head_dim times fewer numbers than the scores) and adds the mask
in place: the same function, within rounding (a test holds it to transformers' eager, outputs and gradients), ~5%
less time a step of MiniLM on packed rows of 128 (benchmarks/README.md).

Only for the model families in `PLAIN_EAGER`, whose own eager function is this plain form (every head its own keys,
no soft-capping, no sinks, a softmax in the scores' dtype; tests/test_encoder_attention.py holds each to its family's
eager), with transformers' eager mask function (`ATTENTION` is registered with it). Other families keep their own.
"""

from __future__ import annotations

import torch

ATTENTION = "tuneforge_encoder"
# transformers' model types whose eager_attention_forward is (q @ k.T) * scale + mask, softmax, dropout, @ v
PLAIN_EAGER = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "electra", "distilbert", "albert"})

_registered = False


def encoder_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """softmax(scale * q @ k.T + mask) @ v for query, key, value of (batch, heads, length, head_dim); returns the
    output as (batch, length, heads, head_dim) and the attention weights, as transformers' eager functions do."""
    scaling = query.size(-1) ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query * scaling, key.transpose(2, 3))
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:  # True: attend
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:  # additive; in place: the product's backward does not need it
            scores = scores.add_(attention_mask)
    weights = torch.nn.functional.softmax(scores, dim=-1)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def register() -> str:
    """`ATTENTION` known to transformers (the function, and eager's mask function for it); returns the name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

        AttentionInterface.register(ATTENTION, encoder_attention)
        AttentionMaskInterface.register(ATTENTION, eager_mask)
        _registered = True
    return ATTENTION


def fits(model) -> bool:
    """Whether `model`'s family's eager attention is the form `encoder_attention` computes."""
    return getattr(getattr(model, "config", None), "model_type", None) in PLAIN_EAGER
