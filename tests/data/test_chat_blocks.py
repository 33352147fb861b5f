"""SFT's length rule and packing a part at a time (data/chat_blocks.py) against the whole-split reference it
replaced (kept here): the same blocks, counts and order for any part size, packed or not, in memory or in a file."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

from tuneforge.data import chat
from tuneforge.data.chat_blocks import fit, write_blocks

IGNORE = chat.IGNORE


def reference(feats, block_size: int, packing: bool):
    """The earlier whole-split implementation: Python lists of every row."""
    ids, labels, cut, dropped = [], [], 0, 0
    for x, y in zip(feats["input_ids"], feats["labels"]):
        if len(x) > block_size:
            cut += 1
            x, y = x[:block_size], y[:block_size]
        if all(t == IGNORE for t in y[1:]):
            dropped += 1
            continue
        ids.append(x)
        labels.append(y)
    groups = pack([len(x) for x in ids], block_size) if packing else [[i] for i in range(len(ids))]
    blocks = {
        "input_ids": [sum((ids[i] for i in g), []) for g in groups],
        "labels": [sum((labels[i] for i in g), []) for g in groups],
        "segments": [[len(ids[i]) for i in g] for g in groups],
    }
    blocks["length"] = [len(x) for x in blocks["input_ids"]]
    targets = sum(sum(t != IGNORE for t in y) for y in labels)
    return blocks, (len(ids), cut, dropped, targets)


def pack(lengths: list[int], block_size: int) -> list[list[int]]:
    """The earlier chat.pack: indices of whole conversations per block, a new block when the next does not fit."""
    blocks, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > block_size:
            blocks.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        blocks.append(current)
    return blocks


def conversations(n: int, seed: int) -> datasets.Dataset:
    """Rows of 0-40 tokens whose labels are IGNORE but for a random span (none, only the first token, or past the
    cut, too)."""
    rng = np.random.default_rng(seed)
    ids, labels = [], []
    for _ in range(n):
        length = int(rng.integers(1, 41))
        x = rng.integers(0, 1000, length).tolist()
        y = [IGNORE] * length
        kind = rng.integers(0, 4)
        if kind == 1:  # a reply somewhere
            a = int(rng.integers(0, length))
            y[a:] = x[a:]
        elif kind == 2:  # only the first token (never a target: dropped)
            y[0] = x[0]
        elif kind == 3 and length > 20:  # a reply past the cut at 16
            y[20:] = x[20:]
        ids.append(x)
        labels.append(y)
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_blocks_equal_the_whole_split_reference(tmp_path, packing, seed):
    feats = conversations(120, seed)
    want, (kept, cut, dropped, targets) = reference(feats, 16, packing)
    assert dropped and cut and kept  # each rule has rows to act on
    for rows_at_once in (1, 3, 7, 1000):
        fitted = fit(feats, 16, rows_at_once=rows_at_once)
        assert (len(fitted.kept), fitted.cut, fitted.dropped, fitted.targets) == (kept, cut, dropped, targets)
        got = write_blocks(feats, fitted, 16, packing, None, rows_at_once=rows_at_once)
        assert got.to_dict() == want
    into = tmp_path / f"blocks-{packing}.arrow"
    in_file = write_blocks(feats, fit(feats, 16), 16, packing, into, rows_at_once=5)
    assert in_file.to_dict() == want and in_file.cache_files[0]["filename"] == str(into)
    assert [p.name for p in tmp_path.iterdir()] == [into.name]  # no temporary left


def test_a_selected_view_is_read_as_its_rows():
    feats = conversations(60, 5)
    view = feats.select(list(range(59, -1, -2)))
    want, _ = reference(view, 16, True)
    assert write_blocks(view, fit(view, 16, rows_at_once=4), 16, True, None, rows_at_once=4).to_dict() == want
