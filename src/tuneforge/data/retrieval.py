"""Retrieval data for sentence embeddings: SQuAD as question -> paragraph pairs, and the query/document collection
of (query, relevant document[, other documents...]) rows.

SQuAD (`squad_pairs`): the published JSON (`data[].paragraphs[].qas[]`, v1.1 or v2.0) or jsonl or parquet rows in
the hub's form (question, context, answers), read by `tuneforge.data.squad`; each answerable question becomes one
(query, positive) row: the question and the paragraph holding its answer, the question's one relevant document. A
question whose paragraph is empty, or whose answers are not in its paragraph, is one error line (its relevant
document is missing); unanswerable questions (SQuAD 2.0) have no relevant paragraph and are left out, with their count.

The collection (`collection_ids`): documents are the distinct texts of the positive and negative columns, queries
the distinct texts of the query column, each numbered in order of first appearance; a query's relevant documents
are the positives of every row it heads. `evaluator_inputs` gives the same collection as the three dicts of
sentence-transformers' InformationRetrievalEvaluator (ids as zero-padded strings, so that its tie order, by
ascending id, is the order of first appearance), for comparing with it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tuneforge.data import squad
from tuneforge.data.sources import decode_text
from tuneforge.errors import DataError

if TYPE_CHECKING:
    import datasets

SQUAD_ROW_COLUMNS = ("question", "context", "answers")


@dataclass(frozen=True)
class SquadPairs:
    """The (query, positive) rows of a SQuAD file and what was read: questions, the distinct paragraphs of the kept
    ones, and the unanswerable questions left out."""

    rows: datasets.Dataset
    questions: int
    paragraphs: int
    unanswerable: int


def is_squad_json(path: str | Path) -> bool:
    """Whether `path` is a .json file holding SQuAD's published layout (an object with a `data` list)."""
    p = Path(path)
    if p.suffix.lower() != ".json" or not p.is_file():
        return False
    try:
        doc = json.loads(decode_text(p.read_bytes(), p))
    except json.JSONDecodeError:
        return False  # JSON lines in a .json file: a table
    return isinstance(doc, dict) and isinstance(doc.get("data"), list)


def has_squad_columns(columns: Sequence[str]) -> bool:
    """Whether a table's columns are the hub's SQuAD form (question, context, answers)."""
    return all(c in columns for c in SQUAD_ROW_COLUMNS)


def squad_pairs(path: str | Path, table=None) -> SquadPairs:
    """The answerable questions of a SQuAD file as (query, positive) rows: each question and its paragraph.
    `table`: the file's rows already read (a jsonl or parquet table in the hub's form)."""
    import datasets

    ds = squad.read_squad(path) if table is None else squad.from_table(table, Path(path))
    queries, positives, dropped = [], [], 0
    for qid, question, context, answers, row in zip(
        ds["id"], ds["question"], ds["context"], ds["answers_text"], ds["row"]
    ):
        where = f"{str(path)!r}, question {qid!r} (row {row})"
        if not question.strip():
            raise DataError(f"{where}: the question is empty; give it its text, or drop it")
        if not context.strip():
            raise DataError(
                f"{where}: the question has no paragraph, so its relevant document is missing; give its context, "
                "or drop the question"
            )
        if not answers:
            dropped += 1
            continue
        missing = next((a for a in answers if not a.strip() or a not in context), None)
        if missing is not None:
            raise DataError(
                f"{where}: answer {missing!r} is not in the question's paragraph, the document it is relevant to; "
                "fix the answer or the paragraph, or drop the question"
            )
        queries.append(question)
        positives.append(context)
    if not queries:
        raise DataError(
            f"file {str(path)!r} holds no answerable questions ({dropped} unanswerable): retrieval needs questions "
            "whose answer is in their paragraph"
        )
    rows = datasets.Dataset.from_dict({"query": queries, "positive": positives})
    return SquadPairs(rows, questions=len(queries), paragraphs=len(set(positives)), unanswerable=dropped)


def collection_ids(queries: Sequence[str], documents: Sequence[Sequence[str]]) -> tuple[list[int], list[list[int]]]:
    """(each row's query id, each row's document ids) of rows whose query is `queries[i]` and whose documents are
    `documents[i]` (the positive first): equal texts share an id, ids numbered by first appearance."""
    query_index: dict[str, int] = {}
    doc_index: dict[str, int] = {}
    query_ids = [query_index.setdefault(q, len(query_index)) for q in queries]
    doc_ids = [[doc_index.setdefault(d, len(doc_index)) for d in docs] for docs in documents]
    return query_ids, doc_ids


def evaluator_inputs(
    queries: Sequence[str], documents: Sequence[Sequence[str]]
) -> tuple[dict[str, str], dict[str, str], dict[str, set[str]]]:
    """(queries, corpus, relevant_docs) of sentence-transformers' InformationRetrievalEvaluator for the collection
    `collection_ids` makes of these rows (the positive first in each row's `documents`)."""
    query_ids, doc_ids = collection_ids(queries, documents)
    width = len(str(max(len(query_ids), sum(len(d) for d in doc_ids))))
    name = f"{{:0{width}d}}".format
    qs = {name(q): text for q, text in zip(query_ids, queries)}
    corpus = {name(d): text for ids, docs in zip(doc_ids, documents) for d, text in zip(ids, docs)}
    relevant: dict[str, set[str]] = {}
    for q, ids in zip(query_ids, doc_ids):
        relevant.setdefault(name(q), set()).add(name(ids[0]))
    return qs, corpus, relevant
