"""What a request's sampling fields do to one row's next-token logits, before the token is chosen: vLLM's and
OpenAI's definitions, applied in vLLM's order (penalties and logit_bias, then temperature, then top_k, top_p,
min_p; min_tokens and the end-of-sequence tokens first of all).

- repetition_penalty (vLLM's; transformers' RepetitionPenaltyLogitsProcessor does it): every token of the prompt
  and of the answer so far: a positive logit divided by it, a negative one multiplied.
- presence_penalty, frequency_penalty (OpenAI): each token of the answer so far loses
  `presence + frequency * count` (its count in the answer).
- logit_bias (OpenAI): a token's logit plus its bias.
- min_tokens (vLLM): the end-of-sequence tokens cannot be chosen before that many tokens.
- top_k: only the k most likely tokens (transformers' TopKLogitsWarper); min_p: only tokens at least min_p times
  as likely as the most likely (MinPLogitsWarper's rule), after top_p (engine.sample_row).
Presence, frequency, logit_bias and min_tokens are one line each here: transformers has no presence or frequency
penalty, and its bias and min-length processors are built per request around a batch's tensors.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper


def penalised(logits: torch.Tensor, params, prompt_ids: list[int], token_ids: list[int], eos_ids) -> torch.Tensor:
    """`logits` (one row, float) after the penalties, logit_bias and min_tokens of `params`; a new tensor only
    where one of them is set."""
    if not changes_logits(params):
        return logits
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor([prompt_ids + token_ids], dtype=torch.long)
        logits = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(seen, logits[None])[0]
    if token_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(token_ids, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
    if params.logit_bias:
        ids, biases = params.bias_tensors
        logits.index_add_(0, ids.to(logits.device), biases.to(logits.device, logits.dtype))  # a repeated id adds up
    if len(token_ids) < params.min_tokens and eos_ids:
        logits[list(eos_ids)] = float("-inf")
    return logits


def changes_logits(params) -> bool:
    return (
        params.repetition_penalty != 1.0
        or bool(params.presence_penalty or params.frequency_penalty)
        or bool(params.logit_bias)
        or params.min_tokens > 0
    )


def top_k_kept(scaled: torch.Tensor, params) -> torch.Tensor:
    """`scaled` (one row's logits over the temperature) with what top_k leaves out at -inf; `scaled` itself when
    it is not set."""
    if 0 < params.top_k < scaled.numel():
        scaled = TopKLogitsWarper(params.top_k)(None, scaled[None])[0]
    return scaled


def min_p_kept(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """`probs` with the tokens less likely than min_p times the most likely at 0 (MinPLogitsWarper's rule), applied
    last: after top_p, whose mass counts every token min_p drops, as in transformers' and vLLM's order."""
    if min_p <= 0:
        return probs
    return probs.masked_fill(probs < min_p * probs.max(), 0)
