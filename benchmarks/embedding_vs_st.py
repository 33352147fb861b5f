"""Sentence embeddings: tuneforge `--task embedding` against sentence-transformers' SentenceTransformerTrainer
(issue 27), same model, data and settings, same machine, whole processes one after the other.

    python benchmarks/embedding_vs_st.py --data stsb --seeds 1 --only uabc
    python benchmarks/embedding_vs_st.py --data squad --train-articles 4 --dev-articles 3 --seeds 1 --only uabc

Model: the bundled all-MiniLM-L6-v2. Variants:
  u: the untuned model scored by sentence-transformers' evaluator (the starting point; the process timed too);
  a: the peer, benchmarks/st_embedding.py (SentenceTransformerTrainer, CoSENTLoss / MultipleNegativesRankingLoss);
  b: tuneforge as a user runs it: its defaults beyond the shared settings (for encoders: embeddings and the bottom
     layer frozen, dropout 0, weight decay 0.01, random batches);
  c: tuneforge with the peer's trainable weights: b plus --freeze-layers 0 --freeze-embeddings off;
  g: b plus data.group_by_length=true (batches of similar lengths: less padding);
  s: b plus --no-pack-texts (each batch in runs of similar length, split_by_length, as before pack_texts);
  n: b plus --no-pack-texts --no-split-by-length (each batch padded and embedded whole, as before both);
  2, 3: b with the bottom 2 or 3 transformer layers frozen (--freeze-layers N; the default freezes 1);
  d: b on 2 data-parallel ranks (--backend ddp --nproc 2) at half the batch each: the same global batch, which the
     in-batch negatives gathered across ranks make the same training as b (its metric should equal b's).
Shared settings (the sentence-transformers STS-B training example's where they fit): batch 16, lr 2e-5, 10% linear
warm-up then linear decay, --epochs (1 by default; the example's 4 do not fit the time), evaluation once after
training. Precision: tuneforge's --precision auto (bf16 where the CPU does bf16 natively, else fp32), the peer the
same (bf16=True, autocast, or fp32). --grad-cache N: GradCache on both (--grad-cache-chunk N; the peer's
CachedMultipleNegativesRankingLoss, mini_batch_size N), squad only; --max-steps stops both sides early. Each
side's wall time runs from process start to its printed dev metric, the model saved on both.

stsb: GLUE's STS-B TSVs as shipped (../shared/data/glue/STS-B), CoSENT, dev Spearman of the cosine similarities.
squad: the first --train-articles articles of ../shared/data/squad's train subset and the first --dev-articles of the
official dev file, written as SQuAD JSON that both sides read (tuneforge reads SQuAD JSON directly): question ->
the paragraph holding its answer, mnrl, ndcg@10 of each distinct dev question over the distinct dev paragraphs;
128 tokens at most per text on both (tuneforge's default --max-length; the peer's model.max_seq_length, 256 in the
model's folder, set to 128).

Writes benchmarks/results/embedding_vs_st-DATA-seeds-....json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from _machine import machine_meta
from _process import timed

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared/data"
NAMES = {
    "u": "untuned all-MiniLM-L6-v2",
    "a": "sentence-transformers SentenceTransformerTrainer",
    "b": "tuneforge --task embedding (defaults)",
    "c": "tuneforge --task embedding --freeze-layers 0 --freeze-embeddings off",
    "g": "tuneforge --task embedding data.group_by_length=true",
    "s": "tuneforge --task embedding --no-pack-texts",
    "n": "tuneforge --task embedding --no-pack-texts --no-split-by-length",
    "d": "tuneforge --task embedding --backend ddp --nproc 2, half the batch per rank",
    "2": "tuneforge --task embedding --freeze-layers 2",
    "3": "tuneforge --task embedding --freeze-layers 3",
}


def squad_subset(src: Path, articles: int, dest: Path) -> int:
    """The first `articles` articles of a SQuAD JSON file written to `dest`; the number of questions."""
    data = json.loads(src.read_text(encoding="utf-8"))
    data["data"] = data["data"][:articles]
    dest.write_text(json.dumps(data))
    return sum(len(p["qas"]) for a in data["data"] for p in a["paragraphs"])


def command(variant: str, args, model: str, files: tuple[Path, Path], out: Path, seed: int) -> list[str]:
    train, dev = files
    if variant in "ua":
        cmd = [sys.executable, str(HERE / "st_embedding.py"), "--data", args.data, "--model", model]
        cmd += ["--train-file", str(train), "--validation-file", str(dev), "--output-dir", str(out)]
        cmd += ["--batch-size", str(args.batch_size), "--lr", args.lr, "--warmup-ratio", "0.1", "--seed", str(seed)]
        cmd += ["--max-seq-length", "128"] if args.data == "squad" else []
        cmd += ["--grad-cache", str(args.grad_cache)] if args.grad_cache and variant == "a" else []
        cmd += ["--max-steps", str(args.max_steps)] if args.max_steps and variant == "a" else []
        return cmd + ["--epochs", "0" if variant == "u" else str(args.epochs), "--precision", args.peer_precision]
    cmd = [sys.executable, "-m", "tuneforge.cli", "train", "--task", "embedding", "--model", model]
    cmd += ["--train-file", str(train), "--validation-file", str(dev), "--output-dir", str(out)]
    per_rank = args.batch_size // 2 if variant == "d" else args.batch_size
    cmd += ["--batch-size", str(per_rank), "--lr", args.lr, "--warmup-ratio", "0.1"]
    cmd += ["--epochs", str(args.epochs), "--seed", str(seed), "--json", "--quiet"]
    cmd += ["--backend", "ddp", "--nproc", "2"] if variant == "d" else []
    cmd += ["--cache-dir", str(out) + "-cache"]  # tokenization paid every run, as the peer's is
    if variant == "c":
        cmd += ["--freeze-layers", "0", "--freeze-embeddings", "off"]
    if variant == "g":
        cmd += ["data.group_by_length=true"]
    if variant in "sn":
        cmd += ["--no-pack-texts"]
    if variant == "n":
        cmd += ["--no-split-by-length"]
    if variant in "23":
        cmd += ["--freeze-layers", variant]
    cmd += ["--grad-cache-chunk", str(args.grad_cache)] if args.grad_cache else []
    cmd += ["--max-steps", str(args.max_steps)] if args.max_steps else []
    return cmd


def metric_of(variant: str, stdout: str, data: str) -> float:
    line = json.loads(stdout.strip().splitlines()[-1])
    if variant in "ua":
        return line["metric"]
    name = "spearman" if data == "stsb" else "ndcg@10"
    found = [v for k, v in line.items() if k == name or k.endswith("_" + name)]
    return found[0] if found else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", choices=["stsb", "squad"], default="stsb")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--only", default="uabc", help="u: untuned, a: sentence-transformers, b/c/g/s/n/d/2/3: tuneforge")
    ap.add_argument("--epochs", type=float, default=1)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", default="2e-5")
    ap.add_argument("--train-articles", type=int, default=4)
    ap.add_argument("--dev-articles", type=int, default=3)
    ap.add_argument("--grad-cache", type=int, help="GradCache at this chunk (--grad-cache-chunk; the peer's Cached*)")
    ap.add_argument("--max-steps", type=int, help="stop both sides after this many steps")
    args = ap.parse_args()
    import torch

    from tuneforge.artifacts import bundled_minilm
    from tuneforge.backends.base import cpu_has_native_bf16

    # the peer at its best here: bf16 autocast on a GPU or where the CPU does bf16 natively, else fp32 (as
    # tuneforge's auto); both sides train on the GPU where there is one
    args.peer_precision = "bf16" if torch.cuda.is_available() or cpu_has_native_bf16() else "fp32"

    model = bundled_minilm()
    work = Path(tempfile.mkdtemp(prefix="bench-embed-"))
    extra = {}
    if args.data == "stsb":
        files = (SHARED / "glue/STS-B/train.tsv", SHARED / "glue/STS-B/dev.tsv")
    else:
        files = (work / "train.json", work / "dev.json")
        extra["train_questions"] = squad_subset(
            SHARED / "squad/train-v1.1-subset-du2017.json", args.train_articles, files[0]
        )
        extra["dev_questions"] = squad_subset(SHARED / "squad/dev-v1.1.json", args.dev_articles, files[1])
    runs = []
    for seed in args.seeds:
        for variant in args.only:
            if variant == "u" and seed != args.seeds[0]:
                continue
            out = work / f"{variant}-{seed}"
            wall, rss, stdout = timed(command(variant, args, model, files, out, seed), work / f"{variant}-{seed}.log")
            run = {"variant": variant, "seed": seed, "wall_s": round(wall, 1), "peak_rss_mib": rss}
            run["metric"] = round(metric_of(variant, stdout, args.data), 4)
            run["stdout_last"] = stdout.strip().splitlines()[-1]
            print({k: v for k, v in run.items() if k != "stdout_last"}, flush=True)
            runs.append(run)
    meta = machine_meta(**vars(args), model=model, work=str(work), **extra)
    settings = f"-grad-cache-{args.grad_cache}" if args.grad_cache else ""
    settings += f"-batch-{args.batch_size}" if args.batch_size != 16 else ""
    settings += f"-steps-{args.max_steps}" if args.max_steps else ""
    settings += "" if args.peer_precision == "bf16" else "-fp32"  # the CPU class: no native bf16 (AVX2)
    settings += "-cuda" if torch.cuda.is_available() else ""
    name = f"embedding_vs_st-{args.data}{settings}-{args.only}-seeds-{'-'.join(map(str, args.seeds))}.json"
    out = HERE / "results" / name
    if out.exists():  # an earlier run's figures stay: this run's file is named by its time
        out = out.with_name(f"{out.stem}-{time.strftime('%Y%m%d-%H%M')}.json")
    out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=2) + "\n")
    metric = "dev Spearman" if args.data == "stsb" else "dev ndcg@10"
    print(f"| variant | seed | wall s | peak RSS MiB | {metric} |\n|---|---|---|---|---|")
    for r in runs:
        print(f"| {NAMES[r['variant']]} | {r['seed']} | {r['wall_s']} | {r['peak_rss_mib']} | {r['metric']} |")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
