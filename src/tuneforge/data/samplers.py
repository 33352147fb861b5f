"""Batch order: length-grouped training batches and sorted evaluation batches.

Training order is a pure function of (seed, epoch, global batch size, lengths): the whole
epoch's example order is computed up front, so a resume can continue from any example position
without touching the batches before it, and data-parallel ranks take disjoint slices of each
global batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from tuneforge.data.mixture import Mixture, index_type

MEGABATCH_FACTOR = 50  # batches per length-sorted bucket (as transformers' LengthGroupedSampler)
SORT_ROWS = 2**20  # examples sorted by length at once
MIXTURE_GROUP = 4  # a mixture's batches per length-sorted bucket (small: the sources' shares hold in any window)


def epoch_order(
    lengths: np.ndarray,
    *,
    seed: int,
    epoch: int,
    global_batch: int,
    group_by_length: bool,
    mixture: Mixture | None = None,
) -> np.ndarray:
    """The epoch's example order. Consecutive chunks of `global_batch` are the global batches.

    One dataset: a seeded permutation; grouped by length, seeded buckets of MEGABATCH_FACTOR global batches each
    sorted by length (longest first), then the order of the full batches shuffled. A mixture: its interleaved order
    (data/mixture.py); grouped by length only within MIXTURE_GROUP global batches, whose order is shuffled among
    themselves, so that the sources' shares hold over any window of the epoch."""
    rng = np.random.default_rng([seed, epoch])
    if mixture is not None:
        order = mixture.order(seed, epoch)
        if not group_by_length:
            return order
        return shuffle_batches(
            sort_chunks(order, lengths, global_batch * MIXTURE_GROUP), global_batch, rng, MIXTURE_GROUP
        )
    perm = rng.permutation(len(lengths)).astype(index_type(len(lengths)), copy=False)
    if not group_by_length:
        return perm
    return shuffle_batches(sort_chunks(perm, lengths, global_batch * MEGABATCH_FACTOR), global_batch, rng)


