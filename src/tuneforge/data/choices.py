"""Multiple-choice rows: SWAG's csv layout, question + choices tables, CODAH's headerless TSV.

Every reader returns a `datasets.Dataset` with `context` (the question or first sentence),
`prefix` (the start shared by every ending: SWAG's sent2, a question + choices row's `prefix`; "" where there is
none), `choices`
(the endings, as many in every row), `label` (the index of the right choice) and `row` (the row
number in the file, for errors).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tuneforge.data import sources
from tuneforge.errors import DataError

if TYPE_CHECKING:
    import datasets

FORMATS = (".csv", ".tsv", ".jsonl", ".json", ".parquet")
SPLIT_NAMES = {"train": ("train",), "validation": ("dev", "val", "valid", "validation"), "test": ("test",)}
ENDING = re.compile(r"ending(\d+)$")


def read_choices(path: str | Path, data_format: str = "auto", need_labels: bool = True) -> datasets.Dataset:
    """One file of multiple-choice rows; checks that every row has the same number of choices and a label among
    them (`need_labels` False: rows to predict, whose labels may be missing: -1 then)."""
    import datasets

    from tuneforge.data.sources import check_file, read_table

    p = check_file(path)
    if p.suffix.lower() not in FORMATS:
        raise DataError(
            f"file {str(p)!r}: multiple choice reads {', '.join(FORMATS)} files; convert it to one of those"
        )
    if data_format == "codah":
        df = read_table(p, quoting_off=True, header=None)
        if df.shape[1] != 7:
            raise DataError(
                f"file {str(p)!r} has {df.shape[1]} columns; CODAH rows are category, question, 4 endings and the "
                "answer index (7 tab-separated columns); drop --data-format codah for other layouts"
            )
        rows = {"context": df[1].tolist(), "prefix": [""] * len(df), "choices": df[[2, 3, 4, 5]].values.tolist()}
        labels = df[6].tolist()
    else:
        rows, labels = _read_named_columns(p, need_labels)
    check_choice_texts(rows["context"], rows["choices"], str(p))
    rows["choices"] = [[str(c) for c in cs] for cs in rows["choices"]]
    rows["context"] = [str(c) for c in rows["context"]]
    rows["prefix"] = [str(c) for c in rows["prefix"]]
    rows["label"] = [
        choice_label(v, i, str(p), len(cs)) if need_labels else -1
        for i, (v, cs) in enumerate(zip(labels, rows["choices"]), 1)
    ]
    rows["row"] = list(range(1, len(labels) + 1))
    if need_labels:  # to predict, rows may differ
        check_choice_counts(rows["choices"], lambda r: f"{p}, row {r}")
    return datasets.Dataset.from_dict(rows)


def _read_named_columns(p: Path, need_labels: bool) -> tuple[dict, list]:
    """(rows, labels) of a file with a header: SWAG's columns or question + choices; -1 labels where the file has
    none and `need_labels` is False."""
    from tuneforge.data.sources import read_table

    df = read_table(p)
    cols = list(map(str, df.columns))
    endings = sorted((int(m.group(1)), c) for c in cols if (m := ENDING.match(c)))
    if {"sent1", "ending0"} <= set(cols):  # SWAG: sent1, sent2, ending0..ending3, label
        prefix = _prefixes(df, "sent2", p)
        columns = [c for _, c in endings]
        choices = [swag_endings(r, columns, row, p) for row, r in enumerate(df[columns].values.tolist(), 1)]
        rows = {"context": df["sent1"].tolist(), "prefix": prefix, "choices": choices}
    elif {"question", "choices"} <= set(cols):
        df["choices"] = [c.tolist() if isinstance(c, np.ndarray) else c for c in df["choices"]]  # parquet's lists
        bad = next((i for i, c in enumerate(df["choices"], 1) if not isinstance(c, list)), None)
        if bad:
            raise DataError(
                f"file {str(p)!r}, row {bad}: 'choices' must be a list of texts (jsonl/json/parquet), got "
                f"{type(df['choices'][bad - 1]).__name__}"
            )
        rows = {
            "context": df["question"].tolist(),
            "prefix": _prefixes(df, "prefix", p),
            "choices": df["choices"].tolist(),
        }
    else:
        codah = (
            "for CODAH's TSV pass --data-format codah"
            if need_labels
            else "predict takes no --data-format: give CODAH's rows as such"
        )
        sources.check_separator(cols, f"file {str(p)!r}")
        raise DataError(
            f"file {str(p)!r} has columns {', '.join(cols)}; multiple choice reads SWAG columns (sent1, sent2, "
            f"ending0, ending1, ..., label) or question, choices (a list) and label; {codah}"
        )
    if "label" in cols:
        labels = df["label"].tolist()
    elif need_labels:
        raise DataError(f"file {str(p)!r} has no 'label' column (the index of the right choice); add it")
    else:
        labels = [-1] * len(df)
    return rows, labels


def swag_endings(values: list, columns: list[str], row: int, p: Path) -> list[str]:
    """A SWAG row's endings, the empty (or null) ones at its end left out (a row of fewer choices); an empty one
    before a given one is a DataError naming both: the label, and predict's answer, index the endings as they stand."""
    given = [not _null(v) and bool(str(v).strip()) for v in values]
    kept = len(given) - given[::-1].index(True) if any(given) else 0
    gap = next((k for k in range(kept) if not given[k]), None)
    if gap is not None:
        after = columns[next(k for k in range(gap, kept) if given[k])]
        raise DataError(
            f"file {str(p)!r}, row {row}: {columns[gap]} is empty and {after} after it is not; a row's endings are "
            "ending0, ending1, ... without a gap (the label counts them): fill it, or move the later endings (and "
            "the label) up"
        )
    return [str(v) for v in values[:kept]]


