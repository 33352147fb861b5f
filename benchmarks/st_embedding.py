"""The peer of `tuneforge train --task embedding` (benchmarks/embedding_vs_st.py): sentence-transformers'
SentenceTransformerTrainer on the same data, model and settings.

    python benchmarks/st_embedding.py --data stsb --model MODEL --output-dir OUT [--epochs 0]   # 0: untuned
    python benchmarks/st_embedding.py --data squad --train-file T.json --validation-file D.json ...

stsb: GLUE's STS-B TSVs as shipped (read without quoting), scores / 5, CoSENTLoss, the dev set scored by
EmbeddingSimilarityEvaluator (spearman of the cosine similarities). squad: SQuAD JSON read as (question, the
paragraph holding its answer) pairs, MultipleNegativesRankingLoss with BatchSamplers.NO_DUPLICATES (the
sentence-transformers examples' choice for that loss), the dev split scored by InformationRetrievalEvaluator (each
distinct question against the split's distinct paragraphs; ndcg@10). Training: AdamW, linear decay after the warm-up,
weight decay 0 (TrainingArguments' default), bf16 autocast where --precision bf16, no saving or evaluation during
training; the model is saved once at the end (as tuneforge saves its). --grad-cache N:
CachedMultipleNegativesRankingLoss (GradCache) at mini-batch N. Prints one JSON line with the metric.
"""

from __future__ import annotations

import argparse
import csv
import json
import time


def stsb(path: str):
    import pandas as pd
    from datasets import Dataset

    df = pd.read_csv(path, sep="\t", quoting=csv.QUOTE_NONE, encoding="utf-8", dtype=str, keep_default_na=False)
    return Dataset.from_dict(
        {
            "sentence1": df["sentence1"].tolist(),
            "sentence2": df["sentence2"].tolist(),
            "score": [float(x) / 5.0 for x in df["score"]],
        }
    )


def squad_pairs(path: str) -> list[tuple[str, str]]:
    """(question, paragraph) of each answerable question, in file order."""
    data = json.load(open(path, encoding="utf-8"))["data"]
    out = []
    for article in data:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                if qa.get("answers"):
                    out.append((qa["question"], paragraph["context"]))
    return out


def evaluator(args):
    from sentence_transformers.sentence_transformer.evaluation import (
        EmbeddingSimilarityEvaluator,
        InformationRetrievalEvaluator,
    )

    if args.data == "stsb":
        dev = stsb(args.validation_file)
        return EmbeddingSimilarityEvaluator(dev["sentence1"], dev["sentence2"], dev["score"], batch_size=32, name="dev")
    pairs = squad_pairs(args.validation_file)
    queries, corpus, relevant = {}, {}, {}
    for question, paragraph in pairs:
        qid = queries.setdefault(question, f"q{len(queries)}")
        did = corpus.setdefault(paragraph, f"d{len(corpus)}")
        relevant.setdefault(qid, set()).add(did)
    return InformationRetrievalEvaluator(
        {v: k for k, v in queries.items()},
        {v: k for k, v in corpus.items()},
        relevant,
        batch_size=32,
        name="dev",
        show_progress_bar=False,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", choices=["stsb", "squad"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--train-file", required=True)
    ap.add_argument("--validation-file", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--warmup-ratio", type=float, default=0.1)
    ap.add_argument("--epochs", type=float, default=1)
    ap.add_argument("--max-seq-length", type=int, default=None)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--grad-cache", type=int, help="squad: CachedMultipleNegativesRankingLoss at this mini-batch size")
    ap.add_argument("--max-steps", type=int, default=-1)
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, losses
    from sentence_transformers.sentence_transformer.training_args import (
        BatchSamplers,
        SentenceTransformerTrainingArguments,
    )

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the peer on the accelerator where there is one
    model = SentenceTransformer(args.model, device=device)
    if args.max_seq_length:
        model.max_seq_length = args.max_seq_length
    result = {}
    if args.epochs > 0:
        if args.data == "stsb":
            train, loss, sampler = stsb(args.train_file), losses.CoSENTLoss(model), BatchSamplers.BATCH_SAMPLER
        else:
            pairs = squad_pairs(args.train_file)
            train = Dataset.from_dict({"anchor": [q for q, _ in pairs], "positive": [p for _, p in pairs]})
            loss, sampler = losses.MultipleNegativesRankingLoss(model), BatchSamplers.NO_DUPLICATES
            if args.grad_cache:
                loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=args.grad_cache)
        targs = SentenceTransformerTrainingArguments(
            output_dir=args.output_dir,
            num_train_epochs=args.epochs,
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr,
            warmup_ratio=args.warmup_ratio,
            bf16=args.precision == "bf16",
            use_cpu=device == "cpu",
            seed=args.seed,
            batch_sampler=sampler,
            save_strategy="no",
            eval_strategy="no",
            report_to="none",
            disable_tqdm=True,
            logging_steps=50,
        )
        t0 = time.perf_counter()
        SentenceTransformerTrainer(model=model, args=targs, train_dataset=train, loss=loss).train()
        result["train_s"] = round(time.perf_counter() - t0, 1)
        model.save(args.output_dir + "/model")
    t0 = time.perf_counter()
    scores = evaluator(args)(model)
    result["eval_s"] = round(time.perf_counter() - t0, 1)
    key = "dev_spearman_cosine" if args.data == "stsb" else "dev_cosine_ndcg@10"
    result["metric"] = scores[key]
    result["scores"] = {k: round(float(v), 5) for k, v in scores.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
