"""SFT's length rule and packing over tokenized conversations, a part of the split at a time, so that a split larger
than memory is never held whole: a conversation longer than `block_size` tokens is cut to its first `block_size`,
one with no assistant token left after the cut is dropped, and the rest are laid into blocks whole, in order (a new
block when the next one does not fit), or one a row without packing.

Two passes over the features in Arrow: the first counts each row's tokens and assistant tokens (vectorised, no
Python loop over tokens) and decides where each block starts; the second writes the blocks (`input_ids`, `labels`,
each conversation's length in `segments`, the block's `length`), to a file beside the tokenization cache when one
is given (read memory-mapped after), else in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tuneforge.data.chat import IGNORE
from tuneforge.data.text import batches_dataset

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa

ROWS_AT_ONCE = 1 << 14


def block_schema() -> pa.Schema:
    """The columns of packed blocks (a function: `pyarrow` is imported only where data is packed)."""
    import pyarrow as pa

    return pa.schema(
        {
            "input_ids": pa.list_(pa.int64()),
            "labels": pa.list_(pa.int64()),
            "segments": pa.list_(pa.int64()),
            "length": pa.int64(),
        }
    )


@dataclass
class Fit:
    """The first pass: which rows are kept, each one's length after the cut, and the counts the log reports."""

    kept: np.ndarray  # row indices, ascending
    lengths: np.ndarray  # their lengths after the cut
    cut: int
    dropped: int  # of them, `unlearnable` ones whatever their length
    targets: int  # assistant tokens of the kept rows, after the cut
    unlearnable: int = 0  # rows whose rendering gave no assistant token at all (the template writes none)


def fit(feats: datasets.Dataset, block_size: int, rows_at_once: int = ROWS_AT_ONCE) -> Fit:
    import pyarrow.compute as pc

    kept, lengths, cut, dropped, targets, start, unlearnable = [], [], 0, 0, 0, 0, 0
    for table in feats.select_columns(["labels"]).with_format("arrow").iter(batch_size=rows_at_once):
        labels = table.column("labels")
        n = pc.list_value_length(labels).to_numpy(zero_copy_only=False).astype(np.int64)
        flat = np.concatenate([c.flatten().to_numpy(zero_copy_only=False) for c in labels.chunks] or [[]])
        row_of = np.repeat(np.arange(len(n)), n)
        pos = np.arange(len(flat)) - np.repeat(np.cumsum(n) - n, n)  # each token's place in its row
        target = (flat != IGNORE) & (pos < block_size)
        learns = np.bincount(row_of[target & (pos >= 1)], minlength=len(n)) > 0  # (the first token has no target)
        unlearnable += int((np.bincount(row_of[(flat != IGNORE) & (pos >= 1)], minlength=len(n)) == 0).sum())
        keep = np.flatnonzero(learns)
        kept.append(start + keep)
        lengths.append(np.minimum(n[keep], block_size))
        cut += int((n > block_size).sum())
        dropped += int(len(n) - len(keep))
        targets += int(np.bincount(row_of[target], minlength=len(n))[keep].sum())
        start += len(n)

    def joined(parts: list) -> np.ndarray:
        return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.empty(0, np.int64)

    return Fit(joined(kept), joined(lengths), cut, dropped, targets, unlearnable)


def block_numbers(lengths: np.ndarray, block_size: int, packing: bool) -> np.ndarray:
    """Each kept row's block: whole conversations in order, a new block when the next does not fit."""
    if not packing:
        return np.arange(len(lengths), dtype=np.int64)
    out = np.empty(len(lengths), np.int64)
    block, used = 0, 0
    for i, n in enumerate(lengths.tolist()):
        if used and used + n > block_size:
            block, used = block + 1, 0
        out[i] = block
        used += n
    return out


def write_blocks(feats, fitted: Fit, block_size: int, packing: bool, into: Path | None, rows_at_once=ROWS_AT_ONCE):
    """The blocks of `fitted`'s rows as a Dataset: written to `into` (reused when there) or built in memory."""
    blocks = block_numbers(fitted.lengths, block_size, packing)
    return batches_dataset(_block_parts(feats, fitted.kept, blocks, block_size, rows_at_once), block_schema(), into)


def _block_parts(feats, kept: np.ndarray, blocks: np.ndarray, block_size: int, rows_at_once: int):
    """Record batches of whole blocks, the kept rows read `rows_at_once` at a time and cut to `block_size`."""
    out = {name: [] for name in block_schema().names}
    current = -1
    columns = feats.select_columns(["input_ids", "labels"])
    for start in range(0, len(kept), rows_at_once):
        rows = columns.select(kept[start : start + rows_at_once]).to_dict()
        for x, y, block in zip(rows["input_ids"], rows["labels"], blocks[start : start + rows_at_once].tolist()):
            if block != current:  # every block so far is whole
                if len(out["length"]) >= rows_at_once:
                    yield _batch(out)
                for name, empty in (("input_ids", []), ("labels", []), ("segments", []), ("length", 0)):
                    out[name].append(empty)
                current = block
            n = min(len(x), block_size)
            out["input_ids"][-1] += x[:n]
            out["labels"][-1] += y[:n]
            out["segments"][-1].append(n)
            out["length"][-1] += n
    if out["length"]:
        yield _batch(out)


def _batch(out: dict) -> pa.RecordBatch:
    """The blocks in `out` as a record batch; `out` emptied."""
    import pyarrow as pa

    batch = pa.RecordBatch.from_pydict(out, schema=block_schema())
    for values in out.values():
        values.clear()
    return batch
