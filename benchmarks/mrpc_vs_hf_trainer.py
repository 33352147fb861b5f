"""MRPC side by side, whole processes timed, runs alternated (the machine is noisy).

(a) transformers.Trainer, HF course recipe (benchmarks/hf_trainer_mrpc.py)
(b) `tuneforge train --task glue/mrpc` with tuneforge's defaults
(f) the same defaults with `--precision fp32` forced: how (b) runs on a CPU without native bf16
    (where `auto` picks fp32); (a) is fp32 on every machine
(c) tuneforge set to recipe (a) exactly: batch 8, lr 5e-5, 3 epochs, linear, no warmup, no weight
    decay, fp32, plain shuffling, eval batch 8, max length 512, the model's dropout, every weight trained

    python benchmarks/mrpc_vs_hf_trainer.py --data-dir ../shared/data/glue/MRPC --only abf --seeds 1 2 3  # README table
    python benchmarks/mrpc_vs_hf_trainer.py --only b --seeds 1 2 3   # dev scores of the defaults, seed mean
Writes benchmarks/results/mrpc_vs_hf_trainer[-ONLY-seeds-S-rounds-R].json and prints a markdown table.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from _machine import machine_meta

HERE = Path(__file__).resolve().parent


def run(cmd):
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"failed: {' '.join(cmd)}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall_s": round(wall, 1), "accuracy": out["accuracy"], "f1": out["f1"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default=str(HERE.parent.parent / "shared/data/glue/MRPC"))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--only", default="abc", help="which variants to run, e.g. 'ab'")
    ap.add_argument("--seeds", type=int, nargs="+", default=[42], help="each variant runs once per seed and round")
    args = ap.parse_args()
    tf = [str(Path(sys.executable).parent / "tuneforge"), *"train --task glue/mrpc --overwrite --json --quiet".split()]
    tf += ["--data-dir", args.data_dir]
    variants = {
        "a": (
            "transformers.Trainer (HF course recipe)",
            [
                sys.executable,
                str(HERE / "hf_trainer_mrpc.py"),
                "--data-dir",
                args.data_dir,
                "--output-dir",
                "/tmp/bench-hf-mrpc",
                "--seed-model-init",
            ],
        ),
        "b": ("tuneforge defaults", tf + ["--output-dir", "/tmp/bench-tf-mrpc-default"]),
        "f": (
            "tuneforge defaults, fp32 forced",
            tf + ["--output-dir", "/tmp/bench-tf-mrpc-fp32", "--precision", "fp32"],
        ),
        # dropout=null: the model's own dropout (0.1), as in (a); every weight trained, as in (a)
        "c": (
            "tuneforge set to recipe (a)",
            tf
            + [
                "--output-dir",
                "/tmp/bench-tf-mrpc-recipe",
                "--batch-size",
                "8",
                "--eval-batch-size",
                "8",
                "--lr",
                "5e-5",
                "--epochs",
                "3",
                "--scheduler",
                "linear",
                "--warmup-ratio",
                "0",
                "--weight-decay",
                "0",
                "--precision",
                "fp32",
                "--no-group-by-length",
                "--max-length",
                "512",
                "--logging-steps",
                "50",
                "--freeze-layers",
                "0",
                "--freeze-embeddings",
                "off",
                "dropout=null",
            ],
        ),
    }
    results = {k: [] for k in args.only}
    for r in range(args.rounds):
        order = args.only if r % 2 == 0 else args.only[::-1]
        for seed in args.seeds:
            for key in order:
                res = {"seed": seed, **run(variants[key][1] + ["--seed", str(seed)])}
                results[key].append(res)
                print(f"round {r + 1} seed {seed} ({key}) {variants[key][0]}: {res}", file=sys.stderr, flush=True)
    summary = {}
    for key, runs in results.items():
        summary[key] = {
            "name": variants[key][0],
            "runs": runs,
            "wall_s": round(sum(x["wall_s"] for x in runs) / len(runs), 1),
            "accuracy": round(sum(x["accuracy"] for x in runs) / len(runs), 4),
            "f1": round(sum(x["f1"] for x in runs) / len(runs), 4),
            "command": " ".join(variants[key][1]) + " --seed SEED",
        }
    meta = machine_meta(seeds=args.seeds, rounds=args.rounds)
    name = "mrpc_vs_hf_trainer"
    if (args.only, args.seeds, args.rounds) != ("abc", [42], 1):  # keep the main table's file
        name += f"-{args.only}-seeds-{'-'.join(map(str, args.seeds))}-rounds-{args.rounds}"
    out = HERE / "results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": summary}, indent=2))
    base = summary.get("a", {}).get("wall_s")
    print(f"seeds {args.seeds}, means over {args.rounds} round(s)")
    print("| variant | wall s | speed-up vs (a) | dev accuracy | dev F1 |\n|---|---|---|---|---|")
    for key, s in summary.items():
        speed = f"{base / s['wall_s']:.2f}x" if base else "-"
        print(f"| ({key}) {s['name']} | {s['wall_s']} | {speed} | {s['accuracy']:.4f} | {s['f1']:.4f} |")


if __name__ == "__main__":
    main()
