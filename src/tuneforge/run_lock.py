"""One run at a time in an output dir: the main process of a run holds an advisory lock on its output folder
(flock on the folder itself, so nothing is written into it) from before its heavy set-up to its end, and a
second run into the same folder (two terminals, a job requeued while the first still runs, `--overwrite` or
`--resume` of a run that is still going) stops with one line instead of both writing metrics.jsonl, checkpoints
and model/ over each other. The kernel drops the lock when the process dies, so a killed run never leaves a stale
one. Best effort: a file system without flock (some network mounts) runs unlocked, as before. Imports no torch."""

from __future__ import annotations

import errno
import fcntl
import os
from contextlib import suppress
from pathlib import Path

from tuneforge.errors import ConfigError
from tuneforge.paths import check_output_dir


class RunLock:
    """The held lock of one output dir; `release` ends it, and removes the folders taking the lock created (the
    output dir and any parent made for it) where the run left them empty: a run that failed before writing anything
    leaves no folder behind."""

    def __init__(self, folder: Path, fd: int | None, created: list[Path]):
        self.folder, self.fd, self.created = folder, fd, created

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor of the open file drops its flock
            self.fd = None
        for made in self.created:  # innermost first
            with suppress(OSError):  # not empty (the run wrote its files), or gone: left as it is
                made.rmdir()
        self.created = []


def take(output_dir: str | os.PathLike) -> RunLock:
    """Lock `output_dir` (created if missing) for this process's run, or a ConfigError when another run holds it."""
    folder = Path(output_dir).expanduser()
    created = [p for p in (folder, *folder.parents) if not p.exists()]
    check_output_dir(str(output_dir))  # a path that cannot be a folder: one line, before making it
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            return RunLock(folder, None, created)  # no flock on this file system: unlocked, as before
        raise ConfigError(
            f"output dir {str(folder)!r} is in use by another tuneforge run that is still going; wait for it to end "
            "(or stop it), or choose another --output-dir"
        ) from None
    return RunLock(folder, fd, created)
