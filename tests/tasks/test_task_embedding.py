"""Sentence embeddings (`--task embedding`): the losses against sentence-transformers' own (MNRL with hard negatives,
CoSENT, cosine MSE, Matryoshka), in-batch negatives gathered across a real 2-process gloo group equal to one process
on the whole batch (loss and gradients), a CLI run whose OUTPUT_DIR/model loads in SentenceTransformer with the same
embeddings as tuneforge's encoder, STS-B as shipped, MiniLM, and every bad input."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import (
    Forked,
    caches_built,
    made_once,
    max_weight_diff,
    quiet_task,
    read_jsonl,
    run_cli,
    tokenized_fresh_then_cached,
    train_losses,
    trained_once,
)
from test_bad_input import assert_refused, in_process

ANIMALS = ["cat", "dog", "bird", "fox", "horse", "cow", "fish", "lion", "owl", "bee"]
PLACES = ["on the mat", "in the barn", "by the river", "under a tree", "in the city", "at the zoo"]


def rows(n: int, seed: int = 0, negatives: bool = True) -> list[dict]:
    """(anchor, positive[, negative]) rows: an animal's description, the same animal elsewhere, another animal."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.sample(ANIMALS, 2)
        row = {"anchor": f"a photo of a {a}", "positive": f"the {a} sits {rng.choice(PLACES)}"}
        if negatives:
            row["negative"] = f"the {b} sits {rng.choice(PLACES)}"
        out.append(row)
    return out


def scored_rows(n: int, seed: int = 0) -> list[dict]:
    """(sentence1, sentence2, score 0-5): the score grows with what the two sentences share (each half the time)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, p = rng.choice(ANIMALS), rng.choice(PLACES)
        b = a if rng.random() < 0.5 else rng.choice(ANIMALS)
        q = p if rng.random() < 0.5 else rng.choice(PLACES)
        score = 2.5 * (a == b) + 2.5 * (p == q)
        out.append({"sentence1": f"the {a} sits {p}", "sentence2": f"a {b} sits {q}", "score": score})
    return out


def write_jsonl(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in items), encoding="utf-8")
    return path


def write_csv(path: Path, items: list[dict]) -> Path:
    cols = list(items[0])
    lines = [",".join(cols)] + [
        ",".join(f'"{r[c]}"' if isinstance(r[c], str) else str(r[c]) for c in cols) for r in items
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def embedding_task(model: str, **options):
    """The embedding task of `model` with these task options (its notes dropped)."""
    from tuneforge.configure import build_config
    from tuneforge.tasks import get_task

    task = get_task(build_config(task="embedding", model=model, **options))
    task.log = lambda msg: None
    return task


def batch_of(task, tokenizer, items: list[dict], columns: tuple[str, ...], score: str | None = None) -> dict:
    """The collated batch of `items` (tokenized as the task tokenizes: each column on its own)."""
    from tuneforge.tasks.embedding import text_key

    features = {text_key(k): tokenizer([r[c] for r in items])["input_ids"] for k, c in enumerate(columns)}
    if score:
        features["score"] = [r[score] / 5 for r in items]
    return task.collate(features, tokenizer)


# ---- the losses: sentence-transformers' own as the reference -----------------------------------------------
@pytest.fixture(scope="module")
def st_model(tiny_bert):
    """tiny_bert as a SentenceTransformer (Transformer + mean Pooling + Normalize)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    transformer = Transformer(tiny_bert)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), "mean"), Normalize()]
    return SentenceTransformer(modules=modules, device="cpu")


@pytest.mark.parametrize(
    "options, data, columns, dims",
    [
        # (sentence-transformers' MNRL counts a text twice in a batch as its own negative: tested below)
        ({"loss": "mnrl", "mask_duplicate_negatives": False}, "triplets", ("anchor", "positive", "negative"), None),
        (
            {"loss": "mnrl", "matryoshka_dims": "32,16,8", "mask_duplicate_negatives": False},
            "pairs",
            ("anchor", "positive"),
            [32, 16, 8],
        ),
        ({"loss": "cosent", "scale": 10.0}, "scored", ("sentence1", "sentence2"), None),
        ({"loss": "cosent", "matryoshka_dims": [16, 4]}, "scored", ("sentence1", "sentence2"), [16, 4]),
        ({"loss": "cosine_mse"}, "scored", ("sentence1", "sentence2"), None),
        (
            {"loss": "cosine_mse", "matryoshka_dims": [16, 8], "matryoshka_weights": "2,0.5"},
            "scored",
            ("sentence1", "sentence2"),
            [16, 8],
        ),
    ],
)
def test_each_loss_is_sentence_transformers_own(tiny_bert, st_model, options, data, columns, dims):
    """The same weights through tuneforge (forward, pooling, loss summed over the batch) and through
    sentence-transformers (its model and its loss, a batch mean): equal within 1e-5."""
    from sentence_transformers.sentence_transformer import losses

    task = embedding_task(tiny_bert, **options)
    tokenizer = task.load_tokenizer()
    model = task.load_model(tokenizer).eval()
    items = scored_rows(12, seed=3) if data == "scored" else rows(12, seed=3, negatives=data == "triplets")
    score = "score" if data == "scored" else None
    batch = batch_of(task, tokenizer, items, columns, score)
    with torch.no_grad():
        total, count = task.compute_loss(task.forward(model, batch), batch)
    loss = {
        "mnrl": lambda: losses.MultipleNegativesRankingLoss(st_model, scale=20.0),
        "cosent": lambda: losses.CoSENTLoss(st_model, scale=options.get("scale", 20.0)),
        "cosine_mse": lambda: losses.CosineSimilarityLoss(st_model),
    }[options["loss"]]()
    if dims:
        weights = [2, 0.5] if "matryoshka_weights" in options else None
        loss = losses.MatryoshkaLoss(st_model, loss, matryoshka_dims=dims, matryoshka_weights=weights)
    features = [st_model.tokenize([r[c] for r in items]) for c in columns]
    labels = torch.tensor([r[score] / 5 for r in items]) if score else torch.zeros(len(items))
    with torch.no_grad():
        expected = loss(features, labels)
    assert count.item() == 12
    assert (total / count).item() == pytest.approx(expected.item(), abs=1e-5)
    assert expected.item() > 0.05  # a loss worth comparing


def duplicated_rows(n: int, seed: int) -> list[dict]:
    """`rows` (all texts distinct) in which row 0's positive is also row n-2's positive and row n-1's negative."""
    items = [
        {"anchor": f"query {i} about a {a}", "positive": f"the {a} number {i} sits here", "negative": f"no {i} {b}"}
        for i, (a, b) in enumerate(random.Random(seed).choices(ANIMALS, k=2) for _ in range(n))
    ]
    items[-2]["positive"] = items[-1]["negative"] = items[0]["positive"]
    return items


