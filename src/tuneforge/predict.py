"""Prediction: `load_predictor(MODEL_DIR)`, and `tuneforge predict` on files (`predict_file`; the command's
arguments are `PredictOptions`' fields).

The model folder's tuneforge.json names the task that exported it; that task's predictor runs
(tasks/classification.py, ner.py, qa.py, multiple_choice.py, sentence_encoder.py). `load_servable` is what `tuneforge
serve` runs: the task's generator for a model that generates text, else its predictor. Batches are sorted by length
and, on a CPU, cut into runs of similar length (tasks/length_runs.py: little padding), and results come back in the
input's order.

A predictor with an `embedding_size` answers with vectors (a sentence encoder): `encode(texts, batch_size,
dimensions)` gives them as a matrix, written as one {"index", "embedding"} line per row (`predict`), or a .npy
matrix when --output ends in .npy; --dimensions keeps the first N of each vector, renormalised (Matryoshka).
--dimensions and a .npy --output are refused for any other model.

--output's name says its format (`OUTPUT_FORMATS`): JSON lines (.jsonl, .json, which `datasets` reads as they are, or
no suffix), or a .csv or .tsv table of the same columns (a nested value, such as the scores, as its JSON text); a
name of another format (.txt, .parquet) is refused before any work.

An input longer than the predictor's max_length is cut to it, as training cut it; the predictor keeps how many of its
last inputs were (`last_cut`), which `note_cuts` says in one `note:` line on stderr, never in the output's rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from tuneforge.artifacts import (
    check_model_path,
    context_length,
    from_pretrained,
    generation_family,
    read_model_info,
)
from tuneforge.errors import ConfigError, DataError
from tuneforge.files import json_text, replacing
from tuneforge.flags import POSITIONAL, add_model_flags, input_max_length_field, parse_options
from tuneforge.options import PATH
from tuneforge.paths import check_local
from tuneforge.tasks.classification import ClassificationPredictor as Predictor  # the name of before

# the table files train reads, each also compressed whole (rows.jsonl.gz, rows.csv.zst): not a .txt corpus, whose
# lines are a language model's text, nor CoNLL's token-per-line .txt
PREDICT_FORMATS = (".csv", ".tsv", ".json", ".jsonl", ".parquet")
MAX_DIMENSIONS = 1 << 20
NO_ROOM_THEN = " or choose another --output"  # a write of --output that failed for want of room
VECTOR_FORMAT = ".npy"  # --output of a sentence encoder's vectors as one matrix
# --output's name: how each is written (the separator of a table); a name of no suffix says no other format
OUTPUT_FORMATS = {"": "lines", ".jsonl": "lines", ".json": "lines", ".csv": ",", ".tsv": "\t", VECTOR_FORMAT: "matrix"}


class PredictOptions(BaseModel):
    """`tuneforge predict`'s arguments (and `predict_file`'s), checked before any file or model is read."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    model_dir: str = Field(
        description="a model folder tuneforge exported (OUTPUT_DIR/model)", json_schema_extra={**POSITIONAL, **PATH}
    )
    input: str = Field(
        description="the rows to predict: a .csv, .tsv, .json, .jsonl or .parquet file (or one gzip'd or zstd'd "
        "whole: .jsonl.gz)",
        json_schema_extra=PATH,
    )
    output: str = Field(
        description="the predictions, a row per input row, in the input's order: JSON lines (.jsonl), or a table "
        "(.csv, .tsv) of the same columns (a sentence encoder's vectors: a float32 matrix when the name ends in .npy)",
        json_schema_extra=PATH,
    )
    text_column: list[str] | None = Field(
        None, description="the input's text column; twice for sentence pairs (default: the columns it trained on)"
    )
    batch_size: int = Field(64, ge=1, description="rows in one forward pass")
    max_length: int | None = input_max_length_field(
        "truncate inputs to this many tokens (default: the training max_length)"
    )
    dimensions: int | None = Field(
        None,
        ge=1,
        le=MAX_DIMENSIONS,
        description="sentence encoders: keep the first N dimensions of each vector, renormalised (a model trained "
        "with --matryoshka-dims keeps its meaning in them); default: all",
        json_schema_extra={"refusal": "{flag} must be between {ge} and {le}, got {value}"},
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="the forwards' precision: fp32 gives the model's own numbers (a sentence encoder's vectors as "
        "sentence-transformers computes them); bf16 or fp16 keep the linear layers' weights so and run under "
        "autocast (norms, softmax, outputs float32; auto: bf16 where the hardware does it natively, else fp32): "
        "faster on AVX512-BF16 and AMX CPUs and on GPUs, vectors and scores within bf16's rounding of fp32's",
    )


