"""Embedding a file: `tuneforge predict --precision fp32 | bf16` against sentence-transformers' `encode` (fp32, and
bf16 weights where this CPU does bf16 natively, its fastest plain-PyTorch setting here), whole processes one after
the other, the same model, texts and batch size.

    python benchmarks/predict_precision.py [--model DIR] [--texts N] [--batch-size 64] [--max-length N] [--rounds 2]

Texts: SQuAD dev-v1.1's distinct paragraphs and questions from ../shared/data/squad (--texts N: the first N of
them, paragraphs first), one JSON line each; the model: the bundled all-MiniLM-L6-v2 (--model: any sentence encoder
folder), each text cut where the folder's sentence_bert_config.json says on both sides (256 tokens for MiniLM;
--max-length N: N on both). Each side's wall time runs from process start to its vectors written as a .npy
matrix; each bf16 matrix is compared with tuneforge's fp32 one (the smallest cosine, row by row). --rounds runs every
variant that many times, alternating. Writes benchmarks/results/predict_precision-....json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _machine import machine_meta
from _process import timed

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "data"
PEER = """
import sys, numpy as np, torch
from sentence_transformers import SentenceTransformer
model_dir, texts_file, out, dtype, batch, max_length = sys.argv[1:7]
kwargs = {"model_kwargs": {"torch_dtype": torch.bfloat16}} if dtype == "bf16" else {}
model = SentenceTransformer(model_dir, device="cpu", **kwargs)
if max_length != "folder":
    model.max_seq_length = int(max_length)
import json
texts = [json.loads(line)["text"] for line in open(texts_file, encoding="utf-8")]
vectors = model.encode(texts, batch_size=int(batch), normalize_embeddings=True, convert_to_numpy=True)
np.save(out, vectors.astype(np.float32))
print(len(vectors))
"""


def squad_texts(limit: int | None) -> list[str]:
    data = json.loads((SHARED / "squad" / "dev-v1.1.json").read_text(encoding="utf-8"))["data"]
    paragraphs = [p["context"] for a in data for p in a["paragraphs"]]
    questions = [q["question"] for a in data for p in a["paragraphs"] for q in p["qas"]]
    texts = list(dict.fromkeys(paragraphs + questions))
    return texts[:limit] if limit else texts


def command(variant: str, model: str, texts: Path, out: Path, batch: int, max_length: int | None) -> list[str]:
    side, precision = variant.split("-")
    if side == "st":
        limit = str(max_length or "folder")
        return [sys.executable, "-c", PEER, model, str(texts), str(out), precision, str(batch), limit]
    cmd = [sys.executable, "-m", "tuneforge.cli", "predict", model, "--input", str(texts), "--output", str(out)]
    cmd += ["--max-length", str(max_length)] if max_length else []
    return cmd + ["--batch-size", str(batch), "--precision", precision]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a sentence encoder folder (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--texts", type=int, help="the first N texts (default: all)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-length", type=int, help="tokens per text on both sides (default: the folder's own)")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    from tuneforge.artifacts import bundled_minilm
    from tuneforge.backends.precision import cpu_has_native_bf16

    model = args.model or bundled_minilm()
    variants = ["st-fp32", "tuneforge-fp32"] + (["st-bf16", "tuneforge-bf16"] if cpu_has_native_bf16() else [])
    texts = squad_texts(args.texts)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        texts_file = work / "texts.jsonl"
        texts_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
        for round_ in range(1, args.rounds + 1):
            for variant in variants:
                out = work / f"{variant}-{round_}.npy"
                cmd = command(variant, model, texts_file, out, args.batch_size, args.max_length)
                wall, rss, _ = timed(cmd, work / "log.txt")
                runs.append({"variant": variant, "round": round_, "wall_s": round(wall, 2), "peak_rss_mib": rss})
                print(f"{variant} round {round_}: {wall:.1f} s", flush=True)
        reference = np.load(work / "tuneforge-fp32-1.npy")
        for run in runs:
            vectors = np.load(work / f"{run['variant']}-{run['round']}.npy")
            run["min_cosine_vs_tuneforge_fp32"] = round(float((vectors * reference).sum(1).min()), 6)
    meta = machine_meta(texts=len(texts), batch_size=args.batch_size, max_length=args.max_length or "the folder's")
    meta.update(model=model, rounds=args.rounds)
    name = f"predict_precision-{len(texts)}-texts-{time.strftime('%Y%m%d-%H%M')}.json"
    (HERE / "results" / name).write_text(json.dumps({"meta": meta, "runs": runs}, indent=2) + "\n")
    print(f"\n{len(texts)} texts, batch {args.batch_size} ({meta.get('cpu_class', '')})\n")
    print("| variant | wall s (each round) | texts/s (mean) | peak RSS MiB | smallest cosine vs tuneforge fp32 |")
    print("|---|---|---|---|---|")
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant]
        walls = [r["wall_s"] for r in mine]
        rate = len(texts) / (sum(walls) / len(walls))
        cos = min(r["min_cosine_vs_tuneforge_fp32"] for r in mine)
        rss = max(r["peak_rss_mib"] for r in mine)
        print(f"| {variant} | {' / '.join(map(str, walls))} | {rate:.0f} | {rss} | {cos} |")


if __name__ == "__main__":
    main()
