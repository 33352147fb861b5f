"""Sentence-embedding evaluation (`--task embedding`): retrieval metrics against sentence-transformers'
InformationRetrievalEvaluator (its definitions, ties included, and end to end on a tiny encoder), STS correlations
against its EmbeddingSimilarityEvaluator, a real 2-rank gloo run reporting one process's metrics, SQuAD read as
question -> paragraph retrieval (the whole dev file, a training run, the untuned MiniLM), `tuneforge eval` of an
exported model reporting what the end of its training did, and each bad retrieval input."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import test_task_embedding as embedding_tests
import torch
from test_task_embedding import ANIMALS, PLACES, embedding_task, scored_rows, write_csv, write_jsonl

from conftest import last_json, read_jsonl, run_cli
from test_bad_input import assert_refused, in_process

st_model = embedding_tests.st_model  # tiny_bert as a SentenceTransformer
trained = embedding_tests.trained  # a CLI run on triplets: (run folder, data folder, printed)

RETRIEVAL = ("ndcg@10", "mrr@10", "recall@1", "recall@10", "recall@100")


def retrieval_rows(n: int, seed: int = 0) -> list[dict]:
    """(query, positive, negative) rows over a collection of more than 100 distinct documents, some queries asked
    twice with another positive (two relevant documents) and some positives and negatives repeated."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.sample(ANIMALS, 2)
        row = {
            "query": f"where does the {a} number {i} rest",
            "positive": f"the {a} number {i} rests {rng.choice(PLACES)}",
            "negative": f"the {b} number {rng.randrange(n)} rests {rng.choice(PLACES)}",
        }
        if out and i % 5 == 0:
            row["query"] = out[rng.randrange(len(out))]["query"]  # a second relevant document
        if out and i % 7 == 0:
            row["positive"] = out[rng.randrange(len(out))]["positive"]  # one document, two queries' answer
        out.append(row)
    return out


def squad_head(path: Path, n: int) -> tuple[int, int]:
    """(distinct questions, distinct paragraphs) among the first `n` questions of a SQuAD JSON file."""
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    pairs = [(qa["question"], p["context"]) for a in doc["data"] for p in a["paragraphs"] for qa in p["qas"]][:n]
    return len({q for q, _ in pairs}), len({c for _, c in pairs})


def squad_sample(source: Path, dest: Path, paragraphs: int, questions: int) -> Path:
    """A SQuAD JSON file of the first `questions` questions of the first `paragraphs` paragraphs of each article."""
    doc = json.loads(source.read_text(encoding="utf-8"))
    for article in doc["data"]:
        article["paragraphs"] = [dict(p, qas=p["qas"][:questions]) for p in article["paragraphs"][:paragraphs]]
    dest.write_text(json.dumps(doc), encoding="utf-8")
    return dest


