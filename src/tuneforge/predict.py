"""Prediction: a Python API and `tuneforge predict` on files.

Batches are sorted by length (little padding), and results come back in the input's order.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from tuneforge.errors import ConfigError, DataError
from tuneforge.export import read_model_info
from tuneforge.files import replacing

PREDICT_FORMATS = (".csv", ".tsv", ".jsonl")


class Predictor:
    """`Predictor("runs/x/model").predict(["a text", ...])` or `.predict([("s1", "s2"), ...])`."""

    def __init__(self, model_dir: str | Path, device: str | None = None, max_length: int | None = None) -> None:
        from transformers import AutoConfig, AutoModelForSequenceClassification

        from tuneforge.tasks.base import check_model_path, from_pretrained, load_tokenizer

        model_dir = str(model_dir)
        if max_length is not None and max_length < 1:
            raise ConfigError(f"--max-length must be at least 1, got {max_length}")
        check_model_path(model_dir)
        self.info = read_model_info(model_dir)
        config = from_pretrained(AutoConfig, model_dir, "the model config")
        archs = getattr(config, "architectures", None) or []
        if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
            raise ConfigError(
                f"model {model_dir!r} is a {archs[0]}, not a sequence-classification model; use `tuneforge "
                "generate` for language models"
            )
        self.max_length = max_length or self.info.get("max_length") or 512
        limit = getattr(config, "max_position_embeddings", None)
        if limit and self.max_length > limit:
            if max_length:
                raise ConfigError(
                    f"max_length {max_length} is above the model's limit of {limit} positions; use --max-length "
                    f"{limit} or less"
                )
            self.max_length = limit
        self.tokenizer = load_tokenizer(model_dir)
        self.model = from_pretrained(AutoModelForSequenceClassification, model_dir, "the model").eval()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model.to(self.device)
        self.regression = config.num_labels == 1
        self.labels = [config.id2label[i] for i in sorted(config.id2label)] if not self.regression else []
        self.text_columns = self.info.get("text_columns")

    @torch.inference_mode()
    def predict(self, inputs: Sequence[str | tuple[str, str]], batch_size: int = 64) -> list[dict]:
        """One dict per input, in input order: label, label_id, score, scores (or score for regression)."""
        pairs = [tuple(x) if isinstance(x, (tuple, list)) else (x,) for x in inputs]
        if not pairs:
            return []
        widths = {len(p) for p in pairs}
        if len(widths) != 1 or not widths <= {1, 2}:
            raise DataError("inputs must be all single texts or all (text, text) pairs")
        enc = self.tokenizer(*[list(col) for col in zip(*pairs)], truncation=True, max_length=self.max_length)
        lengths = np.array([len(ids) for ids in enc["input_ids"]])
        order = np.argsort(-lengths, kind="stable")  # longest first: similar lengths share a batch
        results: list[dict | None] = [None] * len(pairs)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            rows = {k: [enc[k][i] for i in idx] for k in enc.keys()}
            batch = self.tokenizer.pad(rows, return_tensors="pt").to(self.device)
            logits = self.model(**batch).logits.float()
            if self.regression:
                for i, v in zip(idx, logits.squeeze(-1).tolist()):
                    results[i] = {"score": v}
                continue
            probs = logits.softmax(-1)
            top = probs.argmax(-1).tolist()
            for i, t, p in zip(idx, top, probs.tolist()):
                results[i] = {
                    "label": self.labels[t],
                    "label_id": t,
                    "score": p[t],
                    "scores": {name: s for name, s in zip(self.labels, p)},
                }
        return results  # type: ignore[return-value]


def read_inputs(model_dir: str, input_path: str, text_columns: list[str] | None = None) -> list[tuple[str, ...]]:
    """The texts (or pairs) to predict, read and checked before any model is loaded."""
    from tuneforge.data.sources import check_file, read_table, require_columns

    p = check_file(input_path)
    if p.suffix.lower() not in PREDICT_FORMATS:
        raise DataError(
            f"--input {input_path!r}: predict reads {', '.join(PREDICT_FORMATS)} files; convert it to one of those"
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
    cols = text_columns or info.get("text_columns")
    if not cols:
        guesses = [c for c in ("text", "sentence") if c in df.columns]
        if not guesses:
            raise DataError(
                f"no text column in {input_path!r}; columns are: {', '.join(map(str, df.columns))}; pass --text-column"
            )
        cols = guesses[:1]
    if len(cols) > 2:
        raise ConfigError(f"--text-column takes one or two columns (a sentence pair), got {len(cols)}")
    require_columns(list(df.columns), cols, repr(input_path), "--text-column (once, or twice for pairs)")
    for c in cols:
        if df[c].isna().any():
            row = int(np.flatnonzero(df[c].isna().to_numpy())[0]) + 1
            raise DataError(f"column {c!r} of {input_path!r} is empty in row {row}; fill or drop that row")
    return list(zip(*[df[c].astype(str).tolist() for c in cols]))


def predict_file(
    model_dir: str,
    input_path: str,
    output_path: str,
    text_columns: list[str] | None = None,
    batch_size: int = 64,
    max_length: int | None = None,
) -> int:
    """Write one JSON line per input row (in input order); returns the number of rows."""
    from tuneforge.paths import check_output_dir
    from tuneforge.tasks.base import check_model_path

    if batch_size <= 0:
        raise ConfigError(f"--batch-size must be positive, got {batch_size}")
    if max_length is not None and max_length < 1:
        raise ConfigError(f"--max-length must be at least 1, got {max_length}")
    check_model_path(model_dir)
    texts = read_inputs(model_dir, input_path, text_columns)
    out = Path(output_path)
    if out.exists() and out.is_dir():
        raise ConfigError(f"--output {output_path!r} is a folder; pass a file name such as preds.jsonl")
    check_output_dir(str(out.parent), "--output", "the folder of --output")
    predictor = Predictor(model_dir, max_length=max_length)
    preds = predictor.predict(texts, batch_size=batch_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out) as tmp, open(tmp, "w", encoding="utf-8") as fh:  # never leave a half-written file
        for i, p in enumerate(preds):
            fh.write(json.dumps({"index": i, **p}) + "\n")
    return len(preds)
