"""What a run trains and evaluates on: the tokenized training and validation features, and for a mixture of
sources (`data.sources`) the mixture that orders each epoch, each source's validation features, and the content
fingerprints of the training inputs that a checkpoint keeps.

A mixture reads each source as the run's task reads a training file (`--train-file`, or `--data-dir` for a folder;
the source's `options` on top of the run's task options, so each source has its own format), or takes a hub
dataset's split through the task's `prepare_raw`. Each source's validation rows are the run's --validation-file
when one is given, else the source's own `validation_file`, else 10% held out of the source as the task does for a
lone training file; the run evaluates on all of them together and, with several sources, on each one alone too
(metrics `NAME/loss`, ...). The sources' features lie one after the other; `data.mixture.Mixture` orders them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tuneforge.data.fingerprint import fingerprints
from tuneforge.data.mixture import Mixture, share_out
from tuneforge.data.prepared import is_prepared, load_prepared, read_folder, release_pages, save_prepared
from tuneforge.data.samplers import compact_lengths, lengths_of
from tuneforge.errors import DataError, UserError

RELEASE_EVERY = 4  # batches read between two releases of the shards' pages


@dataclass
class TrainingData:
    train: Any  # training features (a Dataset with a `length` column), or None
    evals: Any  # validation features, or None
    mixture: Mixture | None = None  # data.sources: the mixture that orders each epoch
    eval_parts: dict[str, Any] = field(default_factory=dict)  # source name -> its validation features (2+ sources)
    fingerprints: dict[str, str] = field(default_factory=dict)  # training input -> content fingerprint
    train_lengths: np.ndarray | None = None  # the training features' `length` column (prepared data stores it)
    maps: list = field(default_factory=list)  # the memory maps of prepared shards the features read
    batches_read: int = 0

    @property
    def epoch_rows(self) -> int:
        """Examples in one training epoch."""
        return self.mixture.epoch_rows if self.mixture else len(self.train)

    def length_column(self) -> np.ndarray:
        """The training features' lengths, 2 bytes each where they fit: prepared data's stored column (read from
        the mapped shards, the column would page in part of every record batch), else read from the features once."""
        if self.train_lengths is None or len(self.train_lengths) != len(self.train):
            self.train_lengths = compact_lengths(lengths_of(self.train))
        return self.train_lengths

    def release_pages(self) -> None:
        """Told after each batch is read: every RELEASE_EVERY batches, let go of the pages of prepared shards read
        since (data/prepared.py), so a run's memory stays flat however large the data (the rows' next reads come
        from the page cache). Not after every batch: releasing each time made a step ~15% slower."""
        self.batches_read += 1
        if self.batches_read % RELEASE_EVERY == 0:
            release_pages(self.maps)


def load_single(task, tokenizer, splits, log, save: bool = False) -> TrainingData:
    """The features of the config's data files (--train-file, --validation-file, --data-dir, ...): prepared ones
    where `tuneforge prepare` wrote them, else read and tokenized (and, with `save`, written as prepared)."""
    prepared = load_prepared(task.config, tokenizer, log)  # (prepare again: nothing to do)
    lengths, maps = None, []
    if prepared is not None:
        task.use_labels(prepared.labels)
        feats, lengths, maps = prepared.features, prepared.lengths.get("train"), prepared.maps
    else:
        raw = task.load_raw()
        labels = task.label_set(raw)  # the label set, decided from the raw training split
        task.use_labels(labels)
        raw = {k: v for k, v in task.encode_labels(raw).items() if k in splits}
        feats = task.tokenize(raw, tokenizer, log=log)
        if save:
            save_prepared(task.config, tokenizer, dict(feats), labels, labels, log)
    train, evals = (task.select_examples(split, feats.get(split)) for split in ("train", "validation"))
    if "train" not in splits:
        return TrainingData(None, evals, fingerprints=fingerprints(task.config), maps=maps)
    lengths = lengths[: len(train)] if lengths is not None else None  # (select_examples keeps the first rows)
    return TrainingData(train, evals, fingerprints=fingerprints(task.config), train_lengths=lengths, maps=maps)


def load_mixture(task, config, tokenizer, log, save: bool = False) -> TrainingData:
    """The features of `config.data.sources`, mixed; `task` adopts the label set of all sources together. Each
    source's prepared features are read where `tuneforge prepare` wrote them (with `save`, they are written)."""
    from tuneforge.configure import build_config, source_options

    sources = config.data.sources
    subs = [
        _named(s, lambda s=s: type(task)(build_config(config.given_values(_read_as(config, s, source_options)))))
        for s in sources
    ]
    read = []
    for source, sub in zip(sources, subs):
        sub.log = _prefixed(log, source.name)
        if _given_prepared(source):  # a folder tuneforge prepare wrote
            prepared = _named(
                source, lambda s=source, sub=sub: read_folder(Path(s.path), sub.config, tokenizer, sub.log)
            )
        else:
            prepared = load_prepared(sub.config, tokenizer, sub.log)
        raw = None if prepared else _named(source, lambda s=source, sub=sub: _read_source(s, sub, config))
        own = prepared.own_labels if prepared else _named(source, lambda sub=sub, raw=raw: sub.label_set(raw))
        read.append((prepared, raw, own))
    labels = _union([own for _, _, own in read])
    task.use_labels(labels)
    feats = [_features(s, sub, *got, labels, tokenizer, config, save) for s, sub, got in zip(sources, subs, read)]
    train = _concatenate([f["train"] for f in feats], sources)
    stored = [got[0].lengths.get("train") if got[0] and f is got[0].features else None for got, f in zip(read, feats)]
    lengths = None if any(part is None for part in stored) else np.concatenate(stored)  # (else read when needed)
    mixture = _mixture(sources, [len(f["train"]) for f in feats], config.data.max_train_samples)
    for line in mixture.describe():
        log(line)
    if config.data.validation_file:  # every source was read with the run's validation file: one copy of it
        evals, parts = feats[0].get("validation"), {}
    else:
        evals = _concatenate(_eval_shares([f["validation"] for f in feats], config.data.max_eval_samples), sources)
        parts = {s.name: f["validation"] for s, f in zip(sources, feats)} if len(sources) > 1 else {}
    evals = task.select_examples("validation", evals)
    parts = {name: task.select_examples("validation", part) for name, part in parts.items()}
    maps = [m for prepared, _, _ in read if prepared for m in prepared.maps]
    return TrainingData(train, evals, mixture, parts, fingerprints(config), lengths, maps)


