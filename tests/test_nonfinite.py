"""A nan/inf loss or gradient stops the run with one line naming the step, before anything is saved: the last
good checkpoint stays the latest and no model of nan weights is written. `skip_nonfinite N` skips (and logs) up
to N such steps. On several ranks every rank stops at the same step, even when only one saw the nan.

Triggers are honest: a regression row whose label (1e30) squares past float32, and a Trainer subclass whose
`compute_loss` (an override the API offers) turns nan, or whose gradient does, at a chosen step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import cli_main, read_jsonl, run_cli, tiny_run_config
from tuneforge import checkpoint
from tuneforge.configure import build_config
from tuneforge.errors import NonFiniteError
from tuneforge.trainer import Trainer


def run_config(tmp_path: Path, tiny_bert: str, cache_dir: str, **extra):
    values = dict(max_steps=6, eval_strategy="no", optim={"lr": 1e-3, "warmup_ratio": 0.0})
    return tiny_run_config(tmp_path, tiny_bert, cache_dir, **{**values, **extra})


class BadAt(Trainer):
    """Turns the loss (or, `gradient`: only the gradient) nan at the steps in `bad_steps`; records a weight at the
    start of every step."""

    def __init__(self, config, bad_steps: set[int], gradient: bool = False):
        super().__init__(config)
        self.bad_steps, self.gradient = bad_steps, gradient
        self.weight_at: dict[int, torch.Tensor] = {}

    def compute_loss(self, outputs, batch):
        loss_sum, count = super().compute_loss(outputs, batch)
        step = self.state.step + 1  # the step being taken
        weight = next(p for p in self.model.parameters() if p.requires_grad)
        self.weight_at[step] = weight.detach().clone()
        if step in self.bad_steps:
            if not self.gradient:
                return loss_sum * float("nan"), count
            # the value stays finite (sqrt(0) = 0), its gradient is inf * 0 = nan
            return loss_sum + torch.sqrt((weight * 0).sum()), count
        return loss_sum, count


def test_a_nan_loss_stops_before_saving_and_the_last_good_checkpoint_stays(tmp_path, tiny_bert, cache_dir):
    config = run_config(tmp_path, tiny_bert, cache_dir, save_steps=2)
    with pytest.raises(NonFiniteError) as err:
        BadAt(config, {4}).fit()
    message = str(err.value)
    assert "\n" not in message and message.startswith("the loss at step 4 is nan: training stopped")
    assert "--lr" in message and "--skip-nonfinite" in message
    run = tmp_path / "run"
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["checkpoint-2"]
    assert (run / "latest").read_text().strip() == "checkpoint-2" and checkpoint.verify(run / "checkpoint-2") is None
    assert not (run / "model").exists() and not (run / "result.json").exists()
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]  # no nan logged
    # the kept checkpoint is good: the run resumes from it and finishes
    result = Trainer(config.model_copy(update={"resume": "latest"})).fit()
    assert result["steps"] == 6 and (run / "model").is_dir()


def test_skip_nonfinite_skips_without_an_update_and_the_next_one_stops(tmp_path, tiny_bert, cache_dir):
    config = run_config(tmp_path, tiny_bert, cache_dir, skip_nonfinite=1, save_steps=4)
    trainer = BadAt(config, {3})
    result = trainer.fit()
    assert result["steps"] == 6 and result["skipped_steps"] == 1 and (tmp_path / "run" / "model").is_dir()
    assert torch.equal(trainer.weight_at[3], trainer.weight_at[4])  # step 3 changed nothing
    assert not torch.equal(trainer.weight_at[2], trainer.weight_at[3])
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    skipped = [{k: v for k, v in r.items() if k != "time_s"} for r in records if r["split"] == "skipped"]
    assert skipped == [{"split": "skipped", "step": 3, "epoch": 0, "reason": "the loss at step 3 is nan"}]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 4, 5, 6]
    # one skip allowed, and the checkpoint remembers it was used: after a resume the next one stops the run
    resumed = config.model_copy(update={"resume": str(tmp_path / "run" / "checkpoint-4")})
    with pytest.raises(NonFiniteError, match=r"^the loss at step 5 is nan: .*this run allows 1\)$"):
        BadAt(resumed, {5}).fit()


@pytest.mark.parametrize("max_grad_norm", [1.0, None], ids=["clipped", "unclipped"])
def test_a_nan_gradient_under_a_finite_loss_stops_the_run(tmp_path, tiny_bert, cache_dir, max_grad_norm):
    config = run_config(tmp_path, tiny_bert, cache_dir, max_steps=3, optim={"max_grad_norm": max_grad_norm})
    with pytest.raises(NonFiniteError, match=r"^the gradients at step 2 are not finite: training stopped"):
        BadAt(config, {2}, gradient=True).fit()
    assert not (tmp_path / "run" / "model").exists()


def write_regression_csv(path: Path, n: int, extreme_row: int) -> Path:
    """`n` rows of text,score in [0, 5], row `extreme_row` scored 1e30: a finite label whose square error
    overflows float32 (a typo'd or unscaled label column)."""
    rows = ["text,label"]
    for i in range(n):
        score = "1e30" if i == extreme_row else f"{(i * 7) % 6}.0"
        rows.append(f'"{write_text(i)}",{score}')
    path.write_text("\n".join(rows) + "\n")
    return path


def write_text(i: int) -> str:
    return ["a fine film", "a dull film", "great acting", "weak script"][i % 4] + " really" * (i % 3)


def regression_args(tmp_path: Path, tiny_bert: str, cache_dir: str, *extra: str) -> list[str]:
    train = write_regression_csv(tmp_path / "train.csv", 16, extreme_row=9)
    val = write_regression_csv(tmp_path / "val.csv", 4, extreme_row=-1)
    return [
        "train", "--task", "regression", "--model", tiny_bert, "--train-file", str(train), "--validation-file",
        str(val), "--cache-dir", cache_dir, "--output-dir", str(tmp_path / "run"), "--max-steps", "4",
        "--batch-size", "4", "--precision", "fp32", "--eval-strategy", "no", "--quiet", *extra,
    ]  # fmt: skip


def test_cli_an_overflowing_label_is_one_error_line_and_no_model(capsys, tmp_path, tiny_bert, cache_dir):
    code, _, err = cli_main(capsys, *regression_args(tmp_path, tiny_bert, cache_dir))
    assert code == 2 and err.count("\n") == 1, err
    assert re.match(r"error: the loss at step [1-4] is inf: training stopped", err), err
    assert not (tmp_path / "run" / "model").exists()


def test_ddp_one_rank_with_an_inf_loss_stops_every_rank_at_the_same_step(tmp_path, tiny_bert, cache_dir):
    """2 DDP ranks; the overflowing row is on one of them: both stop at its step (none hangs: the run ends), on
    the loss (the other rank learns of it from the flag every rank reduces), and nothing is saved.

    Each rank prints its own line, but torchrun stops the other worker as soon as the first exits: the second
    line is there only when it was printed in time."""
    proc = run_cli(*regression_args(tmp_path, tiny_bert, cache_dir, "--backend", "ddp", "--nproc", "2"), timeout=300)
    assert proc.returncode != 0
    lines = re.findall(r"^error: the (\w+) at step (\d+) (?:is|are) ([\w ]+):", proc.stderr, re.M)
    assert lines, proc.stderr[-3000:]
    assert {what for what, _, _ in lines} == {"loss"} and len({step for _, step, _ in lines}) == 1, lines
    assert {value for _, _, value in lines} <= {"inf", "not finite"}
    assert not (tmp_path / "run" / "model").exists() and not list((tmp_path / "run").glob("checkpoint-*"))


def test_largest_grad_reads_every_gradient_and_passes_over_empty_shards():
    """Without clipping the backend reads the largest |gradient| itself; an FSDP rank's shard of a small tensor
    can be empty (that once raised: the infinity norm of nothing)."""
    from tuneforge.backends.single import SingleBackend

    backend = SingleBackend(build_config(task="classification"), None)
    model = torch.nn.Linear(2, 2)
    model.register_parameter("empty_shard", torch.nn.Parameter(torch.empty(0)))
    for p, grad in zip(model.parameters(), (torch.full((2, 2), -3.0), torch.ones(2), torch.empty(0))):
        p.grad = grad
    assert backend.largest_grad(model).item() == 3.0 and backend.nonfinite(None, backend.largest_grad(model)) is None
    model.bias.grad[1] = float("nan")
    assert backend.nonfinite(torch.tensor(1.0), backend.largest_grad(model)) == "gradients"
    assert backend.nonfinite(torch.tensor(float("inf")), None) == "loss"
