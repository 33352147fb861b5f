"""Atomic writes: a file or folder appears whole under its name, or not at all; and the strict JSON text of every
JSON file and line tuneforge writes.

Everything is written under a temporary sibling name (`.tmp-NAME.PID`) and renamed into place
with one `os.replace`; a crash leaves at most a temporary, which is never read as the real thing.

A write that fails for want of room (a full disk, a quota, a file size limit) is one line naming what it wrote
(`room_for`, which `replacing` applies): `no_room` tells such a failure from others, whichever library wrote.

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
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tuneforge.errors import NoRoomError

TMP_PREFIX = ".tmp-"
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file size limit
RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's io::Error ends its text (safetensors' errors)


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
def replacing(path: str | os.PathLike, durable: bool = False, what: str = "", then: str = "") -> Iterator[Path]:
    """Write a file or folder at the yielded temporary path; when the block succeeds it takes the
    place of `path` (a folder already there is discarded), else it is removed.

    `durable`: fsync the new content before the rename and the parent folder after it.
    A write that fails for want of room is one line (`room_for`, with `what` and `then`).
    """
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    remove(tmp)
    try:
        with room_for(path, what, then):
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


def no_room(err: BaseException) -> str | None:
    """Why a write failed for want of room (its errno's words), or None where it failed for another reason: an
    OSError that `out_of_room` takes, or safetensors' SafetensorError, which is no OSError and says its errno only in
    its text ("I/O error: No space left on device (os error 28)"). torch.save's own is opaque: see `torch_save`."""
    if isinstance(err, OSError):
        if not out_of_room(err):
            return None
        return os.strerror(err.errno) if err.errno else "its disk took part of it only"  # (pyarrow's own is long)
    found = RUST_OS_ERROR.search(str(err)) if type(err).__name__ == "SafetensorError" else None
    if found and int(found.group(1)) in NO_ROOM:
        return os.strerror(int(found.group(1)))
    return None


@contextlib.contextmanager
def room_for(path: str | os.PathLike, what: str = "", then: str = "") -> Iterator[None]:
    """A write in the block that fails for want of room raised as one line (NoRoomError): "`what` 'PATH' has no
    room (why); free space there`then`"; any other failure as it is."""
    try:
        yield
    except Exception as err:
        why = no_room(err)
        if why is None:
            raise
        named = f"{what} {str(path)!r}" if what else repr(str(path))
        raise NoRoomError(f"{named} has no room ({why}); free space there{then}") from None


class _WriteRecorder:
    """A binary file's `write` for torch.save that keeps the OSError a write raised."""

    def __init__(self, fh) -> None:
        self.fh, self.error = fh, None

    def write(self, data) -> int:
        try:
            return self.fh.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.fh.flush()


def torch_save(obj: Any, path: str | os.PathLike) -> None:
    """torch.save(obj, path), a write that fails raising its OSError: torch's own writer answers one with an opaque
    RuntimeError ("unexpected pos 576 vs 534", "file write failed"), which does not say the disk is full."""
    import torch

    with open(path, "wb") as fh:
        sink = _WriteRecorder(fh)
        try:
            torch.save(obj, sink)
        except RuntimeError:
            if sink.error is None:
                raise
            raise sink.error from None


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