def _eval_shares(parts: list, limit: int | None) -> list:
    """--max-eval-samples over the sources' validation rows together: each source's first rows, in proportion to
    its rows (the first N of them laid end to end would be the first source's alone)."""
    if not limit or sum(len(part) for part in parts) <= limit:
        return parts
    counts = share_out(limit, [len(part) for part in parts])
    return [part.select(range(min(count, len(part)))) for part, count in zip(parts, counts)]


def _features(source, sub, prepared, raw, own, labels, tokenizer, config, save: bool) -> dict:
    """One source's features encoded with the mixture's `labels`: its prepared ones where they were encoded so,
    else tokenized from its raw rows (read now if the prepared ones were of another label set)."""
    sub.use_labels(labels)
    if prepared is not None and prepared.labels == labels:
        if _given_prepared(source) and sub.config.data.validation_file:  # (not the folder's own validation rows)
            return {**prepared.features, "validation": _named(source, lambda: _validation_features(sub, tokenizer))}
        return prepared.features
    if _given_prepared(source):  # (its raw rows are not at hand to encode again)
        raise DataError(
            f"data source {source.name!r}: {source.path!r} was prepared with the labels {prepared.labels}, this "
            f"mixture has {labels}; prepare it in one config with the other sources (its labels encoded as theirs)"
        )
    if raw is None:
        raw = _named(source, lambda: _read_source(source, sub, config))
    feats = _named(source, lambda: sub.tokenize(sub.encode_labels(raw), tokenizer, log=sub.log))
    if save:
        save_prepared(sub.config, tokenizer, dict(feats), labels, own, sub.log)
    return feats