def _task_class_of(model_dir: str | Path):
    """The Task class that exported `model_dir` (its tuneforge.json); for a folder tuneforge did not write, the task
    that claims its layout (a sentence-transformers folder: embeddings; a token-classification, question-answering
    or multiple-choice head: ner, qa, multiple-choice); else None (a plain HF folder)."""
    from tuneforge.tasks import TASKS, task_class

    task = str(read_model_info(str(model_dir)).get("task") or "")
    known = task in TASKS or any(k.endswith("/") and task.startswith(k) for k in TASKS)
    if known:
        return task_class(task)
    if task:
        return None
    classes = dict.fromkeys(task_class(name) for name in TASKS if not name.endswith("/"))
    return next((cls for cls in classes if cls.claims_folder(str(model_dir))), None)


def load_predictor(model_dir: str | Path, **kwargs):
    """The predictor of the task that exported `model_dir` (or claims its layout); a plain HF folder: a classifier's."""
    cls = _task_class_of(model_dir)
    return cls.make_predictor(str(model_dir), **kwargs) if cls else Predictor(model_dir, **kwargs)


def load_servable(model_dir: str | Path, max_length: int | None = None):
    """What `tuneforge serve` runs for `model_dir`, as the task that exported it says (`make_generator`, else
    `make_predictor`): a `tuneforge.generate.Generator` for a model that generates text, else a predictor. A
    plain HF folder: a Generator when its architecture generates text, else a classifier's predictor."""
    cls = _task_class_of(model_dir)
    if cls is not None:
        generator = cls.make_generator(str(model_dir), max_length=max_length)
        return generator if generator is not None else cls.make_predictor(str(model_dir), max_length=max_length)
    from transformers import AutoConfig

    from tuneforge.generate import Generator

    model_config = from_pretrained(AutoConfig, str(model_dir), "the model config")
    if generation_family(model_config, read_model_info(str(model_dir))) is not None:
        return Generator(model_dir, max_length=max_length)
    return Predictor(model_dir, max_length=max_length)


def read_inputs(model_dir: str, input_path: str, text_columns: list[str] | None = None) -> list[tuple[str, ...]]:
    """The texts (or pairs) to predict, read and checked before any model is loaded."""
    from tuneforge.data.sources import check_file, check_separator, data_suffix, read_table, require_columns

    p = check_file(input_path)
    if data_suffix(p) not in PREDICT_FORMATS:
        raise DataError(
            f"--input {input_path!r}: predict reads rows of {', '.join(PREDICT_FORMATS)} files (or one gzip'd or "
            "zstd'd whole); convert it to one of those"
        )
    info = read_model_info(model_dir)
    df = None
    task = str(info.get("task") or "")
    if task.startswith("glue/") and not text_columns:  # the task's own TSV layout (quoting off, BOM)
        from tuneforge.tasks.glue import GLUE, read_glue_texts

        if task[5:] in GLUE:
            df = read_glue_texts(task[5:], p)
    if df is None:
        df = read_table(p)
    trained = info.get("text_columns")
    if text_columns and isinstance(trained, list) and len(trained) in (1, 2) and len(text_columns) != len(trained):
        # a pair model fed single texts (or the reverse) answers, wrongly, without a word
        what, flag = ("sentence pairs", "twice") if len(trained) == 2 else ("single texts", "once")
        raise ConfigError(
            f"model {model_dir!r} was trained on {what} ({', '.join(map(str, trained))}), and --text-column names "
            f"{len(text_columns)} column(s); pass --text-column {flag}, or leave it out to read those columns"
        )
    cols = text_columns or trained
    if not cols:
        guesses = [c for c in ("text", "sentence") if c in df.columns]
        if not guesses:
            check_separator(list(df.columns), repr(input_path))
            raise DataError(
                f"no text column in {input_path!r}; columns are: {', '.join(map(str, df.columns))}; pass --text-column"
            )
        cols = guesses[:1]
    if len(cols) > 2:
        raise ConfigError(f"--text-column takes one or two columns (a sentence pair), got {len(cols)}")
    if len(cols) == 2 and cols[0] == cols[1]:  # each text paired with itself: refused as training refuses it
        raise ConfigError(f"--text-column names {cols[0]!r} twice; a sentence pair needs two different columns")
    require_columns(list(df.columns), cols, repr(input_path), "--text-column (once, or twice for pairs)")
    for c in cols:
        check_texts(df[c].tolist(), c, input_path)
    return list(zip(*[df[c].tolist() for c in cols]))


