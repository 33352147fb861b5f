"""Prepared data: tokenized features written once by `tuneforge prepare` as memory-mapped Arrow shards, which every
later run and every rank reads without reading, parsing or tokenizing the raw files again (and without loading the
features whole: Arrow maps the shards from disk).

A prepared folder (CACHE/prepared/KEY) holds one folder per split: Arrow stream files (`datasets`' own format, read
with `Dataset.from_file`) of at most SHARD_BYTES, written in record batches of about RECORD_BYTES, and the split's
`length` column alone as lengths.npy; and meta.json (the label set the features are encoded with, the source's own
label set, the settings that shaped the tokens: max_length, packing, ...; rows and shard files per split). Large
record batches and the separate lengths are what keep a training process's memory flat as the data grows: opening a
mapped Arrow file touches every record batch's header (with the kernel's fault-around, 64 KiB each: 64 bytes per row
at `datasets`' 1,000-row batches), and reading the `length` column from the shards would touch pages of every batch
again. The shards are mapped by this module (not by `datasets`), so that a run can let go of the pages it has read
(`release_pages`): reading a row maps the page cache's whole folio around it (up to 2 MiB on current kernels,
whatever `madvise` says), and over an epoch of random reads a process's resident memory would grow to the size of
the data.

KEY covers what decides the features: the task and its options, the data settings, the content fingerprints of
every input file the config names (data/fingerprint.py: a changed file is another key) and the tokenizer's
content. A folder is written under a temporary name and renamed when whole, so a killed prepare leaves
nothing a run would read.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tuneforge.data.fingerprint import Memo, fingerprint, memo_path
from tuneforge.data.samplers import compact_lengths, lengths_of
from tuneforge.data.tokenize import default_cache_dir, tokenizer_fingerprint
from tuneforge.errors import DataError
from tuneforge.files import room_for

FORMAT = 2  # bumped when what a prepared folder holds changes
SHARD_BYTES = 500 * 2**20
RECORD_BYTES = 32 * 2**20  # rows per record batch: about this many bytes
NOT_FEATURE_SETTINGS = ("cache_dir", "group_by_length", "sources", "allow_changed_data", "num_workers")
# what shapes the tokens whatever the rows: a prepared folder named as a source must be made with the run's values
SHAPING_SETTINGS = ("max_length", "packing", "block_size", "max_target_length", "source_prefix", "doc_stride")


@dataclass(frozen=True)
class Prepared:
    features: dict  # split -> Dataset (memory-mapped)
    labels: list[str] | None  # the label set the features are encoded with
    own_labels: list[str] | None  # the label set of this data alone (a mixture joins its sources')
    folder: Path
    lengths: dict  # split -> its `length` column (numpy), read from lengths.npy
    maps: list  # the shards' memory maps (mmap.mmap), for release_pages


def prepared_root(cache_dir: str | None) -> Path:
    return (Path(cache_dir) if cache_dir else default_cache_dir().parent) / "prepared"


def prepared_key(config, tokenizer) -> str:
    """What decides the features of `config`'s data, hashed."""
    memo = Memo(memo_path(config.data.cache_dir))
    inputs = {flag: fingerprint(path, memo) for flag, path in config.inputs().items() if path and Path(path).exists()}
    memo.save()
    settings = config.data.model_dump(mode="json", exclude=set(NOT_FEATURE_SETTINGS))
    for flag in inputs:  # the files are known by their content, not their names
        settings.pop(flag.removeprefix("--").replace("-", "_"), None)
    what = {
        "format": FORMAT,
        "task": config.task,
        "options": config.task_options.model_dump(mode="json"),
        "data": settings,
        "inputs": inputs,
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


def is_prepared(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder `tuneforge prepare` wrote (a data source may name one directly)."""
    return (Path(path) / "meta.json").is_file() and (Path(path) / "meta.json").stat().st_size < 2**20


def load_prepared(config, tokenizer, log) -> Prepared | None:
    """The prepared features of `config`'s data, where `tuneforge prepare` wrote them; None: not prepared."""
    folder = prepared_root(config.data.cache_dir) / prepared_key(config, tokenizer)
    return read_prepared(folder, log) if (folder / "meta.json").exists() else None


def read_folder(folder: Path, config, tokenizer, log) -> Prepared:
    """A prepared folder named as a data source: one DataError line where it was prepared for another task, with
    another tokenizer than this run's (its token ids would mean other tokens) or other SHAPING_SETTINGS (other
    truncation or packing)."""
    meta = _meta(folder)
    if meta.get("task") != config.task:
        raise DataError(f"{str(folder)!r} was prepared for --task {meta.get('task')}, not {config.task}")
    if meta.get("tokenizer") != tokenizer_fingerprint(tokenizer):
        raise DataError(
            f"{str(folder)!r} was prepared with another tokenizer than this run's model's: its token ids would be "
            "other tokens; prepare the data again with this model (tuneforge prepare), or train the model it was "
            "prepared for"
        )
    given, now = meta.get("settings"), shaping_settings(config)
    if isinstance(given, dict):  # (a folder prepared before the settings were kept in meta.json is not checked)
        for name in sorted(set(given) | set(now)):
            if given.get(name) != now.get(name):
                raise DataError(
                    f"{str(folder)!r} was prepared with {name} {given.get(name)}, this run has {now.get(name)}: its "
                    "features are not this run's; prepare the data again with this run's settings (tuneforge "
                    "prepare), or give the run the folder's"
                )
    return read_prepared(folder, log)


def shaping_settings(config) -> dict:
    """The values of SHAPING_SETTINGS (data settings and task options) that `config` has."""
    values = {**config.data.model_dump(mode="json"), **config.task_options.model_dump(mode="json")}
    return {name: values[name] for name in SHAPING_SETTINGS if name in values}


def _meta(folder: Path) -> dict:
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("shards"), dict):
        raise DataError(f"{str(folder)!r} is not a folder tuneforge prepare wrote (its meta.json is unreadable)")
    return meta


def read_prepared(folder: Path, log) -> Prepared:
    """The features of a prepared folder, memory-mapped; one DataError line where a file of it is missing, cut
    short or holds other rows than its meta.json says (a copy or a disk went wrong)."""
    meta = _meta(folder)
    features, lengths, maps = {}, {}, []
    for split, files in meta["shards"].items():
        features[split], lengths[split] = _read_split(folder, split, files, meta.get("rows", {}).get(split), maps)
    rows = ", ".join(f"{split} {n:,} rows" for split, n in meta["rows"].items())
    log(f"reading prepared data {folder} ({rows}; memory-mapped, nothing tokenized)")
    return Prepared(features, meta.get("labels"), meta.get("own_labels"), folder, lengths, maps)


def _read_split(folder: Path, split: str, files: list[str], rows: int | None, maps: list):
    """One split's features and lengths (its shards' maps added to `maps`)."""
    import datasets

    where = f"{split}/{files[0] if files else 'lengths.npy'}"
    try:
        parts = []
        for name in files:
            where = f"{split}/{name}"
            table, mapped = _open_shard(folder / split / name)
            maps.append(mapped)
            parts.append(datasets.Dataset(table, fingerprint=f"prepared-{folder.name}-{split}-{name}"))
        features = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        where = f"{split}/lengths.npy"
        lengths = np.load(folder / split / "lengths.npy")
    except (OSError, ValueError) as err:  # (pyarrow's ArrowInvalid is a ValueError, its ArrowIOError an OSError)
        why = getattr(err, "strerror", None) or (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise DataError(_damaged(folder, where, why)) from None
    if not (rows == len(features) == len(lengths)):
        held = f"{len(features):,} rows and {len(lengths):,} lengths"
        raise DataError(_damaged(folder, f"{split}/", f"it holds {held}, meta.json says {rows}"))
    return features, lengths


def _damaged(folder: Path, where: str, why: str) -> str:
    return (
        f"prepared data {str(folder)!r} is damaged ({where}: {why}); remove the folder and prepare it again "
        "(tuneforge prepare)"
    )


def _open_shard(path: Path):
    """The shard's table, its buffers in a read-only memory map of the file (nothing is read until a row is), and
    that map."""
    import pyarrow as pa
    from datasets.table import InMemoryTable

    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    # (InMemoryTable: a table `datasets` did not open itself; its buffers are the map's, not copies)
    return InMemoryTable(pa.ipc.open_stream(pa.py_buffer(mapped)).read_all()), mapped


def release_pages(maps: list) -> None:
    """Let go of the pages of `maps` this process has read: they stay in the page cache (a later read maps them
    again, without reading the disk), but no longer count as its resident memory."""
    for mapped in maps:
        mapped.madvise(mmap.MADV_DONTNEED)


def save_prepared(config, tokenizer, features: dict, labels, own_labels, log) -> Path:
    """Write `features` (split -> Dataset) as the prepared data of `config`; an existing folder is kept."""
    folder = prepared_root(config.data.cache_dir) / prepared_key(config, tokenizer)
    if (folder / "meta.json").exists():
        log(f"prepared data already at {folder}")
        return folder
    # a name no other process takes: containers or nodes sharing the cache may run prepares under one process id
    # (made by write_split as any folder, so the umask decides who may read it, not mkdtemp's owner-only mode)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    with room_for(folder, "the prepared data folder", " or choose another --cache-dir"):
        try:
            shards = {split: write_split(ds, tmp / split) for split, ds in features.items()}
            meta = {
                "format": FORMAT,
                "task": config.task,
                "tokenizer": tokenizer_fingerprint(tokenizer),
                "settings": shaping_settings(config),
                "rows": {split: len(ds) for split, ds in features.items()},
                "shards": shards,
                "labels": labels,
                "own_labels": own_labels,
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
            placed = move_into_place(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log(f"prepared data written to {folder}" if placed else f"prepared data already at {folder} (written meanwhile)")
    return folder


def move_into_place(tmp: Path, folder: Path) -> bool:
    """Rename the whole folder `tmp` to `folder`; False (and `tmp` removed) where another process preparing the
    same data at the same time put its own there first: it holds the same features."""
    try:
        tmp.replace(folder)
    except OSError:  # (renaming onto a folder that is not empty)
        if not (folder / "meta.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    return True


def write_split(ds, folder: Path) -> list[str]:
    """`ds` as Arrow stream files of at most SHARD_BYTES in `folder`, in record batches of about RECORD_BYTES, and
    its `length` column as lengths.npy; the files' names."""
    import pyarrow as pa

    folder.mkdir(parents=True)
    row_bytes = max(1, ds.data.nbytes // max(1, len(ds)))
    shards = max(1, min(len(ds), -(-ds.data.nbytes // SHARD_BYTES)))
    per_shard, per_batch = max(1, -(-len(ds) // shards)), max(1, RECORD_BYTES // row_bytes)
    schema = ds.features.arrow_schema
    names = []
    for shard, start in enumerate(range(0, max(1, len(ds)), per_shard)):
        names.append(f"data-{shard:05d}-of-{shards:05d}.arrow")
        part = ds.select(range(start, min(len(ds), start + per_shard))).with_format("arrow")
        with pa.OSFile(str(folder / names[-1]), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for table in part.iter(batch_size=per_batch):
                writer.write_table(table.cast(schema).combine_chunks())
    np.save(folder / "lengths.npy", compact_lengths(lengths_of(ds)))
    return names
