"""transformers.Trainer on MRPC (batch 8, fp32): `--phase save` trains to --step and saves;
`--phase resume` resumes from that checkpoint (replaying the data position, ignore_data_skip=False)
and trains one more step. Used by checkpoints.py."""

import argparse

from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
)

from _peer import read_mrpc

ap = argparse.ArgumentParser()
ap.add_argument("--data-dir", required=True)
ap.add_argument("--step", type=int, required=True)
ap.add_argument("--phase", choices=["save", "resume"], required=True)
args = ap.parse_args()
from tuneforge.tasks.base import bundled_minilm  # noqa: E402

model_dir = bundled_minilm()
tok = AutoTokenizer.from_pretrained(model_dir)
ds = read_mrpc(f"{args.data_dir}/train.tsv")
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
