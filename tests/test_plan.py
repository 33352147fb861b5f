"""The step plan (tuneforge.plan): the loop and a resume count steps alike.

Walks the plan as the Trainer's loop does (pure index arithmetic, no model) and checks, at every point a
checkpoint can be written, that a resume re-plans to the run's own total; and, after a change of batch geometry
(world size, batch size, accumulation), that the steps left to finish the epochs are those the resume planned."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuneforge.configure import build_config
from tuneforge.plan import StepPlan
from tuneforge.progress import Progress


def plan_of(n_train: int, dp_size: int = 1, **values) -> StepPlan:
    config = build_config({"task": "classification", "output_dir": "unused", **values})
    return StepPlan.of(config, n_train, dp_size)


def walk(plan: StepPlan, lengths, progress: Progress, on_point=lambda p: None, until_epoch=None) -> int:
    """The Trainer's loop on rank 0 from `progress` (moved along): steps to the plan's total, or (`until_epoch`)
    whole epochs; `on_point` sees the Progress wherever a checkpoint can be written. Returns the steps taken."""
    taken = 0
    while (progress.epoch < until_epoch) if until_epoch is not None else (progress.step < plan.total_steps):
        steps, order_size = plan.epoch_steps(lengths, progress, dp_rank=0)
        for i, micro_batches in enumerate(steps):
            progress.step, taken = progress.step + 1, taken + 1
            progress.consumed = min(order_size, progress.consumed + plan.global_batch * len(micro_batches))
            on_point(progress)
            if until_epoch is None and progress.step >= plan.total_steps and i < len(steps) - 1:
                break
        else:
            progress.epoch, progress.consumed, progress.order_global_batch = progress.epoch + 1, 0, plan.step_examples
            on_point(progress)
    return taken


def test_the_plan_of_a_run():
    plan = plan_of(48, batch_size=8, epochs=2)  # tests/test_trainer_api.py: 12 steps
    assert (plan.global_batch, plan.steps_per_epoch, plan.total_steps) == (8, 6, 12)
    # 2 ranks x 4: 10 examples make 2 global batches (the last has 2, one per rank), 9 make 1 (1 < 2 ranks)
    assert plan_of(10, dp_size=2, batch_size=4).batches_per_epoch == 2
    assert plan_of(9, dp_size=2, batch_size=4).batches_per_epoch == 1
    accumulated = plan_of(10, dp_size=2, batch_size=4, grad_accum=2, epochs=1.5)
    assert (accumulated.step_examples, accumulated.steps_per_epoch, accumulated.total_steps) == (16, 1, 2)
    assert plan_of(48, batch_size=8, epochs=2, max_steps=5).total_steps == 5


geometry = st.tuples(st.integers(1, 6), st.integers(1, 3), st.integers(1, 3))  # batch size, ranks, accumulation


@settings(max_examples=60, deadline=None)
@given(
    n_train=st.integers(3, 70),
    first=geometry,
    epochs=st.sampled_from([1, 2, 3, 0.5, 1.5, 2.25]),
    group_by_length=st.booleans(),
)
def test_a_resume_at_any_checkpoint_replans_the_same_total(n_train, first, epochs, group_by_length):
    batch_size, dp_size, grad_accum = first
    values = dict(batch_size=batch_size, grad_accum=grad_accum, epochs=epochs)
    values["data"] = {"group_by_length": group_by_length}
    plan = plan_of(n_train, dp_size, **values)
    lengths = np.random.default_rng(n_train).integers(1, 50, n_train)
    start = Progress(order_global_batch=plan.step_examples)
    assert len(plan.epoch_steps(lengths, start, dp_rank=0)[0]) == plan.steps_per_epoch

    def check(at: Progress) -> None:
        assert plan.resumed_at(replace(at), lengths).total_steps == plan.total_steps, at

    assert walk(plan, lengths, start, check) == plan.total_steps


@settings(max_examples=60, deadline=None)
@given(n_train=st.integers(3, 70), first=geometry, then=geometry, epochs=st.integers(1, 3), at=st.integers(0, 200))
def test_after_a_geometry_change_the_steps_left_are_those_planned(n_train, first, then, epochs, at):
    lengths = np.random.default_rng(n_train).integers(1, 50, n_train)
    before = plan_of(n_train, first[1], batch_size=first[0], grad_accum=first[2], epochs=epochs)
    points = []
    walk(before, lengths, Progress(order_global_batch=before.step_examples), lambda p: points.append(replace(p)))
    saved = points[at % len(points)]  # the checkpoint the run resumes from
    after = plan_of(n_train, then[1], batch_size=then[0], grad_accum=then[2], epochs=epochs)
    resumed = after.resumed_at(replace(saved), lengths)
    assert walk(after, lengths, replace(saved), until_epoch=epochs) == resumed.total_steps - saved.step


def test_max_steps_is_the_total_whatever_the_position():
    plan = plan_of(48, batch_size=8, max_steps=7)
    assert plan.resumed_at(Progress(step=3, epoch=0, consumed=24, order_global_batch=8), np.ones(48)).total_steps == 7


@pytest.mark.parametrize("n_train", [1, 2])
def test_an_epoch_of_fewer_examples_than_a_batch_is_one_step(n_train):
    assert plan_of(n_train, batch_size=8).steps_per_epoch == 1
