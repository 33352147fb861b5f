"""Extractive-QA examples: SQuAD JSON (v1.1 and v2.0) as published, and jsonl/json rows in the hub's `squad` form.

Every reader returns a `datasets.Dataset` with `id`, `question`, `context`, `answers_text` (list of
answer strings), `answers_start` (their character offsets into the context) and `row` (the question's
1-based position in its file), so later checks can name the place. A question without answers is
unanswerable (SQuAD 2.0: `is_impossible`, `answers: []`).

`check_examples` refuses what cannot be trained: an empty question, a question without a context,
an empty answer, and an answer whose text is not at its `answer_start`. The last rule is strict:
the published SQuAD files place every answer exactly (0 misplaced of the 46,603 answers in the
shared dev-v1.1.json and train-v1.1-subset-du2017.json), so a misplaced one means offsets counted
some other way (bytes, a cleaned context) and a model would be taught the wrong spans. The error
names the first misplaced answer and how many of the split's answers are misplaced.

--data-dir: the one training file whose name starts with `train` and the one validation file whose
name starts with `dev`, `valid` or `validation` (.json or .jsonl): train-v1.1.json and dev-v1.1.json,
train-v2.0.json and dev-v2.0.json, or the shared train-v1.1-subset-du2017.json. Two candidates for
a split are refused (say which with --train-file / --validation-file).
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tuneforge.data import sources
from tuneforge.errors import DataError

if TYPE_CHECKING:
    import datasets

SQUAD_SUFFIXES = (".json", ".jsonl")
SPLIT_PREFIXES = {"train": ("train",), "validation": ("dev", "valid", "validation")}
COLUMNS = ["id", "question", "context", "answers_text", "answers_start", "row"]


def check_squad_file(path: str | Path) -> Path:
    p = Path(path)
    if why := sources.not_a_file(p):
        raise DataError(f"file {str(p)!r} {why}; pass a SQuAD JSON file or jsonl with question, context, answers")
    if p.suffix.lower() not in SQUAD_SUFFIXES:
        raise DataError(
            f"file {str(p)!r}: unknown format {p.suffix!r}; questions are read from SQuAD JSON (.json) or "
            "jsonl with question, context and answers"
        )
    return p


def read_squad(path: str | Path) -> datasets.Dataset:
    """A SQuAD JSON file (`{"data": [articles]}`), or a json/jsonl table of question, context, answers rows."""
    p = check_squad_file(path)
    if p.suffix.lower() == ".json":
        from tuneforge.data.sources import decode_text

        try:
            doc = json.loads(decode_text(p.read_bytes(), p))
        except json.JSONDecodeError:
            doc = None  # JSON lines in a .json file: read as a table
        if isinstance(doc, dict):
            return read_squad_json(p, doc)
    return read_squad_table(p)


def read_squad_json(path: Path, doc: dict) -> datasets.Dataset:
    """The published layout: data[].paragraphs[].qas[] with answers[].text/answer_start (v2: is_impossible)."""
    if not isinstance(doc.get("data"), list):
        raise DataError(
            f"file {str(path)!r} is a JSON object without a 'data' list; a SQuAD file is "
            '{"data": [{"paragraphs": [{"context", "qas": [{"id", "question", "answers"}]}]}]}'
        )
    rows: dict[str, list] = {c: [] for c in COLUMNS}
    for a, article in enumerate(doc["data"], start=1):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            raise DataError(f"{path}, article {a}: no 'paragraphs' list; each article holds its paragraphs")
        for paragraph in paragraphs:
            qas = paragraph.get("qas") if isinstance(paragraph, dict) else None
            if not isinstance(qas, list):
                raise DataError(f"{path}, article {a}: a paragraph without a 'qas' list of questions")
            context = paragraph.get("context")
            for qa in qas:
                row = len(rows["row"]) + 1
                if not isinstance(qa, dict):
                    raise DataError(f"{path}, question at row {row}: not an object with 'question' and 'answers'")
                answers = [] if qa.get("is_impossible") else qa.get("answers") or []
                texts, starts = _answer_lists(answers, f"{path}, question {qa.get('id', row)!r} (row {row})")
                rows["id"].append(str(qa.get("id", row)))
                rows["question"].append(_text(qa.get("question")))
                rows["context"].append(_text(context))
                rows["answers_text"].append(texts)
                rows["answers_start"].append(starts)
                rows["row"].append(row)
    if not rows["row"]:
        raise DataError(f"file {str(path)!r} holds no questions; a SQuAD file has data[].paragraphs[].qas[]")
    return _dataset(rows)


def read_squad_table(path: Path) -> datasets.Dataset:
    """jsonl/json rows: question, context, answers ({"text": [...], "answer_start": [...]}), optional id."""
    from tuneforge.data.sources import read_table

    return from_table(read_table(path), path)


def from_table(df, path: Path) -> datasets.Dataset:
    """The rows of a table file already read (jsonl, or parquet as the hub ships SQuAD) in this module's columns."""
    from tuneforge.data.sources import require_columns

    require_columns(list(df.columns), ["question", "context", "answers"], repr(str(path)), "rows in SQuAD form")
    _warn_absent_answers(df, path)
    ids = df["id"].tolist() if "id" in df.columns else list(range(1, len(df) + 1))
    return from_rows(ids, df["question"].tolist(), df["context"].tolist(), df["answers"].tolist(), str(path))


