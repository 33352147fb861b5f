"""Prepared data: tokenized features written once by `tuneforge prepare` as memory-mapped Arrow shards, which every
later run and every rank reads without reading, parsing or tokenizing the raw files again (and without loading the
features whole: Arrow maps the shards from disk).

A prepared folder (CACHE/prepared/KEY) holds one folder per split (`datasets.Dataset.save_to_disk`, in shards of
at most SHARD_BYTES) and meta.json (the label set the features are encoded with, the source's own label set, rows
per split). KEY covers what decides the features: the task and its options, the data settings, the content
fingerprints of every input file the config names (data/fingerprint.py: a changed file is another key) and the
tokenizer's content. A folder is written under a temporary name and renamed when whole, so a killed prepare leaves
nothing a run would read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tuneforge.data.fingerprint import Memo, fingerprint, memo_path
from tuneforge.data.tokenize import default_cache_dir, tokenizer_fingerprint
from tuneforge.errors import DataError

FORMAT = 1  # bumped when what a prepared folder holds changes
SHARD_BYTES = 500 * 2**20
NOT_FEATURE_SETTINGS = ("cache_dir", "group_by_length", "sources", "allow_changed_data", "num_workers")


@dataclass(frozen=True)
class Prepared:
    features: dict  # split -> Dataset (memory-mapped)
    labels: list[str] | None  # the label set the features are encoded with
    own_labels: list[str] | None  # the label set of this data alone (a mixture joins its sources')
    folder: Path


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
    """A prepared folder named as a data source: one DataError line where it was prepared for another task or with
    another tokenizer than this run's (its token ids would mean other tokens)."""
    meta = _meta(folder)
    if meta.get("task") != config.task:
        raise DataError(f"{str(folder)!r} was prepared for --task {meta.get('task')}, not {config.task}")
    if meta.get("tokenizer") != tokenizer_fingerprint(tokenizer):
        raise DataError(
            f"{str(folder)!r} was prepared with another tokenizer than this run's model's: its token ids would be "
            "other tokens; prepare the data again with this model (tuneforge prepare), or train the model it was "
            "prepared for"
        )
    return read_prepared(folder, log)


def _meta(folder: Path) -> dict:
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("rows"), dict):
        raise DataError(f"{str(folder)!r} is not a folder tuneforge prepare wrote (its meta.json is unreadable)")
    return meta


def read_prepared(folder: Path, log) -> Prepared:
    import datasets

    meta = _meta(folder)
    features = {split: datasets.load_from_disk(str(folder / split)) for split in meta["rows"]}
    rows = ", ".join(f"{split} {n:,} rows" for split, n in meta["rows"].items())
    log(f"reading prepared data {folder} ({rows}; memory-mapped, nothing tokenized)")
    return Prepared(features, meta.get("labels"), meta.get("own_labels"), folder)


def save_prepared(config, tokenizer, features: dict, labels, own_labels, log) -> Path:
    """Write `features` (split -> Dataset) as the prepared data of `config`; an existing folder is kept."""
    folder = prepared_root(config.data.cache_dir) / prepared_key(config, tokenizer)
    if (folder / "meta.json").exists():
        log(f"prepared data already at {folder}")
        return folder
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # (our own leftover of a killed prepare of this pid)
    try:
        for split, ds in features.items():
            shards = max(1, min(len(ds), -(-ds.data.nbytes // SHARD_BYTES)))
            ds.save_to_disk(str(tmp / split), num_shards=shards)
        meta = {
            "format": FORMAT,
            "task": config.task,
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "rows": {split: len(ds) for split, ds in features.items()},
            "labels": labels,
            "own_labels": own_labels,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        tmp.replace(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"prepared data written to {folder}")
    return folder
