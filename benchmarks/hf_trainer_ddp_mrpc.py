"""The peer for benchmarks/backends.py: transformers.Trainer + DDP (gloo, CPU) on MRPC.

Run under torchrun (2 processes). Per-device batch 8 (global 16), fp32, lr 5e-5, random
batches, `average_tokens_across_devices=False` so its loss is right. Prints one JSON line with
steady-state samples/s measured between step `--skip` and the last step (as backends.py does
for tuneforge), from rank 0.
"""

import argparse
import json
import os
import time

from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from _peer import read_mrpc


class StepClock(TrainerCallback):
    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--output-dir", default="/tmp/bench-hf-ddp")
    args = ap.parse_args()
    from tuneforge.tasks.base import bundled_minilm

    model_dir = bundled_minilm()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ds = read_mrpc(f"{args.data_dir}/train.tsv")
    ds = ds.map(lambda ex: tok(ex["sentence1"], ex["sentence2"], truncation=True, max_length=128), batched=True)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    clock = StepClock()
    targs = TrainingArguments(
        args.output_dir,
        per_device_train_batch_size=8,
        learning_rate=5e-5,
        max_steps=args.max_steps,
        use_cpu=True,
        ddp_backend="gloo",
        average_tokens_across_devices=False,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        logging_steps=10,
    )
    Trainer(
        model,
        targs,
        train_dataset=ds,
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
        callbacks=[clock],
    ).train()
    if int(os.environ.get("RANK", "0")) == 0:
        steps = len(clock.times) - 1 - args.skip
        secs = clock.times[-1] - clock.times[args.skip]
        print(json.dumps({"samples_per_s": round(steps * 16 / secs, 2), "steps": steps}))


if __name__ == "__main__":
    main()
