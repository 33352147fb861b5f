"""The step plan of a training run: batches and optimizer steps per epoch, the run's total steps, and each
epoch's steps from a data position. The loop takes its steps from it and a resume re-plans with it, so the
two can never count differently.

An optimizer step is `grad_accum` micro-batches of `batch_size` examples on each of `dp_size` ranks
(`step_examples` in all). The epoch order is a pure function of (seed, epoch, the global batch the epoch
began with), so an epoch can be continued from any example position (`Progress.consumed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from tuneforge.data.mixture import Mixture
from tuneforge.data.order_cache import OrderCache
from tuneforge.data.samplers import EpochSteps, epoch_order
from tuneforge.progress import Progress


@dataclass(frozen=True)
class StepPlan:
    n_train: int  # training examples
    batch_size: int  # examples per micro-batch on one rank
    dp_size: int  # data-parallel ranks
    grad_accum: int  # micro-batches per optimizer step
    epochs: float
    max_steps: int | None  # given: the run's total, whatever the epochs
    seed: int
    group_by_length: bool
    total_steps: int = 0  # the run's optimizer steps (`of` and `resumed_at` set it)
    # optimizer steps taken on each step's data (a task's `updates_per_batch`: GRPO's num_iterations reuses a
    # generated batch); the data position advances after the last of them
    repeats: int = 1
    mixture: Mixture | None = None  # data sources: the mixture that orders each epoch (n_train: its epoch's rows)

    @classmethod
    def of(cls, config, n_train: int, dp_size: int, repeats: int = 1, mixture: Mixture | None = None) -> StepPlan:
        """The plan of a run of `config` over `n_train` examples per epoch on `dp_size` ranks, `repeats` optimizer
        steps on each step's data, the epochs ordered by `mixture` where given."""
        plan = cls(
            repeats=repeats,
            mixture=mixture,
            n_train=n_train,
            batch_size=config.batch_size,
            dp_size=dp_size,
            grad_accum=config.grad_accum,
            epochs=config.epochs,
            max_steps=config.max_steps,
            seed=config.seed,
            group_by_length=config.data.group_by_length,
        )
        return replace(plan, total_steps=plan.max_steps or math.ceil(plan.epochs * plan.steps_per_epoch))

    @property
    def global_batch(self) -> int:
        """Examples per micro-batch over all ranks."""
        return self.batch_size * self.dp_size

    @property
    def step_examples(self) -> int:
        """Examples per optimizer step over all ranks (the epoch order is built in these units)."""
        return self.global_batch * self.grad_accum

    @property
    def batches_per_epoch(self) -> int:
        """Global micro-batches of an epoch: a last one smaller than `dp_size` is dropped (each rank needs one)."""
        n, g = self.n_train, self.global_batch
        return max(1, n // g + (n % g >= self.dp_size))

    @property
    def steps_per_epoch(self) -> int:
        return max(1, math.ceil(self.batches_per_epoch / self.grad_accum)) * self.repeats

    def epoch_steps(
        self, lengths, progress: Progress, dp_rank: int, orders: OrderCache | None = None
    ) -> tuple[EpochSteps, int]:
        """This rank's optimizer steps (each a list of micro-batches of example indices) left in the epoch
        `progress` is in, from its data position (each step's data `repeats` times in a row); and the size of that
        epoch's order. `orders`: where a large epoch's order is kept (the run folder), read instead of computed."""
        lengths = np.asarray(lengths)
        what = dict(
            seed=self.seed,
            epoch=progress.epoch,
            global_batch=progress.order_global_batch,
            group_by_length=self.group_by_length,
            mixture=self.mixture,
        )
        if orders is None:
            order = epoch_order(lengths, **what)
        else:
            order = orders.order(lambda: epoch_order(lengths, **what), lengths, **what)
        steps = EpochSteps(
            order,
            start=progress.consumed,
            global_batch=self.global_batch,
            dp_rank=dp_rank,
            dp_size=self.dp_size,
            grad_accum=self.grad_accum,
            repeats=self.repeats,
        )
        return steps, len(order)

    def resumed_at(self, progress: Progress, lengths, orders: OrderCache | None = None) -> StepPlan:
        """The plan of a run resumed at `progress`: the configured epochs, counted from the restored position.

        With the batch geometry the checkpoint was written with, the total is the original plan's. After a
        world-size or batch-size change, the rest of the interrupted epoch and the later epochs are counted at
        this plan's global batch.
        """
        if self.max_steps:
            return self
        left_in_epoch = len(self.epoch_steps(lengths, progress, dp_rank=0, orders=orders)[0])
        per_epoch, whole = self.steps_per_epoch, int(self.epochs)
        last_part = math.ceil(self.epochs * per_epoch) - whole * per_epoch  # steps of a final partial epoch
        if progress.epoch < whole:  # (steps are counted with their repeats: a resume lands between data steps)
            left = left_in_epoch + (whole - progress.epoch - 1) * per_epoch + last_part
        elif progress.epoch == whole and last_part:
            examples, data_steps = self.step_examples, math.ceil(last_part / self.repeats)
            rest = math.ceil(max(0, data_steps * examples - progress.consumed) / examples)
            left = min(left_in_epoch, min(last_part, rest * self.repeats))
        else:
            left = 0
        return replace(self, total_steps=progress.step + left)