def sort_chunks(order: np.ndarray, lengths: np.ndarray, size: int) -> np.ndarray:
    """`order` cut into chunks of `size` examples (the last may be shorter), each sorted by length, longest first
    (a stable sort: equal lengths keep their order). Sorted SORT_ROWS examples at a time, into one array of
    `order`'s type: the working memory does not grow with the epoch."""
    lengths = np.asarray(lengths)
    keys_type = np.int16 if len(lengths) and lengths.max() < 2**15 else np.int64  # 16-bit keys sort by radix
    out = np.empty_like(order)
    full = len(order) // size * size
    head = order[:full].reshape(-1, size)
    per_part = max(1, SORT_ROWS // size)
    for first in range(0, len(head), per_part):
        part = head[first : first + per_part]
        by_length = np.argsort(-lengths[part].astype(keys_type), axis=1, kind="stable")
        out[first * size : (first + len(part)) * size] = np.take_along_axis(part, by_length, axis=1).ravel()
    tail = order[full:]
    out[full:] = tail[np.argsort(-lengths[tail].astype(keys_type), kind="stable")]
    return out


def shuffle_batches(order: np.ndarray, global_batch: int, rng, within: int | None = None) -> np.ndarray:
    """The full global batches of `order` in a seeded random order (only among each `within` consecutive batches,
    where given); a last, short batch stays last."""
    n_full = len(order) // global_batch
    batches, tail = order[: n_full * global_batch].reshape(n_full, global_batch), order[n_full * global_batch :]
    if within is None:
        return np.concatenate([batches[rng.permutation(n_full)].ravel(), tail])
    groups = n_full // within
    picks = np.argsort(rng.random((groups, within)), axis=1) + np.arange(groups)[:, None] * within
    rest = np.arange(groups * within, n_full)
    return np.concatenate([batches[np.concatenate([picks.ravel(), rest])].ravel(), tail])


def rank_batches(order: np.ndarray, *, start: int, global_batch: int, dp_rank: int, dp_size: int) -> list[list[int]]:
    """This rank's batches of the epoch, from example position `start` of `order` (all of them, as lists;
    `EpochSteps` makes them one step at a time)."""
    steps = EpochSteps(order, start=start, global_batch=global_batch, dp_rank=dp_rank, dp_size=dp_size, grad_accum=1)
    return [step[0] for step in steps]


def order_digest(order: np.ndarray) -> str:
    """'SIZE:DIGEST' of an epoch's example order (its index type follows its size, so equal orders match)."""
    return f"{len(order)}:{hashlib.sha256(np.ascontiguousarray(order)).hexdigest()[:16]}"


class EpochSteps(Sequence):
    """This rank's optimizer steps left in an epoch, from example position `start` of the epoch's `order`: each a
    list of `grad_accum` micro-batches (the last step may have fewer) of example indices, `repeats` times in a row.

    Each global batch is split into `dp_size` contiguous slices as evenly as possible; a final global batch smaller
    than `dp_size` is dropped (each rank must hold at least one example). The steps are made when asked for: the
    epoch stays one numpy array, never millions of Python ints."""

    def __init__(
        self,
        order: np.ndarray,
        *,
        start: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        grad_accum: int,
        repeats: int = 1,
    ):
        self.rest, self.global_batch, self.dp_rank, self.dp_size = order[start:], global_batch, dp_rank, dp_size
        self.order_digest = order_digest(order)  # the whole epoch's: a resume checks it continues this order
        self.grad_accum, self.repeats = grad_accum, repeats
        full, left = divmod(len(self.rest), global_batch)
        self.batches = full + (left >= dp_size and left > 0)
        self.data_steps = -(-self.batches // grad_accum)

    def __len__(self) -> int:
        return self.data_steps * self.repeats

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        first = (i % len(self)) // self.repeats * self.grad_accum
        return [self._batch(b) for b in range(first, min(first + self.grad_accum, self.batches))]

    def _batch(self, b: int) -> list[int]:
        chunk = self.rest[b * self.global_batch : (b + 1) * self.global_batch]
        bounds = np.linspace(0, len(chunk), self.dp_size + 1).round().astype(int)
        return chunk[bounds[self.dp_rank] : bounds[self.dp_rank + 1]].tolist()


def eval_batches(lengths: np.ndarray, *, batch_size: int, dp_rank: int, dp_size: int) -> list[list[int]]:
    """Evaluation batches sorted by length; every rank gets the same number of batches.

    Each example is on exactly one rank. A rank whose share of the last chunk is empty gets
    index -1 entries, which the caller must skip (they are never counted).
    """
    order = np.argsort(-np.asarray(lengths), kind="stable")
    global_batch = batch_size * dp_size
    out = []
    for i in range(0, len(order), global_batch):
        chunk = order[i : i + global_batch]
        bounds = np.linspace(0, len(chunk), dp_size + 1).round().astype(int)
        mine = chunk[bounds[dp_rank] : bounds[dp_rank + 1]].tolist()
        out.append(mine or [-1])
    return out


def lengths_of(data) -> np.ndarray:
    """The `length` column of tokenized features as a numpy array (a `datasets.Dataset` is read through Arrow,
    never as a list of Python ints: 10 million rows in a fraction of a second)."""
    if hasattr(data, "with_format"):
        return data.with_format("arrow", columns=["length"])[:]["length"].to_numpy()
    return np.asarray(data["length"])


def compact_lengths(lengths: np.ndarray) -> np.ndarray:
    """`lengths` in the smallest unsigned type that holds them (2 bytes an example for any length under 65,536:
    the column stays in memory for the whole run)."""
    lengths = np.asarray(lengths)
    top = int(lengths.max()) if len(lengths) else 0
    kind = np.uint16 if top < 2**16 else np.uint32 if top < 2**32 else np.uint64
    return lengths.astype(kind, copy=False)
