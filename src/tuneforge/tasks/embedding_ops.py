"""The tensor work of `--task embedding` (tasks/embedding.py), pure functions of a model and tensors: pooling a
batch of texts into embeddings, packing or grouping them to skip padding, GradCache, the losses, and gathering rows
across data-parallel ranks.

The embedding: the model's last hidden states averaged over the attention mask (`embed`; sentence-transformers' mean
Pooling), normalised by its users (`cut` keeps leading dimensions, renormalised: Matryoshka).

GradCache (`grad_cache_chunk`, sentence-transformers' Cached losses): a training batch is embedded a chunk at a time
without activations, and each chunk runs again in the backward (`embed_cached`): the activation memory of a chunk,
the loss and gradients of the whole batch. A backend that reduces each gradient once per backward refuses it
(`Task.reruns_in_backward`).

Padding (CPUs): a training batch stays as drawn (random: its in-batch negatives), but its texts, all columns
together, are packed side by side into rows of PACK_WIDTH tokens, each text seeing only itself and counting its
positions from 0 (`pack_texts`: `pack_rows`, `packed_inputs`, `embed_packed`; one forward per rank), where the first
batch shows the model's packed embeddings to be its padded ones (`packing_holds`); else (`split_by_length`) embedded
in runs of similar length, each padded to its own longest (tasks/length_runs.py's `length_groups`, `embed_grouped`;
every rank runs as many forwards).

Across data-parallel ranks: `gather_rows` concatenates every rank's rows with their gradients flowing back to each
rank's own (`rank_sizes`, `rank_offset`, `agreed_count` say who holds what).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tuneforge.tasks.base import no_cache

# a packed row's width (pack_texts): wider rows mean fewer rows, but each row's attention grows with its width
# squared (benchmarks/README.md); a longer text gets a row of its own length
PACK_WIDTH = 128
# packed embeddings within this of the padded ones (relative to their largest entry): the model honours the packing
PACKING_TOLERANCE = 1e-3


# ---- a batch of texts embedded: padded, distinct texts once, in runs of similar length, packed -----------------
def embed(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the last hidden states over the attention mask, in float32 (not normalised): sentence-transformers'
    mean Pooling. A decoder builds no key/value cache (`no_cache`): nothing reads it."""
    hidden = model(input_ids=input_ids, attention_mask=attention_mask, **no_cache(model)).last_hidden_state.float()
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
        **no_cache(model),
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


def attention_window(model) -> int | None:
    """The sliding window some of the model's layers attend within (its config's sliding_window: ModernBERT's local
    layers, Gemma 3's sliding ones), which `embed_packed`'s 4D mask lifts (transformers uses a 4D mask as it is
    given); None where every layer attends to the whole text. A data-parallel wrapper's `module` is looked through."""
    model_config = getattr(getattr(model, "module", model), "config", None)
    layer_types = getattr(model_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return getattr(model_config, "sliding_window", None)


def packing_holds(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, groups: list[list[int]]) -> bool:
    """Whether `embed_packed` gives this model's `embed_grouped` embeddings of these rows (within
    PACKING_TOLERANCE, relative), without grad. A model that ignores `position_ids` or the 4D mask, or counts
    positions its own way (RoBERTa from its padding index), gives others or refuses the inputs. Compared without
    dropout: its masks would make the two differ, and drawing them would move the RNG of a run's first batch, which a
    resumed run checks again."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                packed = embed_packed(model, input_ids, attention_mask)
            except (TypeError, ValueError, RuntimeError, IndexError):
                return False
            padded = embed_grouped(model, input_ids, attention_mask, groups)
    finally:
        model.train(was_training)
    gap = (packed - padded).abs().max() / padded.abs().max().clamp(min=1e-12)
    return bool(gap <= PACKING_TOLERANCE)


# ---- GradCache and the losses ----------------------------------------------------------------------------------
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


def cut(embeddings: torch.Tensor, dim: int | None) -> torch.Tensor:
    """The first `dim` dimensions (all for None), L2-normalised."""
    return F.normalize(embeddings if dim is None else embeddings[:, :dim], dim=-1)


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


def agreed_count(count: int, group, device) -> int:
    """The largest `count` of the ranks of `group` (`count` itself in a single process)."""
    if group is None:
        return count
    mine = torch.tensor([count], dtype=torch.long, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return int(mine.item())
