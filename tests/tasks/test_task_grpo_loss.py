"""GRPO's formulas (tasks/grpo_loss.py) against TRL's GRPOTrainer (1.16) written out here term for term: the group
advantages (with `None` rewards, each `scale_rewards`), and the loss of every `loss_type` with token and sequence
importance sampling, off-policy old log-probs (num_iterations > 1), DAPO's clip-higher and the KL term, on one
micro-batch (where TRL's per-micro-batch normalisers and tuneforge's per-step ones agree)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tuneforge.tasks import grpo_loss


# ---- TRL, written out (trl/trainer/grpo_trainer.py: _generate_and_score_completions, _compute_loss) -------------
def trl_nanstd(tensor):
    variance = torch.nanmean((tensor - torch.nanmean(tensor, keepdim=True)) ** 2)
    count = torch.sum(~torch.isnan(tensor))
    variance *= count / (count - 1)
    return torch.sqrt(variance)


def trl_advantages(rewards_per_func, weights, num_generations, scale_rewards):
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        std = torch.stack([trl_nanstd(row) for row in grouped]).repeat_interleave(num_generations, dim=0)
    else:
        std = trl_nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def trl_loss(
    per_token_logps,
    old,
    ref,
    advantages,
    mask,
    *,
    loss_type,
    level,
    eps_low,
    eps_high,
    beta,
    max_len,
    kl_correction=True,
):
    advantages = advantages.unsqueeze(1)
    log_ratio = per_token_logps - old
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if beta != 0.0:
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        if kl_correction:  # use_bias_correction_kl (True by default)
            per_token_kl = per_token_kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_len)
    num_items_in_batch = mask.sum()  # dapo: the generation batch's tokens (one process, one micro-batch)
    return (per_token_loss * mask).sum() / num_items_in_batch.clamp(min=1.0)


# ---- fixed prompts, completions and rewards -----------------------------------------------------------------------
G, ROWS, WIDTH, MAX_LEN = 4, 8, 7, 9


@pytest.fixture(scope="module")
def rollout():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 3, 5, 1, 6, 7, 2, 4])
    mask = (torch.arange(WIDTH)[None, :] < lengths[:, None]).float()
    logps = -torch.rand(ROWS, WIDTH, generator=gen, dtype=torch.float64) * 3
    old = logps + torch.randn(ROWS, WIDTH, generator=gen, dtype=torch.float64) * 0.3  # off-policy: ratios clip
    ref = logps + torch.randn(ROWS, WIDTH, generator=gen, dtype=torch.float64) * 0.2
    rewards = torch.tensor(
        [[1.0, 0.5], [0.0, float("nan")], [1.0, 0.2], [0.0, 0.9], [0.3, 0.3], [0.3, 0.3], [0.3, 0.3], [0.3, 0.3]],
        dtype=torch.float64,
    )
    return {"mask": mask, "logps": logps, "old": old, "ref": ref, "rewards": rewards}


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls_with_none_rewards_and_a_flat_group(rollout, scale):
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    total = grpo_loss.total_rewards(rollout["rewards"], weights)
    ours, flat = grpo_loss.group_advantages(total, G, scale)
    theirs = trl_advantages(rollout["rewards"].clone(), weights, G, scale)
    assert torch.allclose(ours, theirs, atol=1e-9), (ours, theirs)
    assert flat.tolist() == [False] * 4 + [True] * 4  # the second group's rewards are all equal: no signal
    assert ours[4:].abs().max() == 0


def test_an_unscorable_completion_gets_no_advantage_and_no_weight_in_its_group():
    rewards = torch.tensor([[1.0], [float("nan")], [0.0], [0.0]], dtype=torch.float64)
    total = grpo_loss.total_rewards(rewards, torch.ones(1, dtype=torch.float64))
    advantages, _ = grpo_loss.group_advantages(total, 4, "group")
    assert torch.isnan(total[1]) and advantages[1] == 0
    mean, std = 1 / 3, torch.tensor([1.0, 0.0, 0.0]).std().item()  # over the three scored completions
    assert advantages[0].item() == pytest.approx((1 - mean) / (std + 1e-4))


CASES = list(itertools.product(["grpo", "bnpo", "dr_grpo", "dapo"], ["token", "sequence"], [0.0, 0.04]))
CASES += [("dapo", "token", 0.04, False), ("grpo", "sequence", 0.04, False)]  # without the KL's ratio weight
CASES = [case if len(case) == 4 else (*case, True) for case in CASES]


@pytest.mark.parametrize("loss_type, level, beta, kl_correction", CASES)
def test_each_loss_type_is_trls_within_1e_5(rollout, loss_type, level, beta, kl_correction):
    advantages = trl_advantages(rollout["rewards"].clone(), torch.tensor([1.0, 0.5], dtype=torch.float64), G, "group")
    clip = grpo_loss.Clip(
        epsilon=0.2, epsilon_high=0.28, beta=beta, importance_sampling=level, kl_correction=kl_correction
    )
    mask, logps, old, ref = rollout["mask"], rollout["logps"], rollout["old"], rollout["ref"]
    terms = grpo_loss.token_losses(logps, old, advantages, mask, clip, ref)
    loss_sum, count = grpo_loss.loss_sum_and_count(terms.loss, mask, loss_type, MAX_LEN)
    assert count == grpo_loss.step_count(mask, loss_type, MAX_LEN)
    theirs = trl_loss(
        logps, old, ref, advantages, mask, loss_type=loss_type, level=level, eps_low=0.2, eps_high=0.28, beta=beta,
        max_len=MAX_LEN, kl_correction=kl_correction,
    )  # fmt: skip
    assert (loss_sum / count).item() == pytest.approx(theirs.item(), abs=1e-5)
    clipped = ((terms.ratio < 0.8) | (terms.ratio > 1.28)).any()
    assert clipped, "no ratio reached the clip: the case would not test it"


def test_the_gradient_is_trls_too(rollout):
    """The same loss through autograd: the policy's log-probs get TRL's gradient (dapo, clip-higher, KL)."""
    advantages = trl_advantages(rollout["rewards"].clone(), torch.tensor([1.0, 0.5], dtype=torch.float64), G, "batch")
    mask, old, ref = rollout["mask"], rollout["old"], rollout["ref"]
    ours_in = rollout["logps"].clone().requires_grad_(True)
    theirs_in = rollout["logps"].clone().requires_grad_(True)
    clip = grpo_loss.Clip(0.2, 0.28, 0.04, "token")
    loss_sum, count = grpo_loss.loss_sum_and_count(
        grpo_loss.token_losses(ours_in, old, advantages, mask, clip, ref).loss, mask, "dapo", MAX_LEN
    )
    (loss_sum / count).backward()
    trl_loss(
        theirs_in, old, ref, advantages, mask, loss_type="dapo", level="token", eps_low=0.2, eps_high=0.28, beta=0.04,
        max_len=MAX_LEN,
    ).backward()  # fmt: skip
    assert torch.allclose(ours_in.grad, theirs_in.grad, atol=1e-9)
    assert ours_in.grad.abs().sum() > 0


def test_on_policy_the_ratio_is_one_and_the_loss_is_minus_the_advantage(rollout):
    """num_iterations 1: old log-probs are the policy's own (detached), so nothing clips and each token's loss
    is -advantage; its gradient is -advantage x grad log p (REINFORCE with the group baseline)."""
    mask, logps = rollout["mask"], rollout["logps"].clone().requires_grad_(True)
    advantages = torch.linspace(-1, 1, ROWS, dtype=torch.float64)
    terms = grpo_loss.token_losses(logps, logps.detach(), advantages, mask, grpo_loss.Clip(0.2, 0.2, 0.0, "token"))
    assert torch.equal(terms.ratio, torch.ones_like(terms.ratio))
    (terms.loss * mask).sum().backward()
    assert torch.allclose(logps.grad, -advantages[:, None] * mask)


def trl_logged_clip_and_kl(coef_1, advantages, per_token_kl, mask, eps_low, eps_high):
    """TRL's logged clip_ratio/low_mean, high_mean, region_mean and kl (grpo_trainer.py `_compute_loss`, its
    `global_masked_mean`: a [B, 1] sequence-level tensor is averaged over the rows, a [B, T] one over the mask)."""

    def global_masked_mean(x):
        if x.shape[1] == 1:  # when importance_sampling_level == "sequence": one value per sequence
            return x.sum() / x.shape[0]
        return (x * mask).sum() / mask.sum().clamp(min=1.0)

    advantages = advantages.unsqueeze(1)
    is_low_clipped = (coef_1 < 1 - eps_low) & (advantages < 0)
    is_high_clipped = (coef_1 > 1 + eps_high) & (advantages > 0)
    is_region_clipped = is_low_clipped | is_high_clipped
    return {
        "clip_low": global_masked_mean(is_low_clipped.float()).item(),
        "clip_high": global_masked_mean(is_high_clipped.float()).item(),
        "clip_ratio": global_masked_mean(is_region_clipped.float()).item(),
        "kl": global_masked_mean(per_token_kl).item(),
    }


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_logged_clip_ratios_and_kl_are_trls(rollout, level):
    """With GSPO's sequence ratio, TRL logs the share of sequences clipped; the logs gave the share of tokens, so a
    clipped short completion weighed less than a long one (0.18 where TRL says 0.125 here). A truncated completion
    masked out (DAPO) still counts as a sequence there, as in TRL."""
    from tuneforge.tasks.grpo import StepWindow

    mask = rollout["mask"].clone()
    mask[5] = 0  # mask_truncated_completions
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.0, 0.9, -0.3, 1.5, -0.2], dtype=torch.float64)
    clip = grpo_loss.Clip(0.2, 0.28, 0.04, level)
    terms = grpo_loss.token_losses(rollout["logps"], rollout["old"], advantages, mask, clip, rollout["ref"])
    window = StepWindow(1)
    window.add_loss_terms(terms, mask, advantages, torch.ones(ROWS, 2 * WIDTH), clip)
    logs = window.settled().logs(["r"], with_kl=True)
    expected = trl_logged_clip_and_kl(terms.ratio, advantages, terms.kl, mask, 0.2, 0.28)
    assert {key: logs[key] for key in expected} == pytest.approx(expected, rel=1e-6)  # (TRL: float masks)
    assert 0 < expected["clip_ratio"] < 1, "nothing (or everything) clipped: the case would not test the counts"


def test_token_logps_are_the_log_softmax_at_the_sampling_temperature():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([[1, 5, 10], [0, 0, 3]])
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.allclose(grpo_loss.token_logps(logits, tokens, 0.7), expected, atol=1e-6)


# ---- against TRL's GRPOTrainer itself (trl is in the bench extra: skipped without it) ---------------------------
TRL_CASES = [("grpo", "token", 0.0), ("bnpo", "token", 0.04), ("dr_grpo", "sequence", 0.0), ("dapo", "token", 0.04)]


@pytest.fixture(scope="module")
def trl_trainer(tiny_llama, tmp_path_factory):
    pytest.importorskip("trl", reason="trl is in the dev extra (pip install -e '.[dev]')")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    args = GRPOConfig(
        str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=G, num_generations=G, use_cpu=True,
        bf16=False, report_to=[], max_completion_length=MAX_LEN, epsilon=0.2, epsilon_high=0.28,
    )  # fmt: skip
    rows = Dataset.from_list([{"prompt": "where is the cat?"}] * G)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[lambda completions, **k: [0.0] * len(completions)], args=args,
        train_dataset=rows, processing_class=AutoTokenizer.from_pretrained(tiny_llama),
    )  # fmt: skip
    return trainer, model


@pytest.mark.parametrize("loss_type, level, beta", TRL_CASES)
def test_the_task_loss_equals_trl_grpo_trainer_compute_loss(trl_trainer, tiny_llama, loss_type, level, beta):
    """The same model, prompts, completions, advantages and old / reference log-probs through TRL's own
    `_compute_loss` and through the task's `forward` + `compute_loss` (its batch layout: left-padded prompts,
    right-padded completions): the same loss within 1e-5."""
    from tuneforge.configure import build_config
    from tuneforge.tasks import get_task

    trainer, model = trl_trainer
    trainer.loss_type, trainer.importance_sampling_level, trainer.beta = loss_type, level, beta
    trainer.current_gradient_accumulation_steps = 1  # set by its training loop
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(5, 200, (1, 6), generator=gen).expand(G, 6)
    lengths = torch.tensor([7, 3, 5, 1])
    completion_mask = (torch.arange(WIDTH)[None, :] < lengths[:, None]).long()
    completion = torch.randint(5, 200, (G, WIDTH), generator=gen) * completion_mask
    advantages = torch.tensor([1.2, -0.4, 0.3, -1.1])
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt, completion], 1)).logits[:, 5:-1]
        logps = torch.log_softmax(logits, -1).gather(-1, completion[..., None])[..., 0]
    old = logps + torch.randn(G, WIDTH, generator=gen) * 0.3
    ref = logps + torch.randn(G, WIDTH, generator=gen) * 0.2
    inputs = {
        "prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
        "completion_mask": completion_mask, "advantages": advantages, "old_per_token_logps": old,
        "ref_per_token_logps": ref, "num_items_in_batch": completion_mask.sum(),
    }  # fmt: skip
    model.train()
    theirs = trainer._compute_loss(model, inputs)

    options = {"reward": ["length"], "loss_type": loss_type, "importance_sampling": level, "beta": beta}
    options.update(epsilon=0.2, epsilon_high=0.28, max_completion_length=MAX_LEN, max_prompt_length=16)
    task = get_task(build_config(task="grpo", model=tiny_llama, task_options=options))
    attention = torch.cat([torch.ones_like(prompt), completion_mask], 1)
    batch = {
        "input_ids": torch.cat([prompt, completion], 1), "attention_mask": attention,
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0), "completion_ids": completion,
        "completion_mask": completion_mask.float(), "advantages": advantages, "old_logps": old, "ref_logps": ref,
    }  # fmt: skip
    loss_sum, count = task.compute_loss(task.forward(model, batch), batch)
    assert (loss_sum / count).item() == pytest.approx(theirs.item(), abs=1e-5)