def test_a_text_twice_in_a_batch_is_no_negative_of_itself(tiny_bert):
    """mnrl: a candidate with the text of an anchor's positive (another row's positive or negative) is left out of
    that anchor's softmax, as a hand-written InfoNCE over the texts leaves it; without the mask the loss differs."""
    import torch.nn.functional as F

    columns = ("anchor", "positive", "negative")
    items = duplicated_rows(8, seed=2)
    task = embedding_task(tiny_bert, loss="mnrl")
    tokenizer = task.load_tokenizer()
    model = task.load_model(tokenizer).eval()
    batch = batch_of(task, tokenizer, items, columns)
    with torch.no_grad():
        outputs = task.forward(model, batch)
        total, _ = task.compute_loss(outputs, batch)
        unmasked, _ = embedding_task(tiny_bert, loss="mnrl", mask_duplicate_negatives=False).compute_loss(
            outputs, batch
        )
    anchors, *candidates = (F.normalize(e, dim=-1) for e in outputs.embeddings)
    texts = [r["positive"] for r in items] + [r["negative"] for r in items]
    pool = torch.cat(candidates)
    expected = 0.0
    for i, row in enumerate(items):
        kept = [j for j, text in enumerate(texts) if text != row["positive"] or j == i]
        logits = 20.0 * anchors[i] @ pool[kept].T
        expected += (torch.logsumexp(logits, 0) - logits[kept.index(i)]).item()
    assert total.item() == pytest.approx(expected, abs=1e-4)
    assert abs(unmasked.item() - total.item()) > 1e-2


def test_the_embedding_is_all_minilm_l6_v2s_own(minilm_dir):
    """tuneforge's encoder of the bundled MiniLM (mean over the mask, normalised) gives the model's published
    sentence-transformers embeddings."""
    from sentence_transformers import SentenceTransformer

    from tuneforge.tasks.sentence_encoder import SentenceEncoder

    texts = ["A man is eating food.", "A man is riding a white horse on an enclosed ground.", "ok"] * 3
    ours = SentenceEncoder(minilm_dir, device="cpu", max_length=256).encode(texts, batch_size=4)
    theirs = SentenceTransformer(minilm_dir, device="cpu").encode(texts, batch_size=4)
    assert ours.shape == (9, 384)
    assert np.abs(ours - theirs).max() < 1e-5
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)


# ---- across ranks: a real 2-process gloo group against one process ---------------------------------------
# (options, columns, rows on rank 0 and rank 1, evaluation: rank 1 also holds a padding row its mask leaves out)
RANK_CASES = {
    "mnrl-hard-negatives": ({"loss": "mnrl"}, ("anchor", "positive", "negative"), (3, 3), False),
    "mnrl-uneven-matryoshka": ({"loss": "mnrl", "matryoshka_dims": [32, 16, 8]}, ("anchor", "positive"), (4, 2), False),
    "cosent": ({"loss": "cosent"}, ("sentence1", "sentence2"), (3, 3), False),
    "cosent-uneven-matryoshka": (
        {"loss": "cosent", "matryoshka_dims": [32, 8]},
        ("sentence1", "sentence2"),
        (4, 3),
        False,
    ),
    "cosine-mse": ({"loss": "cosine_mse"}, ("sentence1", "sentence2"), (3, 2), False),
    # GradCache: rank 1's 2 rows in 3 chunks of the largest rank's 5 (one chunk empty on it)
    "mnrl-grad-cache-uneven": ({"loss": "mnrl", "grad_cache_chunk": 2}, ("anchor", "positive"), (5, 2), False),
    "cosent-grad-cache": ({"loss": "cosent", "grad_cache_chunk": 2}, ("sentence1", "sentence2"), (3, 3), False),
    # pack_texts (the default): each rank's texts packed into its own rows, long and short ones
    "mnrl-packed-uneven": ({"loss": "mnrl"}, ("anchor", "positive", "negative"), (5, 1), False),
    "cosent-packed-uneven": ({"loss": "cosent"}, ("sentence1", "sentence2"), (4, 2), False),
    # split_by_length: rank 0's long texts split its positives into two runs, rank 1's one row runs a throw-away one
    "mnrl-split-uneven": ({"loss": "mnrl", "pack_texts": False}, ("anchor", "positive", "negative"), (5, 1), False),
    "cosent-split-uneven": ({"loss": "cosent", "pack_texts": False}, ("sentence1", "sentence2"), (4, 2), False),
    # rank 1's rows repeat rank 0's first positive (as a positive and as a negative): masked across the ranks
    "mnrl-duplicates-across-ranks": ({"loss": "mnrl"}, ("anchor", "positive", "negative"), (4, 3), False),
    "eval-mnrl-padding-row": ({"loss": "mnrl"}, ("anchor", "positive", "negative"), (3, 2), True),
    "eval-cosent-padding-row": ({"loss": "cosent"}, ("sentence1", "sentence2"), (3, 2), True),
}


def grad_gap(grads: dict, reference: dict) -> float:
    """The largest difference of two sets of gradients, relative to the reference's largest entry (at least 1): CPUs
    sum in other orders (AVX2's kernels and AVX512's differ in the 6th digit of a summed batch's gradient)."""
    largest = max(g.abs().max().item() for g in reference.values())
    return max((grads[k] - reference[k]).abs().max().item() for k in reference) / max(1.0, largest)


def case_items(name: str) -> list[dict]:
    _, columns, split, _ = RANK_CASES[name]
    n = sum(split)
    if "duplicates" in name:
        return duplicated_rows(n, seed=5)
    if "split" in name or "packed" in name:
        return uneven_scored_rows(n, seed=5) if columns[0] == "sentence1" else uneven_rows(n, seed=5)
    return scored_rows(n, seed=5) if columns[0] == "sentence1" else rows(n, seed=5, negatives=len(columns) == 3)


