"""Batched tokenization cached on disk with `datasets.map`.

The cache key covers the raw data's content, the tokenizer's content (vocabulary, merges,
normalisation, special tokens) and the task's settings (max_length, truncation, columns), so a
second identical run reuses the cache and any other tokenizer or setting never does.

Cuts: `encode_within` truncates a batch to a task's length limit and says which rows it cut; the task keeps those
flags as a column of its cached features (so a cached run counts them again without tokenizing), and `report_cuts`
turns them into one log line per split (how many of how many rows, the limit, the flag to raise) and drops them.
A predictor keeps the `CutCount` of its last inputs, which `tuneforge predict` says in one note line;
`check_room_for_text` refuses a predictor's or generator's limit that holds no text beside the special tokens.

A process that reads a key's files holds a shared lock on the key's lock file (`.KEY.lock`) until it ends, as
data/mapped.py does for the raw Arrow copies: `tuneforge prepare` removes the files it copied into prepared shards
(`drop_key`) only where no other process holds them (a run of the same data, a second rank about to open them).

A map with workers (`--num-workers N`) forks them, and datasets' process serving their queue, so that they end with
the run however it ends (a kill of the run alone left them running, holding its folder's lock) and leave Ctrl-C to
it (the terminal sends it to every process: each worker printed its traceback, and datasets' wait for them turned
the interrupt into a TimeoutError or a hang); the run stops them. A SIGTERM (the run's end, or a scheduler's stop of
every process of a job) ends a worker by SystemExit, quietly: it lets go of the pool's locks and removes the
temporary file it was writing (see stops.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import signal
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuneforge import stops
from tuneforge.data import reading
from tuneforge.errors import ConfigError
from tuneforge.files import NO_ROOM
from tuneforge.processes import end_with_parent

if TYPE_CHECKING:
    import datasets

KEY_CHARS = 32  # a cache file's name begins with its key: hex digits of the hash of data, tokenizer and settings
SHARD_SUFFIX = re.compile(r"_(\d{5})_of_(\d{5})\.arrow")  # datasets' name of a shard a map with workers writes


def default_cache_dir() -> Path:
    from tuneforge.launch import env_flag

    root = env_flag("TUNEFORGE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tuneforge")
    return Path(root) / "tokenized"


class _Digest(io.RawIOBase):
    """A write-only stream that only hashes what it is given."""

    def __init__(self) -> None:
        self.hash = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.hash.update(data)
        return len(data)


def dataset_fingerprint(ds: datasets.Dataset, rows_at_once: int = 100_000) -> str:
    """Content hash of a dataset's rows (the Arrow IPC bytes of its table, written to the hash a slice at a time:
    a large dataset is never copied whole into memory; a selected or shuffled view hashes the rows it shows). Each
    slice is one record batch, so the same rows read in memory or memory-mapped in other chunks hash the same."""
    import pyarrow as pa

    sink = _Digest()
    view = ds.with_format("arrow")
    schema = ds.with_format(None).data.table.schema
    with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), schema) as writer:
        for start in range(0, len(ds), rows_at_once):
            writer.write_table(view[start : start + rows_at_once].cast(schema).combine_chunks())  # (not the layout)
    return sink.hash.hexdigest()[:24]


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        # truncation/padding are per-call settings that a previous call leaves behind, not content
        state["truncation"] = state["padding"] = None
        h.update(json.dumps(state, sort_keys=True).encode())
    else:  # slow (python) tokenizers: vocabulary + class
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(type(tokenizer).__name__.encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    h.update(str(getattr(tokenizer, "padding_side", "")).encode())
    return h.hexdigest()[:24]


def encode_within(tokenizer, inputs: dict, limit: int | None) -> tuple[Any, list[bool]]:
    """`tokenizer(**inputs, truncation=True, max_length=limit)` (None: the tokenizer's own limit) and which rows it
    cut. A fast tokenizer keeps what a cut left over on each encoding (`overflowing`), so this costs nothing more."""
    if not tokenizer.is_fast:
        return _slow_encode_within(tokenizer, inputs, limit or tokenizer.model_max_length)
    enc = tokenizer(**inputs, truncation=True, max_length=limit)
    return enc, [bool(encoding.overflowing) for encoding in enc.encodings]


def check_room_for_text(max_length: int, tokenizer, texts: int = 1) -> None:
    """ConfigError where `max_length` leaves no token for a text of an input of `texts` texts (2: a pair) beside the
    special tokens the tokenizer adds: the tokenizer would cut every text to nothing, or, below the special tokens,
    cut nothing and pass the input whole (past the model's positions)."""
    added = tokenizer.num_special_tokens_to_add(pair=texts == 2)
    if max_length < added + texts:
        what = "a text pair" if texts == 2 else "a text"
        raise ConfigError(
            f"--max-length {max_length} leaves no room for {what}: its tokenizer adds {added} special tokens to "
            f"each input; give at least {added + texts}"
        )


def _slow_encode_within(tokenizer, inputs: dict, limit: int) -> tuple[dict, list[bool]]:
    """encode_within for a slow tokenizer (no encodings): to one token more first, and only the rows that reach it
    again (each encoded from its whole text, as a direct call would)."""
    enc = dict(tokenizer(**inputs, truncation=True, max_length=limit + 1))
    cut = [len(ids) > limit for ids in enc["input_ids"]]
    rows = [i for i, was_cut in enumerate(cut) if was_cut]
    if rows:
        texts = {key: [value[i] for i in rows] if isinstance(value, list) else value for key, value in inputs.items()}
        again = tokenizer(**texts, truncation=True, max_length=limit)
        for key, values in enc.items():
            for i, value in zip(rows, again[key]):
                values[i] = value
    return enc, cut


@dataclass(frozen=True)
class Cut:
    """One kind of cut a task reports: the features' column of per-row flags, what a row is ("sources"), the
    limit's name and value, the flag that raises it, and the end kept ("first", or "last" for a cut from the left)."""

    column: str
    rows: str
    name: str
    limit: int
    flag: str
    kept: str = "first"


def report_cuts(split: str, feats: datasets.Dataset, cuts: list[Cut], log: Callable[[str], None]) -> datasets.Dataset:
    """One log line when `feats` has rows cut by any of `cuts` (how many of how many, each limit and its flag);
    the features without the flag columns."""
    import pyarrow.compute as pc

    said, flags = [], []
    for cut in cuts:
        count = int(pc.sum(feats.data.column(cut.column)).as_py() or 0)
        if count:
            said.append(cut_phrase(count, len(feats), cut.rows, cut.name, cut.limit, cut.kept))
            flags.append(cut.flag)
    if said:
        log(f"{split}: {', '.join(said)} (raise {' / '.join(flags)} to keep them whole)")
    return feats.remove_columns([cut.column for cut in cuts])


@dataclass(frozen=True)
class CutCount:
    """How many of a predictor's last inputs it cut to its max_length (what `tuneforge predict` says in a note line;
    the predictions themselves say nothing of it), in a report's words (`str`)."""

    count: int
    total: int
    rows: str
    limit: int
    kept: str = "first"

    def __str__(self) -> str:
        return cut_phrase(self.count, self.total, self.rows, "max_length", self.limit, self.kept)


def cut_phrase(count: int, total: int, rows: str, name: str, limit: int, kept: str = "first") -> str:
    """ "3 of 10 sources longer than max_length 128 tokens cut to their first 128": a report's words for one cut."""
    return f"{count} of {total} {rows} longer than {name} {limit} tokens cut to their {kept} {limit}"


def cached_map(
    ds: datasets.Dataset,
    fn: Callable[[dict[str, list]], dict[str, list]],
    *,
    tokenizer,
    settings: dict[str, Any],
    cache_dir: str | Path | None,
    desc: str,
    log: Callable[[str], None] = print,
    num_proc: int = 1,
) -> datasets.Dataset:
    key_src = json.dumps(
        {"data": dataset_fingerprint(ds), "tok": tokenizer_fingerprint(tokenizer), "settings": settings},
        sort_keys=True,
        default=str,
    )
    key = hashlib.sha256(key_src.encode()).hexdigest()[:KEY_CHARS]
    folder = Path(cache_dir) if cache_dir else default_cache_dir()
    if not cache_dir:  # (--cache-dir is checked with the other flags, before any work)
        from tuneforge.paths import check_output_dir

        check_output_dir(str(folder), "TUNEFORGE_CACHE (or --cache-dir)", "tokenization cache")
    created = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    hold(folder, key)  # (before the files are looked for: a prepare ending now keeps them)
    path = folder / f"{key}.arrow"
    if is_cached(folder, key):
        log(f"{desc}: reusing tokenized cache {path if path.exists() else folder / f'{key}_*.arrow'}")
    else:
        log(f"{desc}: tokenizing {len(ds)} examples (cached at {path})")
    try:
        with _forking_workers(folder):
            return ds.map(
                fn,
                batched=True,
                batch_size=1000,
                remove_columns=ds.column_names,
                cache_file_name=str(path),
                load_from_cache_file=True,
                new_fingerprint=key,
                desc=desc,
                num_proc=num_proc if num_proc > 1 and len(ds) >= 2 * num_proc else None,
            )
    except BaseException as err:  # a row the map function refused: leave no cache folder this call made
        _let_go(folder, key)
        for made in created:  # innermost first; a folder something else wrote into stays
            with contextlib.suppress(OSError):
                made.rmdir()
        if isinstance(err, OSError) and err.errno in NO_ROOM:
            raise ConfigError(
                f"{desc}: the tokenization cache {str(folder)!r} has no room for the features ({err.strerror}); "
                "free space there or choose another --cache-dir"
            ) from None
        if isinstance(err.__context__, KeyboardInterrupt):  # datasets' 0.05 s wait for the workers, after Ctrl-C
            raise err.__context__ from None  # (or a stop by SIGTERM: stops.StoppedBySignal)
        raise


_forking_for: list[tuple[int, int, Path]] = []  # (pid, thread, cache folder) of a map inside `_forking_workers`


@contextlib.contextmanager
def _forking_workers(folder: Path):
    """Processes forked inside the block are the map's, writing into `folder`: they end with this one, removing
    what they were writing, and ignore SIGINT (see the module's docstring)."""
    _forking_for.append((os.getpid(), threading.get_ident(), folder))
    try:
        yield
    finally:
        _forking_for.pop()


def _as_map_worker() -> None:
    if _forking_for:
        parent, thread, folder = _forking_for[-1]
        _forking_for.clear()  # (what the worker forks in turn is not the map's)
        if threading.get_ident() != thread:
            # forked by the pool's thread: a replacement for a worker that died, in a map that fails for it (datasets:
            # 'One of the subprocesses has abruptly died'); one that lived would die at that thread's end (the
            # parent-death signal is the forking thread's), maybe holding the task queue's lock, and the pool's
            # terminate waited for it for ever
            os._exit(1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stops.exit_on_stop_in_child(lambda: _remove_open_temporaries(folder))
        end_with_parent(parent)


def _remove_open_temporaries(folder: Path) -> None:
    """The files named tmp* in `folder` that this process holds open: datasets' features of a worker's shard being
    written (datasets removes it on an exception, not on SystemExit, and not once its manager's queue is gone)."""
    where = Path(os.path.realpath(folder))  # as /proc names it
    with contextlib.suppress(OSError):  # (no /proc: not Linux)
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = Path(os.readlink(f"/proc/self/fd/{fd}"))
                if target.parent == where and target.name.startswith("tmp"):
                    target.unlink()


os.register_at_fork(after_in_child=_as_map_worker)


def is_cached(folder: Path, key: str) -> bool:
    """Whether the features of `key` are in the cache folder whole: its file, or each shard of a map with workers
    (datasets reads those back whatever the number of workers asked now)."""
    if (folder / f"{key}.arrow").exists():
        return True
    shards = [SHARD_SUFFIX.fullmatch(f.name[len(key) :]) for f in folder.glob(f"{key}_*_of_*.arrow")]
    counts = Counter(match.group(2) for match in shards if match)
    return any(int(total) == found for total, found in counts.items())


def _lock_file(folder: Path, key: str) -> Path:
    return folder.resolve() / f".{key}.lock"


def hold(folder: Path, key: str) -> None:
    """Mark the files of `key` as read by this process while it lives (data/reading.py), which another process's
    `drop_key` respects."""
    reading.hold(_lock_file(folder, key))


def _let_go(folder: Path, key: str) -> None:
    """This process's hold on `key` given up (its map failed), and the lock file removed where no other process
    holds it and no file of the key is there."""
    lock = _lock_file(folder, key)
    fd = reading.exclusive(lock) if reading.held(lock) else None
    if fd is None:
        return
    try:
        if not any(folder.glob(f"{key}*.arrow")):
            lock.unlink()
    finally:
        os.close(fd)


def drop_key(folder: Path, key: str) -> int | None:
    """Remove the cache files of `key` in `folder` (bytes freed: its file, the shards of a map with workers, the
    blocks cut from them) and its lock file; None where another process holds them (all kept)."""
    lock = _lock_file(folder, key)
    fd = reading.exclusive(lock)
    if fd is None:  # another process reads the files
        return None
    try:
        freed = 0
        for f in (f for f in folder.glob(f"{key}*.arrow") if f.is_file()):
            freed += f.stat().st_size
            f.unlink()
        lock.unlink()
        return freed
    finally:
        os.close(fd)
