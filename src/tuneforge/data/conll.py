"""Token-tagged sentences: CoNLL column files as published, and jsonl/json rows of `tokens` + `tags`.

Every reader returns a `datasets.Dataset` with `tokens` (list of words), `tags` (their tags, as
written) and `line` (where the sentence starts: the line number in a CoNLL file, the row number in a
table), so later checks can name the place. Tags are then brought to IOB2 (`to_iob2`): CoNLL-2003
ships IOB1, where an entity starts with I- unless it follows one of the same type; the entities are
the same either way, and IOB2 gives every entity a B- tag the model can learn to start it with.
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

CONLL_SUFFIXES = (".txt", ".conll", ".iob", ".bio")
TABLE_SUFFIXES = (".jsonl", ".json", ".parquet")
SPLIT_FILES = {  # --data-dir: the first file found per split
    "train": ("train.txt", "train.conll", "eng.train", "train.jsonl"),
    "validation": ("valid.txt", "dev.txt", "validation.txt", "valid.conll", "dev.conll", "eng.testa", "valid.jsonl"),
    "test": ("test.txt", "test.conll", "eng.testb", "test.jsonl"),
}


def check_tagged_file(path: str | Path) -> Path:
    p = Path(path)
    if why := sources.not_a_file(p):
        raise DataError(f"file {str(p)!r} {why}; pass a CoNLL file (.txt, .conll) or jsonl with tokens and tags")
    if not (p.suffix.lower() in CONLL_SUFFIXES + TABLE_SUFFIXES or p.name.startswith("eng.")):
        raise DataError(
            f"file {str(p)!r}: unknown format {p.suffix!r}; token tags are read from CoNLL files "
            f"({', '.join(CONLL_SUFFIXES)}) or {', '.join(TABLE_SUFFIXES)} with tokens and tags"
        )
    return p


def read_conll(path: str | Path) -> datasets.Dataset:
    """A CoNLL column file: one token per line (word first, tag last, any columns between), a blank line
    between sentences, `-DOCSTART-` lines between documents. Every token line has the same number of columns."""
    import datasets

    p = check_tagged_file(path)
    tokens, tags, starts = [], [], []
    words: list[str] = []
    labels: list[str] = []
    width = None
    from tuneforge.data.sources import decode_text

    text = decode_text(p.read_bytes(), p)
    # lines end at \n, \r\n or \r and columns split at spaces and tabs only, as the hub's CoNLL loaders read:
    # a word may hold other whitespace (a no-break space in '10 000', U+2028), which str.split would cut
    for number, line in enumerate(re.split(r"\r\n|\r|\n", text) + [""], start=1):
        cols = [col for col in re.split(r"[ \t]+", line) if col]
        if not cols or cols[0] == "-DOCSTART-":
            if words:
                tokens.append(words), tags.append(labels)
                words, labels = [], []
            continue
        if width is None:
            width = len(cols)
            if width < 2:
                raise DataError(
                    f"{p}, line {number}: one column ({line.strip()!r}); a CoNLL line is a word and its tag "
                    "(other columns between), separated by spaces or tabs"
                )
        elif len(cols) != width:
            raise DataError(
                f"{p}, line {number}: {len(cols)} columns where the file's first token line has {width} "
                f"({line.strip()!r}); every token line needs a word and a tag in the same columns"
            )
        if not words:
            starts.append(number)
        words.append(cols[0])
        labels.append(cols[-1])
    if not tokens:
        raise DataError(f"file {str(p)!r} holds no sentences; a CoNLL file has one 'word ... tag' line per token")
    return datasets.Dataset.from_dict({"tokens": tokens, "tags": tags, "line": starts})


def read_tagged_table(path: str | Path, tokens_column: str, tags_column: str) -> datasets.Dataset:
    """jsonl/json/parquet rows holding a list of words and a list of tags (names, or ids of a ClassLabel)."""
    import datasets

    from tuneforge.data.sources import read_table, require_columns

    p = check_tagged_file(path)
    df = read_table(p)
    require_columns(list(df.columns), [tokens_column], repr(str(p)), "--text-column (the tokens)")
    require_columns(list(df.columns), [tags_column], repr(str(p)), "--label-column (the tags)")
    tokens, tags = [], []
    for row, (words, labels) in enumerate(zip(df[tokens_column], df[tags_column]), start=1):
        words, labels = (x.tolist() if isinstance(x, np.ndarray) else x for x in (words, labels))  # parquet's lists
        if not isinstance(words, list) or not isinstance(labels, list):
            raise DataError(
                f"row {row} of {str(p)!r}: {tokens_column!r} and {tags_column!r} must each be a list "
                f"(got {type(words).__name__} and {type(labels).__name__})"
            )
        tokens.append([str(w) for w in words])
        tags.append([str(t) for t in labels])
    return datasets.Dataset.from_dict({"tokens": tokens, "tags": tags, "line": list(range(1, len(tokens) + 1))})


def read_tagged(path: str | Path, tokens_column: str = "tokens", tags_column: str = "tags") -> datasets.Dataset:
    p = check_tagged_file(path)
    if p.suffix.lower() in TABLE_SUFFIXES:
        return read_tagged_table(p, tokens_column, tags_column)
    return read_conll(p)


def find_split_files(folder: str | Path) -> dict[str, Path]:
    """{split: file} of a CoNLL folder (train.txt, valid.txt, test.txt, or the original eng.* names)."""
    return sources.find_split_files(
        folder,
        SPLIT_FILES,
        "holding train.txt and valid.txt",
        "train.txt or valid.txt (CoNLL files)",
    )


def check_lengths(ds: datasets.Dataset, place) -> None:
    """Every sentence has words, and one tag per word; `place(line)` names a sentence in an error."""
    for words, labels, line in zip(ds["tokens"], ds["tags"], ds["line"]):
        if len(words) != len(labels):
            raise DataError(f"{place(line)}: {len(words)} tokens but {len(labels)} tags; give one tag per token")
        if not words:
            raise DataError(f"{place(line)}: a sentence with no tokens; drop it")


def is_conll(path: str | Path) -> bool:
    return Path(path).suffix.lower() not in TABLE_SUFFIXES


def entity_type(tag: str) -> str | None:
    """'B-PER' -> 'PER', 'O' -> None; anything else is not IOB."""
    if tag == "O":
        return None
    if len(tag) > 2 and tag[:2] in ("B-", "I-"):
        return tag[2:]
    raise ValueError(tag)


def to_iob2(tags: list[str]) -> list[str]:
    """IOB1 (or IOB2) tags as IOB2: an I- that starts an entity (after O or another type) becomes B-."""
    out, prev = [], None
    for tag in tags:
        kind = entity_type(tag)
        if tag.startswith("I-") and kind != prev:
            tag = "B-" + kind
        out.append(tag)
        prev = kind
    return out


def iob_label_set(tag_lists) -> list[str]:
    """O, then B-/I- of each entity type seen, types sorted: a model predicts every tag an entity can take."""
    kinds = {entity_type(t) for tags in tag_lists for t in tags} - {None}
    return ["O"] + [f"{p}-{k}" for k in sorted(kinds) for p in ("B", "I")]


def entities(tags: list[str]) -> list[tuple[str, int, int]]:
    """(type, first word, last word + 1) of each entity in IOB2 tags; a stray I- starts one (as conlleval)."""
    spans: list[tuple[str, int, int]] = []
    start, kind = None, None
    for i, tag in enumerate(tags + ["O"]):
        t = None if tag == "O" else tag[2:]
        begins = tag.startswith("B-") or (t is not None and t != kind)
        if kind is not None and (t is None or begins):
            spans.append((kind, start, i))
            kind = None
        if t is not None and (begins or kind is None):
            start, kind = i, t
    return spans