def _warn_absent_answers(df, path: Path) -> None:
    """Rows without an `answers` key train as unanswerable questions; where another key looks like a misspelt
    `answers` (`answer`), that is almost certainly a mistake: a warning with the count."""
    import difflib
    import sys

    absent = int(df["answers"].isna().sum())
    near = difflib.get_close_matches(
        "answers",
        [str(c) for c in df.columns if c not in ("id", "title", "question", "context", "answers")],
        n=1,
        cutoff=0.75,
    )
    if absent and near:
        print(
            f"warning: {absent} of {len(df)} rows of {str(path)!r} have no `answers` but a `{near[0]}`, which is not "
            f"read: they train as unanswerable questions; rename `{near[0]}` to `answers` "
            '({"text": [...], "answer_start": [...]})',
            file=sys.stderr,
            flush=True,
        )


def from_hf(ds: datasets.Dataset, where: str) -> datasets.Dataset:
    """A `datasets.Dataset` in the hub's squad form (id, question, context, answers) in this module's columns."""
    from tuneforge.data.sources import require_columns

    require_columns(ds.column_names, ["question", "context", "answers"], where, "columns in SQuAD form")
    ids = ds["id"] if "id" in ds.column_names else list(range(1, len(ds) + 1))
    return from_rows(ids, ds["question"], ds["context"], ds["answers"], where)


def from_rows(ids, questions, contexts, answers, where: str) -> datasets.Dataset:
    rows: dict[str, list] = {c: [] for c in COLUMNS}
    for row, (qid, question, context, given) in enumerate(zip(ids, questions, contexts, answers), start=1):
        texts, starts = _answer_lists(given, f"{where}, row {row}")
        rows["id"].append(str(qid))
        rows["question"].append(_text(question))
        rows["context"].append(_text(context))
        rows["answers_text"].append(texts)
        rows["answers_start"].append(starts)
        rows["row"].append(row)
    return _dataset(rows)


def _text(value) -> str:
    return value if isinstance(value, str) else ""  # a missing or null question/context: refused by check_examples


