"""Large local files read without holding them in memory: a JSON-lines, parquet or plain-text file from
LARGE_FILE_BYTES on is converted once by `datasets`' own builders (which read and write it a block at a time) into
Arrow files under the cache folder's `raw/`, and used memory-mapped; a reader of tuneforge's own (chat rows, checked
a line at a time) writes its rows there through `datasets.Dataset.from_generator` (`rows_mapped`). Tokenizing
workers then receive the file's path, not a pickled copy of the rows, and `tuneforge prepare` of a source larger
than the machine's memory stays within a few hundred MiB (benchmarks/README.md, "Data at scale").

Smaller files, compressed files, CSV/TSV and JSON arrays are read in memory as before (`sources.read_table`): this
path is only the bounded one. `drop_raw_copies` removes the Arrow copy of a file once `tuneforge prepare` has
written its prepared shards, unless another process reads it: a process that read a copy holds a shared lock on a
file in it until the process ends (its tokenizing workers open the copy again by its path).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from pathlib import Path

from tuneforge.data import reading
from tuneforge.errors import DataError, UserError

LARGE_FILE_BYTES = 64 * 2**20  # from this size on a file is read memory-mapped (and JSON lines by Arrow's reader)
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def raw_root(cache_dir: str | None) -> Path:
    """Where the raw Arrow copies live: beside the tokenization cache (the same rule as prepared shards)."""
    from tuneforge.data.tokenize import default_cache_dir

    return (Path(cache_dir) if cache_dir else default_cache_dir().parent) / "raw"


def raw_folder(path: str | Path, cache_dir: str | None) -> Path:
    """The folder of one file's Arrow copy: keyed by the file's resolved path, size, modification and change times
    and inode, so an edited or replaced file is converted again and never read from a stale copy (the change time
    also where its modification time was set back, as `touch -r` does)."""
    p = Path(path).resolve()
    stat = p.stat()
    identity = f"{p}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ctime_ns}\0{stat.st_ino}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:32]
    return raw_root(cache_dir) / key


def is_large(path: str | Path, share: float = 1.0) -> bool:
    """Whether `path` is read memory-mapped: an uncompressed JSON-lines, parquet or text file of LARGE_FILE_BYTES
    (times `share`: a reader whose rows cost more in memory takes a smaller share) or more (JSON lines without a
    byte-order mark; a .json file holding one array is read whole)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in BUILDERS or not p.is_file() or p.stat().st_size < LARGE_FILE_BYTES * share:
        return False
    if BUILDERS[suffix] == "parquet":
        return True
    with p.open("rb") as fh:
        head = fh.read(4096)
    if head.startswith(b"\xef\xbb\xbf") or head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return False  # (the in-memory readers own the encoding errors)
    return BUILDERS[suffix] == "text" or not head.lstrip().startswith(b"[")


def read_mapped(path: str | Path, cache_dir: str | None):
    """`path` as a memory-mapped `datasets.Dataset` (one split, the file's rows in order), converted on first use.
    One DataError line for a file that cannot be parsed, has mixed value types or holds no rows."""
    import datasets

    p = Path(path)
    builder = BUILDERS[p.suffix.lower()]
    if p.stat().st_size == 0:
        raise DataError(f"file {str(p)!r} has no examples; it needs at least one row")
    options = {"json": {"on_mixed_types": None}, "text": {"keep_linebreaks": True, "encoding": "utf-8"}}
    folder = raw_folder(p, cache_dir)
    ds = _built(
        p,
        folder,
        builder,
        lambda: datasets.load_dataset(
            builder,
            data_files={"train": str(p.resolve())},
            split="train",
            cache_dir=str(folder),
            **options.get(builder, {}),
        ),
    )
    if len(ds) == 0:
        raise DataError(f"file {str(p)!r} has no examples; it needs at least one row")
    hold(folder)
    return ds


def rows_mapped(path: str | Path, cache_dir: str | None, tag: str, generator, features, **options):
    """The rows `generator(path, **options)` makes of a large file (a reader of tuneforge's own: chat rows checked
    a line at a time), written a batch at a time and memory-mapped, kept under the file's raw folder as `tag` (what
    the rows depend on besides the file). A user error the generator raises is raised as it is."""
    import datasets

    p = Path(path)
    folder = raw_folder(p, cache_dir) / tag
    ds = _built(
        p,
        folder,
        "rows",
        lambda: datasets.Dataset.from_generator(
            generator, features=features, gen_kwargs={"path": str(p.resolve()), **options}, cache_dir=str(folder)
        ),
    )
    hold(folder.parent)
    return ds


def _lock_file(folder: Path) -> Path:
    return folder / ".reading.lock"


def hold(folder: Path) -> None:
    """Mark the raw folder as read by this process while it lives (data/reading.py), which another process's
    `drop_raw_copies` respects."""
    reading.hold(_lock_file(folder))


def _built(p: Path, folder: Path, kind: str, build):
    """`build()`, datasets' logging quiet; on failure the folders it made removed and one error line: the user
    error the reader raised, else the parser's own message."""
    created = [f for f in (folder, *folder.parents) if not f.exists()]
    library_log = logging.getLogger("datasets")  # (its JSON reader logs the parser's error, then raises it)
    level = library_log.level
    library_log.setLevel(logging.CRITICAL)
    try:
        return build()
    except Exception as err:  # DatasetGenerationError around ArrowInvalid / UnicodeDecodeError / a DataError
        _remove(created)
        user = _user_error(err, UserError)
        if user is not None:
            raise user from None
        raise DataError(f"file {str(p)!r} could not be read as {kind} ({_reason(err)}); check the file") from None
    finally:
        library_log.setLevel(level)


def _user_error(err: BaseException | None, kind):
    while err is not None and not isinstance(err, kind):
        err = err.__cause__ or err.__context__
    return err


def _remove(created: list[Path]) -> None:
    """The folders a failed conversion made, innermost first (a folder something else wrote into stays)."""
    if created:
        shutil.rmtree(created[0], ignore_errors=True)
    for made in created[1:]:
        with contextlib.suppress(OSError):
            made.rmdir()


def _reason(err: BaseException) -> str:
    """The parser's own error, first line: datasets wraps it in a generic one (and its JSON reader's fallback then
    fails with a vaguer one, chained after)."""
    while type(err).__module__.startswith("datasets") and (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


def drop_raw_copies(paths, cache_dir: str | None) -> int:
    """Remove the Arrow copies made of `paths` (bytes freed); nothing else under the cache folder, and no copy
    another process reads (a run, another prepare)."""
    freed = 0
    for path in paths:
        if not Path(path).is_file():
            continue
        folder = raw_folder(path, cache_dir)
        if folder.is_dir():
            freed += _drop_unless_read(folder)
    return freed


def _drop_unless_read(folder: Path) -> int:
    """Remove `folder` (bytes freed), where no other process holds its lock (0: kept)."""
    fd = reading.exclusive(_lock_file(folder))
    if fd is None:  # another process reads the copy
        return 0
    try:
        freed = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        shutil.rmtree(folder)
        return freed
    finally:
        os.close(fd)
