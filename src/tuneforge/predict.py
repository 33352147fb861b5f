"""Prediction: a Python API and `tuneforge predict` on files.

Batches are sorted by length (little padding), and results come back in the input's order.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from tuneforge.errors import ConfigError, DataError


class Predictor:
    """`Predictor("runs/x/model").predict(["a text", ...])` or `.predict([("s1", "s2"), ...])`."""

    def __init__(self, model_dir: str | Path, device: str | None = None, max_length: int | None = None) -> None:
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        from tuneforge.tasks.base import check_model_path

        model_dir = str(model_dir)
        check_model_path(model_dir)
        info_file = Path(model_dir) / "tuneforge.json"
        self.info = json.loads(info_file.read_text()) if info_file.exists() else {}
        config = AutoConfig.from_pretrained(model_dir)
        archs = getattr(config, "architectures", None) or []
        if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
            raise ConfigError(f"model {model_dir!r} is a {archs[0]}, not a sequence-classification model; use `tuneforge generate` for language models")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model.to(self.device)
        self.max_length = max_length or self.info.get("max_length") or 512
        self.regression = config.num_labels == 1
        self.labels = [config.id2label[i] for i in sorted(config.id2label)] if not self.regression else []
        self.text_columns = self.info.get("text_columns")

    @torch.inference_mode()
    def predict(self, inputs: Sequence[str | tuple[str, str]], batch_size: int = 64) -> list[dict]:
        pairs = [x if isinstance(x, (tuple, list)) else (x,) for x in inputs]
        if not pairs:
            return []
        enc = self.tokenizer(*zip(*pairs), truncation=True, max_length=self.max_length)
        lengths = np.array([len(ids) for ids in enc["input_ids"]])
        order = np.argsort(-lengths, kind="stable")
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
                results[i] = {"label": self.labels[t], "label_id": t, "score": p[t],
                              "scores": {name: s for name, s in zip(self.labels, p)}}
        return results  # type: ignore[return-value]


def predict_file(model_dir: str, input_path: str, output_path: str, text_columns: list[str] | None = None,
                 batch_size: int = 64, max_length: int | None = None) -> int:
    from tuneforge.data.sources import read_table, require_columns

    predictor = Predictor(model_dir, max_length=max_length)
    df = read_table(input_path)
    cols = text_columns or predictor.text_columns
    if not cols:
        guesses = [c for c in ("text", "sentence") if c in df.columns]
        if not guesses:
            raise DataError(f"no text column in {input_path!r}; columns are: {', '.join(map(str, df.columns))}; pass --text-column")
        cols = guesses[:1]
    require_columns(list(df.columns), cols, repr(input_path), "--text-column")
    texts = list(zip(*[df[c].astype(str).tolist() for c in cols]))
    preds = predictor.predict(texts, batch_size=batch_size)
    out = Path(output_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        for i, p in enumerate(preds):
            fh.write(json.dumps({"index": i, **p}) + "\n")
    return len(preds)
