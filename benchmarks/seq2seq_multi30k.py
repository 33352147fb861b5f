"""Seq2seq on Multi30k en->de with the MiniLM encoder-decoder (bundled, warm-started on both sides),
side by side with transformers.Seq2SeqTrainer on the same model, features, batch size and steps.

    python benchmarks/seq2seq_multi30k.py --data-dir ../shared/data/multi30k --max-steps 1000 --batch-size 16

Reports val BLEU (sacreBLEU corpus BLEU of greedy/beam outputs against the decoded references, the
transformers translation recipe), training tokens/s (source + target tokens of the training
examples consumed, the training loop only) and a few real translations.
Writes benchmarks/results/seq2seq_multi30k.json and prints markdown rows for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent


def tuneforge_config(args, out: str) -> dict:
    d = Path(args.data_dir)
    data = {
        "source_file": str(d / "train.en"),
        "target_file": str(d / "train.de"),
        "validation_source_file": str(d / "val.en"),
        "validation_target_file": str(d / "val.de"),
        "max_length": args.max_length,
        "max_target_length": args.max_length,
        "max_train_samples": args.max_train_pairs,
        "max_eval_samples": args.max_eval_pairs,
    }
    return {
        "task": "seq2seq",
        "model": None,
        "output_dir": out,
        "overwrite": True,
        "quiet": args.quiet,
        "batch_size": args.batch_size,
        "eval_batch_size": args.eval_batch_size,
        "max_steps": args.max_steps,
        "precision": args.precision,
        "seed": args.seed,
        "eval_strategy": "no",
        "logging_steps": 50,
        "num_beams": args.num_beams,
        "generation_max_length": args.generation_max_length,
        "optim": {"lr": args.lr, "warmup_steps": args.warmup_steps, "weight_decay": 0.0, "scheduler": "linear"},
        "data": data,
    }


def tokens_per_example(features) -> float:
    return (sum(len(x) for x in features["input_ids"]) + sum(len(x) for x in features["labels"])) / len(features)


def run_tuneforge(args) -> tuple[dict, object]:
    from tuneforge.trainer import Callback, Trainer

    class LoopTimer(Callback):  # the training loop only: from the first step to the last log line
        def on_train_begin(self, trainer):
            self.start = time.perf_counter()
            self.features = trainer.train_data

        def on_log(self, trainer, logs):
            self.end, self.steps = time.perf_counter(), logs["step"]

    timer = LoopTimer()
    result = Trainer(tuneforge_config(args, "runs/bench-seq2seq-tuneforge"), callbacks=[timer]).fit()
    seconds = timer.end - timer.start
    per_example = tokens_per_example(timer.features)
    examples = timer.steps * args.batch_size
    return (
        {
            "model_dir": result["model_dir"],
            "bleu": result["bleu"],
            "loss": result["loss"],
            "gen_len": result["gen_len"],
            "train_s": round(seconds, 1),
            "examples_per_s": round(examples / seconds, 2),
            "tokens_per_s": round(examples * per_example / seconds, 1),
        },
        timer.features,
    )


def run_seq2seq_trainer(args) -> dict:
    """Seq2SeqTrainer with predict_with_generate on the same features tuneforge trained on."""
    import numpy as np
    import torch
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    from _peer import generative_training_args
    from tuneforge.configure import build_config
    from tuneforge.tasks.seq2seq import Seq2SeqTask, corpus_bleu

    task = Seq2SeqTask(build_config(tuneforge_config(args, "runs/bench-seq2seq-hf")))
    tokenizer = task.load_tokenizer()
    features = task.tokenize(task.load_raw(), tokenizer)
    train = features["train"].remove_columns("length")
    val = features["validation"].remove_columns("length")
    if args.max_train_pairs:
        train = train.select(range(min(args.max_train_pairs, len(train))))
    if args.max_eval_pairs:
        val = val.select(range(min(args.max_eval_pairs, len(val))))
    torch.manual_seed(args.seed)
    model = task.load_model(tokenizer)  # the same MiniLM encoder-decoder, same special-token ids

    def compute_metrics(pred):
        preds, labels = pred.predictions, pred.label_ids
        preds = np.where(preds != -100, preds, tokenizer.pad_token_id)
        labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
        hyps = [t.strip() for t in tokenizer.batch_decode(preds, skip_special_tokens=True)]
        refs = [t.strip() for t in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        return {"bleu": corpus_bleu(hyps, refs)}

    training_args = Seq2SeqTrainingArguments(  # max_new_tokens is given to evaluate(), as tuneforge does
        **generative_training_args(
            args,
            "runs/bench-seq2seq-hf",
            per_device_eval_batch_size=args.eval_batch_size or args.batch_size * 2,
            logging_steps=50,
            predict_with_generate=True,
            generation_num_beams=args.num_beams,
        )
    )
    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=val,
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
    )
    seconds = trainer.train().metrics["train_runtime"]
    metrics = trainer.evaluate(max_new_tokens=args.generation_max_length, num_beams=args.num_beams)
    examples = args.max_steps * args.batch_size
    return {
        "bleu": metrics["eval_bleu"],
        "loss": metrics["eval_loss"],
        "train_s": round(seconds, 1),
        "examples_per_s": round(examples / seconds, 2),
        "tokens_per_s": round(examples * tokens_per_example(train) / seconds, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(HERE.parent.parent / "shared/data/multi30k"))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--eval-batch-size", type=int, default=64)
    ap.add_argument("--max-steps", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--max-length", type=int, default=64, help="source and target tokens")
    ap.add_argument("--generation-max-length", type=int, default=64)
    ap.add_argument("--num-beams", type=int, default=1)
    ap.add_argument("--max-train-pairs", type=int, default=None)
    ap.add_argument("--max-eval-pairs", type=int, default=None, help="default: all 1,014 val pairs")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()

    ours, _ = run_tuneforge(args)
    from tuneforge.generate import Generator

    sources = Path(args.data_dir, "val.en").read_text(encoding="utf-8").splitlines()[:5]
    references = Path(args.data_dir, "val.de").read_text(encoding="utf-8").splitlines()[:5]
    outputs = Generator(ours["model_dir"]).generate(
        sources, max_new_tokens=args.generation_max_length, num_beams=args.num_beams
    )
    examples = [{"source": s, "reference": r, "tuneforge": o} for s, r, o in zip(sources, references, outputs)]
    theirs = None if args.skip_hf else run_seq2seq_trainer(args)

    meta = {
        "date": str(date.today()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": "python benchmarks/seq2seq_multi30k.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, False)),
    }
    out = HERE / "results" / "seq2seq_multi30k.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {"meta": meta, "tuneforge": ours, "seq2seq_trainer": theirs, "translations": examples},
            indent=2,
            ensure_ascii=False,
        )
    )

    print(f"\n{meta['date']}, {meta['machine']}: `{meta['command']}`")
    print("| trainer | val BLEU | val loss | train tokens/s | examples/s | train s |\n|---|---|---|---|---|---|")
    print(
        f"| tuneforge | {ours['bleu']:.2f} | {ours['loss']:.3f} | {ours['tokens_per_s']} | {ours['examples_per_s']} "
        f"| {ours['train_s']} |"
    )
    if theirs:
        print(
            f"| transformers.Seq2SeqTrainer | {theirs['bleu']:.2f} | {theirs['loss']:.3f} | {theirs['tokens_per_s']} | "
            f"{theirs['examples_per_s']} | {theirs['train_s']} |"
        )
    print("\n| source | reference | tuneforge |\n|---|---|---|")
    for ex in examples:
        print(f"| {ex['source']} | {ex['reference']} | {ex['tuneforge']} |")


if __name__ == "__main__":
    main()