def check_texts(values: list, column: str, input_path: str) -> None:
    """Every value of a text column is a string (a JSON number, list or true is refused, as training refuses it:
    its Python str would be embedded or classified instead); an empty (null) one is one line naming its row."""
    for row, value in enumerate(values, start=1):
        if value is None or (isinstance(value, float) and value != value):
            raise DataError(f"column {column!r} of {input_path!r} is empty in row {row}; fill or drop that row")
        if not isinstance(value, str):
            raise DataError(
                f"row {row} of {input_path!r}: column {column!r} holds {value!r}, not text; give each row its text "
                "as a string"
            )


# the keys of a predictions line, every predictor's (a user's rows with an index column start {"index": 0 too)
PREDICTION_KEYS = frozenset(
    ("index", "label", "label_id", "score", "scores", "embedding", "entities", "answer", "start", "end", "choice")
)


def _written_by_predict(path: Path) -> bool:
    """`path` is empty or a predictions file `predict` wrote (its first line: {"index": 0, ...} with no key but a
    prediction's, or a table's header of such columns)."""
    try:
        with path.open("r", encoding="utf-8") as fh:
            first = fh.readline()
        if not first:
            return True
        separator = OUTPUT_FORMATS[path.suffix.lower()]
        if separator in (",", "\t"):  # a table's header: its columns
            columns = first.rstrip("\r\n").split(separator)
            return columns[0] == "index" and set(columns) <= PREDICTION_KEYS
        line = json.loads(first)
        return line.get("index") == 0 and set(line) <= PREDICTION_KEYS
    except (OSError, ValueError, AttributeError):
        return False


def check_output_file(output_path: str, input_path: str, model_dir: str) -> None:
    """--output can be written and replaces nothing but an earlier prediction: not a folder, not the input,
    not inside the model folder, not a file of the user's. Checked before any input is read."""
    from tuneforge.data.sources import COMPRESSED
    from tuneforge.paths import check_output_dir

    out = Path(output_path)
    if out.is_dir():
        raise ConfigError(f"--output {output_path!r} is a folder; pass a file name such as preds.jsonl")
    if out.suffix.lower() in COMPRESSED:  # the plain lines would be written under a name that says gzip or zstd
        raise ConfigError(
            f"--output {output_path!r} names a {COMPRESSED[out.suffix.lower()]} file; predict writes plain JSON lines "
            f"or tables (or a .npy matrix): name it without {out.suffix} and compress it afterwards"
        )
    if out.suffix.lower() not in OUTPUT_FORMATS:  # JSON lines under a .txt or .parquet name: no reader of it reads
        raise ConfigError(
            f"--output {output_path!r}: predict writes .jsonl (JSON lines), .csv or .tsv (a table of the same "
            "columns), or .npy (a sentence encoder's vectors); name it so"
        )
    check_output_dir(str(out.parent), "--output", "the folder of --output")
    if Path(input_path).exists() and out.resolve() == Path(input_path).resolve():
        raise ConfigError(f"--output {output_path!r} is the --input file; write the predictions to another file")
    model = Path(model_dir).resolve()
    if model.is_dir() and model in out.resolve().parents:
        raise ConfigError(
            f"--output {output_path!r} is inside the model folder {model_dir!r}; write the predictions elsewhere"
        )
    if out.suffix.lower() == VECTOR_FORMAT and out.exists() and out.stat().st_size:
        raise ConfigError(
            f"--output {output_path!r} exists; a .npy file does not say what wrote it, so predict replaces none: "
            "delete it or choose another file name"
        )
    if out.exists() and not _written_by_predict(out):
        raise ConfigError(
            f"--output {output_path!r} exists and is not a predictions file of `tuneforge predict`; choose another "
            "file name or delete that file"
        )


