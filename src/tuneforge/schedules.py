"""Learning-rate schedules: the multiplier of the peak rate at each optimizer step.

The formulas are transformers' (`get_scheduler`), written here because importing
`transformers.optimization` pulls in `trainer_utils`, which imports peft and bitsandbytes: about 1.4 s
of every process start (every rank of every run) for four one-line functions. A test holds them
equal to transformers' own.
"""

from __future__ import annotations

import math
import warnings
from functools import partial

import torch


def _warming_up(step: int, warmup: int) -> float:
    return step / max(1, warmup)


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warming_up(step, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warming_up(step, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def _constant(step: int, *, warmup: int, total: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, *, warmup: int, total: int) -> float:
    return _warming_up(step, warmup) if step < warmup else 1.0


_FORMULAS = {
    "linear": _linear,
    "cosine": _cosine,
    "constant": _constant,
    "constant_with_warmup": _constant_with_warmup,
}


def lr_schedule(
    name: str, optimizer: torch.optim.Optimizer, warmup: int, total: int, start_step: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule `name` over `total` steps after `warmup`, positioned at `start_step`.

    Built at a step, torch sets each group's learning rate to the schedule's value there. A partial
    (a callable object, as in transformers) rather than a lambda, so LambdaLR's state_dict keeps it.
    """
    formula = partial(_FORMULAS[name], warmup=warmup, total=total)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, formula)
    if start_step:  # `last_epoch` is the step last taken; the first build recorded each group's initial_lr
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, formula, last_epoch=start_step - 1)
    return schedule


def rates_at_restored_step(schedule) -> None:
    """Give a restored LambdaLR's groups its rates at the step it was restored at (a resume).

    The optimizer's restored state holds the rates of the schedule it was saved under; a resume may change the
    schedule (more steps, another warmup or kind), and its first step would otherwise train at the old rate (0 at
    the end of a linear decay). A LambdaLR's rate is a function of the step alone, so stepping it again from the
    step before gives the new schedule's rate there (and the same rate where the schedule did not change);
    other schedulers are left as restored.
    """
    if not isinstance(schedule, torch.optim.lr_scheduler.LambdaLR):
        return
    schedule.last_epoch -= 1
    with warnings.catch_warnings():  # torch warns of a step() before the optimizer's: this one moves no weights
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        schedule.step()


def warmup_warning(scheduler: str, warmup_steps: int, total_steps: int) -> str | None:
    """The line saying what --warmup-steps will not do in a run of `total_steps` steps: constant has no warmup
    (transformers' get_scheduler ignores it too), and a warmup as long as the run never reaches the peak rate.
    None where it does what it says."""
    if not warmup_steps:
        return None
    if scheduler == "constant":
        return (
            f"warning: --scheduler constant has no warmup, so --warmup-steps {warmup_steps} does nothing; "
            "--scheduler constant_with_warmup warms up"
        )
    if warmup_steps >= total_steps:
        return (
            f"warning: --warmup-steps {warmup_steps} outlasts the run's {total_steps} optimizer steps: the learning "
            f"rate rises to {(total_steps - 1) / warmup_steps:.0%} of --lr at most and never follows --scheduler "
            f"{scheduler}; give fewer warmup steps"
        )
    return None