def _answer_lists(given, where: str) -> tuple[list[str], list[int]]:
    """Answers as ([texts], [starts]) from the hub's {"text": [...], "answer_start": [...]} or SQuAD's
    [{"text", "answer_start"}, ...]; nothing (None, []) is an unanswerable question."""
    if given is None or (isinstance(given, float) and given != given):  # absent, or NaN from a table
        return [], []
    if isinstance(given, np.ndarray):  # parquet's lists
        given = given.tolist()
    if isinstance(given, dict):
        texts, starts = _listed(given.get("text")), _listed(given.get("answer_start"))
    elif isinstance(given, list) and all(isinstance(a, dict) for a in given):
        texts, starts = [a.get("text") for a in given], [a.get("answer_start") for a in given]
    else:
        raise DataError(
            f"{where}: answers must be {{'text': [...], 'answer_start': [...]}} or a list of "
            f"{{'text', 'answer_start'}} (got {type(given).__name__})"
        )
    if len(texts) != len(starts):
        raise DataError(f"{where}: {len(texts)} answer texts but {len(starts)} answer_start offsets; give one each")
    offsets = [_offset(s) for s in starts]
    for text, start, offset in zip(texts, starts, offsets):
        if not isinstance(text, str) or offset is None:
            raise DataError(f"{where}: an answer needs a text and an integer answer_start (got {text!r}, {start!r})")
    return texts, offsets


def _listed(value) -> list:
    """A list of answers' fields as given (a list, or parquet's numpy array); absent: none."""
    return [] if value is None else list(value)


def _offset(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):  # numpy's integers too (pandas reads jsonl numbers as them)
        return int(value)
    return int(value) if isinstance(value, float) and value.is_integer() else None


def _dataset(rows: dict[str, list]) -> datasets.Dataset:
    import datasets

    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "question": datasets.Value("string"),
            "context": datasets.Value("string"),
            "answers_text": datasets.List(datasets.Value("string")),
            "answers_start": datasets.List(datasets.Value("int64")),
            "row": datasets.Value("int64"),
        }
    )
    return datasets.Dataset.from_dict(rows, features=features)


def check_examples(ds: datasets.Dataset, place: Callable[[int, str], str]) -> None:
    """Every question has a text and a context, every answer is non-empty and stands at its answer_start.

    `place(row, id)` names a question in an error."""
    misplaced, first, total = 0, None, 0
    for qid, question, context, texts, starts, row in zip(
        ds["id"], ds["question"], ds["context"], ds["answers_text"], ds["answers_start"], ds["row"]
    ):
        if not question.strip():
            raise DataError(f"{place(row, qid)}: the question is empty; give it its text, or drop it")
        if not context.strip():
            raise DataError(
                f"{place(row, qid)}: the question has no context; extractive QA finds its answer in a context: "
                "give one, or drop the question"
            )
        for text, start in zip(texts, starts):
            total += 1
            if not text.strip():
                raise DataError(
                    f"{place(row, qid)}: an answer is empty; give its text, or leave the question without answers "
                    "(unanswerable, as in SQuAD 2.0)"
                )
            if context[start : start + len(text)] != text or start < 0:
                misplaced += 1
                if first is None:
                    first = (place(row, qid), text, start, context[max(start, 0) : max(start, 0) + len(text)])
    if first is not None:
        where, text, start, found = first
        raise DataError(
            f"{where}: answer {text!r} is not at its answer_start {start} (the context has {found!r} there); "
            f"{misplaced} of {total} answers are misplaced. Each answer_start must be the character offset of the "
            "answer's text in its context: fix the offsets"
        )


def find_split_files(folder: str | Path) -> dict[str, Path]:
    """{split: file} of a SQuAD folder: one train* file, one dev*/valid*/validation* file (.json or .jsonl)."""
    return sources.find_split_files(
        folder, SPLIT_PREFIXES, "of train*.json and dev*.json", "SQuAD files (train*.json, dev*.json)", _split_file
    )


def _split_file(d: Path, split: str) -> Path | None:
    """The one file of `split` in folder `d` (by its name's prefix), or None; two are one error line."""
    hits = sorted(
        f
        for f in d.iterdir()
        if f.is_file() and f.suffix.lower() in SQUAD_SUFFIXES and f.name.lower().startswith(SPLIT_PREFIXES[split])
    )
    if len(hits) > 1:
        flag = "--train-file" if split == "train" else "--validation-file"
        raise DataError(
            f"--data-dir {str(d)!r} holds {len(hits)} {split} files ({', '.join(f.name for f in hits)}); "
            f"pass the one to use with {flag}"
        )
    return hits[0] if hits else None
