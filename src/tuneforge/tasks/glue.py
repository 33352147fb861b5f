"""The GLUE tasks by name: columns, labels, metrics, and the original glue_data TSV layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tuneforge.data.sources import data_suffix, from_hub, read_table, require_columns, to_dataset
from tuneforge.errors import DataError

if TYPE_CHECKING:
    import datasets
    import pandas as pd


@dataclass(frozen=True)
class GlueSpec:
    subset: str  # nyu-mll/glue config name
    folder: str  # glue_data folder name
    text_columns: tuple[str, ...]  # our column names (hub names)
    label_names: tuple[str, ...] | None  # None: regression
    metrics: tuple[str, ...]
    # original TSV layout: our column -> TSV column (name, or index when headerless)
    tsv_columns: dict[str, str | int] = field(default_factory=dict)
    tsv_header: bool = True
    dev_file: str = "dev.tsv"
    quoting_off: bool = True


GLUE: dict[str, GlueSpec] = {
    "cola": GlueSpec(
        "cola",
        "CoLA",
        ("sentence",),
        ("unacceptable", "acceptable"),
        ("mcc", "accuracy"),
        {"sentence": 3, "label": 1},
        tsv_header=False,
    ),
    "sst2": GlueSpec(
        "sst2",
        "SST-2",
        ("sentence",),
        ("negative", "positive"),
        ("accuracy",),
        {"sentence": "sentence", "label": "label"},
    ),
    "mrpc": GlueSpec(
        "mrpc",
        "MRPC",
        ("sentence1", "sentence2"),
        ("not_equivalent", "equivalent"),
        ("accuracy", "f1"),
        {"sentence1": "#1 String", "sentence2": "#2 String", "label": "Quality"},
    ),
    "stsb": GlueSpec(
        "stsb",
        "STS-B",
        ("sentence1", "sentence2"),
        None,
        ("pearson", "spearman"),
        {"sentence1": "sentence1", "sentence2": "sentence2", "label": "score"},
    ),
    "qqp": GlueSpec(
        "qqp",
        "QQP",
        ("question1", "question2"),
        ("not_duplicate", "duplicate"),
        ("accuracy", "f1"),
        {"question1": "question1", "question2": "question2", "label": "is_duplicate"},
    ),
    "mnli": GlueSpec(
        "mnli",
        "MNLI",
        ("premise", "hypothesis"),
        ("entailment", "neutral", "contradiction"),
        ("accuracy",),
        {"premise": "sentence1", "hypothesis": "sentence2", "label": "gold_label"},
        dev_file="dev_matched.tsv",
    ),
    "qnli": GlueSpec(
        "qnli",
        "QNLI",
        ("question", "sentence"),
        ("entailment", "not_entailment"),
        ("accuracy",),
        {"question": "question", "sentence": "sentence", "label": "label"},
    ),
    "rte": GlueSpec(
        "rte",
        "RTE",
        ("sentence1", "sentence2"),
        ("entailment", "not_entailment"),
        ("accuracy",),
        {"sentence1": "sentence1", "sentence2": "sentence2", "label": "label"},
    ),
    "wnli": GlueSpec(
        "wnli",
        "WNLI",
        ("sentence1", "sentence2"),
        ("not_entailment", "entailment"),
        ("accuracy",),
        {"sentence1": "sentence1", "sentence2": "sentence2", "label": "label"},
    ),
}


def _read_split(spec: GlueSpec, path: Path) -> datasets.Dataset:
    if spec.tsv_header:
        df = read_table(path, quoting_off=spec.quoting_off)
        require_columns(
            list(df.columns), [c for c in spec.tsv_columns.values()], str(path), "--data-dir of the right task"
        )
        df = df[[spec.tsv_columns[k] for k in spec.tsv_columns]]
    else:
        df = read_table(path, quoting_off=spec.quoting_off, header=None)
        needed = max(int(v) for v in spec.tsv_columns.values()) + 1
        if df.shape[1] < needed:
            raise DataError(
                f"{str(path)!r} has {df.shape[1]} columns, the {spec.folder} layout needs {needed}; is --data-dir "
                "the right task?"
            )
        df = df[[spec.tsv_columns[k] for k in spec.tsv_columns]]
    df.columns = list(spec.tsv_columns)
    if spec.label_names is not None:
        df["label"] = [_label_id(spec, v, path, row) for row, v in enumerate(df["label"], start=1)]
    return to_dataset(df, where=repr(str(path)))


def _label_id(spec: GlueSpec, value: str, path: Path, row: int) -> int:
    """glue_data stores integer ids for some tasks (MRPC, SST-2, CoLA) and names for others (MNLI)."""
    names = list(spec.label_names)
    text = value.strip()
    if text in names:
        return names.index(text)
    if text.isdigit() and int(text) < len(names):
        return int(text)
    raise DataError(
        f"label {value!r} in {str(path)!r} (row {row}) is not one of {names} or their ids; is --data-dir the right "
        "task?"
    )


def glue_files(name: str, data_dir: str) -> dict[str, Path]:
    """{split: file} of a glue_data folder; a cheap check done before any heavy work."""
    spec = GLUE[name]
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"--data-dir {data_dir!r} is not a folder; point it at glue_data/{spec.folder}")
    files = {"train": root / "train.tsv", "validation": root / spec.dev_file}
    for f in files.values():
        if not f.is_file():
            raise DataError(
                f"{str(f)!r} does not exist; --data-dir must hold the {spec.folder} files train.tsv and {spec.dev_file}"
            )
    return files


def load_glue(name: str, data_dir: str | None) -> datasets.DatasetDict:
    import datasets

    spec = GLUE[name]
    if data_dir is None:
        raw = from_hub(
            "nyu-mll/glue",
            spec.subset,
            hint=f"pass --data-dir path/to/glue_data/{spec.folder} to read the original TSV files instead",
        )
        return datasets.DatasetDict(
            train=raw["train"], validation=raw["validation_matched" if name == "mnli" else "validation"]
        )
    return datasets.DatasetDict({split: _read_split(spec, f) for split, f in glue_files(name, data_dir).items()})


def read_glue_texts(name: str, path: str | Path) -> pd.DataFrame | None:
    """The text columns (our names) of a file in the task's glue_data layout, or None if it is not.

    Used by `tuneforge predict` so a model trained on a GLUE task reads that task's TSV files
    the same way training did (BOM, quoting off, headerless CoLA).
    """
    import pandas as pd

    spec = GLUE[name]
    if data_suffix(path) != ".tsv":  # (dev.tsv.gz too: predict reads a table compressed whole)
        return None
    wanted = {ours: spec.tsv_columns[ours] for ours in spec.text_columns}
    if spec.tsv_header:
        df = read_table(path, quoting_off=spec.quoting_off)
        if not all(col in df.columns for col in wanted.values()):
            return None
    else:
        df = read_table(path, quoting_off=spec.quoting_off, header=None)
        if df.shape[1] != max(int(v) for v in spec.tsv_columns.values()) + 1:
            return None
    return pd.DataFrame({ours: df[col].tolist() for ours, col in wanted.items()})
