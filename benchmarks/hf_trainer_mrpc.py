"""The peer: transformers.Trainer with the Hugging Face course recipe on MRPC.

Per-device batch 8, lr 5e-5, 3 epochs, linear schedule, DataCollatorWithPadding, fp32,
evaluation each epoch (accuracy, F1). Same model (bundled MiniLM) and the same MRPC TSV files
as tuneforge. Prints one JSON line: {"accuracy", "f1", "wall_s"}.

    python benchmarks/hf_trainer_mrpc.py --data-dir ../shared/data/glue/MRPC --output-dir /tmp/hf-mrpc
"""

import argparse
import json
import time

T0 = time.perf_counter()

import numpy as np  # noqa: E402
from sklearn.metrics import accuracy_score, f1_score  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    set_seed,
)

from _peer import read_mrpc  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--seed-model-init", action="store_true", help="seed the classifier head too (reproducible runs)")
    args = ap.parse_args()
    if args.model is None:
        from tuneforge.tasks.base import bundled_minilm

        args.model = bundled_minilm()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    raw = {"train": read_mrpc(f"{args.data_dir}/train.tsv"), "validation": read_mrpc(f"{args.data_dir}/dev.tsv")}
    tok = {
        k: v.map(lambda ex: tokenizer(ex["sentence1"], ex["sentence2"], truncation=True), batched=True)
        for k, v in raw.items()
    }
    if args.seed_model_init:  # the course code builds the head before Trainer seeds: a fresh head each run
        set_seed(args.seed)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2)

    def compute_metrics(pred):
        preds = np.argmax(pred.predictions, axis=-1)
        return {"accuracy": accuracy_score(pred.label_ids, preds), "f1": f1_score(pred.label_ids, preds)}

    training_args = TrainingArguments(
        args.output_dir,
        eval_strategy="epoch",
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        learning_rate=5e-5,
        num_train_epochs=3,
        lr_scheduler_type="linear",
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
        data_collator=DataCollatorWithPadding(tokenizer=tokenizer),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(f"{args.output_dir}/model")  # tuneforge saves its final model too
    print(
        json.dumps(
            {
                "accuracy": metrics["eval_accuracy"],
                "f1": metrics["eval_f1"],
                "wall_s": round(time.perf_counter() - T0, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
