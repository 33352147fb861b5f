"""Sentence embeddings (`--task embedding`): a sentence encoder (default: the bundled all-MiniLM-L6-v2) fine-tuned so
that related texts embed close together, exported as a folder that sentence-transformers loads.

The embedding: the model's last hidden states averaged over the attention mask, L2-normalised (`embed`,
`SentenceEncoder`; the exported modules.json tells sentence-transformers to compute the same). `tuneforge predict`
and `serve` (POST /v1/embeddings) run `EmbeddingPredictor`: the same vectors, of texts or token ids, whole or cut to
their first dimensions (renormalised).

Data: jsonl/json/csv/tsv/parquet rows (a .tsv read as GLUE writes it, without quoting: a field never holds a tab);
columns guessed from sentence-transformers' names or named with --text-column (2 or more, in order) and
--label-column (the score):
- (anchor, positive) pairs or (anchor, positive, negative[, negative_2...]) rows: the multiple-negatives ranking
  loss (InfoNCE, `mnrl`): each anchor's scaled cosine similarity to its positive against every positive of the
  batch and every hard negative (`scale` 20 = 1/temperature, as sentence-transformers);
- scored pairs (sentence1, sentence2, score; STS-B's TSV as shipped): CoSENT (sentence-transformers' CoSENTLoss), or
  `loss: cosine_mse`, the squared error of the cosine similarity to the score. Scores lie in [min_score,
  max_score] (0 to 5 by default, STS-B's range) and are mapped to 0-1; one outside is refused.
`matryoshka_dims` adds the loss of each leading slice of the embedding, renormalised (MatryoshkaLoss; equal weights
unless `matryoshka_weights`).
SQuAD (`tuneforge.data.retrieval`): a file in SQuAD's published JSON layout, or jsonl or parquet rows with question,
context and answers (the hub's form), is read as question -> paragraph pairs (query, positive): each answerable
question and the paragraph holding its answer, trained with mnrl; --data-dir also finds SQuAD's train*/dev* .json
files.

Evaluation (`tuneforge.tasks.embedding_eval`): besides the loss, scored pairs report the Spearman (the best model's
metric) and Pearson correlations of the cosine similarities with the scores; pairs and triplets report retrieval
of each distinct query over the split's whole collection of distinct positive and negative texts, exact search
with the normalised embeddings: ndcg@10 (the best model's metric), mrr@10, recall@1/10/100
(sentence-transformers' InformationRetrievalEvaluator's definitions), a query's relevant documents being the
positives of its rows.

How a batch becomes embeddings (`tuneforge.tasks.embedding_ops`): all its text columns together
(`stacked_columns`) packed side by side into rows without padding (`pack_texts`) where the first batch shows the
model honours the packing, else in runs of similar length (`split_by_length`); GradCache (`grad_cache_chunk`) embeds
a chunk at a time and reruns each in the backward. mnrl's candidates with the text of an anchor's own positive are
not its negatives (`mask_duplicate_negatives`). The trained folder at work (`tuneforge predict`, `serve`):
`tuneforge.tasks.sentence_encoder`.

Exact across data-parallel ranks: the candidates (and CoSENT's pairs) are gathered from every rank of the run's
data-parallel group (`Task.use_data_parallel`) with their gradients (`gather_rows`); each rank sums the loss over
its own anchors (CoSENT, a loss of the whole batch: that loss once per pair of this rank), so the Trainer's division
by the global count makes N ranks x batch B the same loss and gradients as one rank x N*B. Evaluation gathers the
same way and reports the loss (in-batch losses depend on the batch: N ranks at --eval-batch-size B equal one
process at N*B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator, model_validator

from tuneforge.adapters import load_pretrained_model
from tuneforge.artifacts import (
    context_length,
    from_pretrained,
    sentence_transformers_layout,
)
from tuneforge.config import EVAL
from tuneforge.data import squad
from tuneforge.data.retrieval import collection_ids, has_squad_columns, is_squad_json, squad_pairs
from tuneforge.data.sources import (
    check_file,
    check_separator,
    find_split_files,
    read_table,
    require_columns,
    to_dataset,
)
from tuneforge.data.tokenize import Cut, encode_within, report_cuts
from tuneforge.errors import ConfigError, DataError
from tuneforge.options import TaskOptions, comma_list
from tuneforge.tasks.base import Task, empty_check, set_dropout, set_pad_token
from tuneforge.tasks.embedding_eval import EmbeddingStream
from tuneforge.tasks.embedding_ops import (
    PACK_WIDTH,
    agreed_count,
    attention_window,
    cosent_loss,
    cosine_mse_losses,
    cut,
    embed,
    embed_cached,
    embed_grouped,
    embed_packed,
    embed_remembered,
    frozen_weights_in_float32,
    gather_rows,
    packing_holds,
    rank_offset,
    rank_sizes,
    split_to,
)
from tuneforge.tasks.length_runs import CPU_TOKENS_PER_FORWARD, length_groups
from tuneforge.tasks.sentence_encoder import EmbeddingPredictor, sentence_transformers_files

if TYPE_CHECKING:
    import datasets

# (anchor, positive) column names, as sentence-transformers' datasets name them; hard negatives follow
PAIR_GUESSES = (("anchor", "positive"), ("query", "positive"), ("sentence1", "sentence2"), ("question", "answer"))
SCORE_GUESSES = ("score", "label")
SPLIT_FILES = {
    "train": ("train",),
    "validation": ("validation", "valid", "dev", "val"),
}
FORMATS = (".jsonl", ".json", ".csv", ".tsv", ".parquet")
MAX_DIM = 1_000_000


# ---- options ---------------------------------------------------------------------------------------------------
class EmbeddingOptions(TaskOptions):
    loss: Literal["auto", "mnrl", "cosent", "cosine_mse"] = Field(
        "auto",
        description="auto: mnrl (multiple-negatives ranking, in-batch and hard negatives) for pairs and triplets, "
        "cosent for scored pairs; cosine_mse: the squared error of the cosine similarity to the score",
        json_schema_extra=EVAL,
    )
    scale: float = Field(
        20.0,
        gt=0,
        le=1e4,
        description="similarity scale (1/temperature) of the mnrl and cosent losses",
        json_schema_extra=EVAL,
    )
    matryoshka_dims: list[Annotated[int, Field(ge=1, le=MAX_DIM)]] | None = Field(
        None,
        description="also train these leading slices of the embedding, the loss summed over them (comma-separated, "
        "e.g. 384,256,128,64; each at most the model's hidden size)",
        json_schema_extra={**EVAL, "flag_kwargs": {"metavar": "DIMS"}},
    )
    matryoshka_weights: list[Annotated[float, Field(ge=0, le=1e6)]] | None = Field(
        None,
        description="the weight of each of --matryoshka-dims' losses (comma-separated; default: 1 each)",
        json_schema_extra={**EVAL, "flag_kwargs": {"metavar": "WEIGHTS"}},
    )
    grad_cache_chunk: int | None = Field(
        None,
        ge=1,
        le=MAX_DIM,
        description="GradCache: embed each training batch this many texts at a time, keeping no activations, then "
        "again a chunk at a time in the backward with the loss's gradients (sentence-transformers' Cached losses): "
        "the activation memory of a batch of this size, whatever --batch-size (the in-batch negatives) is; one "
        "more forward per step, the same loss and gradients",
        json_schema_extra={"flag_kwargs": {"metavar": "N"}},
    )
    mask_duplicate_negatives: bool = Field(
        True,
        description="mnrl: a candidate with the same text as an anchor's positive (a paragraph twice in a batch, "
        "once per question) is not counted as that anchor's negative",
        json_schema_extra=EVAL,
    )
    pack_texts: bool = Field(
        True,
        description="embed each training batch (on a CPU) in one forward of its texts packed side by side into rows "
        f"of about {PACK_WIDTH} tokens, each text attending only to itself: the same embeddings, loss and gradients "
        "without padding (random batches of short sentences are half padding). Checked on the first batch against the "
        "padded forward; a model that does not take packed rows (position ids, a 4D mask) falls back to "
        "--split-by-length",
    )
    split_by_length: bool = Field(
        True,
        description="embed each training batch (on a CPU) in runs of texts of similar length, each padded to its own "
        "longest: the same batch, its in-batch negatives and its loss, with fewer padding tokens (where "
        "--pack-texts is off or the model does not take packed rows)",
    )
    min_score: float = Field(
        0.0, ge=-1e6, le=1e6, description="the lowest score of scored pairs (mapped to 0)", json_schema_extra=EVAL
    )
    max_score: float = Field(
        5.0,
        ge=-1e6,
        le=1e6,
        description="the highest score of scored pairs (mapped to 1; STS-B's is 5); a score outside the range is "
        "refused",
        json_schema_extra=EVAL,
    )
    # in-batch negatives: random batches, as sentence-transformers draws them (length-sorted ones make the
    # negatives of a batch alike in length)
    run_defaults = {"data.group_by_length": False}
    nonfinite_suspects = ("--scale",)

    @field_validator("matryoshka_dims", "matryoshka_weights", mode="before")
    @classmethod
    def _split(cls, value):
        return comma_list(value)

    @model_validator(mode="after")
    def _consistent(self):
        dims, weights = self.matryoshka_dims, self.matryoshka_weights
        if dims is not None and len(set(dims)) < len(dims):
            raise ValueError(f"--matryoshka-dims names a dimension twice ({', '.join(map(str, dims))})")
        if weights is not None and (dims is None or len(weights) != len(dims)):
            raise ValueError(
                f"--matryoshka-weights gives {len(weights)} weight(s) for {len(dims or [])} --matryoshka-dims; give "
                "one per dimension"
            )
        if self.max_score <= self.min_score:
            raise ValueError(f"--max-score {self.max_score:g} must be above --min-score {self.min_score:g}")
        return self

    def idle_options(self) -> dict[str, str]:
        idle = {}
        if self.loss == "cosine_mse":
            idle["scale"] = (
                "is the similarity scale of the mnrl and cosent losses, and --loss cosine_mse has none; give --loss "
                "cosent"
            )
        if self.loss in ("cosent", "cosine_mse"):
            idle["mask_duplicate_negatives"] = (
                f"sets mnrl's in-batch negatives, and --loss {self.loss} has none; give --loss mnrl"
            )
        if self.loss == "mnrl":  # it refuses a score column, and guesses none
            for name in ("min_score", "max_score"):
                idle[name] = "maps the scores of scored pairs, and --loss mnrl reads none; give --loss cosent"
        return idle


# ---- outputs and metrics ---------------------------------------------------------------------------------------
@dataclass
class EmbeddingOutputs:
    """The pooled (not yet normalised) float32 embeddings of each text column of a batch: anchors (or sentence1)
    first, then positives (sentence2), then each hard-negative column."""

    embeddings: list[torch.Tensor]


# ---- the task --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Which columns of the data files are read: the texts (anchor, positive, negatives...) and the score."""

    texts: tuple[str, ...]
    score: str | None

    @property
    def shape(self) -> str:
        return "scored pairs" if self.score else "pairs" if len(self.texts) == 2 else "triplets"