def _prefixes(df, column: str, p: Path) -> list:
    """Each row's prefix (SWAG's sent2, a question + choices row's `prefix`: the start shared by its endings), ""
    where the row or the file has none; DataError naming the row for one that is not a text."""
    if column not in df.columns:
        return [""] * len(df)
    values = ["" if _null(v) else v for v in df[column]]
    for row, value in enumerate(values, 1):
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise DataError(f"{p}, row {row}: {column} holds {value!r}, not a text; give it as a string")
    return values


def _null(value) -> bool:
    """A cell without a value: JSON null (None), or NaN where pandas filled a column's gap."""
    return value is None or (isinstance(value, float) and value != value)


def check_choice_texts(questions: list, choices: list[list], where: str) -> None:
    """Every row's question and choices hold a text (a number taken as its text); DataError naming `where`, the row
    and the choice otherwise (str() made a null the text 'nan' or 'None', a list its Python text "['a']": trained
    on, predicted, and returned as the chosen choice)."""
    for row, (question, texts) in enumerate(zip(questions, choices), 1):
        for what, value in [("the question", question), *((f"choice {k}", c) for k, c in enumerate(texts, 1))]:
            if _null(value):
                raise DataError(f"{where}, row {row}: {what} is empty (null); fill or drop that row")
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise DataError(f"{where}, row {row}: {what} holds {value!r}, not a text; give it as a string")


def choice_label(value, row: int, where: str, n: int) -> int:
    """A row's label as the index of one of its `n` choices (an int, its text, or a whole float as pandas reads a
    column with a missing value); DataError naming `where` and the row otherwise."""
    if value is None or value != value:  # absent (NaN: a jsonl row without it makes pandas read floats)
        raise DataError(f"{where}, row {row}: no label; give the index of the right choice (0 to {n - 1})")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        label = int(str(value).strip())
    except ValueError:
        raise DataError(f"{where}, row {row}: label {value!r} is not a choice index (0 to {n - 1})") from None
    if not 0 <= label < n:
        raise DataError(f"{where}, row {row}: label {label} is not a choice index (0 to {n - 1}); fix that row")
    return label


def check_choice_counts(choices: list[list[str]], place) -> int:
    """The number of choices, the same in every row (and at least 2); `place(row)` names a row in an error."""
    want = len(choices[0]) if choices else 0
    for row, cs in enumerate(choices, 1):
        if len(cs) != want:
            raise DataError(
                f"{place(row)}: {len(cs)} choices where the first row has {want}; every row needs the same number"
            )
    if want < 2:
        raise DataError(f"{place(1)}: {want} choice; a multiple-choice row needs at least 2")
    return want


def find_split_files(folder: str | Path) -> dict[str, Path]:
    """{split: file} in a folder: train.*, dev.* / val.* / validation.*, test.* (csv, tsv, jsonl, json, parquet)."""
    names = {split: [f"{s}{x}" for s in stems for x in FORMATS] for split, stems in SPLIT_NAMES.items()}
    return sources.find_split_files(
        folder,
        names,
        "holding train and dev files",
        "train or dev file (train.csv, dev.tsv, ...)",
    )
