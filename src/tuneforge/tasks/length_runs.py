"""Which texts share a forward pass when a model runs over many (prediction, serving's batches, a reward model's
scores, a sentence encoder's training batch): runs of similar length, each padded only to its own longest.

`length_groups` cuts rows into the runs that pad the fewest tokens plus a fixed cost per forward (exact dynamic
programming over the sorted lengths); `length_batches` is what predictors loop over: the rows longest first in
batches of at most `batch_size`, each cut further into such runs on a CPU, where a forward's cost is its tokens (a
batch of a 12-token question and a 256-token paragraph padded together costs two paragraphs) and one more forward
costs about CPU_TOKENS_PER_FORWARD tokens; an accelerator's forward costs much per call and little per token, so
there batches stay whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# what one more forward of a run of rows costs on a CPU, in tokens of compute (benchmarks/README.md, split_by_length)
CPU_TOKENS_PER_FORWARD = 48


def length_groups(lengths: Sequence[int], per_forward: float) -> list[list[int]]:
    """The rows (indices into `lengths`) cut into runs of similar length so that padding each run to its longest
    row, plus `per_forward` tokens for each run (what one more forward costs), costs the fewest tokens: an exact
    partition of the rows sorted by length (dynamic programming over the cut points)."""
    order = np.argsort(np.asarray(lengths), kind="stable")
    ranked = np.asarray(lengths)[order]
    best, start = np.zeros(len(ranked) + 1), np.zeros(len(ranked) + 1, dtype=int)
    for end in range(1, len(ranked) + 1):
        costs = best[:end] + (end - np.arange(end)) * ranked[end - 1] + per_forward
        start[end] = int(np.argmin(costs))
        best[end] = costs[start[end]]
    groups, end = [], len(ranked)
    while end > 0:
        groups.append(order[start[end] : end].tolist())
        end = start[end]
    return groups[::-1]


def length_batches(lengths: Sequence[int], batch_size: int, on_cpu: bool) -> list[list[int]]:
    """The rows (indices into `lengths`) in the batches to run, longest first: at most `batch_size` rows each, and on
    a CPU each batch cut into runs of similar length (`length_groups`). Every row in exactly one batch."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    if not on_cpu:
        return batches
    runs = []
    for rows in batches:
        cut = length_groups([lengths[i] for i in rows], CPU_TOKENS_PER_FORWARD)
        runs += [[rows[j] for j in sorted(run)] for run in cut]
    return runs
