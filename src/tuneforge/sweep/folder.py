"""The sweep folder: what a sweep writes there (`is_sweep_entry`), the checks before any work (`check_folder`: a
folder of someone else's files is refused, an earlier sweep needs --resume or --overwrite, --resume needs the same
sweep), its record (sweep.yaml: the base config, the space, the objective and the sampler's settings, so that a
resumed sweep is the one that was started), --overwrite's clearing (only what a sweep wrote: its files, and in the
trial folders the run's entries and the sweep's two files), and the lock that keeps a second sweep process out.

The lock is an flock on sweep.lock, held while the sweep runs; the trials' child processes share it, so a resumed
sweep waits until the trials of a killed one have ended (they get SIGTERM when their sweep dies) before it continues
them.
"""

from __future__ import annotations

import fcntl
import os
import re
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

from tuneforge.errors import ConfigError
from tuneforge.files import discard, write_text
from tuneforge.paths import check_output_dir, run_entries
from tuneforge.sweep.outputs import BEST, PLOTS, TABLE
from tuneforge.sweep.trial import TRIAL_FILES

RECORD = "sweep.yaml"
LOCK = "sweep.lock"
DATABASE = "study.db"  # the default storage: sqlite:///SWEEP_DIR/study.db
SWEEP_FILES = (RECORD, LOCK, TABLE, BEST, *PLOTS, DATABASE, *(f"{DATABASE}-{s}" for s in ("journal", "wal", "shm")))
TRIAL_NAME = re.compile(r"trial-\d{4,}")
RESUME_LOCK_WAIT_S = 60.0  # how long --resume waits for a killed sweep's trials to end
# what must be the same for --resume to continue a sweep (the number of trials, --parallel, --keep-best may change)
SAME_ON_RESUME = ("base", "space", "metric", "direction", "seed", "sampler", "pruner", "storage", "study_name")


def is_sweep_entry(entry: Path) -> bool:
    """`entry` (a child of a sweep folder) is one a sweep writes there: by name and kind."""
    if entry.is_symlink():
        return False
    if entry.name in SWEEP_FILES:
        return entry.is_file()
    return bool(TRIAL_NAME.fullmatch(entry.name)) and entry.is_dir()


def default_storage(out: Path) -> str:
    """sqlite:///SWEEP_DIR/study.db, its path quoted: SQLAlchemy reads a '?' in a URL as the start of its query and
    a '%' as an escape, so a folder named with either put the study elsewhere (or nowhere)."""
    return f"sqlite:///{quote(str((out / DATABASE).resolve()))}"


def read_record(out: Path) -> dict[str, Any] | None:
    """The sweep's record in folder `out` (None where there is none)."""
    path = out / RECORD
    if not path.is_file():
        return None
    try:
        record = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError):
        record = None
    if not isinstance(record, dict):
        raise ConfigError(f"{str(path)!r} is not a sweep record tuneforge can read; pass --overwrite to start again")
    return record


def check_folder(out: Path, resume: bool, overwrite: bool, record: dict[str, Any]) -> None:
    """Before any work: the folder can be written; --resume finds the same sweep there; otherwise an earlier sweep
    needs --overwrite, and a folder of other files is refused unless --overwrite (they stay: nothing but a sweep's
    own entries is ever removed)."""
    check_output_dir(str(out))
    entries = sorted(out.iterdir()) if out.is_dir() else []
    earlier = read_record(out)
    if resume:
        if earlier is None:
            raise ConfigError(f"--resume: {str(out)!r} holds no sweep to continue (no {RECORD}); drop --resume")
        _check_same(out, earlier, record)
        return
    # without its record no sweep wrote there (a sweep writes it first): only a lock of one killed before it
    ours = [e for e in entries if is_sweep_entry(e) and (earlier is not None or e.name == LOCK)]
    if ours and not overwrite:
        raise ConfigError(
            f"sweep folder {str(out)!r} already holds a sweep; pass --resume to continue it, or --overwrite to start "
            "it again"
        )
    foreign = [e.name for e in entries if e not in ours]
    if foreign and not overwrite:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ConfigError(
            f"sweep folder {str(out)!r} holds files a sweep does not write ({shown}); choose another --output-dir "
            "(or pass --overwrite to write beside them: they are never removed)"
        )
    clashes = [e.name for e in entries if (e.name in SWEEP_FILES or TRIAL_NAME.fullmatch(e.name)) and e.name in foreign]
    if clashes:
        raise ConfigError(
            f"sweep folder {str(out)!r} holds {clashes[0]!r}, which is not what a sweep writes under that name; move "
            "it or choose another --output-dir"
        )


def _check_same(out: Path, earlier: dict[str, Any], record: dict[str, Any]) -> None:
    for key in SAME_ON_RESUME:
        if earlier.get(key) != record.get(key):
            what = {"base": "base config", "storage": "--storage", "study_name": "--study-name"}.get(key, key)
            raise ConfigError(
                f"--resume: the sweep in {str(out)!r} was started with another {what} (see its {RECORD}); resume it "
                "with the same config, space and settings, or pass --overwrite to start again"
            )


def prepare(out: Path, resume: bool, overwrite: bool, record: dict[str, Any]) -> int:
    """Create the folder, take its lock (returns the lock's file descriptor, held for the sweep's life), clear an
    earlier sweep (--overwrite) and write the record (not on --resume)."""
    out.mkdir(parents=True, exist_ok=True)
    held = lock(out, wait=RESUME_LOCK_WAIT_S if resume else 0.0)
    if overwrite:
        clear(out)
    if not resume:
        header = "# a tuneforge sweep (written by tuneforge sweep; --resume checks that it continues this sweep)\n"
        write_text(out / RECORD, header + yaml.safe_dump(record, sort_keys=False))
    return held


def lock(out: Path, wait: float) -> int:
    """An exclusive flock on out/sweep.lock, waited for up to `wait` seconds; one line where it stays taken."""
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    deadline, told = time.monotonic() + wait, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise ConfigError(
                    f"another sweep process (or a trial it started) is working in {str(out)!r}; wait for it to end "
                    "or stop it, then try again"
                ) from None
            if not told:
                print(f"waiting for the trials of the earlier sweep in {out} to end", file=sys.stderr, flush=True)
                told = True
            time.sleep(0.2)


def clear(out: Path) -> None:
    """--overwrite: remove what a sweep wrote in `out` (the lock stays: it is held); other files stay."""
    for entry in sorted(out.iterdir()):
        if not is_sweep_entry(entry) or entry.name == LOCK:
            continue
        if entry.is_file():
            entry.unlink()
            continue
        for inner in run_entries(entry):
            discard(inner) if inner.is_dir() else inner.unlink()
        for name in TRIAL_FILES:
            if (entry / name).is_file() and not (entry / name).is_symlink():
                (entry / name).unlink()
        if not any(entry.iterdir()):
            entry.rmdir()
