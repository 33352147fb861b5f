"""Sequence classification: single sentences, sentence pairs and regression (GLUE, BBC, files), and
the predictor of the models it exports."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from tuneforge.adapters import load_pretrained_model
from tuneforge.artifacts import (
    check_vocabulary_fits,
    from_pretrained,
    generation_family,
    inference_device,
    load_tokenizer,
)
from tuneforge.data.sources import (
    bundled_bbc_news,
    check_file,
    check_separator,
    misspelling_hint,
    read_split,
    require_columns,
)
from tuneforge.data.tokenize import Cut, CutCount, check_room_for_text, encode_within, report_cuts
from tuneforge.errors import ConfigError, DataError
from tuneforge.tasks.base import (
    MetricStream,
    ServingPrecision,
    Task,
    empty_check,
    held_out_rows,
    hold_out_validation,
    open_predictor_folder,
    predict_max_length,
    score_last_token_of,
    set_dropout,
    set_pad_token,
)
from tuneforge.tasks.glue import GLUE, glue_files
from tuneforge.tasks.length_runs import length_batches

if TYPE_CHECKING:
    import datasets

TEXT_GUESSES = (
    ("sentence1", "sentence2"),
    ("text",),
    ("sentence",),
    ("question1", "question2"),
    ("premise", "hypothesis"),
)


def classification_metrics(
    preds: np.ndarray, labels: np.ndarray, names: tuple[str, ...], num_labels: int
) -> dict[str, float]:
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    out: dict[str, float] = {}
    if num_labels == 1:
        if "pearson" in names:
            out["pearson"] = correlation(pearsonr, preds, labels)
        if "spearman" in names:
            out["spearman"] = correlation(spearmanr, preds, labels)
        return out
    if "accuracy" in names:
        out["accuracy"] = float(accuracy_score(labels, preds))
    if "f1" in names:
        average = "binary" if num_labels == 2 else "macro"
        out["f1"] = float(f1_score(labels, preds, average=average, zero_division=0))
    if "mcc" in names:
        with warnings.catch_warnings():  # one label in both: sklearn's defined 0.0, with a note meant for its users
            warnings.filterwarnings("ignore", message="A single label was found", category=UserWarning)
            out["mcc"] = float(matthews_corrcoef(labels, preds))
    return out


def correlation(scipy_correlation, preds: np.ndarray, labels: np.ndarray) -> float:
    """scipy's pearsonr or spearmanr of the two; nan where undefined (fewer than 2 rows, a side constant, an infinite
    score of an fp16 forward), without scipy's warnings of it (the metric is written as null; --quiet keeps stderr to
    errors; embedding_eval.sts_metrics does the same)."""
    if len(preds) < 2 or np.ptp(preds) == 0 or np.ptp(labels) == 0:
        return float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(scipy_correlation(preds, labels)[0])


class ClassificationStream(MetricStream):
    """Keeps predicted ids (or values) and labels, never the full logits."""

    def __init__(self, task: ClassificationTask) -> None:
        self.task = task
        self.preds: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []
        self.loss_sum = None
        self.count = None

    def update(self, outputs, batch, valid) -> None:
        logits = outputs.logits.float()
        preds = logits.squeeze(-1) if self.task.num_labels == 1 else logits.argmax(-1)
        self.preds.append(preds[valid].detach())
        self.labels.append(batch["labels"][valid].detach())
        loss, _ = self.task.compute_loss(outputs, batch, row_mask=valid)
        n = valid.sum()
        self.loss_sum = loss.detach() if self.loss_sum is None else self.loss_sum + loss.detach()
        self.count = n if self.count is None else self.count + n

    def compute(self, backend) -> dict[str, float]:
        preds = torch.cat(self.preds).cpu().numpy() if self.preds else np.zeros(0)
        labels = torch.cat(self.labels).cpu().numpy() if self.labels else np.zeros(0)
        gathered = backend.gather_objects((preds, labels))
        preds = np.concatenate([g[0] for g in gathered])
        labels = np.concatenate([g[1] for g in gathered])
        dev = backend.device
        totals = torch.stack(
            [
                (self.loss_sum if self.loss_sum is not None else torch.zeros((), device=dev)).float().to(dev),
                (self.count if self.count is not None else torch.zeros((), device=dev)).float().to(dev),
            ]
        )
        totals = backend.reduce_sum(totals)
        out = classification_metrics(preds, labels, self.task.metrics, self.task.num_labels)
        out["loss"] = float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")
        out["num_examples"] = int(len(labels))
        return out


class ClassificationTask(Task):
    model_kind = "a sequence-classification model"
    pads_with_tokenizer = True
    model_classes = "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"

    def __init__(self, config) -> None:
        super().__init__(config)
        name = config.task
        data = config.data
        self.glue = None
        if name.startswith("glue/"):
            sub = name.split("/", 1)[1]
            if sub not in GLUE:
                raise ConfigError(f"unknown GLUE task {sub!r}; choose one of: {', '.join('glue/' + k for k in GLUE)}")
            self.glue = GLUE[sub]
            self.text_columns = list(data.text_columns or self.glue.text_columns)
            self.label_column = data.label_column or "label"
            self.label_names = list(self.glue.label_names) if self.glue.label_names else None
            self.regression = self.glue.label_names is None
            self.metrics = self.glue.metrics
        else:
            self.text_columns = list(data.text_columns) if data.text_columns else None
            self.label_column = data.label_column or "label"
            self.label_names = None  # from the training data
            self.regression = name == "regression"
            self.metrics = ("pearson", "spearman") if self.regression else ("accuracy", "f1")
        self.num_labels = 1 if self.regression else None
        self.held_out: tuple[int, int] | None = None  # (rows, split_seed) of a training file 10% was held out of
        self.best_metric = self.metrics[0]
        self.greater_is_better = True
        self._check_inputs()

    def _check_inputs(self) -> None:
        """Cheap checks of paths and flags, so a typo fails before any tokenizer, data or model work."""
        cfg, data = self.config, self.config.data
        if data.text_columns is not None and not 1 <= len(data.text_columns) <= 2:
            raise ConfigError(
                f"--text-column takes one or two columns (a sentence pair), got {len(data.text_columns)}: "
                f"{data.text_columns}"
            )
        if data.text_columns and len(set(data.text_columns)) < len(data.text_columns):
            raise ConfigError(
                f"--text-column names {data.text_columns[0]!r} twice; a sentence pair needs two different columns"
            )
        if data.text_columns:
            self._check_label_not_text(self.text_columns)
        for f in (data.train_file, data.validation_file):
            if f:
                check_file(f)
        if data.data_dir and (self.glue is None or data.train_file or data.validation_file):
            raise ConfigError(
                "--data-dir reads a GLUE folder and goes with --task glue/NAME; for your own files use "
                "--train-file/--validation-file"
            )
        if data.data_dir:
            glue_files(cfg.task.split("/", 1)[1], data.data_dir)

    def load_tokenizer(self):
        """The tokenizer; also rejects a max_length above the model's limit before any data work."""
        from transformers import AutoConfig

        tokenizer = super().load_tokenizer()
        set_pad_token(tokenizer, self.model_path())
        model_config = from_pretrained(AutoConfig, self.model_path(), "the model config")
        self.check_max_length(tokenizer, model_config)
        return tokenizer

    # ---- raw data ----------------------------------------------------------------------
    def load_raw(self) -> datasets.DatasetDict:
        cfg, data = self.config, self.config.data
        own_data = not (data.train_file or data.validation_file)  # files given are read, never passed over
        if self.glue is not None and own_data:
            from tuneforge.tasks.glue import load_glue

            raw = load_glue(self.config.task.split("/", 1)[1], data.data_dir)
        elif cfg.task == "bbc-news" and own_data:
            raw = bundled_bbc_news(split_seed=data.split_seed)  # its labels: topic names (sorted by label_set)
        else:
            raw = self._load_files()
        for split in raw:
            empty_check(raw[split], split)
        self._resolve_columns(raw)
        return raw

    def prepare_raw(self, splits: dict) -> datasets.DatasetDict:
        import datasets

        raw = datasets.DatasetDict({k: v for k, v in splits.items() if v is not None})
        for split in raw:
            empty_check(raw[split], split)
        self._resolve_columns(raw)
        return raw

    def _load_files(self) -> datasets.DatasetDict:
        import datasets

        data = self.config.data
        self.held_out = None
        if not data.train_file:
            if data.validation_file and self.label_names is not None:  # evaluating a fine-tuned model
                return datasets.DatasetDict(validation=read_split(data.validation_file))
            raise ConfigError(f"task {self.config.task!r} needs data: pass --train-file (and --validation-file)")
        splits = {"train": read_split(data.train_file)}
        if data.validation_file:
            splits["validation"] = read_split(data.validation_file)
        else:  # hold out 10% of train, fixed by split_seed
            self.log("no --validation-file: holding out 10% of the training file for validation")
            self.held_out = (len(splits["train"]), data.split_seed)
            splits = hold_out_validation(splits["train"], data.split_seed, "row", "add rows or pass --validation-file")
        return datasets.DatasetDict(splits)

    def _where(self, split: str) -> str:
        data = self.config.data
        if split == "validation" and self.held_out is not None:
            return f"the validation rows held out of the train data ({data.train_file})"
        path = data.train_file if split == "train" else data.validation_file
        return f"the {split} data ({path})" if path else f"the {split} data"

    def _row(self, split: str, i: int) -> int:
        """Row `i` of `split` as the file's own row (1-based, the header not counted), which a hold-out shuffled
        (an error's path only: the split is made again, of row numbers alone)."""
        return i + 1 if self.held_out is None else held_out_rows(*self.held_out)[split][i]

    def _resolve_columns(self, raw: datasets.DatasetDict) -> None:
        import datasets

        cols = next(iter(raw.values())).column_names
        if self.text_columns is None:
            for guess in TEXT_GUESSES:
                if all(c in cols for c in guess):
                    self.text_columns = list(guess)
                    break
            else:
                check_separator(cols, self._where(next(iter(raw))))
                raise DataError(
                    f"no text column found; columns are: {', '.join(cols)}; pass --text-column NAME (one or two)"
                )
        if len(self.text_columns) > 2:
            raise ConfigError(f"--text-column takes one or two columns, got {len(self.text_columns)}")
        self._check_label_not_text(self.text_columns)
        for split, ds in raw.items():
            require_columns(ds.column_names, self.text_columns, self._where(split), "--text-column")
            require_columns(ds.column_names, [self.label_column], self._where(split), "--label-column")
            for col in self.text_columns:
                feature = ds.features[col]
                if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
                    raise DataError(
                        f"text column {col!r} of {self._where(split)} holds {feature}, not text; pick the text "
                        "column with --text-column"
                    )
                empty = ds.data.column(col).null_count
                if empty:
                    raise DataError(
                        f"text column {col!r} of {self._where(split)} has {empty} empty (null) values; fill or drop "
                        "those rows"
                    )

    def _check_label_not_text(self, text_columns: list[str]) -> None:
        if self.label_column in text_columns:
            raise ConfigError(
                f"column {self.label_column!r} is both the text column and the label column; pass the column "
                "holding the text with --text-column and the one holding the labels with --label-column"
            )

    # ---- labels ------------------------------------------------------------------------
    def label_set(self, raw: datasets.DatasetDict) -> list[str] | None:
        """The classes, in id order: GLUE's names, a fine-tuned model's (adopt_model_labels), or the
        training split's distinct labels (integers by value, other labels by name). None: regression."""
        if self.regression:
            return None
        if self.label_names is not None:
            return list(self.label_names)
        split = "train" if "train" in raw else next(iter(raw))
        values = raw[split][self.label_column]
        self._check_no_empty_labels(values, split, raw[split].column_names)
        names = sorted(
            {str(v) for v in values},
            key=lambda s: (not s.lstrip("-").isdigit(), int(s) if s.lstrip("-").isdigit() else 0, s),
        )
        if split == "train" and len(names) < 2:
            raise DataError(
                f"{self._where(split)} has a single label, {names[0]!r}; a classifier needs examples of at least "
                f"two labels: add rows with another label (or pick the label column with --label-column)"
            )
        return names

    def use_labels(self, names: list[str] | None) -> None:
        if names is not None:
            self.label_names = list(names)
            self.num_labels = len(self.label_names)

    def _check_no_empty_labels(self, values, split: str, columns: list[str] = ()) -> None:
        for i, v in enumerate(values):
            if v is None or not str(v).strip():
                hint = misspelling_hint(self.label_column, columns)
                raise DataError(
                    f"row {self._row(split, i)} of {self._where(split)} has an empty label{hint}; fill it in or "
                    "drop the row"
                )

    def encode_labels(self, raw: datasets.DatasetDict) -> datasets.DatasetDict:
        """Labels as ids of the adopted label set (a float per row for regression), in a `labels` column."""
        import datasets

        col = self.label_column
        if self.regression:

            def to_float(ex_labels, split):
                out = []
                for i, v in enumerate(ex_labels):
                    try:
                        f = float(v)
                        if not math.isfinite(f):  # nan, and inf, whose squared error is inf at its first batch
                            raise ValueError
                    except (TypeError, ValueError):
                        raise DataError(
                            f"regression label {v!r} in {self._where(split)} (row {self._row(split, i)}) is not a "
                            "finite number; fix that row (or drop --task regression for class labels)"
                        ) from None
                    out.append(f)
                return out

            return datasets.DatasetDict(
                {s: ds.remove_columns(col).add_column("labels", to_float(ds[col], s)) for s, ds in raw.items()}
            )

        if self.label_names is None:
            raise RuntimeError("encode_labels needs the label set: call use_labels(label_set(raw)) first")
        index = {name: i for i, name in enumerate(self.label_names)}

        ids_allowed = self.glue is not None  # GLUE data (hub or glue_data) already holds label ids

        def to_ids(values, split):
            out = []
            for i, v in enumerate(values):
                key = str(v)
                if v is None or not key.strip():
                    raise DataError(
                        f"row {self._row(split, i)} of {self._where(split)} has an empty label; fill it in or drop "
                        "the row"
                    )
                if (
                    key not in index
                    and ids_allowed
                    and isinstance(v, (int, np.integer))
                    and 0 <= int(v) < len(self.label_names)
                ):
                    out.append(int(v))
                    continue
                if key not in index:
                    raise self._not_in_label_set(v, split, i)
                out.append(index[key])
            return out

        return datasets.DatasetDict(
            {s: ds.remove_columns(col).add_column("labels", to_ids(ds[col], s)) for s, ds in raw.items()}
        )

    def _not_in_label_set(self, value, split: str, i: int) -> DataError:
        fix = (
            "no training row is left with it: add rows with that label, or pass --validation-file"
            if split == "validation" and self.held_out is not None  # the hold-out took every row of that label
            else "fix the row or add that label to the training data"
        )
        return DataError(
            f"label {value!r} in {self._where(split)} (row {self._row(split, i)}) is not in the label set "
            f"[{', '.join(self.label_names)}]; {fix}"
        )

    def adopt_model_labels(self, model_config=None) -> None:
        """Evaluating a fine-tuned model: its saved id2label is the label set."""
        if self.regression or not (model_config or self.config.model):
            return
        from transformers import AutoConfig

        mc = model_config or from_pretrained(AutoConfig, self.config.model, "the model config")
        names = [mc.id2label[i] for i in sorted(mc.id2label)] if getattr(mc, "id2label", None) else []
        if not names or all(str(n).startswith("LABEL_") for n in names):
            return  # a base model: no label set of its own
        if self.label_names is not None and list(self.label_names) != names:
            raise ConfigError(
                f"model {self.config.model!r} predicts labels {names}, task {self.config.task!r} has "
                f"{list(self.label_names)}"
            )
        self.label_names = names

    # ---- features ----------------------------------------------------------------------
    def tokenize(self, raw, tokenizer, log=print):
        import datasets

        cols, max_length = self.text_columns, self.config.data.max_length
        # one row is one example: --max-train/eval-samples cut the rows, so a large set is not tokenized in full
        raw = {split: self.select_examples(split, ds) for split, ds in raw.items()}

        def fn(batch):
            texts = dict(zip(("text", "text_pair"), (batch[c] for c in cols)))
            enc, cut = encode_within(tokenizer, texts, max_length)
            enc["labels"] = batch["labels"]
            enc["length"] = [len(x) for x in enc["input_ids"]]
            enc["text_cut"] = cut  # counted in the log line, then dropped
            return enc

        settings = {
            "task": "classification",
            "columns": cols,
            "max_length": max_length,
            "truncation": True,
            "cut_flags": True,
        }
        rows = "texts" if len(cols) == 1 else "text pairs"
        cuts = [Cut("text_cut", rows, "max_length", max_length or tokenizer.model_max_length, "--max-length")]
        return datasets.DatasetDict(
            {
                split: report_cuts(
                    split, self.tokenize_split(split, ds, cols + ["labels"], fn, tokenizer, settings, log), cuts, log
                )
                for split, ds in raw.items()
            }
        )

    def collate(self, rows, tokenizer):
        labels = rows.pop("labels", None)
        rows.pop("length", None)
        batch = tokenizer.pad(rows, return_tensors="pt")
        if labels is not None:
            batch["labels"] = torch.tensor(labels, dtype=torch.float32 if self.regression else torch.long)
        return dict(batch)

    # ---- model -------------------------------------------------------------------------
    def load_model(self, tokenizer):
        from transformers import AutoConfig, AutoModelForSequenceClassification

        path = self.model_path()
        if self.regression:
            kwargs = {"num_labels": 1, "problem_type": "regression"}
        else:
            kwargs = {
                "num_labels": self.num_labels,
                "id2label": dict(enumerate(self.label_names)),
                "label2id": {n: i for i, n in enumerate(self.label_names)},
            }
        model_config = set_dropout(from_pretrained(AutoConfig, path, "the model config", **kwargs), self.config.dropout)
        self.check_max_length(tokenizer, model_config)
        model = load_pretrained_model(
            AutoModelForSequenceClassification,
            path,
            "a sequence-classification model",
            config=model_config,
            new_head=self.log,
            **self.pretrained_kwargs(),
        )
        score_last_token_of(model, tokenizer)
        return model

    def compute_loss(self, outputs, batch, row_mask=None):
        logits = outputs.logits
        labels = batch["labels"]
        if self.regression:
            per = F.mse_loss(logits.squeeze(-1).float(), labels.float(), reduction="none")
        else:
            per = F.cross_entropy(logits.float(), labels, reduction="none")
        if row_mask is not None:
            per = per * row_mask
        return per.sum(), torch.tensor(float(labels.shape[0]), device=logits.device)

    def metric_stream(self):
        return ClassificationStream(self)

    def export_info(self) -> dict:
        return {**super().export_info(), "text_columns": self.text_columns, "regression": self.regression}

    @staticmethod
    def make_predictor(model_dir: str, **kwargs):
        return ClassificationPredictor(model_dir, **kwargs)


