"""What a small run costs before and after its training: whole `tuneforge train` processes on a tiny
model, for one or more source trees of tuneforge side by side (to measure a start-up change).

    python benchmarks/process_start.py --src OLD_CHECKOUT/src src --rounds 5

The run: a random 2-layer BERT (32 wide, MiniLM's vocabulary and tokenizer) classifies 96 short
sentences for 2 epochs (12 steps) and evaluates twice on 33; the tokenization cache is warm (a first,
untimed run fills it), so the time is start-up (imports, model load), the short loop, evaluation and
saving. Each round runs every tree once, in turn, so a busy moment hurts all alike. With `--nproc 2`
the run is ddp over 2 processes; `--torchrun` also times torchrun starting the same 2 workers of the last
tree (each one runs `tuneforge train` from the start, as any torchrun worker runs its command). Prints a markdown table
and writes benchmarks/results/process_start-nprocN.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import machine_meta

HERE = Path(__file__).resolve().parent
WORDS = {"pos": ["good", "great", "fine", "lovely"], "neg": ["bad", "awful", "poor", "dull"]}


def write_rows(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    lines = ["text,label"]
    for _ in range(n):
        label = rng.choice(["pos", "neg"])
        lines.append(f"a {rng.choice(WORDS[label])} film,{label}")
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_model(folder: Path) -> Path:
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from tuneforge.tasks.base import bundled_minilm

    config = BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    BertForSequenceClassification(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(bundled_minilm()).save_pretrained(folder)
    return folder


def timed_run(src: str, args: list[str], out: Path, torchrun: int = 0) -> float:
    """Seconds of one whole run of the tree `src`; `torchrun`: started by torchrun with that many workers."""
    env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
    launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={torchrun}", "--master-port=29533"]
    launcher = launcher if torchrun else []
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *launcher, "-m", "tuneforge.cli", "train", *args, "--output-dir", str(out), "--overwrite"]
        + ["--quiet"],
        env=env,
        capture_output=True,
        text=True,
    )
    took = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{src}: the run failed:\n{proc.stderr[-2000:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", nargs="+", default=["src"], help="tuneforge source trees (folders holding tuneforge/)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--torchrun", action="store_true", help="also time torchrun starting the last tree's workers")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tf-start-"))
    model = tiny_model(work / "model")
    train, val = write_rows(work / "train.csv", 96, 1), write_rows(work / "validation.csv", 33, 2)
    run_args = ["--train-file", str(train), "--validation-file", str(val), "--model", str(model)]
    run_args += ["--epochs", "2", "--batch-size", "16", "--cache-dir", str(work / "cache")]
    by_torchrun = [*run_args, "--backend", "ddp"]
    if args.nproc > 1:
        run_args += ["--backend", "ddp", "--nproc", str(args.nproc)]
    timed_run(args.src[0], run_args, work / "warm-up")  # fills the tokenization cache and the disk cache

    times: dict[str, list[float]] = {src: [] for src in args.src}
    peer = f"torchrun --nproc-per-node {args.nproc} -m tuneforge.cli train (with {args.src[-1]})"
    if args.torchrun:
        times[peer] = []
    for _ in range(args.rounds):
        for src in args.src:
            times[src].append(timed_run(src, run_args, work / "run"))
        if args.torchrun:  # the same workers, started by torchrun: each one runs the command from the start
            times[peer].append(timed_run(args.src[-1], by_torchrun, work / "run", torchrun=args.nproc))

    rows = {src: {"median_s": statistics.median(t), "runs_s": [round(x, 2) for x in t]} for src, t in times.items()}
    trees = " ".join(args.src)
    command = f"python benchmarks/process_start.py --src {trees} --rounds {args.rounds} --nproc {args.nproc}"
    command += " --torchrun" * args.torchrun
    result = {**machine_meta(command=command, nproc=args.nproc), "trees": rows}
    out = HERE / "results" / f"process_start-nproc{args.nproc}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['cpu_class']}, {result['date']}, nproc {args.nproc}\n")
    print("| source tree | median s | runs (s) |\n|---|---|---|")
    for src, row in rows.items():
        print(f"| {src} | {row['median_s']:.2f} | {', '.join(map(str, row['runs_s']))} |")


if __name__ == "__main__":
    main()
