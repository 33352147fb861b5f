"""The peer for multiple choice: transformers.Trainer as transformers' examples/pytorch/multiple-choice/run_swag.py
does it, with the settings of its README, on CODAH (SWAG-style: a prompt and 4 endings).

AutoModelForMultipleChoice; each choice is the pair (sent1, f"{sent2} {ending}") tokenized with
truncation at the tokenizer's max length (512 for MiniLM; run_swag.py caps it at 1024), no padding
until the batch; DataCollatorForMultipleChoice (each batch padded to its longest choice);
per-device batch 16 (train and eval), lr 5e-5, 3 epochs (the README's flags), linear schedule, no
warmup, no weight decay, fp32, the model's own dropout, every weight trained, `set_seed` before the
model is built (as run_swag.py); accuracy as its compute_metrics. CODAH has no sent2: the pair is
(question prompt, " " + ending), the empty header of run_swag.py's f-string (the tokenizer drops
the space). One evaluation, after training (the README's --do_eval; tuneforge evaluates after each
epoch by default, so it pays two more). Differences from the script, all for timing: no checkpoint
every 500 steps (save_strategy no; the final model is saved), loss logged every 50 steps, no tqdm.

Data: CODAH's headerless TSV (category, prompt, 4 endings, answer index), read with csv.QUOTE_NONE;
train.tsv, dev.tsv and test.tsv of a cross-validation fold. With --test-file the saved final model
is then scored on the test file, timed apart: `train_s` is the process up to there.

Last stdout line, JSON: {"accuracy", "test_accuracy", "train_s", "test_s", "wall_s"}.

    python benchmarks/hf_trainer_swag.py --data-dir ../shared/data/codah/cv_split/fold_0 --output-dir /tmp/hf-swag \
        --seed 1
"""

import argparse
import csv
import json
import time

T0 = time.perf_counter()

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForMultipleChoice,
    AutoTokenizer,
    DataCollatorForMultipleChoice,
    Trainer,
    TrainingArguments,
    set_seed,
)

ENDINGS = [f"ending{i}" for i in range(4)]


def read_codah(path) -> Dataset:
    """A CODAH TSV (no header: category, prompt, ending0..3, label) as SWAG columns; CODAH has no sent2."""
    df = pd.read_csv(path, sep="\t", header=None, quoting=csv.QUOTE_NONE, dtype=str, keep_default_na=False)
    if df.shape[1] != 7:
        raise SystemExit(f"{path}: {df.shape[1]} columns; CODAH rows have 7")
    return Dataset.from_dict(
        {
            "sent1": df[1].tolist(),
            "sent2": [""] * len(df),
            **{name: df[2 + i].tolist() for i, name in enumerate(ENDINGS)},
            "label": [int(x) for x in df[6]],
        }
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True, help="folder with CODAH's train.tsv, dev.tsv, test.tsv")
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--train-file", default="train.tsv")
    ap.add_argument("--eval-file", default="dev.tsv")
    ap.add_argument("--test-file", default="test.tsv", help="scored with the final model; '' skips it")
    ap.add_argument("--max-train-samples", type=int, default=None, help="train on the first N rows")
    ap.add_argument("--max-eval-samples", type=int, default=None, help="evaluate on the first N rows")
    ap.add_argument("--max-test-samples", type=int, default=None, help="test on the first N rows")
    args = ap.parse_args()
    if args.model is None:
        from tuneforge.tasks.base import bundled_minilm

        args.model = bundled_minilm()

    raw = {"train": read_codah(f"{args.data_dir}/{args.train_file}")}
    raw["validation"] = read_codah(f"{args.data_dir}/{args.eval_file}")
    if args.test_file:
        raw["test"] = read_codah(f"{args.data_dir}/{args.test_file}")
    for split, limit in (
        ("train", args.max_train_samples),
        ("validation", args.max_eval_samples),
        ("test", args.max_test_samples),
    ):
        if split in raw and limit is not None:
            raw[split] = raw[split].select(range(min(limit, len(raw[split]))))

    set_seed(args.seed)  # run_swag.py: "Set seed before initializing model."
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForMultipleChoice.from_pretrained(args.model)
    max_seq_length = min(tokenizer.model_max_length, 1024)

    def preprocess_function(examples):
        first = [[context] * 4 for context in examples["sent1"]]
        second = [[f"{header} {examples[end][i]}" for end in ENDINGS] for i, header in enumerate(examples["sent2"])]
        first = [s for row in first for s in row]
        second = [s for row in second for s in row]
        enc = tokenizer(first, second, truncation=True, max_length=max_seq_length)
        return {k: [v[i : i + 4] for i in range(0, len(v), 4)] for k, v in enc.items()}

    tok = {
        k: v.map(preprocess_function, batched=True, remove_columns=["sent1", "sent2", *ENDINGS]) for k, v in raw.items()
    }

    def compute_metrics(pred):
        preds = np.argmax(pred.predictions, axis=1)
        return {"accuracy": float((preds == pred.label_ids).astype(np.float32).mean())}

    training_args = TrainingArguments(
        args.output_dir,
        eval_strategy="no",  # the README's --do_eval: one evaluation, after training
        per_device_train_batch_size=16,
        per_device_eval_batch_size=16,
        learning_rate=5e-5,
        num_train_epochs=3,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        seed=args.seed,
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        logging_steps=50,
    )
    trainer = Trainer(
        model,
        training_args,
        train_dataset=tok["train"],
        eval_dataset=tok["validation"],
        data_collator=DataCollatorForMultipleChoice(tokenizer=tokenizer),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )
    trainer.train()
    trainer.save_model(f"{args.output_dir}/model")  # tuneforge saves its final model too
    last = trainer.evaluate()  # do_eval, after saving as the script does
    result = {"accuracy": last["eval_accuracy"], "train_s": round(time.perf_counter() - T0, 2)}
    if "test" in tok:
        t0 = time.perf_counter()
        test = trainer.predict(tok["test"], metric_key_prefix="test").metrics
        result["test_accuracy"] = test["test_accuracy"]
        result["test_s"] = round(time.perf_counter() - t0, 2)
    result["wall_s"] = round(time.perf_counter() - T0, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
