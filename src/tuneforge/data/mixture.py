"""Weighted mixtures of data sources: how many rows of each source an epoch holds, and the epoch's order.

The sources' tokenized rows sit one after the other (source i's row r is example `offsets[i] + r`). An epoch takes
`quotas[i]` rows of source i: with weights, the epoch holds as many rows as the sources together do, shared out by
weight (largest remainder, so they add up); with `epochs`, each source's rows that many times over. A source read
more than once per epoch (upsampled) repeats in fresh orders; one read less than once (downsampled) gives each epoch
the next part of its stream, so every row is seen before any repeats.

Everything is a pure function of (seed, epoch, the sources' sizes and quotas): source i's stream is its rows in
seeded permutations one after another (`stream_rows`), epoch e takes positions [e * quota, (e + 1) * quota) of it,
and the sources are interleaved by stride keys (row k of source i at (k + phase_i) / quota_i, a seeded phase per
epoch), so any window of W examples holds within two rows of W * weight of each source. Nothing is read to find
a position: a resume computes the epoch's order and continues at its index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

STREAM_SALT = 7_919  # keeps the sources' streams apart from the epoch orders drawn from (seed, epoch)
PHASE_SALT = 104_729
BLOCK_VALUES = 2**20  # stream values drawn at once
ORDER_CHUNK = 2**18  # keys placed at once (bounds the order's working memory)


@dataclass(frozen=True)
class Mixture:
    names: tuple[str, ...]
    sizes: tuple[int, ...]  # tokenized rows (features) of each source
    quotas: tuple[int, ...]  # rows of each source in one epoch

    @classmethod
    def of(
        cls, names: list[str], sizes: list[int], weights: list[float] | None = None, epochs: list[float] | None = None
    ) -> Mixture:
        """The mixture of sources of `sizes` rows: by `weights` (an epoch as long as all rows together), by
        `epochs` per source, or (neither) each source once per epoch."""
        if epochs is not None:
            quotas = [max(1, round(n * e)) for n, e in zip(sizes, epochs, strict=True)]
        elif weights is not None:
            quotas = share_out(sum(sizes), weights)
        else:
            quotas = list(sizes)
        return cls(tuple(names), tuple(int(n) for n in sizes), tuple(int(q) for q in quotas))

    @property
    def epoch_rows(self) -> int:
        return sum(self.quotas)

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)

    def limited(self, rows: int) -> Mixture:
        """The mixture with epochs of at most `rows` rows, each source keeping its share (--max-train-samples)."""
        if rows >= self.epoch_rows:
            return self
        return Mixture(self.names, self.sizes, tuple(share_out(rows, list(self.quotas))))

    def order(self, seed: int, epoch: int) -> np.ndarray:
        """The epoch's examples (indices into the sources' rows laid one after the other), interleaved.

        Row k of source i goes where its key (k + phase_i) / quota_i ranks among all the sources' keys (ties to the
        earlier source): counted per source in closed form, so the order is written straight into one array of
        4-byte indices (8 where the sources hold 2**31 rows or more), a chunk of keys at a time, never sorted."""
        phases = np.random.default_rng([seed, epoch, PHASE_SALT]).random(len(self.sizes))
        out = np.empty(self.epoch_rows, dtype=index_type(sum(self.sizes)))
        for source, (offset, size, quota) in enumerate(zip(self.offsets, self.sizes, self.quotas, strict=True)):
            rows = stream_rows(size, seed, source, epoch * quota, quota)
            for start in range(0, quota, ORDER_CHUNK):
                k = np.arange(start, min(quota, start + ORDER_CHUNK), dtype=np.int64)
                keys = (k + phases[source]) / quota
                at = k.copy()
                for other, (q, p) in enumerate(zip(self.quotas, phases, strict=True)):
                    if other != source:
                        at += keys_below(keys, q, p, ties=other < source)
                out[at] = rows[start : start + len(k)] + offset
        return out

    def source_of(self, examples: np.ndarray) -> np.ndarray:
        """The source index of each example index."""
        return np.searchsorted(np.cumsum(self.sizes), examples, side="right")

    def describe(self) -> list[str]:
        """The plan, one line per source: rows, rows per epoch, share, and how often its rows come round."""
        total = self.epoch_rows
        lines = []
        for name, size, quota in zip(self.names, self.sizes, self.quotas, strict=True):
            times = quota / size
            lines.append(
                f"  {name}: {size:,} rows, {quota:,} per epoch ({quota / total:.1%} of it; each row {times:.3g}x "
                f"per epoch)"
            )
        return [f"data mixture: {len(self.names)} sources, {total:,} examples per epoch", *lines]


def share_out(total: int, weights: list[float]) -> list[int]:
    """`total` split by `weights` into whole numbers that add up to it (largest remainder), each at least 1 (every
    source is in every epoch; with fewer rows than sources, one each)."""
    if total < len(weights):
        return [1] * len(weights)
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * (total - len(weights))
    counts = np.floor(exact).astype(np.int64)
    short = total - len(weights) - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return [1 + int(c) for c in counts]


def index_type(rows: int):
    """The smallest integer type that indexes `rows` rows (an epoch's order is one such index per example)."""
    return np.int32 if rows < 2**31 else np.int64


def keys_below(keys: np.ndarray, quota: int, phase: float, ties: bool) -> np.ndarray:
    """For each of `keys` (ascending), how many keys (m + phase) / quota, m in [0, quota), of another source are
    below it (`ties`: or equal to it). The count is estimated in closed form, then settled against the keys as
    `order` computes them, so float rounding cannot move a row."""
    below = (lambda m: (m + phase) / quota <= keys) if ties else (lambda m: (m + phase) / quota < keys)
    count = np.clip(np.ceil(keys * quota - phase), 0, quota).astype(np.int64)
    for _ in range(4):  # (the estimate is off by at most one)
        lower = (count > 0) & ~below(count - 1)
        higher = (count < quota) & below(count)
        if not (lower.any() or higher.any()):
            return count
        count -= lower
        count += higher
    raise AssertionError("mixture keys did not settle")


def stream_rows(size: int, seed: int, source: int, start: int, count: int) -> np.ndarray:
    """Positions [start, start + count) of a source's stream: its rows in one seeded permutation after another.

    The permutations are drawn in blocks of about 2**20 values (a small source upsampled many times over costs
    one draw per block, not one per pass), each block from its own seed, so any part of the stream is drawn alone."""
    per_block = max(1, BLOCK_VALUES // size)
    first, last = start // size // per_block, (start + count - 1) // size // per_block
    blocks = []
    for block in range(first, last + 1):
        rng = np.random.default_rng([seed, STREAM_SALT, source, block])
        blocks.append(rng.permuted(np.tile(np.arange(size, dtype=index_type(size)), (per_block, 1)), axis=1).ravel())
    skip = start - first * per_block * size
    return np.concatenate(blocks)[skip : skip + count]
