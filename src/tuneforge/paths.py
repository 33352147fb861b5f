"""Cheap checks of the folders a user names (--output-dir, --cache-dir, --output, --local-dir), done before
any heavy work so a bad path is one line, not a traceback after minutes of tokenizing. Imports no torch."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from tuneforge.errors import ConfigError


def check_output_dir(path: str, flag: str = "--output-dir", what: str = "output dir") -> None:
    """The folder `path` (given with `flag`) exists and is writable or can be created; checked before any
    heavy work.

    Creates nothing that stays: where the folder does not exist yet, a probe folder is made (and
    removed) in its nearest existing parent, since permissions alone do not tell (root, /proc)."""
    out = Path(path).expanduser()
    parent = out
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        how = "is a file" if parent == out else f"cannot be created: {str(parent)!r} is a file"
        raise ConfigError(f"{what} {str(out)!r} {how}; choose another {flag}")
    why = None
    if not os.access(parent, os.W_OK | os.X_OK):
        why = f"{str(parent)!r} is not writable"
    elif parent != out:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".tuneforge-probe-", dir=parent))
        except OSError as err:  # /proc: ENOENT; a read-only mount: EROFS
            why = f"{str(parent)!r} takes no new folders" + ("" if err.errno == errno.ENOENT else f": {err.strerror}")
    if why:
        verb = "cannot be written" if parent == out else "cannot be created"
        raise ConfigError(f"{what} {str(out)!r} {verb} ({why}); choose another {flag}")
