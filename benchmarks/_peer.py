"""What the transformers.Trainer peers share: the MRPC reader and the TrainingArguments of the
generative peers (benchmarks/ is on sys.path when a script here runs)."""

import csv

import pandas as pd
import torch
from datasets import Dataset


def read_mrpc(path):
    """An MRPC TSV of glue_data (train.tsv, dev.tsv) as sentence1, sentence2, label."""
    df = pd.read_csv(path, sep="\t", quoting=csv.QUOTE_NONE, encoding="utf-8-sig", dtype=str, keep_default_na=False)
    return Dataset.from_dict(
        {
            "sentence1": df["#1 String"].tolist(),
            "sentence2": df["#2 String"].tolist(),
            "label": [int(x) for x in df["Quality"]],
        }
    )


def generative_training_args(args, output_dir: str, **extra) -> dict:
    """TrainingArguments of the clm and seq2seq peers from their command line: linear warm-up and
    decay, no weight decay, no saving or evaluation during training, CPU unless CUDA is there."""
    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=0.0,
        lr_scheduler_type="linear",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        seed=args.seed,
        bf16=args.precision == "bf16",
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=args.quiet,
        **extra,
    )
