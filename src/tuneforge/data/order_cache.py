"""Epoch orders kept in the run folder (OUTPUT_DIR/data-order/), so that a resume into a large epoch reads the
epoch's order instead of computing it again (about 1.5 s for a 10-million-example mixture on 2 cores: the goal is
a resume whose data work is well under a second).

An order is a pure function of what its key covers (seed, epoch, batch geometry, length grouping, the mixture, the
training data's fingerprints and the length column's size and sum), so a stored one is the computed one. Only
epochs of MIN_EXAMPLES or more are stored (smaller ones compute in milliseconds); the main rank writes each (a
temporary file, then renamed) and removes the orders of other epochs it wrote; every rank reads them memory-mapped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tuneforge.errors import NoRoomError
from tuneforge.files import replacing

FOLDER = "data-order"
MIN_EXAMPLES = 1_000_000


class OrderCache:
    def __init__(self, run_dir: str | os.PathLike, writes: bool, data_key: dict) -> None:
        """`writes`: this rank stores orders (the main rank); `data_key`: what identifies the training data (its
        inputs' fingerprints)."""
        self.folder, self.writes, self.data_key = Path(run_dir) / FOLDER, writes, data_key

    def order(self, compute: Callable[[], np.ndarray], lengths: np.ndarray, **what) -> np.ndarray:
        """The order `compute()` gives for `what`: read from the run folder where it was stored, else computed (and
        stored, where this rank writes and the epoch is large)."""
        if len(lengths) < MIN_EXAMPLES or not self.data_key:  # (data given in Python: nothing identifies it)
            return compute()
        key = {**what, "data": self.data_key, "examples": len(lengths), "length_sum": int(lengths.sum())}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
        path = self.folder / f"epoch-{what.get('epoch', 0)}-{digest}.npy"
        with contextlib.suppress(OSError, ValueError):
            return np.load(path, mmap_mode="r")
        order = compute()
        if self.writes:
            self._store(path, order)
        return order

    def _store(self, path: Path, order: np.ndarray) -> None:
        """`order` at `path`, written whole or not at all; the other epochs' orders this cache wrote are removed.
        A folder that cannot be written (or has no room) only costs the next resume the computation; a failed write
        leaves no temporary behind."""
        with contextlib.suppress(OSError, NoRoomError):
            self.folder.mkdir(parents=True, exist_ok=True)
            with replacing(path) as tmp, open(tmp, "wb") as fh:
                np.save(fh, order)
            for old in self.folder.glob("epoch-*.npy"):
                if old != path:
                    old.unlink()
