"""Atomic writes: a file or folder appears whole under its name, or not at all; and the strict JSON text of every
JSON file and line tuneforge writes.

Everything is written under a temporary sibling name (`.tmp-NAME.PID`) and renamed into place
with one `os.replace`; a crash leaves at most a temporary, which is never read as the real thing.

JSON has no nan or infinity: Python's `json.dumps` writes them as bare `NaN`/`Infinity` tokens, which jq,
JavaScript's JSON.parse and Go refuse. `json_text` writes each as null (an undefined metric, such as a correlation
of constant predictions, is no value), as pandas' to_json does; tuneforge's readers take null as "no value".
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TMP_PREFIX = ".tmp-"
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file size limit


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync a file, or every file and folder of a tree."""
    if Path(path).is_file():
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
        return
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(root))


def remove(path: Path) -> None:
    """Delete a file or folder if it exists."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def discard(path: Path) -> None:
    """Remove a folder so that a crash half-way never leaves a partial folder under its name."""
    doomed = path.with_name(f"{TMP_PREFIX}deleted-{path.name}-{os.getpid()}-{time.time_ns()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


@contextlib.contextmanager
def replacing(path: str | os.PathLike, durable: bool = False) -> Iterator[Path]:
    """Write a file or folder at the yielded temporary path; when the block succeeds it takes the
    place of `path` (a folder already there is discarded), else it is removed.

    `durable`: fsync the new content before the rename and the parent folder after it.
    """
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    remove(tmp)
    try:
        yield tmp
        if durable:
            fsync_tree(tmp)
        if path.is_dir() and not path.is_symlink():
            discard(path)
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except BaseException:
        remove(tmp)
        raise


def out_of_room(err: OSError) -> bool:
    """Whether a write failed for want of room: an errno of NO_ROOM, or numpy's short write (`tofile`, as gguf writes
    tensors), which says "N requested and M written" with no errno."""
    short_write = err.errno is None and " requested and " in str(err) and str(err).endswith(" written")
    return err.errno in NO_ROOM or short_write


def write_text(path: str | os.PathLike, text: str, durable: bool = True) -> None:
    """Replace a text file in one rename."""
    with replacing(path, durable=durable) as tmp:
        tmp.write_text(text)


def finite_or_null(value: Any) -> Any:
    """`value` with each nan or infinite float in it (in dicts, lists and tuples, at any depth) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def json_text(value: Any, **how: Any) -> str:
    """`value` as standard JSON (`how`: json.dumps's indent, ensure_ascii, ...), a nan or infinity as null."""
    return json.dumps(finite_or_null(value), allow_nan=False, **how)
