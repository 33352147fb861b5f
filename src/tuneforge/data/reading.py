"""The "in use" locks of cache files one process may remove while another reads them (a large file's Arrow copy,
data/mapped.py; a tokenization key's files, data/tokenize.py): a reader holds a shared POSIX lock on the files'
lock file for as long as it lives (per process, so forked workers need none of their own), and a remover deletes
them only under an exclusive lock it gets without waiting. A process holds at most HELD_MAX locks (one descriptor
each; a lock let go only leaves its files unprotected from a remover)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

HELD_MAX = 256
_HELD: dict[Path, int] = {}  # a lock file -> this process's open descriptor, shared-locked while it lives


def hold(lock: Path) -> None:
    """A shared lock on `lock` (made where missing) for this process's life."""
    lock = lock.resolve()
    while lock not in _HELD:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.lockf(fd, fcntl.LOCK_SH)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                _HELD[lock] = fd
                if len(_HELD) > HELD_MAX:  # (closing the descriptor releases its lock)
                    os.close(_HELD.pop(next(iter(_HELD))))
                return
        os.close(fd)  # (a remover deleted the lock file while this process waited: lock the one there now)


def held(lock: Path) -> bool:
    return lock.resolve() in _HELD


def exclusive(lock: Path) -> int | None:
    """An exclusive lock on `lock`, this process's shared one converted (and no longer held): its descriptor, which
    the caller closes; None where another process holds it."""
    lock = lock.resolve()
    fd = _HELD.pop(lock, None)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644) if fd is None else fd
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # another process reads the files
        os.close(fd)
        return None
    return fd