def run_case(tiny_bert: str, name: str, rank: int | None, world: int) -> dict:
    """One training micro-step (or evaluation batch) of case `name` on this process's rows (`rank` None: all of
    them), normalised as the Trainer does (the summed loss x dp_size / global count; DDP averages the gradients):
    {"loss": the global mean loss, "count": the global count, "grads": {name: gradient}}."""
    import torch.distributed as dist

    options, columns, split, evaluating = RANK_CASES[name]
    items = case_items(name)
    if rank is not None:
        start = sum(split[:rank])
        items = items[start : start + split[rank]]
    valid = torch.ones(len(items), dtype=torch.bool)
    if evaluating and rank == 1:  # every rank gets a full batch: a duplicate that counts for nothing
        items, valid = items + items[:1], torch.cat([valid, torch.zeros(1, dtype=torch.bool)])
    task = embedding_task(tiny_bert, **options)
    task.use_data_parallel(dist.group.WORLD if world > 1 else None)  # as the run tells it (run.data_parallel_group)
    tokenizer = task.load_tokenizer()
    torch.manual_seed(0)
    model = task.load_model(tokenizer)
    # as the ddp backend wraps it (no buffer broadcast before each forward: torch 2.11 then fails the backward of
    # a step of several forwards)
    wrapped = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False) if world > 1 else model
    batch = batch_of(task, tokenizer, items, columns, "score" if columns[0] == "sentence1" else None)
    with torch.set_grad_enabled(not evaluating):
        total, count = task.compute_loss(task.forward(wrapped, batch), batch, row_mask=valid if evaluating else None)
    sums = torch.stack([total.detach(), count.float()])
    if world > 1:
        dist.all_reduce(sums)
    if not evaluating:
        (total * world / sums[1]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": float(sums[0] / sums[1]), "count": float(sums[1]), "grads": grads}


def two_rank_worker(tiny_bert: str, store: str, out: str, rank: int) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        results = {name: run_case(tiny_bert, name, rank, 2) for name in RANK_CASES}
    finally:
        dist.destroy_process_group()
    torch.save(results, f"{out}/rank{rank}.pt")
    return 0


@pytest.fixture(scope="module")
def two_ranks(tiny_bert) -> list[dict]:
    """Every case on a real 2-process gloo group (two processes forked from this one): each rank's results."""
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryFile() as log:
        store = f"{folder}/store"
        children = [
            Forked(lambda r=r: two_rank_worker(tiny_bert, store, folder, r), log.fileno(), log.fileno()) for r in (0, 1)
        ]
        try:
            codes = [child.wait(timeout=300) for child in children]
        finally:
            for child in children:
                child.kill()
        log.seek(0)
        assert codes == [0, 0], log.read().decode(errors="replace")[-4000:]
        return [torch.load(f"{folder}/rank{r}.pt") for r in (0, 1)]


@pytest.mark.parametrize("name", list(RANK_CASES))
def test_two_ranks_give_the_loss_and_gradients_of_one_process_on_the_whole_batch(tiny_bert, two_ranks, name):
    one = run_case(tiny_bert, name, rank=None, world=1)
    evaluating = RANK_CASES[name][3]
    for result in (ranks[name] for ranks in two_ranks):
        assert result["count"] == one["count"] == sum(RANK_CASES[name][2])
        assert result["loss"] == pytest.approx(one["loss"], abs=1e-5)
        if evaluating:
            continue
        assert result["grads"].keys() == one["grads"].keys() and len(one["grads"]) > 10
        assert "pooler.dense.weight" not in one["grads"]  # not part of a mean-pooled embedding: fixed
        assert grad_gap(result["grads"], one["grads"]) < 1e-5
    if RANK_CASES[name][0]["loss"] != "cosine_mse":  # (a loss of each pair alone: nothing to gather)
        # each rank's rows on their own, nothing gathered, give another loss: the candidates cross the ranks
        alone = [run_case(tiny_bert, name, r, world=1) for r in (0, 1)]
        local = sum(a["loss"] * a["count"] for a in alone) / one["count"]
        assert abs(local - one["loss"]) > 1e-3


# ---- GradCache (grad_cache_chunk): the batch embedded a chunk at a time ----------------------------------------
# a batch's loss computed another way: within 1e-5, or 1e-6 of itself where it is large (CoSENT's scale 20 gives
# losses in the tens, which fp32's summation order alone moves by ~1e-5 on AVX512 kernels)
SAME_LOSS = {"rel": 1e-6, "abs": 1e-5}


def cached_step(tiny_bert: str, options: dict, items: list[dict], columns: tuple[str, ...], seed: int = 0, calls=None):
    """(the summed loss, each weight's gradient) of one training batch of `items` under `options`; `calls` (a list)
    gets (rows, width, grad enabled) of each of the model's forwards."""
    task = embedding_task(tiny_bert, **options)
    tokenizer = task.load_tokenizer()
    torch.manual_seed(0)
    model = task.load_model(tokenizer).train()
    if calls is not None:

        def record(_, args, kwargs):
            calls.append((*kwargs["input_ids"].shape, torch.is_grad_enabled()))

        model.register_forward_pre_hook(record, with_kwargs=True)
    batch = batch_of(task, tokenizer, items, columns, "score" if columns[0] == "sentence1" else None)
    torch.manual_seed(seed)
    total, _ = task.compute_loss(task.forward(model, batch), batch)
    total.backward()
    return total.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "options, columns, chunk",
    [
        ({"loss": "mnrl"}, ("anchor", "positive", "negative"), 5),
        ({"loss": "mnrl", "matryoshka_dims": [32, 8]}, ("anchor", "positive"), 1),
        ({"loss": "cosent"}, ("sentence1", "sentence2"), 4),
        ({"loss": "cosine_mse"}, ("sentence1", "sentence2"), 7),
    ],
)
def test_grad_cache_gives_the_loss_and_gradients_of_the_whole_batch(tiny_bert, options, columns, chunk):
    """12 rows embedded `chunk` at a time (in near-equal chunks), then run again in the backward: the loss and every
    gradient of the whole batch embedded at once, within 1e-5 (the loss within SAME_LOSS); no forward with grad
    sees more than a chunk."""
    items = scored_rows(12, seed=4) if columns[0] == "sentence1" else rows(12, seed=4, negatives=len(columns) == 3)
    whole_loss, whole = cached_step(tiny_bert, options, items, columns)
    calls = []
    loss, cached = cached_step(tiny_bert, {**options, "grad_cache_chunk": chunk}, items, columns, calls=calls)
    sizes = [len(part) for part in torch.arange(12).tensor_split(-(-12 // chunk))]
    assert sorted((n, grad) for n, _, grad in calls) == sorted(
        [(n, grad) for n in sizes for grad in (False, True)] * len(columns)
    )
    assert loss == pytest.approx(whole_loss, **SAME_LOSS)
    assert cached.keys() == whole.keys() and len(whole) > 10
    assert grad_gap(cached, whole) < 1e-5


# ---- split_by_length: a training batch embedded in runs of similar length ---------------------------------------
def uneven_rows(n: int, seed: int, negatives: bool = True) -> list[dict]:
    """`rows` whose every third positive is long (~70 tokens): a random batch padded to it is mostly padding."""
    items = rows(n, seed=seed, negatives=negatives)
    for r in items[::3]:
        r["positive"] += " and then it walks along the long road to the old town" * 5
    return items


def uneven_scored_rows(n: int, seed: int) -> list[dict]:
    """`scored_rows` whose every third sentence2 is long."""
    items = scored_rows(n, seed=seed)
    for r in items[::3]:
        r["sentence2"] += " far away from the old town by the long road" * 5
    return items


@pytest.mark.parametrize(
    "options, columns",
    [({"loss": "mnrl"}, ("anchor", "positive", "negative")), ({"loss": "cosent"}, ("sentence1", "sentence2"))],
)
def test_split_by_length_gives_the_loss_and_gradients_of_the_padded_batch(tiny_bert, options, columns):
    """A batch with a few long texts, its columns' texts embedded together in runs of similar length: the loss and
    every gradient of each column embedded at once (within 1e-5), from forwards that read fewer token positions
    (padding included)."""
    items = uneven_scored_rows(12, seed=3) if columns[0] == "sentence1" else uneven_rows(12, seed=3)
    seen = {True: [], False: []}
    results = {}
    for split in (True, False):
        calls = []
        split_options = {**options, "split_by_length": split, "pack_texts": False}
        results[split] = cached_step(tiny_bert, split_options, items, columns, calls=calls)
        seen[split] = calls
    (loss, grads), (whole_loss, whole) = results[True], results[False]
    assert loss == pytest.approx(whole_loss, **SAME_LOSS)
    assert grads.keys() == whole.keys() and grad_gap(grads, whole) < 1e-5
    assert len(seen[False]) == len(columns)  # a forward per column, padded to its longest text
    # every column's texts in runs of similar length: the long texts apart from the short ones of every column
    assert sorted(rows for rows, _, _ in seen[True]) == [4, 12 * len(columns) - 4]
    assert sum(rows * width for rows, width, _ in seen[True]) < 0.7 * sum(
        rows * width for rows, width, _ in seen[False]
    )


# ---- pack_texts: a training batch's texts packed side by side into rows, one forward ------------------------------
@pytest.mark.parametrize("padding_side, attention", [("right", "sdpa"), ("left", "sdpa"), ("right", "eager")])
def test_packed_embeddings_are_each_text_embedded_alone(tiny_bert, padding_side, attention):
    """`embed_packed` of a batch of short and long texts (right- or left-padded; SDPA or eager attention, which adds
    the mask it is given to its scores): each text's embedding as a batch of its own gives it, within 1e-5, from
    rows that hold fewer positions than the padded batch."""
    from transformers import AutoModel, AutoTokenizer

    from tuneforge.tasks.embedding_ops import embed, embed_packed

    tokenizer = AutoTokenizer.from_pretrained(tiny_bert, padding_side=padding_side)
    model = AutoModel.from_pretrained(tiny_bert, attn_implementation=attention).eval()
    texts = [r["positive"] for r in uneven_rows(9, seed=2, negatives=False)] + ["a", "the cat"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    seen = []
    model.register_forward_pre_hook(lambda _, a, kw: seen.append(kw["input_ids"].shape), with_kwargs=True)
    with torch.no_grad():
        packed = embed_packed(model, batch["input_ids"], batch["attention_mask"], width=32)
        alone = [tokenizer([t], return_tensors="pt") for t in texts]
        alone = torch.cat([embed(model, one["input_ids"], one["attention_mask"]) for one in alone])
    assert (packed - alone).abs().max() < 1e-5
    rows, width = seen[0]
    assert rows * width < 0.6 * batch["input_ids"].numel()


@pytest.mark.parametrize(
    "options, columns",
    [({"loss": "mnrl"}, ("anchor", "positive", "negative")), ({"loss": "cosent"}, ("sentence1", "sentence2"))],
)
def test_packed_texts_give_the_loss_and_gradients_of_the_padded_batch(tiny_bert, options, columns):
    """pack_texts (the default): the loss and every gradient of each column embedded padded at once (within 1e-5),
    from one forward with grad over packed rows (after the first batch's check, two forwards without grad)."""
    items = uneven_scored_rows(12, seed=3) if columns[0] == "sentence1" else uneven_rows(12, seed=3)
    padded_calls, packed_calls = [], []
    padded_options = {**options, "pack_texts": False, "split_by_length": False}
    whole_loss, whole = cached_step(tiny_bert, padded_options, items, columns, calls=padded_calls)
    loss, grads = cached_step(tiny_bert, options, items, columns, calls=packed_calls)
    assert loss == pytest.approx(whole_loss, **SAME_LOSS)
    assert grads.keys() == whole.keys() and grad_gap(grads, whole) < 1e-5
    with_grad = [(rows, width) for rows, width, grad in packed_calls if grad]
    assert len(with_grad) == 1 and with_grad[0][0] < 12 * len(columns)
    assert with_grad[0][0] * with_grad[0][1] < 0.7 * sum(rows * width for rows, width, _ in padded_calls)


def test_a_bf16_run_packs_its_batches(tiny_bert):
    """Under bf16 autocast, with the frozen layers kept in bf16 as a bf16 run keeps them (eager attention, the
    kernel bf16 trains with on a CPU), the first batch's check still finds packing exact (it compares float32
    forwards) and the batch is packed: one forward with grad, the loss the padded batch's within bf16 rounding; the
    frozen weights are bf16 again after the check."""
    from tuneforge.adapters import store_frozen_linears

    items, columns = uneven_scored_rows(12, seed=3), ("sentence1", "sentence2")
    padded_options = {"loss": "cosent", "pack_texts": False, "split_by_length": False}
    options = {"loss": "cosent", "freeze_layers": 1}
    losses, calls = {}, {}
    for name, chosen in (("padded", {**options, **padded_options}), ("packed", options)):
        task = embedding_task(tiny_bert, **chosen)
        tokenizer = task.load_tokenizer()
        torch.manual_seed(0)
        model = task.load_model(tokenizer).train()
        model.set_attn_implementation("eager")
        assert store_frozen_linears(model, torch.bfloat16) > 0
        calls[name] = []
        model.register_forward_pre_hook(
            lambda _, a, kw, seen=calls[name]: seen.append(torch.is_grad_enabled()), with_kwargs=True
        )
        batch = batch_of(task, tokenizer, items, columns, "score")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[name] = task.compute_loss(task.forward(model, batch), batch)[0].item()
    assert task.packs is True and calls["packed"].count(True) == 1
    assert losses["packed"] == pytest.approx(losses["padded"], rel=2e-2)
    assert torch.bfloat16 in {p.dtype for p in model.parameters() if not p.requires_grad and p.dim() == 2}


@pytest.mark.parametrize("loss, columns", [("mnrl", ("anchor", "positive")), ("cosent", ("sentence1", "sentence2"))])
def test_the_packing_check_under_dropout_packs_and_draws_no_random_numbers(tiny_bert, loss, columns):
    """With dropout on (--dropout 0.1), the first batch's check compares the model's forwards without dropout: BERT
    is packed, and the check draws nothing from the RNG, so a run resumed from a checkpoint (whose first batch is
    checked again) draws the dropout masks of the run it continues."""
    from tuneforge.tasks.embedding import stacked_columns

    items = uneven_scored_rows(8, seed=3) if loss == "cosent" else uneven_rows(8, seed=3, negatives=False)
    task = embedding_task(tiny_bert, loss=loss, dropout=0.1)
    tokenizer = task.load_tokenizer()
    model = task.load_model(tokenizer).train()
    batch = batch_of(task, tokenizer, items, columns, "score" if loss == "cosent" else None)
    ids, mask = stacked_columns(batch, len(columns))
    before = torch.get_rng_state()
    assert task._packing_holds(model, ids, mask) is True
    assert torch.equal(torch.get_rng_state(), before) and model.training


def save_roberta(folder: Path) -> None:
    """A tiny random RoBERTa: it numbers positions from its padding index, not from 0."""
    from transformers import RobertaConfig, RobertaModel

    config = RobertaConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=130, pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    RobertaModel(config).save_pretrained(folder)


def save_modernbert(folder: Path) -> None:
    """A tiny random ModernBERT whose local layers attend within 16 tokens (8 either side), as its 128 do."""
    from transformers import ModernBertConfig, ModernBertModel

    config = ModernBertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        local_attention=16, max_position_embeddings=128, pad_token_id=0, cls_token_id=101, sep_token_id=102,
        bos_token_id=101, eos_token_id=102,
    )  # fmt: skip
    ModernBertModel(config).save_pretrained(folder)


# RoBERTa's packed embeddings differ on the first batch; ModernBERT's first batch (short texts, each within its
# window) packs exactly, where a later one of long texts would lose the window
UNPACKED_MODELS = {
    "roberta": (save_roberta, uneven_rows, "position ids from 0"),
    "modernbert": (save_modernbert, rows, "sliding window"),
}


@pytest.mark.parametrize("family", UNPACKED_MODELS)
def test_a_model_that_counts_positions_its_own_way_or_attends_in_a_window_is_not_packed(minilm_dir, tmp_path, family):
    """RoBERTa numbers positions from its padding index, not from 0: its packed embeddings differ, so the first
    batch's check keeps it unpacked (said in one line), and the step is split_by_length's, loss and gradients. A
    model whose layers attend within a sliding window (ModernBERT) is not packed either: the packed rows' 4D mask is
    used as it is, lifting the window, which a first batch of short texts does not show."""
    from transformers import AutoTokenizer

    save, make_rows, said = UNPACKED_MODELS[family]
    torch.manual_seed(0)
    save(tmp_path)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(tmp_path)
    items, columns = make_rows(8, seed=1), ("anchor", "positive", "negative")
    task = embedding_task(str(tmp_path), loss="mnrl")
    notes = []
    task.log = notes.append
    tokenizer = task.load_tokenizer()
    model = task.load_model(tokenizer).train()
    batch = batch_of(task, tokenizer, items, columns)
    total, _ = task.compute_loss(task.forward(model, batch), batch)
    assert task.packs is False and len(notes) == 1 and "pack_texts" in notes[0] and said in notes[0]
    split_loss, _ = cached_step(str(tmp_path), {"loss": "mnrl", "pack_texts": False}, items, columns)
    assert total.item() == pytest.approx(split_loss, abs=1e-5)


@pytest.mark.parametrize(
    "model, options",
    [
        ("tiny_llama", {"pack_texts": False, "split_by_length": False}),
        ("tiny_gpt2", {}),  # the packing check and packed or grouped forwards
        ("tiny_llama", {"grad_cache_chunk": 2}),
    ],
)
def test_a_decoder_s_embedding_forward_builds_no_key_value_cache(model, options, request):
    """A decoder's config says use_cache=True (for generation); a mean-pooled embedding reads no cache, so none is
    built, in training and in evaluation, and the config keeps its setting for the export."""
    task = embedding_task(request.getfixturevalue(model), loss="mnrl", data={"max_length": 64}, **options)
    tokenizer = task.load_tokenizer()
    model = task.load_model(tokenizer).train()
    built = caches_built(model)
    batch = batch_of(task, tokenizer, rows(6, seed=1, negatives=False), ("anchor", "positive"))
    task.compute_loss(task.forward(model, batch), batch)[0].backward()
    with torch.no_grad():
        task.forward(model.eval(), batch)
    assert built and not any(built)
    assert model.config.use_cache is True


def test_evaluation_embeds_each_distinct_text_of_a_batch_once(tiny_bert):
    """Without grad (evaluation) a column's repeated texts (a paragraph for each of its questions) are embedded once:
    the model sees the distinct rows alone, and every row gets the embedding it gets in a batch of its own."""
    from tuneforge.tasks.embedding import text_key
    from tuneforge.tasks.embedding_ops import embed

    task = embedding_task(tiny_bert, loss="mnrl")
    tokenizer = task.load_tokenizer()
    model = task.load_model(tokenizer).eval()
    items = rows(6, seed=1, negatives=False)
    items = [*items, *({**r, "anchor": f"{r['anchor']} again"} for r in items[:4])]  # 4 positives repeated
    batch = batch_of(task, tokenizer, items, ("anchor", "positive"))
    seen = []
    model.register_forward_pre_hook(lambda _, a, kw: seen.append(len(kw["input_ids"])), with_kwargs=True)
    with torch.no_grad():
        embs = task.forward(model, batch).embeddings
        alone = [embed(model, batch[text_key(k)], batch[text_key(k, "attention_mask")]) for k in (0, 1)]
    distinct = [len({r[c] for r in items}) for c in ("anchor", "positive")]
    assert seen[:2] == distinct and distinct[1] <= 6
    assert max((a - b).abs().max().item() for a, b in zip(embs, alone)) < 1e-5


def test_an_evaluation_embeds_each_text_once_across_its_batches(tiny_bert):
    """Within one evaluation (one metric stream) a text seen in an earlier batch is not embedded again, even padded to
    another width; each batch still runs the model at least once (ranks keep step); a new evaluation starts afresh."""
    from tuneforge.tasks.embedding import text_key
    from tuneforge.tasks.embedding_ops import embed

    task = embedding_task(tiny_bert, loss="mnrl")
    tokenizer = task.load_tokenizer()
    model = task.load_model(tokenizer).eval()
    items = rows(6, seed=1, negatives=False)
    first = batch_of(task, tokenizer, items[:3], ("anchor", "positive"))
    changed = [items[0], items[1], {**items[2], "positive": "a long new text " * 4}]
    again = batch_of(task, tokenizer, changed, ("anchor", "positive"))
    seen = []
    model.register_forward_pre_hook(lambda _, a, kw: seen.append(len(kw["input_ids"])), with_kwargs=True)

    class Tools:
        forward = staticmethod(lambda batch: task.forward(model, batch))

    stream = task.metric_stream()
    with torch.no_grad():
        for batch in (first, again):
            task.eval_step(batch, torch.ones(3, dtype=torch.bool), stream, Tools)
        embs = task.forward(model, again).embeddings  # outside an evaluation step: nothing remembered
        alone = [embed(model, again[text_key(k)], again[text_key(k, "attention_mask")]) for k in (0, 1)]
    distinct = [len({r[c] for r in items[:3]}) for c in ("anchor", "positive")]
    assert seen[:4] == [*distinct, 1, 1]  # the second batch: its anchors all known (one runs), one new positive
    assert max((a - b).abs().max().item() for a, b in zip(embs, alone)) < 1e-5
    texts = {r[c] for r in items[:3] for c in ("anchor", "positive")} | {"a long new text " * 4}
    assert len(stream.memo) == len(texts) and all(v.shape == (32,) for v in stream.memo.values())
    assert task.metric_stream().memo == {}  # the next evaluation's model differs: nothing carried over


def test_grad_cache_runs_each_chunk_again_with_its_own_dropout(minilm_dir, tmp_path):
    """With dropout on, the backward's second run of each chunk draws the masks of its first run: the gradients equal
    those of the same chunks embedded with grad in one pass (another seed draws other masks: the test can fail)."""
    from conftest import save_tiny_bert
    from tuneforge.tasks.embedding import EmbeddingOutputs, text_key
    from tuneforge.tasks.embedding_ops import embed

    model_dir = save_tiny_bert(tmp_path / "dropout-bert", minilm_dir)
    options, columns = {"loss": "mnrl", "dropout": 0.2}, ("anchor", "positive", "negative")
    items = rows(9, seed=2)
    _, cached = cached_step(model_dir, {**options, "grad_cache_chunk": 4}, items, columns, seed=11)

    task = embedding_task(model_dir, **options)
    tokenizer = task.load_tokenizer()
    torch.manual_seed(0)
    model = task.load_model(tokenizer).train()
    batch = batch_of(task, tokenizer, items, columns)
    torch.manual_seed(11)
    chunks = [slice(0, 3), slice(3, 6), slice(6, 9)]  # 9 rows in ceil(9 / 4) = 3 near-equal chunks
    embs = [
        torch.cat([embed(model, batch[text_key(k)][c], batch[text_key(k, "attention_mask")][c]) for c in chunks])
        for k in range(3)
    ]
    total, _ = task.compute_loss(EmbeddingOutputs(embs), batch)
    total.backward()
    reference = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grad_gap(cached, reference) < 1e-5
    _, reseeded = cached_step(model_dir, {**options, "grad_cache_chunk": 4}, items, columns, seed=12)
    assert grad_gap(reseeded, reference) > 1e-3


def test_ddp_two_ranks_train_as_one_process_on_the_double_batch(tiny_bert, cache_dir, tmp_path):
    """The Trainer end to end: `--backend ddp --nproc 2 --batch-size 4` logs the losses and exports the weights of one
    process at --batch-size 8 (its evaluation, at the same global batch, the same loss)."""
    train = write_jsonl(tmp_path / "train.jsonl", rows(40, seed=6))
    args = ["train", "--task", "embedding", "--model", tiny_bert, "--train-file", str(train)]
    args += ["--validation-file", str(train), "--max-steps", "4", "--precision", "fp32", "--logging-steps", "1"]
    args += ["--lr", "3e-3", "--eval-strategy", "no", "--freeze-layers", "0", "--freeze-embeddings", "off"]
    args += ["--cache-dir", cache_dir, "--max-eval-samples", "20", "--json", "--quiet"]
    one = run_cli(*args, "--batch-size", "8", "--output-dir", str(tmp_path / "one"))
    two = run_cli(*args, "--batch-size", "4", "--backend", "ddp", "--nproc", "2", "--output-dir", str(tmp_path / "two"))
    assert one.returncode == 0 and two.returncode == 0, (one.stderr + two.stderr)[-4000:]
    whole, split = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert max_weight_diff(tiny_bert, tmp_path / "one" / "model") > 1e-3  # it trains: the comparison means something
    assert max(abs(whole[s] - split[s]) for s in whole) < 1e-5
    # (AVX2's kernels sum in another order than AVX512's: 1.06e-5 there after 4 Adam steps)
    assert max_weight_diff(tmp_path / "one" / "model", tmp_path / "two" / "model") < 5e-5
    assert json.loads(two.stdout.strip().splitlines()[-1])["loss"] == pytest.approx(
        json.loads(one.stdout.strip().splitlines()[-1])["loss"], abs=1e-5
    )


# ---- the CLI end to end, and what sentence-transformers loads -------------------------------------------
def write_triplets(root: Path) -> Path:
    folder = root / "data"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", rows(48, seed=1))
    write_jsonl(folder / "valid.jsonl", rows(16, seed=2))
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_bert, cache_dir):
    """A real `tuneforge train --task embedding` run on triplets (Matryoshka dims 32,16,8): (run folder, data)."""

    def command(data: Path, run: Path) -> list[str]:
        files = ["--train-file", str(data / "train.jsonl"), "--validation-file", str(data / "valid.jsonl")]
        run_flags = ["--max-steps", "12", "--batch-size", "8", "--lr", "2e-3", "--logging-steps", "1"]
        run_flags += ["--save-steps", "12"]  # a checkpoint for the export test
        every_weight = ["--freeze-layers", "0", "--freeze-embeddings", "off", "--eval-strategy", "no"]
        return [
            "train",
            "--task",
            "embedding",
            "--model",
            tiny_bert,
            *files,
            *run_flags,
            *every_weight,
            "--matryoshka-dims",
            "32,16,8",
            "--max-length",
            "24",
            "--cache-dir",
            cache_dir,
            "--output-dir",
            str(run),
            "--json",
        ]

    run, data, printed = trained_once(tmp_path_factory, "embedding-triplets", write_triplets, command)
    return run, data, printed


def test_a_cli_run_trains_on_triplets_and_learns(trained, tiny_bert, cache_dir, capfd):
    run, data, printed = trained
    result = json.loads(printed.strip().splitlines()[-1])
    assert result["steps"] == 12 and result["num_examples"] == 16
    info = json.loads((run / "model" / "tuneforge.json").read_text())
    assert info["task"] == "embedding" and info["loss"] == "mnrl" and info["matryoshka_dims"] == [32, 16, 8]
    assert info["trained_on_columns"] == ["anchor", "positive", "negative"] and info["max_length"] == 24
    assert len(train_losses(run)) == 12
    # the untrained model on the same validation rows: training lowered the loss
    before = in_process(
        capfd,
        "eval",
        tiny_bert,
        "--task",
        "embedding",
        "--validation-file",
        str(data / "valid.jsonl"),
        "--matryoshka-dims",
        "32,16,8",
        "--max-length",
        "24",
        "--cache-dir",
        cache_dir,
        "--json",
        "--quiet",
    )
    assert before.returncode == 0, before.stderr
    untrained = json.loads(before.stdout.strip().splitlines()[-1])
    assert untrained["num_examples"] == 16
    assert result["loss"] < untrained["loss"] - 0.1


def test_the_exported_model_loads_in_sentence_transformers_with_the_same_embeddings(trained):
    from sentence_transformers import SentenceTransformer

    from tuneforge.tasks.sentence_encoder import SentenceEncoder

    folder = trained[0] / "model"
    assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"] is True
    texts = [r["anchor"] for r in rows(6, seed=9)] + ["a much longer text about a fox that sits by the river " * 3]
    st = SentenceTransformer(str(folder), device="cpu")
    assert st.max_seq_length == 24 and st.get_embedding_dimension() == 32
    theirs = st.encode(texts)
    ours = SentenceEncoder(folder, device="cpu").encode(texts)
    assert np.abs(theirs - ours).max() < 1e-5
    assert np.allclose(np.linalg.norm(theirs, axis=1), 1, atol=1e-5)  # the Normalize module
    # a Matryoshka slice: sentence-transformers' truncate_dim (renormalised) is tuneforge's dims
    short = SentenceTransformer(str(folder), device="cpu", truncate_dim=8).encode(texts, normalize_embeddings=True)
    assert np.abs(short - SentenceEncoder(folder, device="cpu").encode(texts, dims=8)).max() < 1e-5


def test_an_exported_checkpoint_loads_in_sentence_transformers_as_the_run_s_model(trained, tmp_path):
    """`tuneforge export OUTPUT_DIR/checkpoint-STEP OUT` of an encoder writes sentence-transformers' modules too (the
    checkpoint keeps the task's files): the same embeddings as the run's own OUTPUT_DIR/model."""
    from sentence_transformers import SentenceTransformer

    out = tmp_path / "exported"
    proc = run_cli("export", str(trained[0] / "checkpoint-12"), str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "modules.json").exists() and (out / "1_Pooling" / "config.json").exists()
    texts = [r["anchor"] for r in rows(4, seed=2)]
    exported = SentenceTransformer(str(out), device="cpu")
    assert exported.max_seq_length == 24
    run_model = SentenceTransformer(str(trained[0] / "model"), device="cpu")
    assert np.abs(exported.encode(texts) - run_model.encode(texts)).max() < 1e-6


# ---- scored pairs: STS-B as shipped, CoSENT and cosine MSE ----------------------------------------------
@pytest.mark.parametrize("loss", ["auto", "cosine_mse"])
def test_sts_b_as_shipped_trains_with_cosent_or_cosine_mse(shared_data, tiny_bert, cache_dir, tmp_path, loss):
    out = tmp_path / "run"
    args = ["train", "--task", "embedding", "--model", tiny_bert, "--data-dir", str(shared_data / "glue" / "STS-B")]
    args += ["--max-train-samples", "64", "--max-eval-samples", "32", "--max-steps", "4", "--batch-size", "16"]
    args += ["--max-length", "32", "--cache-dir", cache_dir, "--output-dir", str(out), "--loss", loss, "--json"]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    chosen = "cosent" if loss == "auto" else "cosine_mse"
    assert f"scored pairs (sentence1, sentence2, score from 0 to 5 as 0-1): {chosen} loss" in proc.stderr
    assert json.loads((out / "model" / "tuneforge.json").read_text())["loss"] == chosen
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "eval"]
    assert evals[-1]["num_examples"] == 32 and np.isfinite(evals[-1]["loss"])


def test_scores_are_mapped_to_0_1_by_the_stated_range(tiny_bert, tmp_path):
    from tuneforge.configure import build_config
    from tuneforge.tasks import get_task

    items = [dict(r, score=score) for r, score in zip(scored_rows(10), [0, 10, 5, 2.5, 7.5] * 2)]
    train = write_csv(tmp_path / "train.csv", items)
    config = build_config(task="embedding", model=tiny_bert, max_score=10, data={"train_file": str(train)})
    task = get_task(config)
    task.log = lambda msg: None
    raw = task.load_raw()
    scores = sorted([*raw["train"]["score"], *raw["validation"]["score"]])
    assert scores == [0.0, 0.0, 0.25, 0.25, 0.5, 0.5, 0.75, 0.75, 1.0, 1.0]


# ---- MiniLM, the default model: a short run -------------------------------------------------------------
def test_minilm_fine_tunes_on_pairs_and_exports_for_sentence_transformers(tmp_path_factory, cache_dir):
    from sentence_transformers import SentenceTransformer

    from tuneforge.tasks.sentence_encoder import SentenceEncoder

    def make(folder: Path) -> None:
        write_jsonl(folder / "pairs.jsonl", rows(40, seed=4, negatives=False))
        args = ["train", "--task", "embedding", "--train-file", str(folder / "pairs.jsonl"), "--max-steps", "3"]
        args += ["--batch-size", "12", "--max-length", "16", "--eval-strategy", "no", "--cache-dir", cache_dir]
        proc = run_cli(*args, "--output-dir", str(folder / "run"), "--json")
        assert proc.returncode == 0, proc.stderr[-3000:]

    folder = made_once(tmp_path_factory, "embedding-minilm", make) / "run" / "model"
    texts = ["a photo of a cat", "the owl sits under a tree"]
    st = SentenceTransformer(str(folder), device="cpu")
    assert st.get_embedding_dimension() == 384 and st.max_seq_length == 16
    assert np.abs(st.encode(texts) - SentenceEncoder(folder, device="cpu").encode(texts)).max() < 1e-5


# ---- options ------------------------------------------------------------------------------------------------
def test_matryoshka_dims_take_a_comma_list_or_a_repeated_flag():
    from tuneforge.tasks.embedding import EmbeddingOptions

    assert EmbeddingOptions(matryoshka_dims="384,256, 128").matryoshka_dims == [384, 256, 128]
    assert EmbeddingOptions(matryoshka_dims=["384,256", "64"]).matryoshka_dims == [384, 256, 64]
    assert EmbeddingOptions(matryoshka_dims=[64]).matryoshka_dims == [64]
    assert EmbeddingOptions().matryoshka_dims is None


# ---- bad input: one line, exit 2, nothing written -------------------------------------------------------
def bad_run(capfd, tmp_path: Path, tiny_bert: str, train: Path, *extra: str):
    args = ["train", "--task", "embedding", "--model", tiny_bert, "--train-file", str(train), "--max-steps", "1"]
    args += ["--output-dir", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), *extra]
    return in_process(capfd, *args)