def eval_json(capfd, model: str, data: Path, *extra: str) -> dict:
    """`tuneforge eval MODEL --task embedding --validation-file DATA` in this process: its JSON result."""
    proc = in_process(
        capfd, "eval", model, "--task", "embedding", "--validation-file", data, "--json", "--quiet", *extra
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return last_json(proc.stdout)


def hand_built_collection(items: list[dict], columns=("query", "positive", "negative")):
    """sentence-transformers' (queries, corpus, relevant_docs), written here from the rule itself: distinct texts,
    ids by first appearance, a query's positives relevant."""
    queries, corpus, relevant = {}, {}, {}
    for r in items:
        q = queries.setdefault(r[columns[0]], f"{len(queries):04d}")
        for c in columns[1:]:
            corpus.setdefault(r[c], f"{len(corpus):04d}")
        relevant.setdefault(q, set()).add(corpus[r[columns[1]]])
    return {v: k for k, v in queries.items()}, {v: k for k, v in corpus.items()}, relevant


# ---- the metrics' definitions: sentence-transformers' own compute_metrics ---------------------------------
@pytest.mark.parametrize("n_docs", [130, 7])
def test_retrieval_metrics_are_the_information_retrieval_evaluators(n_docs):
    """Low-resolution embeddings (many exact ties), queries with 1-3 relevant documents, a collection larger than 100
    and one smaller than 10: our metrics equal the evaluator's compute_metrics on the same scores."""
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    from tuneforge.tasks.embedding_eval import retrieval_metrics

    gen = torch.Generator().manual_seed(n_docs)
    queries = torch.randint(-2, 3, (40, 6), generator=gen).float()
    documents = torch.randint(-2, 3, (n_docs, 6), generator=gen).float()
    rng = random.Random(n_docs)
    relevant = {q: rng.sample(range(n_docs), rng.randint(1, 3)) for q in range(40)}
    pairs = [(q, d) for q, docs in relevant.items() for d in docs]
    ours = retrieval_metrics(queries, documents, tuple(np.array(x) for x in zip(*pairs)))

    name = "{:04d}".format
    evaluator = InformationRetrievalEvaluator(
        {name(q): "q" for q in range(40)},
        {name(d): "d" for d in range(n_docs)},
        {name(q): {name(d) for d in docs} for q, docs in relevant.items()},
        mrr_at_k=[10],
        ndcg_at_k=[10],
        accuracy_at_k=[1],
        precision_recall_at_k=[1, 10, 100],
        map_at_k=[100],
    )
    scores = (queries @ documents.T).tolist()
    results = [[{"corpus_id": name(d), "score": s} for d, s in enumerate(row)] for row in scores]
    theirs = evaluator.compute_metrics(results)
    assert (queries @ documents.T).unique().numel() < 40  # ties everywhere: their order matters
    assert ours["ndcg@10"] == pytest.approx(theirs["ndcg@k"][10], abs=1e-12)
    assert ours["mrr@10"] == pytest.approx(theirs["mrr@k"][10], abs=1e-12)
    for k in (1, 10, 100):
        assert ours[f"recall@{k}"] == pytest.approx(theirs["recall@k"][k], abs=1e-12)
    assert 0 < ours["ndcg@10"] < 1 and ours["recall@1"] < ours["recall@10"]


def test_the_collection_helper_is_the_rule():
    from tuneforge.data.retrieval import evaluator_inputs

    items = retrieval_rows(40, seed=3)
    built = evaluator_inputs([r["query"] for r in items], [(r["positive"], r["negative"]) for r in items])

    def by_text(queries, corpus, relevant):
        return (
            list(queries.values()),
            list(corpus.values()),
            {queries[q]: {corpus[d] for d in ds} for q, ds in relevant.items()},
        )

    assert by_text(*built) == by_text(*hand_built_collection(items))
    assert sorted(built[1]) == list(built[1]) and sorted(built[0]) == list(built[0])  # ids ascend as texts appear
    assert any(len(docs) == 2 for docs in built[2].values())  # a query with two relevant documents


# ---- end to end on a tiny encoder: sentence-transformers' evaluators on the same model ----------------------
def test_eval_reports_the_information_retrieval_evaluators_metrics(capfd, tmp_path, tiny_bert, st_model, cache_dir):
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    items = retrieval_rows(120, seed=1)
    dev = write_jsonl(tmp_path / "dev.jsonl", items)
    ours = eval_json(capfd, tiny_bert, dev, "--precision", "fp32", "--cache-dir", cache_dir)
    queries, corpus, relevant = hand_built_collection(items)
    assert (ours["num_queries"], ours["num_documents"]) == (len(queries), len(corpus))
    assert ours["num_examples"] == 120 and len(corpus) > 100 and len(queries) < 120
    evaluator = InformationRetrievalEvaluator(
        queries, corpus, relevant, mrr_at_k=[10], ndcg_at_k=[10], precision_recall_at_k=[1, 10, 100]
    )
    theirs = evaluator(st_model)
    for metric in RETRIEVAL:
        assert ours[metric] == pytest.approx(theirs[f"cosine_{metric}"], abs=1e-6), metric
    assert 0.01 < ours["ndcg@10"] < 0.99 and ours["recall@100"] < 1  # a random encoder: neither extreme
    assert np.isfinite(ours["loss"])


def test_eval_reports_the_embedding_similarity_evaluators_correlations(capfd, tmp_path, tiny_bert, st_model, cache_dir):
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    items = scored_rows(60, seed=2)
    dev = write_csv(tmp_path / "dev.csv", items)
    ours = eval_json(capfd, tiny_bert, dev, "--precision", "fp32", "--cache-dir", cache_dir)
    evaluator = EmbeddingSimilarityEvaluator(
        [r["sentence1"] for r in items], [r["sentence2"] for r in items], [r["score"] / 5 for r in items]
    )
    theirs = evaluator(st_model)
    assert ours["spearman"] == pytest.approx(theirs["spearman_cosine"], abs=1e-6)
    assert ours["pearson"] == pytest.approx(theirs["pearson_cosine"], abs=1e-6)
    assert abs(ours["spearman"]) > 0.05 and ours["num_examples"] == 60
    assert "ndcg@10" not in ours


# ---- a real 2-rank gloo group reports one process's metrics -----------------------------------------------
@pytest.mark.parametrize("kind", ["retrieval", "sts"])
def test_two_ranks_report_the_metrics_of_one_process(capfd, tmp_path, tiny_bert, cache_dir, kind):
    """37 rows, 2 ranks at --eval-batch-size 8 (a last global batch of 5: a padding row on one rank) against one
    process at 16 (the same batches, so the in-batch loss is the same too)."""
    if kind == "retrieval":
        data = write_jsonl(tmp_path / "dev.jsonl", retrieval_rows(37, seed=4))
    else:
        data = write_csv(tmp_path / "dev.csv", scored_rows(37, seed=4))
    args = ["eval", tiny_bert, "--task", "embedding", "--validation-file", str(data), "--precision", "fp32"]
    args += ["--cache-dir", cache_dir, "--json", "--quiet"]
    two = run_cli(*args, "--eval-batch-size", "8", "--backend", "ddp", "--nproc", "2")
    assert two.returncode == 0, two.stderr[-4000:]
    split = last_json(two.stdout)
    one = eval_json(capfd, tiny_bert, data, "--eval-batch-size", "16", "--precision", "fp32", "--cache-dir", cache_dir)
    names = RETRIEVAL + ("num_queries", "num_documents") if kind == "retrieval" else ("spearman", "pearson")
    for name in (*names, "loss", "num_examples"):
        assert split[name] == pytest.approx(one[name], abs=1e-6), name
    assert one["num_examples"] == 37


# ---- SQuAD: question -> paragraph ----------------------------------------------------------------------
def test_squad_dev_is_10570_questions_over_2067_paragraphs(shared_data):
    from tuneforge.data.retrieval import collection_ids, is_squad_json, squad_pairs

    path = shared_data / "squad" / "dev-v1.1.json"
    assert is_squad_json(path)
    read = squad_pairs(path)
    assert (read.questions, read.paragraphs, read.unanswerable) == (10570, 2067, 0)
    queries, positives = read.rows["query"], read.rows["positive"]
    doc = json.loads(path.read_text())
    first = doc["data"][0]["paragraphs"][0]
    assert (queries[0], positives[0]) == (first["qas"][0]["question"], first["context"])
    query_ids, doc_ids = collection_ids(queries, [[p] for p in positives])
    assert len(set(query_ids)) == 10539  # a repeated question text is one query, all its paragraphs relevant
    assert len({d for ids in doc_ids for d in ids}) == 2067


def test_a_run_trains_on_squad_pairs_and_keeps_the_best_ndcg(shared_data, tiny_bert, cache_dir, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--task", "embedding", "--model", tiny_bert, "--data-dir", str(shared_data / "squad")]
    args += ["--max-train-samples", "64", "--max-eval-samples", "160", "--max-steps", "3", "--batch-size", "16"]
    args += ["--lr", "5e-3", "--max-length", "64", "--eval-strategy", "steps", "--eval-steps", "1"]
    args += ["--freeze-layers", "0", "--freeze-embeddings", "off", "--cache-dir", cache_dir, "--json"]
    proc = run_cli(*args, "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dev-v1.1.json': 10570 questions over 2067 paragraphs, as (question, paragraph) pairs" in proc.stderr
    assert "pairs (query, positive): mnrl loss" in proc.stderr
    queries, paragraphs = squad_head(shared_data / "squad" / "dev-v1.1.json", 160)
    assert f"retrieval evaluation: {queries} distinct queries over a collection of {paragraphs} " in proc.stderr
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "eval"]
    assert len(evals) == 3 and all(0 <= r["ndcg@10"] <= 1 for r in evals)
    assert (evals[0]["num_queries"], evals[0]["num_documents"], evals[0]["num_examples"]) == (queries, paragraphs, 160)
    assert paragraphs > 5
    result = last_json(proc.stdout)
    best = max(evals, key=lambda r: (r["ndcg@10"], -r["step"]))  # the highest ndcg@10, the first of equals
    assert result["best_step"] == best["step"]


def test_the_best_model_metric_follows_the_data(tiny_bert, tmp_path):
    from tuneforge.configure import build_config
    from tuneforge.tasks import get_task

    pairs = write_jsonl(tmp_path / "pairs.jsonl", retrieval_rows(10))
    scored = write_csv(tmp_path / "scored.csv", scored_rows(10))
    for path, metric in ((pairs, "ndcg@10"), (scored, "spearman")):
        task = get_task(build_config(task="embedding", model=tiny_bert, data={"validation_file": str(path)}))
        task.log = lambda msg: None
        assert task.best_metric == "loss"  # nothing read yet
        task.load_raw()
        assert (task.best_metric, task.greater_is_better) == (metric, True)
    assert embedding_task(tiny_bert).greater_is_better is False


def test_untuned_minilm_retrieves_squad_paragraphs_and_ranks_sts_b(shared_data, minilm_dir, capfd, tmp_path, cache_dir):
    """The default model, all-MiniLM-L6-v2, as published: its retrieval over 96 SQuAD dev paragraphs (the first 2 of
    each article, a question each) and its STS-B dev correlation are those of a good encoder (a broken metric or pooling
    gives far less)."""
    dev = squad_sample(shared_data / "squad" / "dev-v1.1.json", tmp_path / "dev.json", paragraphs=2, questions=1)
    squad = eval_json(capfd, minilm_dir, dev, "--max-length", "256", "--cache-dir", cache_dir)
    assert (squad["num_queries"], squad["num_documents"]) == squad_head(dev, 10_000)
    assert squad["num_documents"] == 96
    assert squad["ndcg@10"] > 0.85 and squad["recall@1"] > 0.7  # 0.94 and 0.83 here (bf16)
    sts = eval_json(
        capfd,
        minilm_dir,
        shared_data / "glue" / "STS-B" / "dev.tsv",
        "--max-eval-samples",
        "200",
        "--cache-dir",
        cache_dir,
    )
    assert sts["spearman"] > 0.85  # 0.94


# ---- an exported model: `tuneforge eval` reports what the end of training did ---------------------------
def test_eval_of_the_exported_model_reports_the_end_of_training(trained, capfd):
    run, data, printed = trained
    at_end = last_json(printed)
    again = eval_json(
        capfd,
        str(run / "model"),
        data / "valid.jsonl",
        "--eval-batch-size",
        "16",
        "--max-length",
        "24",
        "--matryoshka-dims",
        "32,16,8",
    )
    for name in (*RETRIEVAL, "num_queries", "num_documents", "num_examples"):
        assert again[name] == pytest.approx(at_end[name], abs=1e-6), name
    assert again["loss"] == pytest.approx(at_end["loss"], abs=1e-4)
    assert at_end["num_documents"] > 16  # the positives and the hard negatives


# ---- bad input: one line, exit 2, nothing written -------------------------------------------------------
def squad_doc(context: str, answers: list[dict], **qa) -> dict:
    good = {
        "context": "The owl sits under a tree.",
        "qas": [{"id": "q1", "question": "Where?", "answers": [{"text": "under a tree", "answer_start": 13}]}],
    }
    bad = {"context": context, "qas": [{"id": "q2", "question": "What sits?", "answers": answers, **qa}]}
    return {"version": "1.1", "data": [{"title": "t", "paragraphs": [good, bad]}]}


@pytest.mark.parametrize(
    "doc, needles",
    [
        (
            squad_doc("", []),
            ("question 'q2' (row 2)", "has no paragraph, so its relevant document is missing"),
        ),
        (
            squad_doc("The fox runs.", [{"text": "the owl", "answer_start": 0}]),
            ("question 'q2' (row 2)", "answer 'the owl' is not in the question's paragraph"),
        ),
        (
            {"data": [{"paragraphs": [{"context": "a", "qas": [{"id": "x", "question": "b", "answers": []}]}]}]},
            ("holds no answerable questions (1 unanswerable)",),
        ),
        ({"data": [{"title": "no paragraphs"}]}, ("article 1: no 'paragraphs' list",)),
    ],
)
def test_a_bad_squad_file_is_one_line(capfd, tmp_path, tiny_bert, doc, needles):
    train = tmp_path / "train.json"
    train.write_text(json.dumps(doc), encoding="utf-8")
    proc = in_process(
        capfd,
        "train",
        "--task",
        "embedding",
        "--model",
        tiny_bert,
        "--train-file",
        train,
        "--max-steps",
        "1",
        "--output-dir",
        tmp_path / "out",
        "--cache-dir",
        tmp_path / "cache",
    )
    assert_refused(proc, tmp_path, "train.json", *needles)


def test_a_retrieval_file_whose_relevant_document_is_missing_is_one_line(capfd, tmp_path, tiny_bert):
    items = [*retrieval_rows(3), {"query": "where does the fox rest", "negative": "the cow rests in the barn"}]
    dev = write_jsonl(tmp_path / "dev.jsonl", items)
    proc = in_process(
        capfd,
        "eval",
        tiny_bert,
        "--task",
        "embedding",
        "--validation-file",
        dev,
        "--output-dir",
        tmp_path / "out",
        "--cache-dir",
        tmp_path / "cache",
    )
    assert_refused(proc, tmp_path, "row 4 of", "dev.jsonl", "empty 'positive' text")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_squad_rows_in_the_hubs_form_read_as_pairs(tiny_bert, tmp_path, suffix):
    """Rows with question, context and answers (the hub's squad form) are SQuAD too: jsonl, or parquet as the hub
    ships rajpurkar/squad (a parquet file was refused as 'unknown format', its answers numpy arrays); an
    unanswerable question (SQuAD 2.0: no answers) is left out."""
    import pandas as pd

    from tuneforge.configure import build_config
    from tuneforge.tasks import get_task

    items = [
        {
            "question": "Where does the owl sit?",
            "context": "The owl sits under a tree.",
            "answers": {"text": ["under a tree"], "answer_start": [13]},
        },
        {
            "question": "What runs?",
            "context": "The fox runs by the river.",
            "answers": {"text": ["The fox", "fox"], "answer_start": [0, 4]},
        },
        {"question": "Which fox?", "context": "The fox runs.", "answers": {"text": [], "answer_start": []}},
    ]
    dev = tmp_path / f"dev{suffix}"
    if suffix == ".parquet":
        pd.DataFrame(items).to_parquet(dev)
    else:
        write_jsonl(dev, items)
    task = get_task(build_config(task="embedding", model=tiny_bert, data={"validation_file": str(dev)}))
    notes = []
    task.log = notes.append
    raw = task.load_raw()
    assert raw["validation"]["text_0"] == ["Where does the owl sit?", "What runs?"]
    assert raw["validation"]["text_1"] == ["The owl sits under a tree.", "The fox runs by the river."]
    assert any("2 questions over 2 paragraphs" in note and "1 unanswerable" in note for note in notes)


def test_a_squad_dev_file_evaluates_pairs_named_otherwise(shared_data, tiny_bert, tmp_path):
    from tuneforge.data.retrieval import squad_pairs

    """Training pairs named anchor/positive, SQuAD's dev JSON (read as query, positive) to evaluate them: each split's
    guessed columns under the training file's names (it was refused, 'column anchor not found', and no
    --text-column could name a SQuAD file's columns)."""
    from tuneforge.configure import build_config
    from tuneforge.tasks import get_task

    train = write_jsonl(
        tmp_path / "train.jsonl", [{"positive": r["positive"], "anchor": r["query"]} for r in retrieval_rows(8)]
    )
    dev = squad_sample(shared_data / "squad" / "dev-v1.1.json", tmp_path / "dev.json", paragraphs=1, questions=2)
    data = {"train_file": str(train), "validation_file": str(dev)}
    task = get_task(build_config(task="embedding", model=tiny_bert, data=data))
    task.log = lambda msg: None
    raw = task.load_raw()
    assert task.layout.texts == ("anchor", "positive")
    queries, positives = (squad_pairs(dev).rows[c] for c in ("query", "positive"))
    assert (raw["validation"]["text_0"], raw["validation"]["text_1"]) == (queries, positives)
    assert raw["train"]["text_0"] == [r["query"] for r in retrieval_rows(8)]