def _given_prepared(source) -> bool:
    """Whether the source's path is a folder tuneforge prepare wrote (not a raw file or folder)."""
    return source.path is not None and is_prepared(source.path)


def _validation_features(sub, tokenizer):
    """The features of the validation file `sub` is given (read alone: its training rows are prepared)."""
    raw = sub.load_raw()
    return sub.tokenize(sub.encode_labels({"validation": raw["validation"]}), tokenizer, log=sub.log)["validation"]


def _prefixed(log, name: str):
    return lambda line: log(f"data source {name!r}: {line}")


def _read_as(config, source, source_options) -> dict:
    """The config values that read `source` alone: its file as the training data, the validation rows it has,
    its options on the run's; the whole training split (the mixture applies --max-train-samples)."""
    data = config.data.model_dump(exclude_unset=True)
    folder = source.path is not None and _is_dir(source.path)
    data.update(
        sources=[],
        train_file=None if folder or source.path is None or is_prepared(source.path) else source.path,
        data_dir=source.path if folder else None,
        validation_file=config.data.validation_file or source.validation_file,
        max_train_samples=None,
        max_eval_samples=None,
    )
    return {"data": data, "task_options": source_options(config, source).model_dump(exclude_unset=True)}


def _is_dir(path: str) -> bool:
    return Path(path).is_dir() and not is_prepared(path)


def _read_source(source, sub, config):
    """The raw train and validation rows of one source."""
    if source.path is not None:
        return sub.load_raw()
    from tuneforge.data.sources import from_hub
    from tuneforge.tasks.base import hold_out_validation

    hub = from_hub(source.hub, source.subset, f"pass the source as a local file (path) instead of hub {source.hub!r}")
    if source.split not in hub:
        raise DataError(f"hub dataset {source.hub!r} has no split {source.split!r}; its splits: {', '.join(hub)}")
    splits = {"train": hub[source.split]}
    if config.data.validation_file or source.validation_file:
        splits["validation"] = sub.load_raw()["validation"]  # (the sub-task reads the validation file alone)
    elif "validation" in hub:
        splits["validation"] = hub["validation"]
    else:
        splits = hold_out_validation(hub[source.split], config.data.split_seed, "row", "give a validation_file")
    return sub.prepare_raw(splits)


def _named(source, work):
    """`work()`, a user error it raises naming the source it was about."""
    try:
        return work()
    except UserError as err:
        raise type(err)(f"data source {source.name!r}: {err}") from None


def _union(label_sets: list) -> list[str] | None:
    """One label set for all sources: theirs where they agree, else every label once, integers by value first."""
    given = [s for s in label_sets if s is not None]
    if not given:
        return None
    if all(s == given[0] for s in given):
        return list(given[0])
    every = {label for s in given for label in s}
    numeric = lambda s: s.lstrip("-").isdigit()  # noqa: E731
    return sorted(every, key=lambda s: (not numeric(s), int(s) if numeric(s) else 0, s))


def _concatenate(parts: list, sources) -> Any:
    """The sources' features one after the other (memory-mapped Arrow tables are not copied)."""
    import datasets

    first = parts[0]
    aligned = [first]
    for source, part in zip(sources[1:], parts[1:]):
        if part.features != first.features:
            try:
                part = part.cast(first.features)
            except (ValueError, TypeError) as err:
                raise DataError(
                    f"data source {source.name!r} gives features {sorted(part.features)} of other types than "
                    f"{sources[0].name!r} ({str(err).splitlines()[0][:160]}); read every source into the same "
                    "columns (its options)"
                ) from None
        aligned.append(part)
    return datasets.concatenate_datasets(aligned) if len(aligned) > 1 else first


def _mixture(sources, sizes: list[int], max_rows: int | None) -> Mixture:
    for source, size in zip(sources, sizes):
        if size == 0:
            raise DataError(f"data source {source.name!r} yields no training examples; give it rows with data")
    weights = [s.weight for s in sources] if sources[0].weight is not None else None
    epochs = [s.epochs for s in sources] if sources[0].epochs is not None else None
    mixture = Mixture.of([s.name for s in sources], sizes, weights=weights, epochs=epochs)
    return mixture.limited(max_rows) if max_rows else mixture
