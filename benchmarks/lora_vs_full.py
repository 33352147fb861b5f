"""LoRA against full fine-tuning on the same run (issue 13): trainable parameters, checkpoint size, peak
memory (RSS) and training tokens/s, each variant a whole `tuneforge train` process.

    python benchmarks/lora_vs_full.py --data-dir ../shared/data/wikitext-2 --max-steps 30

The run: the causal LM task on the bundled SmolLM2-135M (its GGUF, converted once), WikiText-2's
valid.txt in packed blocks of --block-size tokens, batch --batch-size, --max-steps optimizer steps,
one checkpoint at the end (its folder size is the checkpoint size), evaluation on the first blocks of
test.txt. Variants: (full) every weight trained; (lora) `--adapter lora` with its defaults (r 16,
alpha 32, peft's targets for Llama: q_proj, v_proj) and (lora-all) `--lora-targets all-linear`. Peak
memory is the process's maximum resident set (its own rusage, from os.wait4); tokens/s = steps x batch x
block size over the training loop's time (the progress records' first and last step times).
Writes benchmarks/results/lora_vs_full.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _machine import machine_meta

HERE = Path(__file__).resolve().parent
VARIANTS = {
    "full": [],
    "lora": ["--adapter", "lora"],
    "lora-all": ["--adapter", "lora", "--lora-targets", "all-linear"],
}
LR = {"full": "5e-5", "lora": "5e-4", "lora-all": "5e-4"}  # LoRA's usual learning rates are ~10x full fine-tuning's


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run(variant: str, args, out: Path) -> dict:
    data = Path(args.data_dir)
    cmd = [sys.executable, "-m", "tuneforge.cli", "train", "--task", "clm"]
    cmd += ["--train-file", str(data / "valid.txt"), "--validation-file", str(data / "test.txt")]
    cmd += [
        "--block-size",
        str(args.block_size),
        "--batch-size",
        str(args.batch_size),
        "--max-steps",
        str(args.max_steps),
    ]
    cmd += ["--max-eval-samples", "16", "--eval-strategy", "no", "--save-steps", str(args.max_steps)]
    cmd += ["--logging-steps", "1", "--lr", LR[variant], "--precision", args.precision, "--seed", str(args.seed)]
    cmd += ["--output-dir", str(out), "--overwrite", "--json", "--quiet", *VARIANTS[variant]]
    start = time.perf_counter()
    with open(out.parent / f"{variant}.stdout", "w") as so, open(out.parent / f"{variant}.stderr", "w") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS (KiB on Linux)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{variant} failed:\n{(out.parent / f'{variant}.stderr').read_text()[-3000:]}")
    peak_kib = usage.ru_maxrss
    stdout = (out.parent / f"{variant}.stdout").read_text()
    result = json.loads(stdout.strip().splitlines()[-1])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if r.get("split") == "train"]
    loop_s = train[-1]["time_s"] - train[0]["time_s"]
    tokens = (args.max_steps - 1) * args.batch_size * args.block_size  # the steps between the first and last record
    from tuneforge.adapters import TRAINABLE_FILE

    ckpt = out / f"checkpoint-{args.max_steps}"
    trainable_file = ckpt / TRAINABLE_FILE
    if trainable_file.exists():
        from safetensors.torch import load_file

        trainable = sum(t.numel() for t in load_file(str(trainable_file)).values())
    else:
        trainable = None  # full: every weight
    return {
        "variant": variant,
        "wall_s": round(wall, 1),
        "peak_rss_mib": round(peak_kib / 1024),
        "checkpoint_mib": round(folder_bytes(ckpt) / 2**20, 2),
        "model_dir_mib": round(folder_bytes(out / "model") / 2**20, 2),
        "trainable_params": trainable,
        "train_loss": result.get("train_loss"),
        "eval_loss": result.get("loss"),
        "perplexity": result.get("perplexity"),
        "tokens_per_s": round(tokens / loop_s, 1),
        "command": " ".join(cmd),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(HERE.parent.parent / "shared/data/wikitext-2"))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work-dir", default="/tmp/bench-lora-vs-full")
    args = ap.parse_args()
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    results = [run(v, args, Path(args.work_dir) / v) for v in args.variants]
    meta = machine_meta(**{k: v for k, v in vars(args).items() if k != "work_dir"})
    out = HERE / "results" / "lora_vs_full.json"
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print("| variant | trainable params | checkpoint MiB | model folder MiB | peak RSS MiB | tokens/s | eval loss |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['variant']} | {r['trainable_params'] or 'all'} | {r['checkpoint_mib']} | {r['model_dir_mib']} | "
            f"{r['peak_rss_mib']} | {r['tokens_per_s']} | {r['eval_loss']} |"
        )
    print(f"results in {out}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