# what evaluation batches carry besides the texts: the row's number, its query's and its documents' ids
EVAL_COLUMNS = ("row", "query_id", "doc_ids")


def text_key(k: int, name: str = "input_ids") -> str:
    """A batch's key of the k-th text column's `name` (input_ids, attention_mask): the first column's plain."""
    return name if k == 0 else f"{name}_{k}"


def stacked_columns(batch: dict, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of every text column's rows one under the other, column after column, each
    right-padded to the widest column's width (the padding masked)."""
    width = max(batch[text_key(k)].shape[1] for k in range(columns))
    ids, mask = [], []
    for k in range(columns):
        extra = width - batch[text_key(k)].shape[1]
        ids.append(F.pad(batch[text_key(k)], (0, extra)))
        mask.append(F.pad(batch[text_key(k, "attention_mask")], (0, extra)))
    return torch.cat(ids), torch.cat(mask)


class EmbeddingTask(Task):
    name = "embedding"
    model_kind = "a sentence encoder"
    pads_with_tokenizer = True
    Options = EmbeddingOptions
    training_data_flags = "--train-file (pairs, triplets or scored pairs)"

    def __init__(self, config) -> None:
        super().__init__(config)
        data = config.data
        if data.text_columns is not None:
            if len(data.text_columns) < 2:
                raise ConfigError(
                    f"--task embedding takes two or more --text-column: the anchor and the positive (or sentence1 "
                    f"and sentence2 of scored pairs), then any hard negatives; got {data.text_columns}"
                )
            if len(set(data.text_columns)) < len(data.text_columns):
                raise ConfigError(f"--text-column names a column twice: {data.text_columns}")
        self.layout: Layout | None = None
        self.eval_memo: dict[bytes, torch.Tensor] | None = None  # set during an evaluation step (eval_step)
        self.packs: bool | None = None  # pack_texts: whether the model takes packed rows (checked on a first batch)
        self.check_local_files(check_file, self._find_in_dir)
        self.check_dims(self.peek_model_config())
        self.check_sentence_transformers_base()

    @property
    def best_metric(self) -> str:
        """What picks the best model: spearman for scored pairs, ndcg@10 for pairs and triplets; the loss where the
        data came tokenized (no texts, so no metric but the loss)."""
        if self.layout is None:
            return "loss"
        return "spearman" if self.layout.score else "ndcg@10"

    @property
    def greater_is_better(self) -> bool:
        return self.best_metric != "loss"

    @property
    def reruns_in_backward(self) -> str | None:
        return None if self.options.grad_cache_chunk is None else "--grad-cache-chunk (GradCache)"

    # ---- settings ----------------------------------------------------------------------------------------------
    def check_dims(self, model_config) -> None:
        """--matryoshka-dims within the model's hidden size (when the config says it)."""
        dims, size = self.options.matryoshka_dims, getattr(model_config, "hidden_size", None)
        if dims and isinstance(size, int) and max(dims) > size:
            raise ConfigError(
                f"--matryoshka-dims {max(dims)} is above the embedding size of model {self.model_path()!r}, "
                f"{size}; give dimensions up to {size}"
            )

    def check_sentence_transformers_base(self) -> None:
        """A sentence-transformers folder as --model: a module after its pooling (a Dense projection) is refused (the
        task embeds the Transformer's mean-pooled states, and the export would leave the module's weights out); what
        else of its config the task does not apply (another pooling, its default prompt, lowercasing) is one line."""
        path = self.model_path()
        layout = sentence_transformers_layout(path) if Path(path).is_dir() else None
        if layout is None:
            return
        if layout.others:
            raise ConfigError(
                f"{path!r} is a sentence-transformers folder with {', '.join(layout.others)} after its pooling; "
                "--task embedding trains and evaluates a Transformer with mean pooling and Normalize only (its "
                "export would leave those weights out)"
            )
        differs = []
        if layout.pooling != "mean":
            differs.append(f"its {layout.pooling} pooling (mean pooling here)")
        if layout.prompt:
            differs.append(f"its default prompt {layout.prompt!r} (texts are embedded without it)")
        if layout.lowercase:
            differs.append("its do_lower_case (texts are not lowercased)")
        if differs:
            self.log(
                f"{path!r} is a sentence-transformers folder: --task embedding and its exported model do not keep "
                f"{'; '.join(differs)}"
            )

    def loss_name(self, scored: bool | None = None) -> str:
        """The loss that trains: the option, or (auto) the data's: cosent for scored pairs, else mnrl. `scored`:
        whether the batch at hand carries scores (None: as the data files' columns say)."""
        if self.options.loss != "auto":
            return self.options.loss
        if scored is None:
            scored = self.layout is not None and self.layout.score is not None
        return "cosent" if scored else "mnrl"

    def slices(self) -> list[tuple[int | None, float]]:
        """(leading dimensions, weight) of each loss term: the whole embedding alone without matryoshka_dims."""
        dims = self.options.matryoshka_dims
        if not dims:
            return [(None, 1.0)]
        return list(zip(dims, self.options.matryoshka_weights or [1.0] * len(dims)))

    # ---- raw data ----------------------------------------------------------------------------------------------
    @staticmethod
    def _find_in_dir(folder) -> dict:
        """train.jsonl, dev.tsv, ... in `folder`; where it holds none of those, SQuAD's train*/dev* .json files."""
        names = {split: [s + x for s in stems for x in FORMATS] for split, stems in SPLIT_FILES.items()}
        try:
            return find_split_files(
                folder,
                names,
                "holding train and dev files",
                "train or dev file (train.jsonl, dev.tsv, ...)",
            )
        except DataError as none:
            try:
                return squad.find_split_files(folder)
            except DataError:
                raise none from None

    def _read_file(self, path) -> datasets.Dataset:
        """A file's rows; SQuAD (its JSON layout, or question/context/answers rows) as (query, positive) pairs."""
        if is_squad_json(path):
            return self._squad(path)
        df = read_table(path, quoting_off=Path(path).suffix.lower() == ".tsv")
        if self.config.data.text_columns is None and has_squad_columns([str(c) for c in df.columns]):
            return self._squad(path, df)
        return to_dataset(df, where=f"file {str(path)!r}")

    def _squad(self, path, table=None) -> datasets.Dataset:
        read = squad_pairs(path, table)
        left = f"; {read.unanswerable} unanswerable questions left out" if read.unanswerable else ""
        self.log(
            f"SQuAD file {str(path)!r}: {read.questions} questions over {read.paragraphs} paragraphs, as (question, "
            f"paragraph) pairs{left}"
        )
        return read.rows

    def load_raw(self) -> datasets.DatasetDict:
        splits = self.read_local_splits(self._find_in_dir, self._read_file)
        if splits is None:
            raise ConfigError(
                "task 'embedding' needs data: pass --train-file pairs.jsonl (anchor/positive[/negative] or "
                "sentence1/sentence2/score rows) and --validation-file, or --data-dir"
            )
        return self._canonical(splits)

    def prepare_raw(self, splits: dict) -> datasets.DatasetDict:
        self.files = {}
        return self._canonical({split: ds for split, ds in splits.items() if ds is not None})

    def _canonical(self, splits: dict) -> datasets.DatasetDict:
        """Each split as text_0, text_1, ... (and score, mapped to 0-1), every row checked; 10% of the training
        rows held out where no validation split was given."""
        import datasets

        for split, ds in splits.items():
            empty_check(ds, split)
        splits = self._named_alike(splits)
        self.layout = self._resolve_layout(splits)
        self._check_loss_fits()
        out = {split: self._checked(split, ds) for split, ds in splits.items()}
        columns = ", ".join(self.layout.texts)
        if self.layout.score:
            columns += f", {self.layout.score} from {self.options.min_score:g} to {self.options.max_score:g} as 0-1"
        self.log(f"{self.layout.shape} ({columns}): {self.loss_name()} loss")
        return datasets.DatasetDict(self.hold_out_if_needed(out, "row"))

    def _where(self, split: str) -> str:
        return repr(self.files[split]) if self.files.get(split) else f"the {split} data"

    @staticmethod
    def _guessed_texts(cols: list[str]) -> tuple[str, ...] | None:
        """The text columns sentence-transformers' names give (a pair, then any hard negatives), or None."""
        pair = next((g for g in PAIR_GUESSES if all(c in cols for c in g)), None)
        negatives = [c for c in cols if c == "negative" or c.startswith(("negative_", "negative-"))]
        return None if pair is None else (*pair, *negatives)

    def _named_alike(self, splits: dict) -> dict:
        """Without --text-column, each split's guessed text columns renamed to the first split's where they are as
        many: SQuAD's dev file (read as query, positive) evaluates training pairs named anchor/positive."""
        if self.config.data.text_columns or len(splits) < 2:
            return splits
        first = "train" if "train" in splits else next(iter(splits))
        names = self._guessed_texts([str(c) for c in splits[first].column_names])
        out = {}
        for split, ds in splits.items():
            cols = [str(c) for c in ds.column_names]
            own = self._guessed_texts(cols)
            if names and own and len(own) == len(names):
                renames = {a: b for a, b in zip(own, names) if a != b and b not in cols}
                ds = ds.rename_columns(renames) if len(renames) == sum(a != b for a, b in zip(own, names)) else ds
            out[split] = ds
        return out

    def _resolve_layout(self, splits: dict) -> Layout:
        data = self.config.data
        first = "train" if "train" in splits else next(iter(splits))
        cols = [str(c) for c in splits[first].column_names]
        if data.text_columns:
            texts = tuple(data.text_columns)
        else:
            texts = self._guessed_texts(cols)
            if texts is None:
                check_separator(cols, self._where(first))
                raise DataError(
                    f"no text columns found in {self._where(first)}; columns are: {', '.join(cols)}; name them "
                    "anchor/positive[/negative] or sentence1/sentence2/score, or pass --text-column (twice or more)"
                )
            # hard negatives under another name (a list column, hard_negative) would silently train as pairs
            unread = [c for c in cols if "negative" in c.lower() and c not in texts]
            if unread:
                raise DataError(
                    f"column {unread[0]!r} of {self._where(first)} is not read: hard negatives are read from columns "
                    "named negative, negative_1, negative_2, ... (one text each); rename it, or name every text "
                    "column in order with --text-column"
                )
        score = data.label_column
        if score is None and len(texts) == 2 and self.options.loss != "mnrl":
            score = next((c for c in SCORE_GUESSES if c in cols and c not in texts), None)
        if score is not None and len(texts) != 2:
            raise ConfigError(
                f"scored pairs take two text columns, got {len(texts)} ({', '.join(texts)}); drop --label-column "
                "for rows with hard negatives"
            )
        for split, ds in splits.items():
            held = [str(c) for c in ds.column_names]
            require_columns(held, list(texts), self._where(split), "--text-column (twice or more)")
            if score:
                require_columns(held, [score], self._where(split), "--label-column (the score)")
        return Layout(texts=texts, score=score)

    def _check_loss_fits(self) -> None:
        loss, layout = self.options.loss, self.layout
        if loss == "mnrl" and layout.score:
            raise ConfigError(
                f"loss mnrl takes (anchor, positive) pairs; the data are scored pairs (score column "
                f"{layout.score!r}): use --loss cosent or cosine_mse, or drop --label-column"
            )
        if loss in ("cosent", "cosine_mse") and not layout.score:
            raise ConfigError(
                f"loss {loss} takes scored pairs (sentence1, sentence2, score); the data are {layout.shape} "
                f"({', '.join(layout.texts)}) without a score column: name it with --label-column, or use --loss mnrl"
            )

    def _checked(self, split: str, ds) -> datasets.Dataset:
        """text_k (and score) of one split; an empty or non-text value, or a score that is not a number in the
        stated range, is one line naming the row and the column."""
        import datasets

        columns = {}
        for k, col in enumerate(self.layout.texts):
            columns[f"text_{k}"] = self._texts(split, col, ds[col])
        if self.layout.score:
            columns["score"] = self._scores(split, self.layout.score, ds[self.layout.score])
        return datasets.Dataset.from_dict(columns)

    def _texts(self, split: str, col: str, values: list) -> list[str]:
        for i, v in enumerate(values):
            if v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str) and not v.strip()):
                raise DataError(
                    f"row {i + 1} of {self._where(split)} has an empty {col!r} text; fill it in or drop the row"
                )
            if not isinstance(v, str):
                raise DataError(f"row {i + 1} of {self._where(split)}: column {col!r} holds {v!r}, not text")
        return list(values)

    def _scores(self, split: str, col: str, values: list) -> list[float]:
        low, high = self.options.min_score, self.options.max_score
        out = []
        for i, v in enumerate(values):
            try:
                if isinstance(v, bool) or (isinstance(v, str) and not v.strip()):
                    raise ValueError
                score = float(v)
                if not math.isfinite(score):
                    raise ValueError
            except (TypeError, ValueError):
                raise DataError(
                    f"row {i + 1} of {self._where(split)}: score {v!r} in column {col!r} is not a number"
                ) from None
            if not low <= score <= high:
                raise DataError(
                    f"row {i + 1} of {self._where(split)}: score {score:g} in column {col!r} is outside the stated "
                    f"range {low:g} to {high:g}; fix the row, or state the range with --min-score/--max-score"
                )
            out.append((score - low) / (high - low))
        return out

    # ---- features ----------------------------------------------------------------------------------------------
    def tokenize(self, raw, tokenizer, log=print):
        import datasets

        max_length = self.config.data.max_length
        raw = {split: self.select_examples(split, ds) for split, ds in raw.items()}
        if raw.get("validation") is not None:
            raw["validation"] = self._numbered(raw["validation"], log)

        def fn(batch):
            out, lengths, cut = {}, None, None
            n = sum(1 for key in batch if key.startswith("text_"))
            for k in range(n):
                enc, text_cut = encode_within(tokenizer, {"text": batch[f"text_{k}"]}, max_length)
                out[text_key(k)] = enc["input_ids"]
                sizes = [len(ids) for ids in enc["input_ids"]]
                lengths = sizes if lengths is None else [a + b for a, b in zip(lengths, sizes)]
                cut = text_cut if cut is None else [a or b for a, b in zip(cut, text_cut)]
            for key in ("score", *EVAL_COLUMNS):
                if key in batch:
                    out[key] = batch[key]
            out["length"] = lengths
            out["text_cut"] = cut  # counted in the log line, then dropped
            return out

        settings = {"task": "embedding", "max_length": max_length, "truncation": True, "cut_flags": True}
        limit = max_length or tokenizer.model_max_length
        cuts = [Cut("text_cut", "rows with a text", "max_length", limit, "--max-length")]
        return datasets.DatasetDict(
            {
                split: report_cuts(
                    split, self.tokenize_split(split, ds, ds.column_names, fn, tokenizer, settings, log), cuts, log
                )
                for split, ds in raw.items()
            }
        )

    def collate(self, rows, tokenizer):
        """Each text column padded on its own: input_ids/attention_mask (anchors), input_ids_1/attention_mask_1
        (positives), ...; `scores` for scored pairs."""
        batch = {}
        n = sum(1 for key in rows if key == "input_ids" or key.startswith("input_ids_"))
        for k in range(n):
            padded = tokenizer.pad({"input_ids": rows[text_key(k)]}, return_tensors="pt")
            batch[text_key(k)] = padded["input_ids"]
            batch[text_key(k, "attention_mask")] = padded["attention_mask"]
        if "score" in rows:
            batch["scores"] = torch.tensor(rows["score"], dtype=torch.float32)
        else:  # each candidate's text as a number: a text twice in a batch is no negative of itself (mnrl)
            for k in range(1, n):
                ids = rows[text_key(k)]
                batch[text_key(k, "text_id")] = torch.tensor([hash(tuple(row)) for row in ids], dtype=torch.long)
        for key in EVAL_COLUMNS:
            if key in rows:
                batch[key] = torch.tensor(rows[key], dtype=torch.long)
        return batch

    @staticmethod
    def _numbered(ds, log) -> datasets.Dataset:
        """The validation rows with what evaluation reads (EVAL_COLUMNS): each row's number and, for pairs and
        triplets, the id of its query and of each of its documents in the split's collection (`collection_ids`)."""
        ds = ds.add_column("row", list(range(len(ds))))
        if "score" in ds.column_names:
            return ds
        texts = sorted((c for c in ds.column_names if c.startswith("text_")), key=lambda c: int(c[5:]))
        query_ids, doc_ids = collection_ids(ds[texts[0]], list(zip(*(ds[c] for c in texts[1:]))))
        queries, documents = len(set(query_ids)), len({d for ids in doc_ids for d in ids})
        log(f"retrieval evaluation: {queries} distinct queries over a collection of {documents} distinct documents")
        return ds.add_column("query_id", query_ids).add_column("doc_ids", doc_ids)

    # ---- model -------------------------------------------------------------------------------------------------
    def load_tokenizer(self):
        tokenizer = super().load_tokenizer()
        set_pad_token(tokenizer, self.model_path())  # each text column is padded into a batch
        return tokenizer

    def load_model(self, tokenizer):
        from transformers import AutoConfig, AutoModel

        path = self.model_path()
        model_config = set_dropout(from_pretrained(AutoConfig, path, "the model config"), self.config.dropout)
        self.check_max_length(tokenizer, model_config)
        self.check_dims(model_config)
        model = load_pretrained_model(AutoModel, path, self.model_kind, config=model_config, **self.pretrained_kwargs())
        pooler = getattr(model, "pooler", None)
        if isinstance(pooler, torch.nn.Module):  # BERT's pooler: not part of a mean-pooled embedding
            pooler.requires_grad_(False)
        return model

    def forward(self, model, batch):
        """Each text column's pooled embeddings; while training with grad_cache_chunk, computed in chunks
        (`embed_cached`) when the batch of any rank is larger than one chunk; else, training on a CPU, every
        column's texts packed into rows (pack_texts, where the model takes them) or in runs of similar length
        (split_by_length); without grad each distinct text once (`embed_remembered`: once per evaluation within
        `eval_step`)."""
        n = sum(1 for key in batch if key == "input_ids" or key.startswith("input_ids_"))
        training = torch.is_grad_enabled()
        parts = self._cache_parts(batch["input_ids"]) if training else 1
        less_padding = self.options.pack_texts or self.options.split_by_length
        if training and parts == 1 and less_padding and batch["input_ids"].device.type == "cpu":
            ids, mask = stacked_columns(batch, n)  # every column's texts together
            if self.options.pack_texts and self._packing_holds(model, ids, mask):
                return EmbeddingOutputs(list(embed_packed(model, ids, mask).chunk(n)))
            if self.options.split_by_length:
                return EmbeddingOutputs(list(embed_grouped(model, ids, mask, self._length_groups(mask)).chunk(n)))
        embs = []
        for k in range(n):
            ids, mask = batch[text_key(k)], batch[text_key(k, "attention_mask")]
            if parts > 1:
                embs.append(embed_cached(model, ids, mask, parts))
            elif training:
                embs.append(embed(model, ids, mask))
            else:  # within an evaluation step, its memo; else each distinct text of this batch once
                embs.append(embed_remembered(model, ids, mask, {} if self.eval_memo is None else self.eval_memo))
        return EmbeddingOutputs(embs)

    def eval_step(self, batch, valid, stream, tools) -> None:
        """One evaluation batch, each text embedded once per evaluation (the stream's memo: a SQuAD paragraph once,
        not once per question in every batch that holds one)."""
        self.eval_memo = stream.memo
        try:
            super().eval_step(batch, valid, stream, tools)
        finally:
            self.eval_memo = None

    def _packing_holds(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> bool:
        """pack_texts: whether this model's packed embeddings are its padded ones, checked once, on the first training
        batch, in fp32 (the frozen weights a bf16 run keeps in bf16 cast up for it; a model whose trained weights are
        in lower precision rounds the two differently and is not packed); every data-parallel rank decides the same
        (the forwards of the ranks pair up). A model attending within a sliding window is not packed: a first batch
        of texts shorter than the window would pass the check."""
        window = attention_window(model) if self.packs is None else None
        if window is not None:
            self.packs = False
            self.log(
                f"pack_texts: this model's layers attend within a sliding window (sliding_window {window} in its "
                "config), which packed texts' attention mask would lift: its batches are not packed "
                "(--split-by-length decides)"
            )
        if self.packs is None:
            with torch.autocast(attention_mask.device.type, enabled=False), frozen_weights_in_float32(model):
                holds = packing_holds(model, input_ids, attention_mask, self._length_groups(attention_mask))
            self.packs = agreed_count(int(not holds), self.dp_group, attention_mask.device) == 0
            if not self.packs:
                self.log(
                    "pack_texts: this model's embeddings of packed texts differ from its padded ones (it does not "
                    "take position ids from 0 and a 4D attention mask as BERT does, or its trained weights are not "
                    "fp32): its batches are not packed (--split-by-length decides)"
                )
        return self.packs

    def _length_groups(self, attention_mask: torch.Tensor) -> list[list[int]]:
        """split_by_length (on a CPU; an accelerator's forward costs little per token but much per call): the rows
        in runs of similar length (`length_groups`), as many runs on every data-parallel rank."""
        plan = length_groups(attention_mask.sum(1).tolist(), CPU_TOKENS_PER_FORWARD)
        return split_to(plan, agreed_count(len(plan), self.dp_group, attention_mask.device))

    def _cache_parts(self, input_ids: torch.Tensor) -> int:
        """How many chunks grad_cache_chunk cuts a batch into: as many on every data-parallel rank, from the
        largest rank's rows (1: no GradCache)."""
        chunk = self.options.grad_cache_chunk
        if chunk is None:
            return 1
        return math.ceil(max(rank_sizes(input_ids, self.dp_group)) / chunk)

    # ---- loss --------------------------------------------------------------------------------------------------
    def compute_loss(self, outputs, batch, row_mask=None):
        """(the loss summed over this rank's rows, their number); `row_mask` (evaluation): the rows that count, the
        others neither anchors nor candidates. Summed over `slices` (matryoshka_dims)."""
        embs = outputs.embeddings
        valid = row_mask.bool().to(embs[0].device) if row_mask is not None else None
        loss = self.loss_name(scored="scores" in batch)
        if loss != "mnrl" and "scores" not in batch:
            raise DataError(f"loss {loss} takes scored pairs; the data have no scores (a `score` column)")
        if loss == "mnrl":
            text_ids = [batch.get(text_key(k, "text_id")) for k in range(1, len(embs))]  # (collate adds them)
            masked = self.options.mask_duplicate_negatives and all(t is not None for t in text_ids)
            total = self._ranking(embs, valid, text_ids if masked else None)
        elif loss == "cosent":
            total = self._cosent(embs, batch["scores"].float(), valid)
        else:
            total = embs[0].new_zeros(())
            for dim, weight in self.slices():
                per = cosine_mse_losses(cut(embs[0], dim), cut(embs[1], dim), batch["scores"].float())
                total = total + weight * (per if valid is None else per[valid]).sum()
        rows = float(embs[0].shape[0]) if valid is None else valid.sum().float()
        return total, torch.as_tensor(rows, device=embs[0].device)

    def _ranking(self, embs: list[torch.Tensor], valid, text_ids: list[torch.Tensor] | None) -> torch.Tensor:
        """Each of this rank's anchors against every rank's positives and hard negatives, summed over the anchors;
        with `text_ids` (each candidate column's texts as numbers), a candidate with the text of an anchor's own
        positive is not its negative (a SQuAD paragraph in a batch once per question: sentence-transformers'
        NO_DUPLICATES sampler keeps such rows apart)."""
        group = self.dp_group
        sizes = rank_sizes(embs[0], group)
        candidates = torch.cat([gather_rows(e, sizes, group) for e in embs[1:]])
        targets = rank_offset(sizes, group) + torch.arange(embs[0].shape[0], device=embs[0].device)
        anchors, drop = embs[0], None
        if valid is not None:  # evaluation: padding rows are neither anchors nor candidates
            keep = gather_rows(valid.float(), sizes, group).bool().repeat(len(embs) - 1)
            anchors, targets = anchors[valid], targets[valid]
            drop = ~keep[None, :]
        if text_ids is not None:
            duplicates = self._duplicates(text_ids, sizes, targets)
            drop = duplicates if drop is None else drop | duplicates
        total = anchors.new_zeros(())
        for dim, weight in self.slices():
            logits = self.options.scale * cut(anchors, dim) @ cut(candidates, dim).T
            if drop is not None:
                logits = logits.masked_fill(drop, float("-inf"))
            total = total + weight * F.cross_entropy(logits, targets, reduction="sum")
        return total

    def _duplicates(self, text_ids: list[torch.Tensor], sizes: list[int], targets: torch.Tensor) -> torch.Tensor:
        """(anchors, candidates): True where a candidate other than the anchor's positive has that positive's text."""
        ids = torch.cat([gather_rows(t, sizes, self.dp_group) for t in text_ids])
        same = ids[None, :] == ids[targets][:, None]
        same[torch.arange(len(targets), device=same.device), targets] = False
        return same

    def _cosent(self, embs: list[torch.Tensor], scores: torch.Tensor, valid) -> torch.Tensor:
        """CoSENT over every rank's pairs, counted once per pair of this rank (the ranks' sums make it once per pair
        of the global batch)."""
        group = self.dp_group
        sizes = rank_sizes(embs[0], group)
        firsts, seconds, scores = (gather_rows(t, sizes, group) for t in (embs[0], embs[1], scores))
        mine = embs[0].shape[0]
        if valid is not None:
            keep = gather_rows(valid.float(), sizes, group).bool()
            firsts, seconds, scores, mine = firsts[keep], seconds[keep], scores[keep], valid.sum()
        total = firsts.new_zeros(())
        for dim, weight in self.slices():
            total = total + weight * cosent_loss(cut(firsts, dim), cut(seconds, dim), scores, self.options.scale)
        return total * mine

    def metric_stream(self):
        return EmbeddingStream(self)

    # ---- export ------------------------------------------------------------------------------------------------
    def max_seq_length(self, model_config) -> int:
        return self.config.data.max_length or context_length(model_config) or 512

    def export_info(self) -> dict:
        info = {**super().export_info(), "pooling": "mean", "normalize": True, "loss": self.loss_name()}
        if self.layout is not None:
            info["trained_on_columns"] = list(self.layout.texts)  # (predict reads "text_columns" as its input's)
        if self.options.matryoshka_dims:
            info["matryoshka_dims"] = list(self.options.matryoshka_dims)
        return info

    def model_files(self, model_config) -> dict[str, str]:
        size = getattr(model_config, "hidden_size", None)
        if not isinstance(size, int):
            return {}  # a model whose width its config does not name: the HF folder alone
        return sentence_transformers_files(size, self.max_seq_length(model_config))

    @staticmethod
    def claims_folder(model_dir: str) -> bool:
        """A sentence-transformers folder (modules.json) with mean pooling and its weights in the root, as
        sentence-transformers writes them (all-MiniLM-L6-v2 is one): embedded as it embeds (normalised: a folder
        without a Normalize module gives sentence-transformers unnormalised vectors of the same directions). Another
        pooling, a module after the pooling (Dense, ...), weights in a subfolder, or a prompt left out of the
        pooling: refused in one line."""
        layout = sentence_transformers_layout(model_dir)
        if layout is None:
            return False
        if layout.pooling != "mean":
            raise ConfigError(
                f"{model_dir!r} is a sentence-transformers folder with {layout.pooling} pooling; tuneforge embeds with "
                "mean pooling (fine-tune it with --task embedding to get one)"
            )
        if layout.others:
            raise ConfigError(
                f"{model_dir!r} is a sentence-transformers folder with {', '.join(layout.others)} after its pooling; "
                "tuneforge embeds a Transformer, its mean pooling and Normalize only"
            )
        if layout.weights:
            raise ConfigError(
                f"{model_dir!r} is a sentence-transformers folder with its weights in the subfolder "
                f"{layout.weights!r}; tuneforge reads them from the folder's root (save it again with a recent "
                "sentence-transformers)"
            )
        if not layout.pools_prompt and layout.prompt:
            raise ConfigError(
                f"{model_dir!r} is a sentence-transformers folder that pools its texts without its default prompt's "
                "tokens (include_prompt false); tuneforge pools every token of the prompted text"
            )
        return True

    @staticmethod
    def make_predictor(model_dir: str, **kwargs):
        return EmbeddingPredictor(model_dir, **kwargs)
