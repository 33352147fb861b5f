"""Evaluation of sentence embeddings (`--task embedding`): the metric stream and the metrics it reports.

- Scored pairs: the Spearman and Pearson correlations of the two sentences' cosine similarity with the scores
  (sentence-transformers' EmbeddingSimilarityEvaluator, cosine).
- (query, positive[, negatives...]) rows: exact retrieval of every query over the whole document collection of the
  split (`tuneforge.data.retrieval.collection_ids`: texts deduplicated), by the cosine similarity of the normalised
  embeddings: mrr@10, ndcg@10, recall@1, recall@10 and recall@100 as sentence-transformers'
  InformationRetrievalEvaluator defines them (binary relevance; documents of equal score in order of first
  appearance, its ascending-id order), with num_queries and num_documents.
- Always the loss (the task's, over the evaluation batches) and num_examples.

Exact across data-parallel ranks: each rank keeps its rows' normalised embeddings (or similarities) with their row
numbers; `compute` gathers every rank's, orders them by row, and computes the metrics from the whole split, so N
ranks report what one process does. A query's or document's embedding is that of its first row.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from tuneforge.tasks.base import MetricStream

RECALL_AT = (1, 10, 100)
RANK_DEPTH = 10  # mrr@10, ndcg@10
QUERY_CHUNK = 256  # queries scored against the whole collection at a time


def sts_metrics(similarities: np.ndarray, scores: np.ndarray) -> dict[str, float]:
    """Spearman and Pearson correlations of the cosine similarities with the scores (nan: fewer than 2 pairs, or
    either side constant)."""
    from scipy.stats import pearsonr, spearmanr

    sims, gold = np.asarray(similarities, dtype=np.float64), np.asarray(scores, dtype=np.float64)
    if len(sims) < 2 or np.ptp(sims) == 0 or np.ptp(gold) == 0:
        return {"spearman": math.nan, "pearson": math.nan}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"spearman": float(spearmanr(gold, sims)[0]), "pearson": float(pearsonr(gold, sims)[0])}


def retrieval_metrics(
    queries: torch.Tensor, documents: torch.Tensor, relevant: tuple[np.ndarray, np.ndarray]
) -> dict[str, float]:
    """mrr@10, ndcg@10 and recall@1/10/100 of each query (rows of `queries`, normalised) searching every document
    (rows of `documents`) by dot product, averaged over the queries; `relevant`: (query positions, document
    positions) of the relevant pairs, every query with at least one."""
    n_docs = documents.shape[0]
    depth = min(max(RECALL_AT), n_docs)
    discount = 1.0 / np.log2(np.arange(2, RANK_DEPTH + 2, dtype=np.float64))
    ideal = np.cumsum(discount)
    pairs_q, pairs_d = (np.asarray(a, dtype=np.int64) for a in relevant)
    order = np.argsort(pairs_q, kind="stable")
    pairs_q, pairs_d = pairs_q[order], pairs_d[order]
    sums = {name: 0.0 for name in ("mrr@10", "ndcg@10", *(f"recall@{k}" for k in RECALL_AT))}
    for start in range(0, queries.shape[0], QUERY_CHUNK):
        chunk = queries[start : start + QUERY_CHUNK]
        lo, hi = np.searchsorted(pairs_q, [start, start + chunk.shape[0]])
        rel = torch.zeros((chunk.shape[0], n_docs), dtype=torch.bool)
        rel[torch.from_numpy(pairs_q[lo:hi] - start), torch.from_numpy(pairs_d[lo:hi])] = True
        ranked = torch.sort(chunk @ documents.T, dim=1, descending=True, stable=True).indices[:, :depth]
        hits = rel.gather(1, ranked).numpy()
        n_rel = rel.sum(1).numpy()
        top = hits[:, :RANK_DEPTH]
        sums["mrr@10"] += float(np.where(top.any(1), 1.0 / (top.argmax(1) + 1), 0.0).sum())
        dcg = (top * discount[: top.shape[1]]).sum(1)
        sums["ndcg@10"] += float((dcg / ideal[np.minimum(n_rel, RANK_DEPTH) - 1]).sum())
        for k in RECALL_AT:
            sums[f"recall@{k}"] += float((hits[:, :k].sum(1) / n_rel).sum())
    return {name: total / queries.shape[0] for name, total in sums.items()}


def collection(merged: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, tuple[np.ndarray, np.ndarray]]:
    """(query embeddings, document embeddings, relevant pairs) of the split's rows (`merged`, in row order): each
    distinct query and document once, in id order (their first row's embedding); each row's positive relevant to its
    query."""
    query_ids, doc_ids = merged["query_id"], merged["doc_ids"]
    q_unique, q_first = np.unique(query_ids, return_index=True)
    d_unique, d_first = np.unique(doc_ids.reshape(-1), return_index=True)
    queries = merged["query"][q_first]
    documents = merged["documents"].reshape(-1, merged["documents"].shape[-1])[d_first]
    relevant = (np.searchsorted(q_unique, query_ids), np.searchsorted(d_unique, doc_ids[:, 0]))
    return torch.from_numpy(queries), torch.from_numpy(documents), relevant


class EmbeddingStream(MetricStream):
    """The loss over every evaluation row across ranks, and (where the batches carry their row numbers: features
    the task tokenized) the STS or retrieval metrics of the whole split."""

    def __init__(self, task) -> None:
        self.task = task
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.count = torch.zeros((), dtype=torch.float64)
        self.parts: dict[str, list[np.ndarray]] = {}
        self.memo: dict[bytes, torch.Tensor] = {}  # each text's embedding in this evaluation (the task's eval_step)

    def update(self, outputs, batch, valid) -> None:
        loss, _ = self.task.compute_loss(outputs, batch, row_mask=valid)
        self.loss_sum += loss.detach().double().cpu()
        self.count += valid.sum().double().cpu()
        if "row" not in batch:
            return
        keep = valid.bool()
        embs = [F.normalize(e.detach().float()[keep], dim=-1).cpu() for e in outputs.embeddings]
        self._keep("row", batch["row"][keep])
        if "scores" in batch:
            self._keep("similarity", (embs[0] * embs[1]).sum(-1))
            self._keep("score", batch["scores"][keep])
        if "query_id" in batch:
            self._keep("query_id", batch["query_id"][keep])
            self._keep("doc_ids", batch["doc_ids"][keep])
            self._keep("query", embs[0])
            self._keep("documents", torch.stack(embs[1:], dim=1))

    def _keep(self, name: str, values: torch.Tensor) -> None:
        self.parts.setdefault(name, []).append(values.detach().cpu().numpy())

    def compute(self, backend) -> dict[str, float]:
        mine = {name: np.concatenate(arrays) for name, arrays in self.parts.items()}
        merged = merge_ranks(backend.gather_objects(mine))
        metrics: dict = {}
        if len(merged.get("similarity", ())):
            metrics.update(sts_metrics(merged["similarity"], merged["score"]))
        if len(merged.get("query_id", ())):
            queries, documents, relevant = collection(merged)
            metrics.update(retrieval_metrics(queries, documents, relevant))
            metrics.update(num_queries=int(queries.shape[0]), num_documents=int(documents.shape[0]))
        examples = int(backend.reduce_sum(self.count.float().to(backend.device)))
        return self.with_loss(backend, metrics, examples)


def merge_ranks(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Every rank's arrays as one, ordered by row number (a rank without rows sends none)."""
    names = {name for part in parts for name in part}
    merged = {name: np.concatenate([part[name] for part in parts if name in part]) for name in names}
    if "row" in merged:
        order = np.argsort(merged["row"], kind="stable")
        merged = {name: values[order] for name, values in merged.items()}
    return merged
