"""Content fingerprints of the files a run trains on, and the resume's check that they have not changed.

A fingerprint is the SHA-256 of a file's bytes (a folder's: of its files' names and fingerprints). Reading a large
corpus costs seconds per GB, so each large file's digest is remembered in `fingerprints.json` in the cache folder under
(path, size, modification and change times in ns, inode), as git's index does: a file that was rewritten, edited or
replaced has another entry and is read again (the change time also when its modification time was set back, as
`touch -r` does); an unchanged one costs a `stat`. A checkpoint holds the fingerprints of the
run's training inputs (`Progress.data_fingerprints`); resuming onto changed data is refused in one line, unless
`--allow-changed-data`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from tuneforge.errors import DataError

MEMO_NAME = "fingerprints.json"
MEMO_LIMIT = 10_000  # remembered digests (the oldest are forgotten)
MEMO_MIN_BYTES = 32 * 2**20  # smaller files are read again each time (milliseconds), never remembered


def memo_path(cache_dir: str | None) -> Path:
    from tuneforge.data.tokenize import default_cache_dir

    return (Path(cache_dir) if cache_dir else default_cache_dir().parent) / MEMO_NAME


def training_inputs(config) -> dict[str, str]:
    """{what: path} of the files and folders a run trains on: a mixture's sources (local ones), else
    --train-file or --data-dir."""
    data = config.data
    if data.sources:
        return {f"data source {s.name!r}": s.path for s in data.sources if s.path}
    if data.train_file:
        return {"--train-file": data.train_file}
    return {"--data-dir": data.data_dir} if data.data_dir else {}


def fingerprints(config) -> dict[str, str]:
    """{what: fingerprint} of the run's training inputs (those that exist; a missing one is the readers' to report)."""
    memo = Memo(memo_path(config.data.cache_dir))
    out = {what: fingerprint(path, memo) for what, path in training_inputs(config).items() if Path(path).exists()}
    memo.save()
    return out


def fingerprint(path: str | os.PathLike, memo: Memo) -> str:
    p = Path(path)
    if p.is_file():
        return memo.digest(p)
    h = hashlib.sha256()
    for f in sorted(x for x in p.rglob("*") if x.is_file() and not x.name.startswith(".")):
        h.update(f"{f.relative_to(p).as_posix()}\0{memo.digest(f)}\n".encode())
    return h.hexdigest()[:32]


class Memo:
    """The digests of files read before, by (path, size, mtime_ns, ctime_ns, inode); `save` writes it back
    atomically."""

    def __init__(self, path: Path) -> None:
        self.path, self.changed = path, False
        try:
            self.known = json.loads(path.read_text())
        except (OSError, ValueError):
            self.known = {}
        self.known = self.known if isinstance(self.known, dict) else {}

    def digest(self, f: Path) -> str:
        st = f.stat()
        key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"
        if key in self.known:
            return self.known[key]
        try:
            with f.open("rb") as fh:
                digest = hashlib.file_digest(fh, "sha256").hexdigest()[:32]
        except OSError as err:  # a folder's file open() refuses: the run's fingerprint of its inputs needs every one
            raise DataError(
                f"{str(f)!r} cannot be read ({err.strerror}), and the run's record of its training data reads every "
                "file of it; check its permissions or move it out of the folder"
            ) from None
        if st.st_size >= MEMO_MIN_BYTES:
            self.known[key], self.changed = digest, True
        return digest

    def save(self) -> None:
        """Write the memo (the newest MEMO_LIMIT entries); a cache folder that cannot be written only costs time."""
        if not self.changed:
            return
        entries = dict(list(self.known.items())[-MEMO_LIMIT:])
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(entries))
            os.replace(tmp, self.path)


def check_unchanged(
    saved: dict[str, str], now: dict[str, str], checkpoint: str, allow: bool = False, log: Callable = print
) -> None:
    """Resuming from `checkpoint`, whose training inputs had the fingerprints `saved`, onto `now`: one DataError
    line for the first input that changed (or is new, or gone), unless `allow`, which logs what it means instead.
    A checkpoint of before fingerprints (none saved) is not checked."""
    if not saved:
        return
    changed = [what for what in sorted(set(saved) | set(now)) if saved.get(what) != now.get(what)]
    if not changed:
        return
    what = changed[0]
    how = "is not among this run's inputs" if what not in now else "changed" if what in saved else "was not trained on"
    if not allow:
        raise DataError(
            f"{what} {how} since {checkpoint} was written (content fingerprint): the resumed run would not see the "
            "data the interrupted one did; restore it, or pass --allow-changed-data to continue on the data as it "
            "is now"
        )
    log(
        f"warning: {', '.join(changed)} changed since {checkpoint} (--allow-changed-data): the rest of the run follows "
        "the data as it is now; examples of the interrupted epoch may repeat or be missed"
    )
