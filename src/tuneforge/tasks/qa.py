"""Extractive question answering (SQuAD): the answer is a span of the context, found by start and end logits.

Data: SQuAD v1.1/v2.0 JSON or jsonl rows (data/squad.py), or the hub's `squad`. A context longer than a
window is cut into windows of --max-length tokens (qa's default 384, as transformers' run_qa.py, unless
--max-length is given; at most the model's positions) that share --doc-stride tokens (default
max_length // 3); only the context is cut, never the question. A training window's target is the
answer's first and last token, or [CLS] where the answer is not wholly inside the window or the
question has none. The loss is (CE(start) + CE(end)) / 2 per window over its real tokens, summed and
normalised by the number of windows across accumulation and ranks. --max-train-samples and
--max-eval-samples count questions (each with all its windows).

Evaluation follows run_qa.py's postprocessing (utils_qa.py): in each window the n_best start and end
tokens give the candidate spans (inside the context, end >= start, at most max_answer_length tokens,
scored start_logit + end_logit); an example's answer is the best span over all its windows, and in
SQuAD 2.0 mode (some question has no answer) the empty answer when the smallest window null score
([CLS] start + end) exceeds that span's score by more than null_score_diff_threshold. Exact match and
F1 are the official SQuAD evaluation scripts' (their normalisation; v2.0's rules in 2.0 mode), x100,
over whole examples: every window is gathered from every rank and grouped by example, so each example
counts once however its windows were spread.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from tuneforge.adapters import load_pretrained_model
from tuneforge.artifacts import (
    check_max_length_fits,
    check_vocabulary_fits,
    context_length,
    from_pretrained,
    inference_device,
    load_tokenizer,
)
from tuneforge.config import EVAL, MAX_TOKENS
from tuneforge.data.squad import check_examples, check_squad_file, find_split_files, from_hf, read_squad
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
    set_pad_token,
)
from tuneforge.tasks.length_runs import length_batches

if TYPE_CHECKING:
    import datasets

DEFAULT_MAX_LENGTH = 384  # run_qa.py's max_seq_length: a question and its context want more than classification's 128
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
POSITIONS = ("start_positions", "end_positions", "cls_index")


# ---- the official SQuAD scores ----------------------------------------------------------------
PUNCTUATION = set(string.punctuation)
ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(text: str) -> str:
    """The official scripts' normalisation: lower case, punctuation removed, articles (a, an, the) removed,
    whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in PUNCTUATION)
    return " ".join(ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, gold: str, version_2: bool = False) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if version_2 and (not pred or not ref):  # evaluate-v2.0.py: an empty answer scores 1 against an empty one only
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def answer_scores(prediction: str, golds: list[str], version_2: bool = False) -> tuple[float, float]:
    """(exact match, F1) of one prediction: the best over its gold answers, as evaluate-v1.1.py scores it
    (version_2: as evaluate-v2.0.py, where golds that normalise to nothing are dropped and none means '')."""
    if version_2:
        golds = [g for g in golds if normalize_answer(g)] or [""]
    golds = golds or [""]
    exact = max(float(normalize_answer(prediction) == normalize_answer(g)) for g in golds)
    return exact, max(token_f1(prediction, g, version_2) for g in golds)


def squad_metrics(predictions: list[str], golds: list[list[str]], version_2: bool = False) -> dict[str, float]:
    """exact_match and f1 (x100) over examples; in 2.0 mode also over those with and without answers."""
    scores = [answer_scores(p, g, version_2) for p, g in zip(predictions, golds)]
    out = {
        "exact_match": 100 * float(np.mean([s[0] for s in scores])) if scores else float("nan"),
        "f1": 100 * float(np.mean([s[1] for s in scores])) if scores else float("nan"),
    }
    if version_2:
        for name, has in (("has_answer", True), ("no_answer", False)):
            part = [s for s, g in zip(scores, golds) if bool(g) == has]  # evaluate-v2.0.py: bool(qa['answers'])
            if part:
                out[f"{name}_exact_match"] = 100 * float(np.mean([s[0] for s in part]))
                out[f"{name}_f1"] = 100 * float(np.mean([s[1] for s in part]))
    return out


