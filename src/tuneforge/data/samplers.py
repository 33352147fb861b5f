"""Batch order: length-grouped training batches and sorted evaluation batches.

Training order is a pure function of (seed, epoch, global batch size, lengths): the whole
epoch's example order is computed up front, so a resume can continue from any example position
without touching the batches before it, and data-parallel ranks take disjoint slices of each
global batch.
"""

from __future__ import annotations

import numpy as np

MEGABATCH_FACTOR = 50  # batches per length-sorted bucket (as transformers' LengthGroupedSampler)


def epoch_order(lengths: np.ndarray, *, seed: int, epoch: int, global_batch: int, group_by_length: bool) -> np.ndarray:
    """The epoch's example order. Consecutive chunks of `global_batch` are the global batches."""
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(len(lengths))
    if not group_by_length:
        return perm
    # seeded random buckets, each sorted by length (longest first), then batch order shuffled
    mega = global_batch * MEGABATCH_FACTOR
    chunks = [perm[i : i + mega] for i in range(0, len(perm), mega)]
    chunks = [c[np.argsort(-lengths[c], kind="stable")] for c in chunks]
    order = np.concatenate(chunks)
    batches = [order[i : i + global_batch] for i in range(0, len(order), global_batch)]
    # keep the very last (possibly short) batch last; shuffle the full ones
    full = batches[:-1] if len(batches[-1]) < global_batch else batches
    tail = batches[len(full) :]
    shuffled = [full[i] for i in rng.permutation(len(full))]
    return np.concatenate(shuffled + tail) if (shuffled or tail) else order


def rank_batches(order: np.ndarray, *, start: int, global_batch: int, dp_rank: int, dp_size: int) -> list[list[int]]:
    """This rank's batches of the epoch, from example position `start` of `order`.

    Each global batch is split into `dp_size` contiguous slices as evenly as possible; a final
    global batch smaller than `dp_size` is dropped (each rank must hold at least one example).
    """
    out = []
    rest = order[start:]
    for i in range(0, len(rest), global_batch):
        chunk = rest[i : i + global_batch]
        if len(chunk) < dp_size:
            break
        bounds = np.linspace(0, len(chunk), dp_size + 1).round().astype(int)
        out.append(chunk[bounds[dp_rank] : bounds[dp_rank + 1]].tolist())
    return out


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
