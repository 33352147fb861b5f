"""Causal LM on WikiText-2: fine-tune on valid.txt, evaluate on test.txt, side by side with
transformers.Trainer running the run_clm recipe on the same model, data, block size and steps.

    python benchmarks/clm_wikitext.py --data-dir ../shared/data/wikitext-2 --block-size 256 --max-steps 200

Default model: the bundled SmolLM2-135M (converted from its GGUF once). Reports
  - test perplexity of the pretrained model, after tuneforge fine-tuning, after HF fine-tuning
  - training tokens/s of both (tokens = steps x batch x block size; the training loop only)
Writes benchmarks/results/clm_wikitext.json and prints markdown rows for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from datetime import date
from itertools import chain
from pathlib import Path

HERE = Path(__file__).resolve().parent


def tuneforge_config(args, out: str, **extra) -> dict:
    data = {
        "train_file": str(Path(args.data_dir) / "valid.txt"),
        "validation_file": str(Path(args.data_dir) / "test.txt"),
        "block_size": args.block_size,
        "max_eval_samples": args.max_eval_blocks,
    }
    return {
        "task": "clm",
        "model": args.model,
        "output_dir": out,
        "overwrite": True,
        "quiet": args.quiet,
        "batch_size": args.batch_size,
        "eval_batch_size": args.batch_size,
        "max_steps": args.max_steps,
        "precision": args.precision,
        "seed": args.seed,
        "eval_strategy": "no",
        "logging_steps": 10,
        "attn_implementation": args.attn_implementation,
        "optim": {"lr": args.lr, "warmup_steps": args.warmup_steps, "weight_decay": 0.0, "scheduler": "linear"},
        "data": data,
        **extra,
    }


def run_tuneforge(args) -> dict:
    from tuneforge.trainer import Callback, Trainer

    class LoopTimer(Callback):  # the training loop only: from the first step to the last log line
        def on_train_begin(self, trainer):
            self.start = time.perf_counter()

        def on_log(self, trainer, logs):
            self.end, self.steps = time.perf_counter(), logs["step"]

    before = Trainer(tuneforge_config(args, "runs/bench-clm-before")).validate()
    timer = LoopTimer()
    after = Trainer(tuneforge_config(args, "runs/bench-clm-tuneforge"), callbacks=[timer]).fit()
    seconds = timer.end - timer.start
    tokens = timer.steps * args.batch_size * args.block_size
    return {
        "model_dir": after["model_dir"],
        "perplexity_before": before["perplexity"],
        "eval_tokens": before["num_tokens"],
        "perplexity_after": after["perplexity"],
        "train_s": round(seconds, 1),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def run_hf_trainer(args, model_path: str) -> dict:
    """The run_clm recipe: tokenize lines (line breaks kept), group_texts, Trainer with labels = input_ids."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, default_data_collator

    from _peer import generative_training_args

    raw = datasets.load_dataset(
        "text",
        data_files={"train": str(Path(args.data_dir) / "valid.txt"), "test": str(Path(args.data_dir) / "test.txt")},
        keep_linebreaks=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    block_size = args.block_size

    def group_texts(examples):  # run_clm: concatenate, drop the small remainder, labels = input_ids
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total = (len(concatenated["input_ids"]) // block_size) * block_size
        result = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    tokenized = raw.map(lambda ex: tokenizer(ex["text"]), batched=True, remove_columns=["text"])
    lm = tokenized.map(group_texts, batched=True)
    test = lm["test"].select(range(min(args.max_eval_blocks, len(lm["test"])))) if args.max_eval_blocks else lm["test"]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    training_args = TrainingArguments(
        **generative_training_args(
            args, "runs/bench-clm-hf", per_device_eval_batch_size=args.batch_size, logging_steps=10
        )
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=lm["train"],
        eval_dataset=test,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    train = trainer.train()
    seconds = train.metrics["train_runtime"]
    evaluation = trainer.evaluate()
    tokens = args.max_steps * args.batch_size * block_size
    return {
        "perplexity_after": math.exp(evaluation["eval_loss"]),
        "train_s": round(seconds, 1),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(HERE.parent.parent / "shared/data/wikitext-2"))
    ap.add_argument("--model", default=None, help="HF folder; default: the bundled SmolLM2-135M")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument(
        "--max-eval-blocks", type=int, default=None, help="evaluate on the first N test blocks (default: all)"
    )
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument(
        "--attn-implementation", default="auto", help="tuneforge's attention kernel (the peer keeps the model's)"
    )
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()

    if args.model is None:
        from tuneforge.tasks.clm import bundled_smollm2

        args.model = bundled_smollm2()
    ours = run_tuneforge(args)
    theirs = None if args.skip_hf else run_hf_trainer(args, args.model)
    meta = {
        "date": str(date.today()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": "python benchmarks/clm_wikitext.py "
        + " ".join(
            f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
            for k, v in vars(args).items()
            if v not in (None, False, "auto") and k != "model"
        ),
        "model": args.model,
        "block_size": args.block_size,
        "batch_size": args.batch_size,
        "max_steps": args.max_steps,
    }
    out = (
        HERE
        / "results"
        / (
            "clm_wikitext.json"
            if args.attn_implementation == "auto"
            else f"clm_wikitext-attn-{args.attn_implementation}.json"
        )
    )
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "tuneforge": ours, "transformers_trainer": theirs}, indent=2))

    print(f"\n{meta['date']}, {meta['machine']}: `{meta['command']}`")
    print(f"test perplexity before fine-tuning: {ours['perplexity_before']:.2f} ({ours['eval_tokens']} target tokens)")
    print("| trainer | test perplexity after | train tokens/s | train s |\n|---|---|---|---|")
    print(f"| tuneforge | {ours['perplexity_after']:.2f} | {ours['tokens_per_s']} | {ours['train_s']} |")
    if theirs:
        print(
            f"| transformers.Trainer (run_clm) | {theirs['perplexity_after']:.2f} | {theirs['tokens_per_s']} | "
            f"{theirs['train_s']} |"
        )


if __name__ == "__main__":
    main()