def predict_file(
    model_dir: str,
    input_path: str,
    output_path: str,
    text_columns: list[str] | None = None,
    batch_size: int | None = None,
    max_length: int | None = None,
    dimensions: int | None = None,
    precision: str | None = None,
) -> int:
    """Write one JSON line (a table's row for a .csv or .tsv) per input row (in input order), or a sentence encoder's
    vectors (a .npy matrix when `output_path` ends in .npy); returns the number of rows.
    Left out (None): the default of PredictOptions."""
    paths = {"model_dir": model_dir, "input": input_path, "output": output_path}
    given = {"text_column": text_columns, "batch_size": batch_size, "max_length": max_length}
    options = parse_options(PredictOptions, {**paths, **given, "dimensions": dimensions, "precision": precision})
    check_model_path(model_dir)
    check_local("--input", input_path)
    check_output_file(output_path, input_path, model_dir)
    reader = getattr(_task_class_of(model_dir), "read_predict_inputs", None)  # a task with its own input rows
    texts = reader(input_path, text_columns) if reader else read_inputs(model_dir, input_path, text_columns)
    out = Path(output_path)
    predictor = load_predictor(model_dir, max_length=options.max_length)
    predictor.precision.use(options.precision)  # every predictor's forwards (tasks/base.ServingPrecision)
    from tuneforge.backends.precision import emulated_bf16_note

    if note := emulated_bf16_note(options.precision, predictor.precision.device):
        print(note, file=sys.stderr, flush=True)
    items = [t[0] if isinstance(t, tuple) and len(t) == 1 else t for t in texts]
    vectors = getattr(predictor, "embedding_size", None) is not None  # a sentence encoder's
    if not vectors:
        check_predicts_vectors_only_where_asked(options, predictor.task)
    elif out.suffix.lower() == VECTOR_FORMAT:
        written = write_matrix(out, predictor.encode(items, options.batch_size, options.dimensions))
        note_cuts(predictor)
        return written
    extra = {"dimensions": options.dimensions} if vectors else {}
    preds = predictor.predict(items, batch_size=options.batch_size, **extra)
    write_predictions(out, [{"index": i, **p} for i, p in enumerate(preds)])
    note_cuts(predictor)
    return len(preds)


def write_predictions(out: Path, rows: list[dict]) -> None:
    """`rows` as JSON lines, or as a table where `out`'s name says .csv or .tsv (a list or dict in a cell as its
    JSON text, a missing or undefined number as an empty cell, as pandas writes it)."""
    separator = OUTPUT_FORMATS[out.suffix.lower()]
    out.parent.mkdir(parents=True, exist_ok=True)
    with (
        replacing(out, what="--output", then=NO_ROOM_THEN) as tmp,
        open(tmp, "w", encoding="utf-8", newline="") as fh,
    ):  # never leave a half-written file
        if separator == "lines":
            fh.writelines(json_text(row) + "\n" for row in rows)
            return
        import pandas as pd

        nested = [{k: json_text(v) if isinstance(v, (list, dict)) else v for k, v in row.items()} for row in rows]
        pd.DataFrame(nested).to_csv(fh, sep=separator, index=False)


def note_cuts(predictor) -> None:
    """One `note:` line on stderr when the predictor cut inputs to its max_length (the output's rows, whose format
    is fixed, say nothing of it): how many of how many, and how to keep them whole where the model reads more."""
    counted = getattr(predictor, "last_cut", None)  # (NER and QA read a long text in windows: nothing is cut)
    if not counted or not counted.count:
        return
    model = getattr(predictor, "model", None) or getattr(getattr(predictor, "encoder", None), "model", None)
    positions = context_length(model.config) if model is not None else None
    if positions and counted.limit >= positions:
        way_out = f"the model reads no more than its {positions} positions"
    else:
        way_out = "raise --max-length to keep them whole"
    print(f"note: {counted} ({way_out})", file=sys.stderr, flush=True)


def check_predicts_vectors_only_where_asked(options: PredictOptions, task: str) -> None:
    """--dimensions and a .npy --output are for models that answer with vectors; one line for any other model."""
    if options.dimensions is not None:
        raise ConfigError(
            f"--dimensions keeps the first dimensions of a sentence encoder's vectors; model {options.model_dir!r} "
            f"({task}) does not answer with vectors: leave it out"
        )
    if Path(options.output).suffix.lower() == VECTOR_FORMAT:
        raise ConfigError(
            f"--output {options.output!r} names a .npy matrix of vectors; model {options.model_dir!r} ({task}) "
            "answers with JSON lines: name a .jsonl file"
        )


def write_matrix(out: Path, vectors: np.ndarray) -> int:
    """`vectors` (a float32 matrix, a row per input) as a .npy file; returns the number of rows."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with (
        replacing(out, what="--output", then=NO_ROOM_THEN) as tmp,
        open(tmp, "wb") as fh,
    ):  # never leave a half-written file
        np.save(fh, vectors, allow_pickle=False)
    return len(vectors)


def cmd_predict(ns: argparse.Namespace) -> int:
    options = parse_options(PredictOptions, ns)  # every flag checked before any file or model is read
    n = predict_file(
        options.model_dir,
        options.input,
        options.output,
        options.text_column,
        options.batch_size,
        options.max_length,
        options.dimensions,
        options.precision,
    )
    print(f"wrote {n} prediction{'' if n == 1 else 's'} to {options.output}", flush=True)
    return 0


def add_arguments(p) -> None:
    """`tuneforge predict`'s arguments: PredictOptions' fields (the CLI lists the command and its help)."""
    add_model_flags(p, PredictOptions)
    p.set_defaults(func=cmd_predict)
