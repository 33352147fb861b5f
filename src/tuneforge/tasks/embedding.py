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
SQuAD (`tuneforge.data.retrieval`): a file in SQuAD's published JSON layout, or jsonl rows with question, context
and answers, is read as question -> paragraph pairs (query, positive): each answerable question and the paragraph
holding its answer, trained with mnrl; --data-dir also finds SQuAD's train*/dev* .json files.

Evaluation (`tuneforge.tasks.embedding_eval`): besides the loss, scored pairs report the Spearman (the best model's
metric) and Pearson correlations of the cosine similarities with the scores; pairs and triplets report retrieval
of each distinct query over the split's whole collection of distinct positive and negative texts, exact search
with the normalised embeddings: ndcg@10 (the best model's metric), mrr@10, recall@1/10/100
(sentence-transformers' InformationRetrievalEvaluator's definitions), a query's relevant documents being the
positives of its rows.

GradCache (`grad_cache_chunk`, sentence-transformers' Cached losses): a training batch is embedded a chunk at a time
without activations, and each chunk runs again in the backward (`embed_cached`): the activation memory of a chunk,
the loss and gradients of the whole batch. A backend that reduces each gradient once per backward refuses it
(`Task.reruns_in_backward`).

Padding (CPUs): a training batch stays as drawn (random: its in-batch negatives), but its texts, all columns
together (`stacked_columns`), are packed side by side into rows of PACK_WIDTH tokens, each text seeing only itself
and counting its positions from 0 (`pack_texts`: `pack_rows`, `packed_inputs`, `embed_packed`; one forward per rank),
where the first batch shows the model's packed embeddings to be its padded ones (`packing_holds`); else
(`split_by_length`) embedded in runs of similar length, each padded to its own longest (`length_groups`,
`embed_grouped`; every rank runs as many forwards). mnrl's candidates with the text of an
anchor's own positive are not its negatives (`mask_duplicate_negatives`).

Exact across data-parallel ranks: the candidates (and CoSENT's pairs) are gathered from every rank of the run's
data-parallel group (`Task.use_data_parallel`) with their gradients (`gather_rows`); each rank sums the loss over
its own anchors (CoSENT, a loss of the whole batch: that loss once per pair of this rank), so the Trainer's division
by the global count makes N ranks x batch B the same loss and gradients as one rank x N*B. Evaluation gathers the
same way and reports the loss (in-batch losses depend on the batch: N ranks at --eval-batch-size B equal one
process at N*B).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import datasets
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import Field, field_validator, model_validator

from tuneforge.adapters import load_pretrained_model
from tuneforge.artifacts import (
    check_model_path,
    context_length,
    from_pretrained,
    inference_device,
    load_tokenizer,
    read_model_info,
    sentence_transformers_layout,
)
from tuneforge.config import EVAL
from tuneforge.data import squad
from tuneforge.data.retrieval import collection_ids, has_squad_columns, is_squad_json, squad_pairs
from tuneforge.data.sources import check_file, find_split_files, read_table, require_columns, to_dataset
from tuneforge.errors import ConfigError, DataError
from tuneforge.options import TaskOptions, comma_list
from tuneforge.tasks.base import ServingPrecision, Task, empty_check, predict_max_length, set_dropout
from tuneforge.tasks.embedding_eval import EmbeddingStream

# (anchor, positive) column names, as sentence-transformers' datasets name them; hard negatives follow
PAIR_GUESSES = (("anchor", "positive"), ("query", "positive"), ("sentence1", "sentence2"), ("question", "answer"))
SCORE_GUESSES = ("score", "label")
SPLIT_FILES = {
    "train": ("train",),
    "validation": ("validation", "valid", "dev", "val"),
}
FORMATS = (".jsonl", ".json", ".csv", ".tsv", ".parquet")
MAX_DIM = 1_000_000
# what one more forward of a run of rows costs on a CPU, in tokens of compute (split_by_length; benchmarks/README.md)
CPU_TOKENS_PER_FORWARD = 48
# a packed row's width (pack_texts): wider rows mean fewer rows, but each row's attention grows with its width
# squared (benchmarks/README.md); a longer text gets a row of its own length
PACK_WIDTH = 128
# packed embeddings within this of the padded ones (relative to their largest entry): the model honours the packing
PACKING_TOLERANCE = 1e-3


# ---- the embedding and the losses (pure functions of tensors) -----------------------------------------------
def embed(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the last hidden states over the attention mask, in float32 (not normalised): sentence-transformers'
    mean Pooling."""
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float()
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def embed_distinct(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """`embed` of each distinct row once, copied to its repeats (evaluation: a retrieval split repeats a document for
    each of its queries, SQuAD's dev file each paragraph for its ~5 questions). Identical token ids have an identical
    attention mask."""
    distinct, inverse = torch.unique(input_ids, dim=0, return_inverse=True)
    rows = input_ids.shape[0]
    if distinct.shape[0] == rows:
        return embed(model, input_ids, attention_mask)
    order = torch.arange(rows, device=input_ids.device)
    first = torch.full((distinct.shape[0],), rows, device=input_ids.device).scatter_reduce(0, inverse, order, "amin")
    return embed(model, input_ids[first], attention_mask[first])[inverse]


def embed_remembered(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, memo: dict) -> torch.Tensor:
    """`embed_distinct` of the rows whose texts `memo` (token ids, unpadded -> embedding) does not hold yet, the
    others taken from it, and the new ones added to it: an evaluation embeds each text once, whatever batches its
    repeats fall into. One row at least always runs, so that every rank of a group runs one forward per batch
    (fsdp gathers its weights inside each)."""
    rows, real = input_ids.cpu().numpy(), attention_mask.cpu().numpy().astype(bool)
    keys = [row[keep].tobytes() for row, keep in zip(rows, real)]
    new = [i for i, key in enumerate(keys) if key not in memo] or [0]
    pick = torch.tensor(new, device=input_ids.device)
    for i, vector in zip(new, embed_distinct(model, input_ids[pick], attention_mask[pick])):
        memo.setdefault(keys[i], vector)
    return torch.stack([memo[key] for key in keys])


def length_groups(lengths: Sequence[int], per_forward: float) -> list[list[int]]:
    """The rows (indices into `lengths`) cut into runs of similar length so that padding each run to its longest
    row, plus `per_forward` tokens for each run (what one more forward costs), costs the fewest tokens: an exact
    partition of the rows sorted by length (dynamic programming over the cut points)."""
    order = np.argsort(np.asarray(lengths), kind="stable")
    ranked = np.asarray(lengths)[order]
    best, start = np.zeros(len(ranked) + 1), np.zeros(len(ranked) + 1, dtype=int)
    for end in range(1, len(ranked) + 1):
        costs = best[:end] + (end - np.arange(end)) * ranked[end - 1] + per_forward
        start[end] = int(np.argmin(costs))
        best[end] = costs[start[end]]
    groups, end = [], len(ranked)
    while end > 0:
        groups.append(order[start[end] : end].tolist())
        end = start[end]
    return groups[::-1]


def split_to(groups: list[list[int]], count: int) -> list[list[int]]:
    """`groups` cut further, the largest in halves first, until there are `count` (so that every data-parallel rank
    runs as many forwards); an empty group where the rows run out."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda g: len(groups[g]), default=None)
        if largest is None or len(groups[largest]) < 2:
            groups.append([])
            continue
        rows = groups.pop(largest)
        groups[largest:largest] = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return groups


def embed_grouped(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, groups: list[list[int]]):
    """`embed` of each group of rows on its own, padded only to its own longest row (fewer padding tokens than the
    whole batch's; each text's embedding does not depend on the others of its forward), back in the rows' order. An
    empty group runs the first row and keeps none of it: every rank of a data-parallel group runs as many forwards
    (DDP's and fsdp's collectives pair up)."""
    parts, order = [], []
    for rows in groups:
        pick = torch.tensor(rows or [0], device=input_ids.device)
        mask = attention_mask[pick]
        columns = mask.any(0)  # the columns some row of the group reads (right or left padding alike)
        pooled = embed(model, input_ids[pick][:, columns], mask[:, columns])
        parts.append(pooled if rows else pooled[:0])
        order += rows
    inverse = torch.empty(len(order), dtype=torch.long, device=input_ids.device)
    inverse[torch.tensor(order, device=input_ids.device)] = torch.arange(len(order), device=input_ids.device)
    return torch.cat(parts)[inverse]


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """The rows (indices into `lengths`) packed into bins of at most `width` tokens, longest first, each into the
    first bin it fits (first-fit decreasing); a row longer than `width` gets a bin of its own."""
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = next((b for b, left in enumerate(room) if lengths[row] <= left), None)
        if fits is None:
            bins.append([row])
            room.append(max(width, lengths[row]) - lengths[row])
        else:
            bins[fits].append(row)
            room[fits] -= lengths[row]
    return bins


def packed_inputs(lengths: list[int], bins: list[list[int]], device) -> dict[str, torch.Tensor]:
    """Where each text's real tokens go when its bin's texts sit side by side in one row: `text` (the text of each
    real token, texts one after another, as `input_ids[attention_mask.bool()]` lists them), `dest` (each real
    token's flat index into rows x width), `position_ids` (each text from 0), `segment` (the text of each position,
    -1 for padding) and the 4D attention mask that lets a token see only its own text's tokens (a padding position
    sees itself, so that no row of the softmax is empty)."""
    start, used = [0] * len(lengths), []
    for r, rows in enumerate(bins):
        offset = 0
        for i in rows:
            start[i] = (r, offset)
            offset += lengths[i]
        used.append(offset)
    width = max(used)
    first = torch.tensor([r * width + offset for r, offset in start], device=device)  # each text's first slot
    counts = torch.tensor(lengths, device=device)
    text = torch.arange(len(lengths), device=device).repeat_interleave(counts)
    within = torch.arange(len(text), device=device) - (counts.cumsum(0) - counts)[text]  # a token's place in its text
    dest = first[text] + within
    segment = torch.full((len(bins) * width,), -1, dtype=torch.long, device=device).index_put((dest,), text)
    positions = torch.zeros(len(bins) * width, dtype=torch.long, device=device).index_put((dest,), within)
    segment, positions = segment.view(len(bins), width), positions.view(len(bins), width)
    sees = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0)
    sees |= torch.eye(width, dtype=torch.bool, device=device)
    return {"text": text, "dest": dest, "position_ids": positions, "segment": segment, "mask": sees[:, None]}


def additive_mask(sees: torch.Tensor) -> torch.Tensor:
    """A boolean may-attend mask as the bias every attention implementation adds to its scores: 0 where a token
    sees, the dtype's lowest elsewhere (eager attention adds the mask it is given: a boolean one would add 1 where
    it should block), in autocast's dtype where autocast is on (SDPA takes a float mask of the query's dtype only)."""
    device = sees.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.float32
    return torch.zeros(sees.shape, dtype=dtype, device=sees.device).masked_fill_(~sees, torch.finfo(dtype).min)


def embed_packed(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int = PACK_WIDTH):
    """`embed` of every row, its texts packed side by side into rows of about `width` tokens (`pack_rows`), each text
    attending only to itself from position 0: one forward over the real tokens, with no padding but a bin's last
    few. Equal to `embed` of each text alone where the model takes `position_ids` and a 4D additive attention mask
    (BERT does, with eager or SDPA attention; `packing_holds` checks)."""
    real = attention_mask.bool()
    lengths = real.sum(1)
    counts = lengths.tolist()
    where = packed_inputs(counts, pack_rows(counts, width), input_ids.device)
    ids = input_ids.new_zeros(where["segment"].numel()).index_put((where["dest"],), input_ids[real])
    hidden = model(
        input_ids=ids.view_as(where["segment"]),
        position_ids=where["position_ids"],
        attention_mask=additive_mask(where["mask"]),
    ).last_hidden_state.float()
    tokens = hidden.reshape(-1, hidden.shape[-1])[where["dest"]]
    sums = tokens.new_zeros(len(counts), tokens.shape[-1]).index_add(0, where["text"], tokens)
    return sums / lengths.clamp(min=1).unsqueeze(-1).to(sums.dtype)


@contextlib.contextmanager
def frozen_weights_in_float32(model):
    """The model's frozen weights that a bf16 run keeps in bf16 (single and ddp: `store_frozen_linears`) in float32
    for the while, given back after: the packing check compares float32 forwards, the same maths whatever the run's
    precision. Sharded (DTensor) and partitioned (empty) parameters stay as they are."""
    kept = [
        (param, param.data)
        for param in model.parameters()
        if not param.requires_grad
        and param.is_floating_point()
        and param.dtype != torch.float32
        and type(param.data) is torch.Tensor
        and param.numel() > 0
    ]
    for param, data in kept:
        param.data = data.float()
    try:
        yield
    finally:
        for param, data in kept:
            param.data = data


def packing_holds(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, groups: list[list[int]]) -> bool:
    """Whether `embed_packed` gives this model's `embed_grouped` embeddings of these rows (within
    PACKING_TOLERANCE, relative), without grad. A model that ignores `position_ids` or the 4D mask, or counts
    positions its own way (RoBERTa from its padding index), gives others or refuses the inputs."""
    with torch.no_grad():
        try:
            packed = embed_packed(model, input_ids, attention_mask)
        except (TypeError, ValueError, RuntimeError, IndexError):
            return False
        padded = embed_grouped(model, input_ids, attention_mask, groups)
    gap = (packed - padded).abs().max() / padded.abs().max().clamp(min=1e-12)
    return bool(gap <= PACKING_TOLERANCE)


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


def agreed_count(count: int, group, device) -> int:
    """The largest `count` of the ranks of `group` (`count` itself in a single process)."""
    if group is None:
        return count
    mine = torch.tensor([count], dtype=torch.long, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return int(mine.item())


def _embed_chunk(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return embed(model, input_ids, attention_mask)


def embed_cached(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, parts: int) -> torch.Tensor:
    """`embed` of the rows in `parts` near-equal chunks, GradCache's way, by torch's own reentrant checkpoint: the
    forward keeps no activation (only the embeddings), and the backward, once the loss has given every row's
    embedding its gradient, runs each chunk again with grad and back-propagates that gradient through it (the same
    dropout: the checkpoint restores the RNG state; the same autocast). A chunk empty on this rank (an uneven last
    batch) runs the first row and keeps none of it, so that every rank of a data-parallel group runs as many
    forwards and backwards (DDP's collectives pair up)."""
    from torch.utils.checkpoint import checkpoint

    rows = input_ids.shape[0]
    needs_grad = torch.ones((), device=input_ids.device, requires_grad=True)  # the checkpoint's outputs need it
    out = []
    for idx in torch.arange(rows, device=input_ids.device).tensor_split(parts):
        take = idx if len(idx) else idx.new_zeros(1)
        chunk = checkpoint(_embed_chunk, model, input_ids[take], attention_mask[take], needs_grad, use_reentrant=True)
        out.append(chunk if len(idx) else chunk[:0])
    return torch.cat(out)


def cosent_loss(first: torch.Tensor, second: torch.Tensor, scores: torch.Tensor, scale: float) -> torch.Tensor:
    """CoSENT (sentence-transformers' CoSENTLoss) of a batch of normalised pairs: log(1 + the sum of
    exp(scale * (cos_i - cos_j)) over the pairs of pairs i, j with score_i < score_j)."""
    sims = scale * (first * second).sum(-1)
    diff = sims[:, None] - sims[None, :]
    diff = diff.masked_fill(~(scores[:, None] < scores[None, :]), float("-inf"))
    return torch.logsumexp(torch.cat([diff.new_zeros(1), diff.flatten()]), dim=0)


def cosine_mse_losses(first: torch.Tensor, second: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Per pair: the squared error of the cosine similarity (rows normalised) to the score (CosineSimilarityLoss)."""
    return ((first * second).sum(-1) - scores) ** 2


# ---- across data-parallel ranks --------------------------------------------------------------------------------
def rank_sizes(rows: torch.Tensor, group) -> list[int]:
    """Every rank's number of `rows` (a last batch may be uneven); [len(rows)] in a single process (`group` None)."""
    if group is None:
        return [rows.shape[0]]
    mine = torch.tensor([rows.shape[0]], dtype=torch.long, device=rows.device)
    sizes = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, mine, group=group)
    return [int(s) for s in sizes]


class _GatherRows(torch.autograd.Function):
    """All ranks' rows in rank order; the gradient of each rank's rows is the sum of every rank's gradient for
    them (an all_reduce, which every backend has; torch.distributed.nn's all_gather, which does the same, is
    deprecated as of torch 2.13 and warns on every call)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, sizes: list[int], group):
        padded = rows.new_zeros((max(sizes), *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        ctx.sizes, ctx.group, ctx.rank = sizes, group, dist.get_rank(group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start : start + ctx.sizes[ctx.rank]], None, None


def gather_rows(rows: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Every rank's `rows` (`sizes`: rank_sizes), concatenated in rank order, gradients flowing back to each rank's
    own; `rows` itself in a single process."""
    return rows if group is None else _GatherRows.apply(rows, sizes, group)


def rank_offset(sizes: list[int], group) -> int:
    """Where this rank's rows start among the gathered ones."""
    if group is None:
        return 0
    return sum(sizes[: dist.get_rank(group)])


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


class EmbeddingTask(Task):
    name = "embedding"
    model_kind = "a sentence encoder"
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
            return self._squad(path)
        return to_dataset(df, where=f"file {str(path)!r}")

    def _squad(self, path) -> datasets.Dataset:
        read = squad_pairs(path)
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
        for split, ds in splits.items():
            empty_check(ds, split)
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

    def _resolve_layout(self, splits: dict) -> Layout:
        data = self.config.data
        first = "train" if "train" in splits else next(iter(splits))
        cols = [str(c) for c in splits[first].column_names]
        if data.text_columns:
            texts = tuple(data.text_columns)
        else:
            pair = next((g for g in PAIR_GUESSES if all(c in cols for c in g)), None)
            if pair is None:
                raise DataError(
                    f"no text columns found in {self._where(first)}; columns are: {', '.join(cols)}; name them "
                    "anchor/positive[/negative] or sentence1/sentence2/score, or pass --text-column (twice or more)"
                )
            negatives = [c for c in cols if c == "negative" or c.startswith(("negative_", "negative-"))]
            texts = (*pair, *negatives)
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
        max_length = self.config.data.max_length
        raw = {split: self.select_examples(split, ds) for split, ds in raw.items()}
        if raw.get("validation") is not None:
            raw["validation"] = self._numbered(raw["validation"], log)

        def fn(batch):
            out, lengths = {}, None
            n = sum(1 for key in batch if key.startswith("text_"))
            for k in range(n):
                enc = tokenizer(batch[f"text_{k}"], truncation=True, max_length=max_length)
                out[text_key(k)] = enc["input_ids"]
                sizes = [len(ids) for ids in enc["input_ids"]]
                lengths = sizes if lengths is None else [a + b for a, b in zip(lengths, sizes)]
            for key in ("score", *EVAL_COLUMNS):
                if key in batch:
                    out[key] = batch[key]
            out["length"] = lengths
            return out

        settings = {"task": "embedding", "max_length": max_length, "truncation": True}
        return datasets.DatasetDict(
            {
                split: self.tokenize_split(split, ds, ds.column_names, fn, tokenizer, settings, log)
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
        (the forwards of the ranks pair up)."""
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


def cut(embeddings: torch.Tensor, dim: int | None) -> torch.Tensor:
    """The first `dim` dimensions (all for None), L2-normalised."""
    return F.normalize(embeddings if dim is None else embeddings[:, :dim], dim=-1)


def sentence_transformers_files(size: int, max_seq_length: int) -> dict[str, str]:
    """sentence-transformers' folder format for a mean-pooled, normalised encoder of width `size` whose HF weights
    and tokenizer sit in the folder's root: modules.json (Transformer, Pooling, Normalize), the Pooling config,
    sentence_bert_config.json and config_sentence_transformers.json (module names as every version since 2.x
    reads them)."""
    import transformers

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    pooling = {
        "word_embedding_dimension": size,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False,
        "include_prompt": True,
    }
    model = {
        "__version__": {"transformers": transformers.__version__, "pytorch": torch.__version__},
        "model_type": "SentenceTransformer",
        "prompts": {},
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    }
    files = {
        "modules.json": modules,
        "1_Pooling/config.json": pooling,
        "sentence_bert_config.json": {"max_seq_length": max_seq_length, "do_lower_case": False},
        "config_sentence_transformers.json": model,
    }
    return {name: json.dumps(value, indent=2) + "\n" for name, value in files.items()}


def tokenizer_limit(tokenizer) -> int | None:
    """The tokenizer's model_max_length where its folder sets one (transformers' stand-in for none is ~1e30): what
    sentence-transformers cuts texts at when its own config names no max_seq_length."""
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 1_000_000 else None


class SentenceEncoder:
    """`SentenceEncoder("runs/x/model").encode(["a text", ...])`: one L2-normalised, mean-pooled embedding per text
    (float32, shape (texts, size)), as training computed them; `dims` keeps the first dims (renormalised)."""

    def __init__(self, model_dir: str | Path, device: str | None = None, max_length: int | None = None) -> None:
        from transformers import AutoConfig, AutoModel

        model_dir = str(model_dir)
        if max_length is not None and max_length < 1:
            raise ConfigError(f"--max-length must be at least 1, got {max_length}")
        check_model_path(model_dir)
        self.info = read_model_info(model_dir)
        config = from_pretrained(AutoConfig, model_dir, "the model config")
        self.tokenizer = load_tokenizer(model_dir)
        layout = sentence_transformers_layout(model_dir)  # its texts prompted, lowercased and cut as it says
        folder_length = layout.max_seq_length if layout else None
        self.lowercase, self.prompt = (layout.lowercase, layout.prompt) if layout else (False, "")
        trained = self.info.get("max_length") or folder_length or tokenizer_limit(self.tokenizer)
        self.max_length = predict_max_length(max_length, trained, 512, config)
        self.size = getattr(config, "hidden_size", None)
        self.model = load_pretrained_model(AutoModel, model_dir, "a sentence encoder").eval()
        self.device = inference_device(device)
        self.model.to(self.device)
        self.precision = ServingPrecision(self.model, self.device)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's token ids as the folder's sentence-transformers config has it tokenized: after its default
        prompt, lowercased where it says do_lower_case, cut at max_length."""
        texts = [self.prompt + t for t in texts]
        texts = [t.lower() for t in texts] if self.lowercase else texts
        return self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"] if texts else []

    @torch.inference_mode()
    def encode(self, texts: Sequence[str], batch_size: int = 64, dims: int | None = None) -> np.ndarray:
        return self.encode_ids(self.tokenize(texts), batch_size, dims)

    @torch.inference_mode()
    def encode_ids(self, ids: Sequence[Sequence[int]], batch_size: int = 64, dims: int | None = None) -> np.ndarray:
        """`encode` of texts already tokenized: each one's token ids as the tokenizer gives them (its special tokens
        included, at most max_length)."""
        if dims is not None and (dims < 1 or (self.size and dims > self.size)):
            raise ConfigError(f"dims {dims} is outside the embedding's 1 to {self.size} dimensions")
        if not ids:
            return np.zeros((0, dims or self.size or 0), dtype=np.float32)
        order = np.argsort([-len(x) for x in ids], kind="stable")  # similar lengths share a batch
        parts = []
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            batch = self.tokenizer.pad({"input_ids": [list(ids[i]) for i in idx]}, return_tensors="pt")
            with self.precision.autocast():
                pooled = embed(self.model, batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device))
            parts.append(cut(pooled, dims).cpu().numpy())
        out = np.empty((len(ids), parts[0].shape[1]), dtype=np.float32)
        out[order] = np.concatenate(parts)
        return out


# ---- prediction and serving ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Embedded:
    """One input's embedding as `tuneforge serve` answers it: the L2-normalised float32 vector, and the number of
    tokens the model read (its special tokens included, after truncation at max_length)."""

    vector: np.ndarray
    tokens: int


class EmbeddingPredictor:
    """What `tuneforge predict` and `serve` run for a sentence encoder (`make_predictor`): SentenceEncoder's vectors
    of texts, or of token-id lists as the model's tokenizer gives them (special tokens included). `encode` -> a
    matrix, `predict` -> per input {"embedding": [...]}, `embed` -> per input an `Embedded` (serve's batches);
    `dimensions` keeps the first N dimensions, renormalised (what a Matryoshka-trained model, `matryoshka_dims`,
    is made for). `embedding_size` is the capability predict and serve read: this model answers with vectors (a
    .npy matrix, POST /v1/embeddings), not through /predict (`accepts` is empty)."""

    accepts: tuple[str, ...] = ()
    regression = False
    labels: list[str] = []
    task = "embedding"

    def __init__(self, model_dir: str | Path, device: str | None = None, max_length: int | None = None) -> None:
        self.model_dir = str(model_dir)
        self.encoder = SentenceEncoder(model_dir, device=device, max_length=max_length)
        self.max_length = self.encoder.max_length
        self.embedding_size = int(self.encoder.size or self.encoder.encode(["a"]).shape[1])
        self.matryoshka_dims = [int(d) for d in self.encoder.info.get("matryoshka_dims") or []]
        self.vocab_size = int(self.encoder.model.get_input_embeddings().num_embeddings)
        self.precision = self.encoder.precision

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is not None and not 1 <= dimensions <= self.embedding_size:
            raise ConfigError(
                f"--dimensions {dimensions} is outside the {self.embedding_size} dimensions of model "
                f"{self.model_dir!r}'s embedding; give 1 to {self.embedding_size}"
            )

    def input_problem(self, item) -> str | None:
        """What is wrong with one input, worded to follow its name (None: nothing): a text must not be empty;
        token ids must lie below the vocabulary size, at most max_length of them."""
        if isinstance(item, str):
            return "is empty; send some text" if not item else None
        if not isinstance(item, (list, tuple)):
            return f"is a {type(item).__name__}, not a text"
        if any(isinstance(t, str) for t in item):
            return "holds several texts; a sentence encoder embeds one text per input (predict: one --text-column)"
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            return "is neither a text nor a list of token ids"
        if not item:
            return "is an empty list of token ids; send at least one"
        bad = next((j for j, t in enumerate(item) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return f"holds {item[bad]} at [{bad}], which is not a token id below {self.vocab_size}"
        if len(item) > self.max_length:
            return f"holds {len(item)} token ids, above the {self.max_length} the model reads (its max_length)"
        return None

    def token_ids(self, items: Sequence) -> list[list[int]]:
        """Each input's token ids: a text tokenized (truncated at max_length), token ids as given; DataError naming
        the first input that is neither."""
        for i, item in enumerate(items):
            problem = self.input_problem(item)
            if problem:
                raise DataError(f"input {i + 1} {problem}")
        ids = [None if isinstance(item, str) else list(item) for item in items]
        texts = [i for i, item in enumerate(items) if isinstance(item, str)]
        if texts:
            for i, row in zip(texts, self.encoder.tokenize([items[i] for i in texts])):
                ids[i] = row
        return ids

    def encode(self, items: Sequence, batch_size: int = 64, dimensions: int | None = None) -> np.ndarray:
        """The embeddings of `items` (texts or token-id lists) as a float32 matrix, one row per input in order."""
        self.check_dimensions(dimensions)
        return self.encoder.encode_ids(self.token_ids(items), batch_size, dimensions)

    def predict(self, items: Sequence, batch_size: int = 64, dimensions: int | None = None) -> list[dict]:
        return [{"embedding": row.tolist()} for row in self.encode(items, batch_size, dimensions)]

    def embed(self, items: Sequence, batch_size: int = 64) -> list[Embedded]:
        ids = self.token_ids(items)
        return [Embedded(v, len(x)) for v, x in zip(self.encoder.encode_ids(ids, batch_size), ids)]
