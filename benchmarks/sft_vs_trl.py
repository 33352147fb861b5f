"""Chat SFT with LoRA: tuneforge against TRL's SFTTrainer + peft (issue 13), same model, rows, LoRA and
optimiser settings, same machine, whole processes one after the other.

    python benchmarks/sft_vs_trl.py --train-rows 96 --eval-rows 24 --seeds 1

Model: the bundled SmolLM2-135M-Instruct (its GGUF converted once; its tokenizer has a ChatML chat
template). Data: LIMA (../shared/data/lima/lima.json, Alpaca-style rows: one user turn, one reply), the
first --train-rows for training and the next --eval-rows for evaluation, written once as `messages`
jsonl that both sides read. Settings on both: LoRA r 16, alpha 32, dropout 0.05 on q_proj and v_proj,
AdamW lr 2e-4 with 6% warm-up and linear decay, weight decay 0.01, batch 4 (evaluation too), one epoch,
512 tokens at most per conversation (longer ones cut), fp32, gradient checkpointing (SFTConfig's
default; `--gradient-checkpointing` for tuneforge), loss on the assistant's reply only, evaluated after the
epoch.
tuneforge runs its defaults beyond these: conversations packed whole into 512-token blocks, batches
grouped by length; TRL runs its own: one conversation per row, padded per batch, no packing (its
default; its packing needs a flash-attention kernel to keep conversations apart).

Reported per side: the process's wall time, its peak RSS (os.wait4), tokens/s end to end (the training
conversations' tokens after the 512 cut, counted once with the chat template, over the wall time), and
the evaluation loss on the assistant tokens of the eval rows after the epoch. Writes
benchmarks/results/sft_vs_trl.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from _machine import machine_meta
from _process import timed

HERE = Path(__file__).resolve().parent
LIMA = HERE.parent.parent / "shared/data/lima/lima.json"
MAX_LENGTH, BATCH, LR = 512, 4, "2e-4"


def write_rows(folder: Path, train_rows: int, eval_rows: int) -> tuple[Path, Path]:
    from tuneforge.data.chat import read_conversations

    conversations = read_conversations(LIMA)
    parts = {"train": conversations[:train_rows], "eval": conversations[train_rows : train_rows + eval_rows]}
    paths = {}
    for name, rows in parts.items():
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps({"messages": c}) + "\n" for c in rows))
    return paths["train"], paths["eval"]


def count_tokens(model: str, path: Path) -> int:
    from transformers import AutoTokenizer

    from tuneforge.data.chat import encode_conversation

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(x)["messages"] for x in path.read_text().splitlines()]
    return sum(min(MAX_LENGTH, len(encode_conversation(tokenizer, m)[0])) for m in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-rows", type=int, default=96)
    ap.add_argument("--eval-rows", type=int, default=24)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--only", default="ab", help="a: TRL, b: tuneforge")
    args = ap.parse_args()
    from tuneforge.tasks.clm import bundled_smollm2

    model = bundled_smollm2()
    work = Path(tempfile.mkdtemp(prefix="bench-sft-"))
    train, evals = write_rows(work, args.train_rows, args.eval_rows)
    tokens = count_tokens(model, train)
    runs = []
    for seed in args.seeds:
        for variant in args.only:
            out = work / f"{variant}-{seed}"
            if variant == "a":
                cmd = [sys.executable, str(HERE / "trl_sft.py"), "--model", model, "--train-file", str(train)]
                cmd += ["--validation-file", str(evals), "--output-dir", str(out), "--seed", str(seed)]
                cmd += ["--max-length", str(MAX_LENGTH), "--batch-size", str(BATCH), "--lr", LR]
            else:
                cmd = [sys.executable, "-m", "tuneforge.cli", "train", "--task", "sft", "--model", model]
                cmd += ["--train-file", str(train), "--validation-file", str(evals), "--output-dir", str(out)]
                cmd += ["--block-size", str(MAX_LENGTH), "--batch-size", str(BATCH), "--eval-batch-size", str(BATCH)]
                cmd += ["--lr", LR, "--epochs", "1", "--gradient-checkpointing"]  # TRL's SFTConfig default
                cmd += ["--adapter", "lora", "--precision", "fp32", "--seed", str(seed), "--json", "--quiet"]
                cmd += ["--cache-dir", str(work / f"cache-{seed}")]  # tokenization paid every run, as TRL's is
            wall, rss, stdout = timed(cmd, work / f"{variant}-{seed}.log")
            line = json.loads(stdout.strip().splitlines()[-1])
            eval_loss = line["eval_loss"] if variant == "a" else line["loss"]
            run = {"variant": variant, "seed": seed, "wall_s": round(wall, 1), "peak_rss_mib": rss}
            run.update({"tokens_per_s": round(tokens / wall, 1), "eval_loss": round(eval_loss, 4)})
            print(run, flush=True)
            runs.append(run)
    meta = machine_meta(**vars(args), train_tokens=tokens, model=model)
    (HERE / "results" / "sft_vs_trl.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=2) + "\n")
    names = {"a": "TRL SFTTrainer + peft", "b": "tuneforge --task sft --adapter lora"}
    print("| variant | seed | wall s | tokens/s | peak RSS MiB | eval loss |\n|---|---|---|---|---|---|")
    for r in runs:
        cells = [names[r["variant"]], r["seed"], r["wall_s"], r["tokens_per_s"], r["peak_rss_mib"], r["eval_loss"]]
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