@pytest.mark.parametrize(
    "items, writer, extra, needles",
    [
        (
            [*rows(2), {"anchor": "a cat", "positive": "  ", "negative": "a dog"}],
            write_jsonl,
            (),
            ("row 3 of", "train.jsonl", "empty 'positive' text", "fill it in or drop the row"),
        ),
        (
            [*rows(3), {"anchor": "a cat", "positive": "the cat"}],  # a triplet row without its negative
            write_jsonl,
            (),
            ("row 4 of", "empty 'negative' text"),
        ),
        (
            [*rows(2), {"anchor": "a cat", "positive": None, "negative": "a dog"}],
            write_jsonl,
            (),
            ("row 3 of", "empty 'positive' text"),
        ),
        (
            [{"anchor": 7 + i, "positive": "a dog", "negative": "a cat"} for i in range(3)],
            write_jsonl,
            (),
            ("row 1 of", "column 'anchor' holds 7, not text"),
        ),
        (
            [*scored_rows(3), {"sentence1": "a cat", "sentence2": "a dog", "score": 5.5}],
            write_csv,
            (),
            ("row 4 of", "train.csv", "score 5.5 in column 'score'", "outside the stated range 0 to 5", "--max-score"),
        ),
        (
            [*scored_rows(3), {"sentence1": "a cat", "sentence2": "a dog", "score": -1}],
            write_csv,
            (),
            ("row 4 of", "score -1", "outside the stated range 0 to 5"),
        ),
        (
            [*scored_rows(2), {"sentence1": "a cat", "sentence2": "a dog", "score": "high"}],
            write_csv,
            (),
            ("row 3 of", "score 'high' in column 'score' is not a number"),
        ),
        (
            rows(4, negatives=False),  # the triplet file named by its columns lacks its negative column
            write_jsonl,
            ("--text-column", "anchor", "--text-column", "positive", "--text-column", "negative"),
            ("column 'negative' not found in", "train.jsonl", "columns are: anchor, positive", "--text-column"),
        ),
        (
            [{"query": "a cat", "passage": "the cat"}] * 3,
            write_jsonl,
            (),
            ("no text columns found", "columns are: query, passage", "--text-column"),
        ),
        (
            [dict(r, negatives=[r["negative"], "a fish"]) for r in rows(4)],  # (a list: not read)
            write_jsonl,
            (),
            (
                "column 'negatives' of",
                "train.jsonl",
                "is not read",
                "negative, negative_1, negative_2",
                "--text-column",
            ),
        ),
        (
            [{"anchor": r["anchor"], "positive": r["positive"], "hard_negative": r["negative"]} for r in rows(4)],
            write_jsonl,
            (),
            ("column 'hard_negative' of", "is not read"),
        ),
        (rows(4), write_jsonl, ("--text-column", "anchor"), ("takes two or more --text-column",)),
        (rows(4), write_jsonl, ("--matryoshka-dims", "64,16"), ("--matryoshka-dims 64", "embedding size", "32")),
        (rows(4), write_jsonl, ("--matryoshka-dims", "16,16"), ("--matryoshka-dims", "names a dimension twice")),
        (
            rows(4),
            write_jsonl,
            ("--matryoshka-dims", "0"),
            ("'task_options.matryoshka_dims'", "greater than or equal to 1"),
        ),
        (
            rows(4),
            write_jsonl,
            ("--matryoshka-dims", "16,8", "--matryoshka-weights", "1"),
            ("--matryoshka-weights gives 1 weight(s) for 2",),
        ),
        (rows(4), write_jsonl, ("--loss", "cosent"), ("loss cosent takes scored pairs", "without a score column")),
        (scored_rows(4), write_csv, ("--loss", "mnrl", "--label-column", "score"), ("loss mnrl takes", "cosent")),
        (scored_rows(4), write_csv, ("--max-score", "0"), ("--max-score 0 must be above --min-score 0",)),
        (rows(4), write_jsonl, ("--scale", "0"), ("'task_options.scale'", "> 0")),
        # settings the loss never reads: they trained without a word
        (
            scored_rows(4),
            write_csv,
            ("--loss", "cosine_mse", "--scale", "10"),
            ("--scale is the similarity scale of the mnrl and cosent losses, and --loss cosine_mse", "or drop it"),
        ),
        (
            scored_rows(4),
            write_csv,
            ("--loss", "cosent", "--no-mask-duplicate-negatives"),
            ("--mask-duplicate-negatives sets mnrl's in-batch negatives, and --loss cosent has none", "or drop it"),
        ),
        (rows(4), write_jsonl, ("--loss", "mnrl", "--max-score", "1"), ("--max-score", "--loss mnrl", "or drop it")),
        (rows(4), write_jsonl, ("--grad-cache-chunk", "0"), ("'task_options.grad_cache_chunk'", "greater than or")),
        (
            rows(4),
            write_jsonl,
            ("--grad-cache-chunk", "2", "--backend", "deepspeed", "--zero-stage", "3"),
            ("--grad-cache-chunk (GradCache) runs the model again", "'deepspeed'", "ZeRO stage 3", "--zero-stage 1"),
        ),
    ],
)
def test_bad_input_is_one_line(capfd, tmp_path, tiny_bert, items, writer, extra, needles):
    name = "train.jsonl" if writer is write_jsonl else "train.csv"
    train = writer(tmp_path / name, items)
    assert_refused(bad_run(capfd, tmp_path, tiny_bert, train, *extra), tmp_path, *needles)