class ClassificationPredictor:
    """`ClassificationPredictor("runs/x/model").predict(["a text", ...])` or `.predict([("s1", "s2"), ...])`."""

    accepts = ("texts", "pairs")  # what `tuneforge serve` takes for it

    def __init__(self, model_dir: str | Path, device: str | None = None, max_length: int | None = None) -> None:
        from transformers import AutoModelForSequenceClassification

        folder = open_predictor_folder(model_dir, max_length)
        model_dir, self.info, config = folder.path, folder.info, folder.config
        self.task = self.info.get("task") or "classification"
        archs = getattr(config, "architectures", None) or []
        if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
            if generation_family(config, {}) is None:  # a bare encoder (BertModel): it cannot generate either
                raise ConfigError(
                    f"model {model_dir!r} is a {archs[0]}, without a task head; predict and serve take a fine-tuned "
                    "model (train one with --task classification, or --task embedding for sentence vectors) or a "
                    "sentence-transformers folder"
                )
            raise ConfigError(
                f"model {model_dir!r} is a {archs[0]}, not a sequence-classification model; use `tuneforge "
                "generate` for language models"
            )
        self.max_length = predict_max_length(max_length, self.info.get("max_length"), 512, config)
        self.tokenizer = load_tokenizer(model_dir)
        check_vocabulary_fits(self.tokenizer, config, model_dir)
        set_pad_token(self.tokenizer, model_dir)  # a hub causal LM's classifier: batches pad with eos, as it trains
        trained_pairs = len(self.info.get("text_columns") or ()) == 2
        check_room_for_text(self.max_length, self.tokenizer, 2 if trained_pairs else 1)  # (pairs of another: predict)
        self.model = load_pretrained_model(AutoModelForSequenceClassification, model_dir, "the model").eval()
        score_last_token_of(self.model, self.tokenizer)
        self.device = inference_device(device)
        self.model.to(self.device)
        self.precision = ServingPrecision(self.model, self.device)
        self.regression = config.num_labels == 1
        # labels that each hold or not (a toxicity model): each its own sigmoid, as transformers' pipeline scores them
        self.multi_label = config.problem_type == "multi_label_classification"
        # a regressor of several outputs (valence, arousal, ...): each its own value, as the pipeline gives them
        self.outputs = config.problem_type == "regression" and not self.regression
        self.labels = [config.id2label[i] for i in sorted(config.id2label)] if not self.regression else []
        self.text_columns = self.info.get("text_columns")
        self.last_cut: CutCount | None = None  # of the last inputs predicted (`tuneforge predict` says it)

    @torch.inference_mode()
    def predict(self, inputs: Sequence[str | tuple[str, str]], batch_size: int = 64) -> list[dict]:
        """One dict per input, in input order: label, label_id, score, scores (or score for regression; scores alone,
        each output's value, for a regressor of several); scores are a softmax across the labels, or each label's
        sigmoid for a multi-label model (as transformers' pipeline)."""
        pairs = [tuple(x) if isinstance(x, (tuple, list)) else (x,) for x in inputs]
        if not pairs:
            return []
        widths = {len(p) for p in pairs}
        if len(widths) != 1 or not widths <= {1, 2}:
            raise DataError("inputs must be all single texts or all (text, text) pairs")
        texts = dict(zip(("text", "text_pair"), (list(col) for col in zip(*pairs))))
        check_room_for_text(self.max_length, self.tokenizer, len(texts))
        enc, cut = encode_within(self.tokenizer, texts, self.max_length)
        self.last_cut = CutCount(sum(cut), len(pairs), "texts" if len(texts) == 1 else "text pairs", self.max_length)
        lengths = [len(ids) for ids in enc["input_ids"]]
        results: list[dict | None] = [None] * len(pairs)
        for idx in length_batches(lengths, batch_size, on_cpu=self.device.type == "cpu"):
            rows = {k: [enc[k][i] for i in idx] for k in enc.keys()}
            batch = self.tokenizer.pad(rows, return_tensors="pt").to(self.device)
            with self.precision.autocast():
                logits = self.model(**batch).logits.float()
            if self.regression:
                for i, v in zip(idx, logits.squeeze(-1).tolist()):
                    results[i] = {"score": v}
                continue
            if self.outputs:
                for i, values in zip(idx, logits.tolist()):
                    results[i] = {"scores": dict(zip(self.labels, values))}
                continue
            probs = logits.sigmoid() if self.multi_label else logits.softmax(-1)
            top = probs.argmax(-1).tolist()
            for i, t, p in zip(idx, top, probs.tolist()):
                results[i] = {
                    "label": self.labels[t],
                    "label_id": t,
                    "score": p[t],
                    "scores": {name: s for name, s in zip(self.labels, p)},
                }
        return results  # type: ignore[return-value]
