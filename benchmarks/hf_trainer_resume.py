"""transformers.Trainer on MRPC (batch 8, fp32): `--phase save` trains to --step and saves;
`--phase resume` resumes from that checkpoint (replaying the data position, ignore_data_skip=False)
and trains one more step. Used by checkpoints.py."""

import argparse
import csv

import pandas as pd
from datasets import Dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
)

ap = argparse.ArgumentParser()
ap.add_argument("--data-dir", required=True)
ap.add_argument("--step", type=int, required=True)
ap.add_argument("--phase", choices=["save", "resume"], required=True)
args = ap.parse_args()
from tuneforge.tasks.base import bundled_minilm  # noqa: E402

model_dir = bundled_minilm()
df = pd.read_csv(
    f"{args.data_dir}/train.tsv",
    sep="\t",
    quoting=csv.QUOTE_NONE,
    encoding="utf-8-sig",
    dtype=str,
    keep_default_na=False,
)
tok = AutoTokenizer.from_pretrained(model_dir)
ds = Dataset.from_dict(
    {
        "sentence1": df["#1 String"].tolist(),
        "sentence2": df["#2 String"].tolist(),
        "label": [int(x) for x in df["Quality"]],
    }
)
ds = ds.map(lambda ex: tok(ex["sentence1"], ex["sentence2"], truncation=True), batched=True)
model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
steps = args.step if args.phase == "save" else args.step + 1
targs = TrainingArguments(
    "/tmp/bench-ckpt/hf",
    per_device_train_batch_size=8,
    learning_rate=5e-5,
    max_steps=steps,
    use_cpu=True,
    save_strategy="steps",
    save_steps=args.step,
    eval_strategy="no",
    report_to=[],
    disable_tqdm=True,
    ignore_data_skip=False,
)
trainer = Trainer(model, targs, train_dataset=ds, data_collator=DataCollatorWithPadding(tok), processing_class=tok)
trainer.train(resume_from_checkpoint=f"/tmp/bench-ckpt/hf/checkpoint-{args.step}" if args.phase == "resume" else None)