def test_the_python_api_takes_datasets_of_pairs(tiny_bert, cache_dir, tmp_path):
    import datasets

    from tuneforge.trainer import Trainer

    train = datasets.Dataset.from_list(scored_rows(24, seed=7))
    config = {"task": "embedding", "model": tiny_bert, "output_dir": str(tmp_path / "run"), "max_steps": 2}
    config.update(batch_size=8, quiet=True, data={"cache_dir": cache_dir})
    result = Trainer(config).fit(train_dataset=train, eval_dataset=train.select(range(8)))
    assert result["steps"] == 2 and result["num_examples"] == 8 and np.isfinite(result["loss"])
    assert json.loads((tmp_path / "run" / "model" / "tuneforge.json").read_text())["loss"] == "cosent"


def test_python_api_data_without_an_eval_dataset_hold_out_a_tenth(tiny_bert):
    """Trainer.fit(train_dataset=...) alone: the task's prepare_raw of a train split with no file behind it."""
    import datasets

    task = quiet_task("embedding", tiny_bert)
    splits = task.prepare_raw({"train": datasets.Dataset.from_list(rows(30, seed=3))})
    assert (len(splits["train"]), len(splits["validation"])) == (27, 3)


def save_sentence_transformer(folder: Path, tiny_bert: str, pooling: str, dense: bool = False, **config) -> str:
    """tiny_bert saved by sentence-transformers with this pooling (and a Dense projection), Normalize last."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    modules = [Transformer(tiny_bert), Pooling(32, pooling_mode=pooling), *([Dense(32, 16)] if dense else [])]
    SentenceTransformer(modules=[*modules, Normalize()], device="cpu", **config).save(str(folder))
    return str(folder)


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_sentence_transformers_model_with_a_dense_module_is_refused(capfd, tmp_path, tiny_bert, command):
    """Its vectors are the Dense projection's (16 wide); mean-pooled hidden states (32) would train and be scored in
    their place, and the export would drop the projection."""
    folder = save_sentence_transformer(tmp_path / "dense", tiny_bert, "mean", dense=True)
    data = str(write_jsonl(tmp_path / "t.jsonl", rows(4)))
    args = ["train", "--model", folder, "--train-file", data] if command == "train" else ["eval", folder]
    proc = in_process(capfd, *args, "--validation-file", data, "--task", "embedding")
    assert_refused(proc, tmp_path, "folder with Dense after its pooling", "export would leave those weights out")


def test_what_a_sentence_transformers_model_has_and_the_task_does_not_apply_is_said(capfd, tmp_path, tiny_bert):
    prompts = {"prompts": {"query": "query: "}, "default_prompt_name": "query"}
    quiet_task("embedding", save_sentence_transformer(tmp_path / "cls", tiny_bert, "cls", **prompts))
    said = "do not keep its cls pooling (mean pooling here); its default prompt 'query: ' (texts are embedded"
    assert said in capfd.readouterr().out


def test_a_missing_score_column_is_named_with_its_flag(capfd, tmp_path, tiny_bert):
    train = write_jsonl(tmp_path / "train.jsonl", rows(4, negatives=False))
    proc = bad_run(capfd, tmp_path, tiny_bert, train, "--label-column", "similarity")
    assert_refused(proc, tmp_path, "column 'similarity' not found in", "--label-column (the score)")


def test_a_validation_file_without_the_training_files_negative_column_is_refused(capfd, tmp_path, tiny_bert):
    train = write_jsonl(tmp_path / "train.jsonl", rows(4))
    valid = write_jsonl(tmp_path / "valid.jsonl", rows(4, negatives=False))
    proc = bad_run(capfd, tmp_path, tiny_bert, train, "--validation-file", str(valid))
    assert_refused(proc, tmp_path, "column 'negative' not found in", "valid.jsonl")


def test_rows_with_a_text_cut_to_max_length_are_counted_and_counted_again_from_the_cache(tiny_bert, tmp_path):
    # an anchor, positive or negative longer than --max-length was embedded from its first tokens without a word
    from tuneforge.configure import build_config
    from tuneforge.tasks import get_task

    items = rows(12, seed=6)
    for i, row in enumerate(items):
        row[("anchor", "positive", "negative", "anchor")[i % 4]] += " and the grass" * (i % 3)
    data = {"train_file": str(write_jsonl(tmp_path / "train.jsonl", items)), "max_length": 10}
    data |= {"validation_file": data["train_file"], "cache_dir": str(tmp_path / "cache")}
    task = get_task(build_config(task="embedding", model=tiny_bert, data=data))
    task.log = lambda msg: None
    tokenizer = task.load_tokenizer()
    raw = {"train": task.load_raw()["train"]}
    columns = ("anchor", "positive", "negative")
    cut = sum(any(len(tokenizer(r[c])["input_ids"]) > 10 for c in columns) for r in items)
    assert 0 < cut < len(items)
    for lines, feats in tokenized_fresh_then_cached(task, raw, tokenizer, "train"):  # cached: said again
        assert lines[-1] == (
            f"train: {cut} of 12 rows with a text longer than max_length 10 tokens cut to their first 10 (raise "
            "--max-length to keep them whole)"
        )
        for k, column in enumerate(columns):  # the features as before
            direct = tokenizer([r[column] for r in items], truncation=True, max_length=10)["input_ids"]
            assert feats["input_ids" if k == 0 else f"input_ids_{k}"] == direct
        assert "text_cut" not in feats.column_names
