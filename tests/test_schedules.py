"""tuneforge's learning-rate schedules against transformers' `get_scheduler`, step by step."""

import typing

import pytest
import torch
from transformers import get_scheduler

from conftest import cli_main, train_command
from tuneforge.config import OptimConfig
from tuneforge.schedules import lr_schedule

SCHEDULE_NAMES = typing.get_args(OptimConfig.model_fields["scheduler"].annotation)


def lrs(make, steps: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    schedule = make(optimizer)
    out = []
    for _ in range(steps):
        out.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    return out


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("warmup,total", [(0, 10), (3, 10), (7, 7), (2, 1)])
def test_every_configurable_schedule_equals_transformers(name, warmup, total):
    ours = lrs(lambda opt: lr_schedule(name, opt, warmup, total), total + 3)
    theirs = lrs(lambda opt: get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total), total + 3)
    assert ours == pytest.approx(theirs, abs=1e-12)
    flat = name == "constant" or (name == "constant_with_warmup" and warmup == 0)
    assert flat or any(lr != ours[0] for lr in ours)  # the schedule moves, so the comparison has teeth


def test_a_saved_schedule_has_transformers_state_so_older_checkpoints_load():
    def state_after(make, steps: int) -> dict:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        schedule = make(optimizer)
        for _ in range(steps):
            optimizer.step()
            schedule.step()
        return schedule.state_dict()

    ours = state_after(lambda opt: lr_schedule("cosine", opt, 2, 10), 4)
    theirs = state_after(lambda opt: get_scheduler("cosine", opt, num_warmup_steps=2, num_training_steps=10), 4)
    assert ours == theirs  # lr_lambdas included: a callable object is saved as its __dict__, a lambda as None


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ("--warmup-steps 10", "warning: --warmup-steps 10 outlasts the run's 2 optimizer steps"),
        ("--warmup-steps 2 --scheduler cosine", "warning: --warmup-steps 2 outlasts the run's 2 optimizer steps"),
        ("--warmup-steps 1 --scheduler constant", "warning: --scheduler constant has no warmup"),
        ("--warmup-steps 1", None),
    ],
)
def test_a_warmup_the_run_never_finishes_or_its_schedule_lacks_is_said(
    flags, said, capsys, tiny_bert, sentiment_files, cache_dir, tmp_path
):
    """A warmup as long as the run kept the rate below --lr all run (1/10 of it here), and constant ignores the
    warmup (as transformers' get_scheduler does): both trained without a word, --quiet or not."""
    args = train_command(sentiment_files, tiny_bert, max_steps=2, eval_strategy="no", quiet=True, cache_dir=cache_dir)
    code, _, err = cli_main(capsys, *args, "--output-dir", str(tmp_path / "run"), *flags.split())
    assert code == 0, err
    warned = [line for line in err.splitlines() if line.startswith("warning:")]
    assert [line.startswith(said) for line in warned] == ([] if said is None else [True]), err