# ---- windows and spans --------------------------------------------------------------------------
def require_fast(tokenizer, path: str) -> None:
    if not tokenizer.is_fast:
        raise ConfigError(
            f"model {path!r} has a slow (Python) tokenizer; extractive QA needs a fast one for the character "
            "offsets of its tokens: save a tokenizer.json with the model (AutoTokenizer.from_pretrained(..., "
            "use_fast=True))"
        )


def question_room(tokenizer, max_length: int, stride: int) -> int:
    """The most tokens a question may have: a window holds it, the special tokens and more than `stride`
    context tokens (the tokenizer refuses to cut a context into windows that share all they hold)."""
    return max_length - tokenizer.num_special_tokens_to_add(pair=True) - stride - 1


def check_window_room(tokenizer, max_length: int, stride: int) -> None:
    """ConfigError where windows of `max_length` tokens sharing `stride` hold no question token (each question
    would be refused as too long for a room below 1), naming the least --max-length that does (sharing a third)."""
    if question_room(tokenizer, max_length, stride) >= 1:
        return
    least = next(n for n in range(max_length + 1, MAX_TOKENS) if question_room(tokenizer, n, n // 3) >= 1)
    raise ConfigError(
        f"--max-length {max_length} leaves no room for a question: a window holds it, the special tokens and more "
        f"than the {stride} tokens consecutive windows share; give at least {least}"
    )


def question_lengths(tokenizer, questions: list[str]) -> list[int]:
    ids = tokenizer([q.lstrip() for q in questions], add_special_tokens=False)["input_ids"]
    return [len(x) for x in ids]


def encode_windows(tokenizer, questions: list[str], contexts: list[str], max_length: int, stride: int):
    """(encoding, window -> its question's index, offsets, [CLS] index) of every window of every question.

    Only the context is cut: into windows of `max_length` tokens that share `stride` tokens. `offsets`
    are each token's (start, end) character offsets in the context, None for tokens outside the context
    (question, special tokens), as utils_qa.py keeps them. A tokenizer that pads on the left (XLNet)
    takes the context first, as run_qa.py does."""
    question_first = tokenizer.padding_side == "right"
    questions = [q.lstrip() for q in questions]  # run_qa.py: leading spaces would only take window room
    enc = tokenizer(
        questions if question_first else contexts,
        contexts if question_first else questions,
        truncation="only_second" if question_first else "only_first",
        max_length=max_length,
        stride=stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
    )
    context_id = 1 if question_first else 0
    offsets, cls = [], []
    for i, ids in enumerate(enc["input_ids"]):
        seq = enc.sequence_ids(i)
        offsets.append([tuple(o) if seq[k] == context_id else None for k, o in enumerate(enc["offset_mapping"][i])])
        cls.append(ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in ids else 0)
    return enc, list(enc["overflow_to_sample_mapping"]), offsets, cls


def answer_tokens(offsets: list, starts: list[int], texts: list[str], cls: int) -> tuple[int, int]:
    """The first and last token of the (first) answer in a window, or (cls, cls) when the question has no
    answer or the answer is not wholly inside the window's context."""
    inside = [k for k, o in enumerate(offsets) if o is not None]
    if not texts or not inside:
        return cls, cls
    start_char = starts[0]
    end_char = start_char + len(texts[0])
    if offsets[inside[0]][0] > start_char or offsets[inside[-1]][1] < end_char:
        return cls, cls
    first = max(k for k in inside if offsets[k][0] <= start_char)
    last = min(k for k in inside if offsets[k][1] >= end_char)
    return first, last


def window_features(batch, tokenizer, max_length: int, stride: int, evaluating: bool) -> dict[str, list]:
    """Batched: questions -> window features (answer positions; evaluation also keeps each window's
    example index and context offsets)."""
    enc, sample, offsets, cls = encode_windows(tokenizer, batch["question"], batch["context"], max_length, stride)
    out = {k: enc[k] for k in MODEL_INPUTS if k in enc}
    positions = [
        answer_tokens(offsets[i], batch["answers_start"][j], batch["answers_text"][j], cls[i])
        for i, j in enumerate(sample)
    ]
    out["start_positions"] = [p[0] for p in positions]
    out["end_positions"] = [p[1] for p in positions]
    out["cls_index"] = cls
    out["length"] = [len(x) for x in enc["input_ids"]]
    if evaluating:
        out["example"] = [batch["example"][j] for j in sample]
        out["offset_mapping"] = offsets
    return out


def best_span(start_logits, end_logits, offsets, n_best: int, max_answer_length: int):
    """(score, start char, end char, start token, end token) of a window's best span, or None.

    Candidates as utils_qa.py takes them: the `n_best` highest start and end logits, spans inside the
    context, end >= start, at most `max_answer_length` tokens; score = start logit + end logit."""
    starts = np.argsort(-start_logits, kind="stable")[:n_best]
    ends = np.argsort(-end_logits, kind="stable")[:n_best]
    best = None
    for s in starts.tolist():
        if offsets[s] is None:
            continue
        for e in ends.tolist():
            if offsets[e] is None or e < s or e - s + 1 > max_answer_length:
                continue
            score = float(start_logits[s]) + float(end_logits[e])
            if best is None or score > best[0]:
                best = (score, offsets[s][0], offsets[e][1], s, e)
    return best


def better(a, b):
    """The better of two (score, start char, end char, ...) spans; equal scores: the earlier, then shorter,
    span, so the choice does not depend on the order windows arrive in."""
    if a is None or b is None:
        return a if b is None else b
    return a if (a[0], -a[1], -a[2]) >= (b[0], -b[1], -b[2]) else b


def pick(span, null_score: float, version_2: bool, threshold: float):
    """An example's answer from its best span and its smallest window null score: the span, or None (no answer)."""
    if span is None or (version_2 and null_score - span[0] > threshold):
        return None
    return span


def masked_logits(logits: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Padding positions take no probability: the loss of a window does not depend on its batch's padding."""
    logits = logits.float()
    if attention_mask is None:
        return logits
    return logits.masked_fill(attention_mask == 0, torch.finfo(logits.dtype).min)


class AnswerStream(MetricStream):
    """Per window: its example, its null score and its best span (score, character offsets); answers are
    chosen per example in `compute`, from the windows of every rank."""

    def __init__(self, task: QuestionAnsweringTask) -> None:
        if task.eval_examples is None:
            raise ConfigError(
                "qa evaluation scores answers against the validation questions' contexts and answers: pass the "
                "raw validation data (question, context, answers), not tokenized features"
            )
        self.task = task
        self.windows: list[tuple] = []
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.count = torch.zeros((), dtype=torch.float64)

    def update(self, outputs, batch, valid) -> None:
        options = self.task.options
        starts = outputs.start_logits.detach().float().cpu().numpy()
        ends = outputs.end_logits.detach().float().cpu().numpy()
        for row in torch.nonzero(valid).flatten().tolist():
            offsets = batch["offset_mapping"][row]
            n, cls = len(offsets), int(batch["cls_index"][row])
            s, e = starts[row, :n], ends[row, :n]
            span = best_span(s, e, offsets, options.n_best_size, options.max_answer_length)
            null = float(s[cls]) + float(e[cls])
            self.windows.append((int(batch["example"][row]), null, span[:3] if span else None))
        loss, n = self.task.compute_loss(outputs, batch, row_mask=valid)
        self.loss_sum += loss.detach().double().cpu()
        self.count += n.detach().double().cpu()

    def compute(self, backend) -> dict[str, float]:
        threshold, examples = self.task.options.null_score_diff_threshold, self.task.eval_examples
        nulls: dict[int, float] = {}
        spans: dict[int, tuple | None] = {}
        for part in backend.gather_objects(self.windows):
            for example, null, span in part:
                nulls[example] = min(nulls.get(example, math.inf), null)
                spans[example] = better(spans.get(example), span)
        order = sorted(nulls)
        predictions = []
        for example in order:
            chosen = pick(spans[example], nulls[example], self.task.version_2, threshold)
            predictions.append("" if chosen is None else examples["context"][example][chosen[1] : chosen[2]])
        out = squad_metrics(predictions, [examples["answers"][i] for i in order], self.task.version_2)
        return self.with_loss(backend, out, len(order))


class QAOptions(TaskOptions):
    doc_stride: int | None = Field(
        None,
        gt=0,
        le=MAX_TOKENS,
        description="tokens that consecutive windows of a long context share (default: max_length // 3)",
        json_schema_extra=EVAL,
    )
    max_answer_length: int = Field(
        30, gt=0, le=MAX_TOKENS, description="longest answer, in tokens", json_schema_extra=EVAL
    )
    n_best_size: int = Field(
        20, gt=0, le=10_000, description="start and end candidates scored per window", json_schema_extra=EVAL
    )
    null_score_diff_threshold: float = Field(
        0.0,
        ge=-1e6,
        le=1e6,
        description="SQuAD v2: answer nothing when the null score beats the best span by more than this",
        json_schema_extra=EVAL,
    )


class QuestionAnsweringTask(Task):
    Options = QAOptions
    model_kind = "a question-answering model"
    pads_with_tokenizer = True
    model_classes = "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"
    best_metric = "f1"
    greater_is_better = True

    def __init__(self, config) -> None:
        super().__init__(config)
        data = config.data
        if data.text_columns or data.label_column:
            raise ConfigError(
                "--task qa reads the columns question, context and answers (the SQuAD form: answers "
                '{"text": [...], "answer_start": [...]}); drop --text-column and --label-column'
            )
        self.user_max_length = data.max_length if "max_length" in data.model_fields_set else None
        self.max_length = self.user_max_length or DEFAULT_MAX_LENGTH
        self.doc_stride = self._stride()
        self.version_2 = False  # set from the data: some question without answers
        self.eval_examples: dict[str, list] | None = None  # the validation questions' ids, contexts, answers
        self.check_local_files(check_squad_file, find_split_files)

    def _stride(self) -> int:
        given = self.options.doc_stride
        stride = given or self.max_length // 3
        if stride >= self.max_length:
            length = f"--max-length {self.max_length}" + ("" if self.user_max_length else " (qa's default)")
            raise ConfigError(
                f"--doc-stride {stride} must be below {length}: it is how many tokens consecutive windows of "
                f"{self.max_length} tokens share; use --doc-stride {max(self.max_length // 3, 1)} (the default, "
                "max_length // 3) or raise --max-length"
            )
        return stride

    def _fit_to_model(self, model_config) -> None:
        """No --max-length given: windows of at most the model's positions (run_qa.py takes the smaller too)."""
        limit = context_length(model_config)
        if self.user_max_length is None and limit and limit < self.max_length:
            self.max_length = limit
            self.doc_stride = self._stride()

    # ---- model -------------------------------------------------------------------------
    def load_tokenizer(self):
        from transformers import AutoConfig

        path = self.model_path()
        tokenizer = load_tokenizer(path)
        require_fast(tokenizer, path)
        set_pad_token(tokenizer, path)
        model_config = from_pretrained(AutoConfig, path, "the model config")
        self._fit_to_model(model_config)
        self.check_max_length(tokenizer, model_config)
        return tokenizer

    def load_model(self, tokenizer):
        from transformers import AutoConfig, AutoModelForQuestionAnswering

        path = self.model_path()
        model_config = from_pretrained(AutoConfig, path, "the model config")
        if getattr(model_config, "num_labels", 2) != 2:  # a classifier's config: the span head has 2 outputs
            model_config.num_labels = 2
        set_dropout(model_config, self.config.dropout)
        self.check_max_length(tokenizer, model_config)
        return load_pretrained_model(
            AutoModelForQuestionAnswering,
            path,
            self.model_kind,
            config=model_config,
            new_head=self.log,
            **self.pretrained_kwargs(),
        )

    def check_max_length(self, tokenizer, model_config) -> None:
        check_max_length_fits(self.max_length, model_config)

    # ---- raw data ----------------------------------------------------------------------
    def load_raw(self) -> datasets.DatasetDict:
        import datasets

        splits = self.read_local_splits(find_split_files, read_squad)
        if splits is None:
            return self._from_hub()
        splits = self._check(splits)  # before a hold-out, so errors name the file's own rows
        return datasets.DatasetDict(self.hold_out_if_needed(splits, "question"))

    def prepare_raw(self, splits: dict) -> datasets.DatasetDict:
        """Datasets in the hub's squad form: question, context, answers {"text", "answer_start"}, optional id."""
        import datasets

        self.files = {}
        raw = {split: from_hf(ds, f"the {split} data") for split, ds in splits.items() if ds is not None}
        return datasets.DatasetDict(self._check(raw))

    def _from_hub(self) -> datasets.DatasetDict:
        import datasets

        from tuneforge.data.sources import from_hub

        hub = from_hub("squad", None, "pass --data-dir with the SQuAD JSON files (train-v1.1.json, dev-v1.1.json)")
        raw = {split: from_hf(hub[split], f"squad {split}") for split in ("train", "validation")}
        return datasets.DatasetDict(self._check(raw))

    def _check(self, raw: dict) -> dict:
        for split, ds in raw.items():
            empty_check(ds, split)
            check_examples(ds, self._place(split))
        self.version_2 = any(not texts for ds in raw.values() for texts in ds["answers_text"])
        return raw

    def _place(self, split: str):
        """(row, id) -> where a question of `split` is, for errors: 'FILE, question ID (row N)'."""
        where = self.files.get(split) or f"the {split} data"
        return lambda row, qid: f"{where}, row {row}" if qid == str(row) else f"{where}, question {qid!r} (row {row})"

    def select_examples(self, split: str, ds):
        """--max-train-samples / --max-eval-samples count questions, each with all its windows: applied to the
        raw questions before tokenizing (a question's windows are never split); features pass as they are."""
        if ds is not None and "input_ids" in ds.column_names:
            return ds
        return super().select_examples(split, ds)

    # ---- features ----------------------------------------------------------------------
    def tokenize(self, raw, tokenizer, log=print):
        import datasets

        require_fast(tokenizer, self.model_path())
        self._fit_to_model(self.peek_model_config())
        max_length, stride = self.max_length, self.doc_stride
        raw = {split: self.select_examples(split, ds) for split, ds in raw.items()}
        for split, ds in raw.items():  # every split before any is tokenized: a bad question costs no work
            self._check_question_lengths(split, ds, tokenizer)
        out = {}
        for split, ds in raw.items():
            ds = ds.add_column("example", list(range(len(ds))))
            evaluating = split != "train"
            if evaluating:  # every rank tokenizes, so every rank can turn spans into answer texts
                self.eval_examples = {"id": ds["id"], "context": ds["context"], "answers": ds["answers_text"]}

            def fn(batch, evaluating=evaluating):
                return window_features(batch, tokenizer, max_length, stride, evaluating)

            settings = {
                "task": "qa",
                "max_length": max_length,
                "doc_stride": stride,
                "features": "evaluation" if evaluating else "training",
            }
            cols = ["question", "context", "answers_text", "answers_start", "example"]
            out[split] = self.tokenize_split(split, ds, cols, fn, tokenizer, settings, log)
            log(
                f"{split}: {len(ds)} questions in {len(out[split])} windows of up to {max_length} tokens "
                f"(consecutive windows share {stride}: --doc-stride)"
            )
        return datasets.DatasetDict(out)

    def _check_question_lengths(self, split: str, ds, tokenizer) -> None:
        room = question_room(tokenizer, self.max_length, self.doc_stride)
        lengths = question_lengths(tokenizer, ds["question"])
        for i, n in enumerate(lengths):
            if n > room:
                where = self._place(split)(ds[i]["row"], ds[i]["id"])
                raise DataError(
                    f"{where}: the question is {n} tokens; windows of {self.max_length} tokens that share "
                    f"{self.doc_stride} (--max-length, --doc-stride) leave room for questions of at most {room}: "
                    "raise --max-length, lower --doc-stride, or shorten the question"
                )

    def collate(self, rows, tokenizer):
        positions = {k: rows.pop(k) for k in POSITIONS if k in rows}
        offsets, example = rows.pop("offset_mapping", None), rows.pop("example", None)
        rows.pop("length", None)
        # padded on the right whatever the tokenizer's side: token positions and offsets stay as tokenized
        batch = dict(tokenizer.pad(rows, return_tensors="pt", padding_side="right"))
        for k, v in positions.items():
            batch[k] = torch.tensor(v, dtype=torch.long)
        if offsets is not None:
            batch["offset_mapping"], batch["example"] = offsets, example
        return batch

    # ---- loss and metrics --------------------------------------------------------------
    def compute_loss(self, outputs, batch, row_mask=None):
        mask = batch.get("attention_mask")
        start = F.cross_entropy(masked_logits(outputs.start_logits, mask), batch["start_positions"], reduction="none")
        end = F.cross_entropy(masked_logits(outputs.end_logits, mask), batch["end_positions"], reduction="none")
        per = (start + end) / 2
        if row_mask is None:
            return per.sum(), torch.tensor(float(per.shape[0]), device=per.device)
        return (per * row_mask).sum(), row_mask.sum().float()

    def metric_stream(self):
        return AnswerStream(self)

    def export_info(self) -> dict:
        options = self.options
        return {
            **super().export_info(),
            "max_length": self.max_length,
            "doc_stride": self.doc_stride,
            "max_answer_length": options.max_answer_length,
            "n_best_size": options.n_best_size,
            "null_score_diff_threshold": options.null_score_diff_threshold,
            "version_2": self.version_2,
            "text_columns": ["question", "context"],  # `tuneforge predict` reads these columns unless told others
        }

    @staticmethod
    def claims_folder(model_dir: str) -> bool:
        return architecture_ends(model_dir, "ForQuestionAnswering")  # a hub model's folder: run as its head says

    @staticmethod
    def make_predictor(model_dir: str, **kwargs):
        return AnswerPredictor(model_dir, **kwargs)


def masked_softmax(x: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    z = np.where(allowed, x.astype(np.float64), -np.inf)
    p = np.exp(z - z.max())
    return p / p.sum()


class AnswerPredictor:
    """`AnswerPredictor("runs/qa/model").predict([("Where does Ana live?", "Ana lives in Lima.")])` -> per pair
    {"answer", "start", "end" (character offsets: context[start:end] == answer), "score"}.

    The answer is chosen as evaluation chooses it: the best span over the context's windows, with the
    windows and limits of training (tuneforge.json; another max_length shares a third of it).
    score: the span's probability in its window, the softmax of the start and of the end logits over
    the window's context tokens and [CLS], multiplied (as transformers' question-answering pipeline
    reports it). A model trained with unanswerable questions (SQuAD 2.0) answers "" with start and end
    -1 where its no-answer score wins by more than the threshold; score is then the no-answer
    probability. No span at all (only possible with tiny limits): "", -1, -1 and score 0."""

    regression = False
    accepts = ("pairs",)  # serve: {"pairs": [[question, context], ...]}
    task = "qa"

    def __init__(self, model_dir: str, device: str | None = None, max_length: int | None = None) -> None:
        from transformers import AutoModelForQuestionAnswering

        folder = open_predictor_folder(model_dir, max_length)
        model_dir, info, config = folder.path, folder.info, folder.config
        archs = getattr(config, "architectures", None) or []
        if archs and not any(a.endswith("ForQuestionAnswering") for a in archs):
            raise ConfigError(f"model {model_dir!r} is a {archs[0]}, not a question-answering model")
        self.max_length = predict_max_length(max_length, info.get("max_length"), DEFAULT_MAX_LENGTH, config)
        # the trained windows' stride, or a third of other windows (--max-length, or the model's limit)
        same = self.max_length == info.get("max_length") and info.get("doc_stride")
        self.doc_stride = int(info["doc_stride"]) if same else self.max_length // 3
        self.max_answer_length = int(info.get("max_answer_length") or 30)
        self.n_best_size = int(info.get("n_best_size") or 20)
        self.version_2 = bool(info.get("version_2", False))
        self.threshold = float(info.get("null_score_diff_threshold") or 0.0)
        self.tokenizer = load_tokenizer(model_dir)
        require_fast(self.tokenizer, model_dir)
        check_window_room(self.tokenizer, self.max_length, self.doc_stride)
        check_vocabulary_fits(self.tokenizer, config, model_dir)
        set_pad_token(self.tokenizer, model_dir)
        self.model = load_pretrained_model(
            AutoModelForQuestionAnswering, model_dir, "a question-answering model"
        ).eval()
        self.device = inference_device(device)
        self.model.to(self.device)
        self.precision = ServingPrecision(self.model, self.device)
        self.labels: list[str] = []  # serve's /health: a QA model has no classes

    @torch.inference_mode()
    def predict(self, inputs, batch_size: int = 32) -> list[dict]:
        """One dict per (question, context) pair, in input order; `batch_size` windows per forward pass."""
        pairs = self.check_inputs(inputs)
        if not pairs:
            return []
        questions, contexts = [q for q, _ in pairs], [c for _, c in pairs]
        enc, sample, offsets, cls = encode_windows(
            self.tokenizer, questions, contexts, self.max_length, self.doc_stride
        )
        keys = [k for k in MODEL_INPUTS if k in enc]
        lengths = np.array([len(x) for x in enc["input_ids"]])
        nulls: list[tuple[float, float]] = [(math.inf, 0.0)] * len(pairs)  # (smallest null score, its probability)
        spans: list[tuple | None] = [None] * len(pairs)  # (score, start, end, probability)
        for idx in length_batches(lengths.tolist(), batch_size, on_cpu=self.device.type == "cpu"):
            rows = {k: [enc[k][i] for i in idx] for k in keys}
            batch = self.tokenizer.pad(rows, return_tensors="pt", padding_side="right").to(self.device)
            with self.precision.autocast():
                out = self.model(**batch)
            starts, ends = out.start_logits.float().cpu().numpy(), out.end_logits.float().cpu().numpy()
            for j, w in enumerate(idx):
                n, c, p = int(lengths[w]), cls[w], sample[w]
                s, e = starts[j, :n], ends[j, :n]
                allowed = np.array([o is not None for o in offsets[w]])
                allowed[c] = True
                ps, pe = masked_softmax(s, allowed), masked_softmax(e, allowed)
                null = float(s[c]) + float(e[c])
                if null < nulls[p][0]:
                    nulls[p] = (null, float(ps[c] * pe[c]))
                span = best_span(s, e, offsets[w], self.n_best_size, self.max_answer_length)
                if span is not None:
                    spans[p] = better(spans[p], (*span[:3], float(ps[span[3]] * pe[span[4]])))
        results = []
        for p, context in enumerate(contexts):
            chosen = pick(spans[p], nulls[p][0], self.version_2, self.threshold)
            if chosen is None:
                score = nulls[p][1] if self.version_2 else 0.0
                results.append({"answer": "", "start": -1, "end": -1, "score": score})
            else:
                _, start, end, prob = chosen
                results.append({"answer": context[start:end], "start": start, "end": end, "score": prob})
        return results

    def check_inputs(self, inputs) -> list[tuple[str, str]]:
        """The (question, context) pairs, checked before any model work (serve: before they join a batch):
        DataError naming the input for a pair that is not two texts, an empty one, or a question too long."""
        pairs = self._pairs(inputs)
        room = question_room(self.tokenizer, self.max_length, self.doc_stride)
        for i, n in enumerate(question_lengths(self.tokenizer, [q for q, _ in pairs]), start=1):
            if n > room:
                raise DataError(
                    f"input {i}: the question is {n} tokens; windows of {self.max_length} tokens sharing "
                    f"{self.doc_stride} leave room for questions of at most {room}: shorten it or raise --max-length"
                )
        return pairs

    @staticmethod
    def _pairs(inputs) -> list[tuple[str, str]]:
        pairs = []
        for i, item in enumerate(inputs, start=1):
            if isinstance(item, str) or not isinstance(item, (tuple, list)) or len(item) != 2:
                raise DataError(
                    f"input {i}: question answering takes (question, context) pairs, not "
                    f"{type(item).__name__}s; `tuneforge predict`: --text-column question --text-column context"
                )
            question, context = item
            if not isinstance(question, str) or not isinstance(context, str):
                raise DataError(f"input {i}: the question and the context must be strings")
            if not question.strip():
                raise DataError(f"input {i}: the question is empty")
            if not context.strip():
                raise DataError(f"input {i}: the context is empty; the answer is a span of it")
            pairs.append((question, context))
        return pairs
