"""Multiple choice (SWAG, CODAH, question + choices): one score per choice, softmax over the choices.

Each choice is encoded as the pair (context, prefix + ending), as transformers' run_swag.py does,
and the model (`AutoModelForMultipleChoice`) scores every choice of a row together. The loss is
the cross-entropy over a row's choices, summed over rows; the metric is accuracy, gathered from
every rank (each row once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from tuneforge.adapters import load_pretrained_model
from tuneforge.artifacts import check_vocabulary_fits, from_pretrained, inference_device, load_tokenizer
from tuneforge.config import EVAL
from tuneforge.data.choices import (
    check_choice_counts,
    check_choice_texts,
    choice_label,
    find_split_files,
    read_choices,
)
from tuneforge.data.sources import check_file
from tuneforge.data.tokenize import Cut, CutCount, check_room_for_text, encode_within, report_cuts
from tuneforge.errors import ConfigError, DataError
from tuneforge.options import TaskOptions
from tuneforge.tasks.base import (
    MetricStream,
    ServingPrecision,
    Task,
    architecture_ends,
    empty_check,
    open_predictor_folder,
    predict_max_length,
    set_dropout,
)
from tuneforge.tasks.length_runs import length_batches

if TYPE_CHECKING:
    import datasets

MAX_CHOICES = 64  # choices of one input a predictor takes (SWAG, HellaSwag, ARC and PIQA have 2 to 5)
# a predictor's input: what it reads, and the row's own id and label, which a labelled row carries along unread
INPUT_KEYS = frozenset(("question", "prefix", "choices", "id", "label"))


def choice_pairs(context: str, prefix: str, choices: list[str]) -> tuple[list[str], list[str]]:
    """The (first, second) texts of each choice: the context, and the prefix followed by the ending."""
    return [context] * len(choices), [f"{prefix} {c}".strip() for c in choices]


def given_choice_rows(ds, where: str) -> tuple[list[str], list[list[str]]]:
    """The questions and choices of a dataset given to fit / validate, checked as a file's are (a text each, numbers
    taken as their text); DataError naming the row otherwise (a text given for the list of choices: its characters)."""
    questions, choices = ds["question"], ds["choices"]
    for row, given in enumerate(choices, 1):
        if not isinstance(given, list):
            raise DataError(f"{where}, row {row}: choices must be a list of texts (got {type(given).__name__})")
    check_choice_texts(questions, choices, where)
    return [str(q) for q in questions], [[str(c) for c in given] for given in choices]


def given_prefixes(ds, where: str) -> list[str]:
    """Each row's `prefix` of a dataset given to fit / validate (the start its endings share; "" where it has none),
    checked as a question is."""
    if "prefix" not in ds.column_names:
        return [""] * len(ds)
    prefixes = ["" if p is None else p for p in ds["prefix"]]
    for row, prefix in enumerate(prefixes, 1):
        if isinstance(prefix, bool) or not isinstance(prefix, (str, int, float)):
            raise DataError(f"{where}, row {row}: prefix holds {prefix!r}, not a text; give it as a string")
    return [str(p) for p in prefixes]


class ChoiceStream(MetricStream):
    def __init__(self, task: MultipleChoiceTask) -> None:
        self.task = task
        self.preds: list[np.ndarray] = []
        self.labels: list[np.ndarray] = []
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.count = torch.zeros((), dtype=torch.float64)

    def update(self, outputs, batch, valid) -> None:
        keep = valid.cpu()
        self.preds.append(outputs.logits.argmax(-1).cpu()[keep].numpy())
        self.labels.append(batch["labels"].cpu()[keep].numpy())
        loss, _ = self.task.compute_loss(outputs, batch, row_mask=valid)
        self.loss_sum += loss.detach().double().cpu()
        self.count += keep.sum()

    def compute(self, backend) -> dict[str, float]:
        mine = (np.concatenate(self.preds or [np.zeros(0)]), np.concatenate(self.labels or [np.zeros(0)]))
        gathered = backend.gather_objects(mine)
        preds = np.concatenate([g[0] for g in gathered])
        labels = np.concatenate([g[1] for g in gathered])
        accuracy = float((preds == labels).mean()) if len(labels) else float("nan")
        return self.with_loss(backend, {"accuracy": accuracy}, int(len(labels)))


class MultipleChoiceOptions(TaskOptions):
    data_format: Literal["auto", "codah"] = Field(
        "auto",
        description="auto reads SWAG columns (sent1, sent2, ending0..) or question + choices; codah reads "
        "CODAH's headerless TSV (category, question, 4 endings, answer index)",
        json_schema_extra=EVAL,
    )


class MultipleChoiceTask(Task):
    Options = MultipleChoiceOptions
    model_kind = "a multiple-choice model"
    model_classes = "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES"
    best_metric = "accuracy"
    greater_is_better = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.check_local_files(check_file, find_split_files)

    # ---- model -------------------------------------------------------------------------
    def load_tokenizer(self):
        from transformers import AutoConfig

        tokenizer = load_tokenizer(self.model_path())
        self.check_max_length(tokenizer, from_pretrained(AutoConfig, self.model_path(), "the model config"))
        return tokenizer

    def load_model(self, tokenizer):
        from transformers import AutoConfig, AutoModelForMultipleChoice

        path = self.model_path()
        model_config = set_dropout(from_pretrained(AutoConfig, path, "the model config"), self.config.dropout)
        self.check_max_length(tokenizer, model_config)
        return load_pretrained_model(
            AutoModelForMultipleChoice,
            path,
            self.model_kind,
            config=model_config,
            new_head=self.log,
            **self.pretrained_kwargs(),
        )

    # ---- raw data ----------------------------------------------------------------------
    def load_raw(self) -> datasets.DatasetDict:
        import datasets

        splits = self.read_local_splits(find_split_files, lambda path: read_choices(path, self.options.data_format))
        if splits is None:
            return self._from_hub()
        for split, ds in splits.items():
            empty_check(ds, split)
        self._check_same_width(splits)
        return datasets.DatasetDict(self.hold_out_if_needed(splits, "row"))

    def _from_hub(self) -> datasets.DatasetDict:
        import datasets

        from tuneforge.data.sources import from_hub

        hub = from_hub("swag", "regular", "pass --data-dir or --train-file/--validation-file with SWAG-style rows")
        raw = {}
        for split in ("train", "validation"):
            ds = hub[split]
            choices = [list(c) for c in zip(*(ds[f"ending{i}"] for i in range(4)))]
            raw[split] = datasets.Dataset.from_dict(
                {
                    "context": ds["sent1"],
                    "prefix": ds["sent2"],
                    "choices": choices,
                    "label": ds["label"],
                    "row": list(range(1, len(ds) + 1)),
                }
            )
        return datasets.DatasetDict(raw)

    def prepare_raw(self, splits: dict) -> datasets.DatasetDict:
        import datasets

        raw = {}
        for split, ds in splits.items():
            if ds is None:
                continue
            cols = ds.column_names
            if not {"question", "choices", "label"} <= set(cols):
                raise DataError(
                    f"the {split} dataset has columns {', '.join(cols)}; multiple choice takes question, choices "
                    "(a list of texts) and label (the right choice's index)"
                )
            n, where = len(ds), f"the {split} dataset"
            questions, choices = given_choice_rows(ds, where)
            labels = [choice_label(v, row, where, len(cs)) for row, (v, cs) in enumerate(zip(ds["label"], choices), 1)]
            raw[split] = datasets.Dataset.from_dict(
                {
                    "context": questions,
                    "prefix": given_prefixes(ds, where),
                    "choices": choices,
                    "label": labels,
                    "row": list(range(1, n + 1)),
                }
            )
            empty_check(raw[split], split)
        self._check_same_width(raw)
        return datasets.DatasetDict(raw)

    def _check_same_width(self, splits: dict) -> None:
        """Every split has as many choices per row as the first (a model's head is not tied to it, but the
        batches are rows x choices)."""
        widths = {}
        for split, ds in splits.items():
            where = self.files.get(split, f"the {split} data")
            widths[split] = check_choice_counts(ds["choices"], lambda row, where=where: f"{where}, row {row}")
        if len(set(widths.values())) > 1:
            shown = ", ".join(f"{s}: {w}" for s, w in widths.items())
            raise DataError(f"the splits have different numbers of choices per row ({shown}); give every row the same")

    # ---- features ----------------------------------------------------------------------
    def tokenize(self, raw, tokenizer, log=print):
        import datasets

        max_length = self.config.data.max_length
        raw = {split: self.select_examples(split, ds) for split, ds in raw.items()}

        def fn(batch):
            out = {"input_ids": [], "attention_mask": [], "token_type_ids": [], "labels": [], "length": []}
            out["choice_cut"] = []  # counted in the log line, then dropped
            for context, prefix, choices, label in zip(
                batch["context"], batch["prefix"], batch["choices"], batch["label"]
            ):
                first, second = choice_pairs(context, prefix, choices)
                enc, cut = encode_within(tokenizer, {"text": first, "text_pair": second}, max_length)
                for key in ("input_ids", "attention_mask", "token_type_ids"):
                    if key in enc:
                        out[key].append(enc[key])
                out["labels"].append(label)
                out["length"].append(max(len(x) for x in enc["input_ids"]))
                out["choice_cut"].append(any(cut))
            return {k: v for k, v in out.items() if v}

        settings = {
            "task": "multiple-choice",
            "max_length": max_length,
            "pairs": "context, prefix + ending",
            "cut_flags": True,
        }
        cols = ["context", "prefix", "choices", "label"]
        rows = "questions with a choice (and its context)"
        cuts = [Cut("choice_cut", rows, "max_length", max_length or tokenizer.model_max_length, "--max-length")]
        return datasets.DatasetDict(
            {
                split: report_cuts(split, self.tokenize_split(split, ds, cols, fn, tokenizer, settings, log), cuts, log)
                for split, ds in raw.items()
            }
        )

    def collate(self, rows, tokenizer):
        labels = rows.pop("labels", None)
        rows.pop("length", None)
        n_rows, n_choices = len(rows["input_ids"]), len(rows["input_ids"][0])
        flat = {k: [c for row in v for c in row] for k, v in rows.items()}
        batch = {k: v.view(n_rows, n_choices, -1) for k, v in tokenizer.pad(flat, return_tensors="pt").items()}
        if labels is not None:
            batch["labels"] = torch.tensor(labels, dtype=torch.long)
        return batch

    # ---- loss and metrics --------------------------------------------------------------
    def compute_loss(self, outputs, batch, row_mask=None):
        per = F.cross_entropy(outputs.logits.float(), batch["labels"], reduction="none")
        if row_mask is not None:
            per = per * row_mask
        return per.sum(), torch.tensor(float(per.shape[0]), device=per.device)

    def metric_stream(self):
        return ChoiceStream(self)

    @staticmethod
    def claims_folder(model_dir: str) -> bool:
        return architecture_ends(model_dir, "ForMultipleChoice")  # a hub model's folder: run as its head says

    @staticmethod
    def make_predictor(model_dir: str, **kwargs):
        return ChoicePredictor(model_dir, **kwargs)

    @staticmethod
    def read_predict_inputs(path: str, text_columns=None) -> list[dict]:
        """`tuneforge predict` input: rows of a SWAG csv or a question + choices jsonl (a label, if any, unused)."""
        if text_columns:  # the rows' own columns say what each text is: a column named here would go unread
            raise ConfigError(
                "--text-column: a multiple-choice model reads each row's question and choices (or SWAG's sent1, "
                "sent2, ending0, ending1, ...); leave it out and name the file's columns so"
            )
        ds = read_choices(path, need_labels=False)
        return [
            {"question": c, "prefix": p, "choices": cs} for c, p, cs in zip(ds["context"], ds["prefix"], ds["choices"])
        ]


class ChoicePredictor:
    """`ChoicePredictor(model_dir).predict([{"question": ..., "choices": [...]}, ...])` -> per row the chosen
    index (`label`), its text (`choice`), its probability (`score`) and every choice's (`scores`)."""

    regression = False
    accepts = ("inputs",)
    task = "multiple-choice"
    labels: list[str] = []

    def __init__(self, model_dir: str, device: str | None = None, max_length: int | None = None) -> None:
        from transformers import AutoModelForMultipleChoice

        folder = open_predictor_folder(model_dir, max_length)
        self.max_length = predict_max_length(max_length, folder.info.get("max_length"), 512, folder.config)
        self.tokenizer = load_tokenizer(model_dir)
        check_room_for_text(self.max_length, self.tokenizer, 2)  # (context, prefix + ending)
        check_vocabulary_fits(self.tokenizer, folder.config, model_dir)
        self.model = load_pretrained_model(AutoModelForMultipleChoice, model_dir, "a multiple-choice model").eval()
        self.device = inference_device(device)
        self.model.to(self.device)
        self.precision = ServingPrecision(self.model, self.device)
        self.last_cut: CutCount | None = None  # of the last inputs predicted (`tuneforge predict` says it)

    @staticmethod
    def check_inputs(rows: list[dict]) -> None:
        """Each row a {"question": text, "choices": [2 to MAX_CHOICES texts]} (a "prefix" text optional), checked
        before any model work (serve: before the request joins a batch); DataError naming the input otherwise. A
        row's choices run in one forward, hence the bound (one request must not hold a million of them)."""
        shape = f'{{"question": text, "choices": [at least 2 texts, at most {MAX_CHOICES}]}} (a "prefix" text optional)'
        for i, row in enumerate(rows, start=1):
            if not isinstance(row, dict) or not isinstance(row.get("choices"), list) or len(row["choices"]) < 2:
                raise DataError(f"input {i}: each input is {shape}")
            if len(row["choices"]) > MAX_CHOICES:
                raise DataError(
                    f"input {i} has {len(row['choices'])} choices, above {MAX_CHOICES}; each input is {shape}"
                )
            unknown = sorted(set(row) - INPUT_KEYS)
            if unknown:  # a "context" sent for "question" would be scored as an empty question
                raise DataError(f"input {i}: unknown key {unknown[0]!r}; each input is {shape}")
            if not all(isinstance(c, str) for c in row["choices"]):
                raise DataError(f"input {i}: every choice must be a text; each input is {shape}")
            for key in ("question", "prefix"):
                if row.get(key) is not None and not isinstance(row[key], str):
                    raise DataError(f"input {i}: {key!r} must be a text; each input is {shape}")

    def _encode(self, rows: list[dict]) -> tuple[dict[str, list], list[bool]]:
        """Every (context, prefix + ending) pair of `rows`, choice after choice, row after row, tokenized unpadded,
        and which pairs were cut to max_length."""
        first, second = [], []
        for row in rows:
            a, b = choice_pairs(row.get("question") or "", row.get("prefix") or "", row["choices"])
            first += a
            second += b
        return encode_within(self.tokenizer, {"text": first, "text_pair": second}, self.max_length)

    @torch.inference_mode()
    def predict(self, rows: list[dict], batch_size: int = 16) -> list[dict]:
        """The best choice of each row, in input order; rows with as many choices share batches, and on a CPU rows
        of similar length (`length_batches` over each row's longest pair)."""
        self.check_inputs(rows)
        out: list[dict | None] = [None] * len(rows)
        by_width: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_width.setdefault(len(row["choices"]), []).append(i)
        cut_rows = 0
        for width, members in by_width.items():
            enc, cut = self._encode([rows[i] for i in members])
            pairs = [range(m * width, (m + 1) * width) for m in range(len(members))]
            cut_rows += sum(any(cut[j] for j in pair) for pair in pairs)
            lengths = [max(len(enc["input_ids"][j]) for j in pair) for pair in pairs]
            for run in length_batches(lengths, batch_size, on_cpu=self.device.type == "cpu"):
                picked = {k: [enc[k][j] for r in run for j in pairs[r]] for k in enc.keys()}
                padded = self.tokenizer.pad(picked, return_tensors="pt")
                inputs = {k: v.view(len(run), width, -1).to(self.device) for k, v in padded.items()}
                with self.precision.autocast():
                    logits = self.model(**inputs).logits
                probs = logits.float().softmax(-1).cpu()
                for r, p in zip(run, probs.tolist()):
                    i, best = members[r], int(np.argmax(p))
                    out[i] = {"label": best, "choice": rows[i]["choices"][best], "score": p[best], "scores": p}
        self.last_cut = CutCount(cut_rows, len(rows), "questions with a choice (and its context)", self.max_length)
        return out  # type: ignore[return-value]
