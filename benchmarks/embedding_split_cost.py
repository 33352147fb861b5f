"""What `split_by_length` saves, and the per-forward cost it assumes (tasks/embedding.py: CPU_TOKENS_PER_FORWARD):
one training step (forward and backward of both columns, CoSENT) of the bundled all-MiniLM-L6-v2 on random STS-B
batches, each column embedded padded to the batch's longest text (`whole`), or in runs of similar length chosen by
`length_groups` with a given per-forward cost in tokens: both columns' texts together (as the task does, N) or
each column on its own (column-N).

    python benchmarks/embedding_split_cost.py --batch-size 16 --batches 40
    python benchmarks/embedding_split_cost.py --batch-size 64 --batches 12

The embeddings and the bottom layer are frozen as tuneforge's defaults freeze them; fp32 (the AVX2 class's
precision; on a CPU with native bf16 tuneforge trains in bf16 autocast, not measured here). Each setting runs the same
batches (the first 3 a warm-up), --rounds times interleaved; the minimum and the median ms per step are reported.
Writes benchmarks/results/embedding_split_cost-batch-N.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import time
from pathlib import Path

from _machine import machine_meta

HERE = Path(__file__).resolve().parent
STSB = HERE.parent.parent / "shared/data/glue/STS-B/train.tsv"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--costs",
        default="whole,column-48,32,48,64,96",
        help="per-forward costs in tokens, both columns' texts grouped together; column-N: each column on its own; "
        "whole: each column padded whole",
    )
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    from tuneforge.artifacts import bundled_minilm
    from tuneforge.tasks.embedding import stacked_columns
    from tuneforge.tasks.embedding_ops import cosent_loss, embed, embed_grouped, length_groups

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(bundled_minilm())
    model = AutoModel.from_pretrained(bundled_minilm()).train()
    for name, weight in model.named_parameters():
        weight.requires_grad_(not (name.startswith(("embeddings.", "pooler.")) or ".layer.0." in name))
    with STSB.open(encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    random.Random(0).shuffle(rows)
    batches, padded, real = [], 0, 0
    for start in range(0, args.batches * args.batch_size, args.batch_size):
        part = rows[start : start + args.batch_size]
        columns = [tokenizer([r[c] for r in part], padding=True, truncation=True, return_tensors="pt") for c in (7, 8)]
        batches.append((columns, torch.tensor([float(r[9]) / 5 for r in part])))
        padded += sum(c["attention_mask"].numel() for c in columns)
        real += sum(int(c["attention_mask"].sum()) for c in columns)

    def step(batch, cost) -> None:
        columns, scores = batch
        embs = []
        for enc in columns:
            ids, mask = enc["input_ids"], enc["attention_mask"]
            if cost == "whole":
                embs.append(embed(model, ids, mask))
            elif cost.startswith("column-"):
                per_forward = float(cost.removeprefix("column-"))
                embs.append(embed_grouped(model, ids, mask, length_groups(mask.sum(1).tolist(), per_forward)))
        if not embs:  # both columns' texts grouped together, as the task groups them
            batch = {"input_ids": columns[0]["input_ids"], "attention_mask": columns[0]["attention_mask"]}
            batch |= {"input_ids_1": columns[1]["input_ids"], "attention_mask_1": columns[1]["attention_mask"]}
            ids, mask = stacked_columns(batch, 2)
            embs = embed_grouped(model, ids, mask, length_groups(mask.sum(1).tolist(), float(cost))).chunk(2)
        cosent_loss(*(F.normalize(e, dim=-1) for e in embs), scores, 20.0).backward()
        model.zero_grad(set_to_none=True)

    for batch in batches[:3]:
        step(batch, "whole")
    costs = args.costs.split(",")
    times: dict[str, list[float]] = {c: [] for c in costs}
    for _ in range(args.rounds):
        for cost in costs:
            start = time.perf_counter()
            for batch in batches[3:]:
                step(batch, cost)
            times[cost].append((time.perf_counter() - start) / (len(batches) - 3) * 1000)
    result = {
        "meta": machine_meta(**vars(args), real_tokens=real, padded_tokens=padded),
        "ms_per_step": {
            c: {"min": round(min(t), 1), "median": round(statistics.median(t), 1)} for c, t in times.items()
        },
    }
    out = HERE / "results" / f"embedding_split_cost-batch-{args.batch_size}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"batch {args.batch_size}: {real} real tokens, {padded} padded ({padded / real:.2f}x)")
    print("| per-forward cost (tokens) | ms/step, min | median |\n|---|---|---|")
    for cost, t in result["ms_per_step"].items():
        print(f"| {cost} | {t['min']} | {t['median']} |")


if __name__ == "__main__":
    main()
