"""The formulas of GRPO and its variants, as plain tensor functions: group advantages, the clipped per-token
objective with its KL term, and each loss type's sum and count (the Trainer divides the summed loss by the count
over the whole step: every micro-batch and every rank).

They follow TRL's GRPOTrainer (1.x, `_compute_loss` and `_generate_and_score_completions`) term for term; the
suite checks them against TRL's formulas written out (tests/tasks/test_task_grpo_loss.py), and
benchmarks/grpo_vs_trl.py against TRL itself. Where TRL normalises per micro-batch (`bnpo`), tuneforge normalises
over the whole step, exactly (see `loss_sum_and_count`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased (n - 1) standard deviation of the non-nan values (TRL's `nanstd`): nan where there are fewer
    than two."""
    if dim is None:
        x, dim = x.flatten(), 0
    valid = ~torch.isnan(x)
    n = valid.sum(dim)
    mean = torch.nansum(x, dim) / n
    sq = torch.where(valid, (x - mean.unsqueeze(dim)) ** 2, torch.zeros_like(x)).sum(dim)
    return torch.where(n > 1, (sq / (n - 1)).sqrt(), torch.nan)  # (none: -0.0 else, counted as a std of 0)


def total_rewards(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's reward: its functions' rewards times their weights, summed over the functions that
    apply (`None` rewards are nan); nan where none applies (TRL: such a completion is unscorable)."""
    total = (per_function * weights.to(per_function)).nansum(dim=1)
    return total.masked_fill(torch.isnan(per_function).all(dim=1), float("nan"))


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str, batch_std: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, per-completion flag: its group's rewards are all equal) of `rewards`, consecutive groups of
    `group_size` completions of one prompt. scale "group": each group's std; "batch": `batch_std` (the std of
    every completion's reward over the whole step, all ranks); "none": rewards minus the group mean. An
    unscorable completion (nan) has advantage 0 and counts in neither mean nor std."""
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
    group_std = nanstd(grouped, dim=1).repeat_interleave(group_size)
    if scale == "batch":
        std = batch_std.expand_as(rewards) if batch_std is not None else nanstd(rewards).expand_as(rewards)
    else:
        std = group_std
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPS)
    flat = torch.isclose(group_std, torch.zeros_like(group_std)) | torch.isnan(group_std)
    return torch.nan_to_num(advantages, nan=0.0), flat


@dataclass(frozen=True)
class Clip:
    epsilon: float  # the lower clip: ratios below 1 - epsilon are clipped
    epsilon_high: float  # the upper clip (DAPO's clip-higher when above epsilon)
    beta: float  # the KL term's weight (0: none)
    importance_sampling: str  # "token" or "sequence" (GSPO)
    kl_correction: bool = True  # the KL estimate times the importance ratio (TRL's use_bias_correction_kl default)


@dataclass
class TokenLoss:
    """Per completion token: the loss, the importance ratio (per token, or per sequence as [R, 1]) and the KL
    estimate (None when beta is 0)."""

    loss: torch.Tensor
    ratio: torch.Tensor
    kl: torch.Tensor | None


def token_losses(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: Clip,
    ref_logps: torch.Tensor | None = None,
) -> TokenLoss:
    """The clipped surrogate of every completion token ([R, C] log-probs of the policy, of the policy that
    sampled them, and of the reference; [R] advantages; [R, C] mask of the completion tokens)."""
    log_ratio = logps - old_logps
    if clip.importance_sampling == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - clip.epsilon, 1 + clip.epsilon_high)
    adv = advantages.unsqueeze(1)
    loss = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if clip.beta != 0.0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1  # k3, non-negative, unbiased
        if clip.kl_correction:  # sampled by the old policy: weighted by the ratio (1 on-policy, its gradient not 0)
            kl = kl * ratio
        loss = loss + clip.beta * kl
    return TokenLoss(loss=loss, ratio=ratio, kl=kl)


def loss_sum_and_count(
    token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, count) of one micro-batch; the loss of the step is the sum over its micro-batches and ranks
    divided by the count over them:
    - grpo: each completion's mean over its tokens, averaged over completions;
    - bnpo and dapo: every completion token weighs the same, averaged over the step's tokens (TRL's dapo; TRL's
      bnpo averages per micro-batch, which equals this when every micro-batch holds the same number of tokens);
    - dr_grpo: summed over tokens, divided by completions x max_completion_length (no length bias)."""
    masked = token_loss * mask
    rows = torch.tensor(float(mask.shape[0]), device=mask.device)
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), rows
    if loss_type in ("bnpo", "dapo"):
        return masked.sum(), mask.sum()
    if loss_type == "dr_grpo":
        return masked.sum(), rows * max_completion_length
    raise ValueError(f"unknown loss_type {loss_type!r}")


def step_count(mask: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """The count of `loss_sum_and_count` from the mask alone (before any forward pass)."""
    if loss_type in ("bnpo", "dapo"):
        return mask.sum()
    rows = torch.tensor(float(mask.shape[0]), device=mask.device)
    return rows * (max_completion_length if loss_type == "dr_grpo" else 1)


def token_logps(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) of each position's token under softmax(logits / temperature) ([R, C, V] logits, [R, C]
    tokens): the distribution the completions were sampled from (TRL divides by the temperature too)."""
    logits = logits.float()
    if temperature != 1.0:  # (at 1, no second [R, C, vocabulary] tensor)
        logits = logits / temperature
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
