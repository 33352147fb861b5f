"""The peer for NER: transformers.Trainer as transformers' examples/pytorch/token-classification/run_ner.py
does it, with the settings of its README and its defaults.

AutoModelForTokenClassification; label_all_tokens False: each word's tag on its first sub-token,
the other sub-tokens -100; DataCollatorForTokenClassification (dynamic padding); per-device batch 8
(train and eval), lr 5e-5, 3 epochs, linear schedule, no warmup, no weight decay, fp32, the model's
own dropout, every weight trained, `set_seed` before the model is built (as run_ner.py: the head's
initialisation is seeded). One evaluation on the validation file after training (the README's
--do_eval; tuneforge evaluates after each epoch by default, so it pays two more), scored as run_ner.py's
compute_metrics does through `evaluate`'s seqeval (overall precision, recall, F1 and accuracy over
the first sub-tokens, return_entity_level_metrics False; computed here with seqeval itself, which
is what `evaluate` calls). The label list is the sorted tags of the whole training file, as
run_ner.py builds it from files. Differences from the script, all for timing: no checkpoint every
500 steps (save_strategy no; the final model is saved), loss logged every 50 steps, no tqdm.

Same model (the bundled MiniLM) and the same CoNLL-2003 column files as tuneforge (read with
tuneforge's parser, tuneforge.data.conll.read_conll: word first, tag last, -DOCSTART- skipped;
the shared files are IOB2 already). --max-train-samples N trains on the first N sentences, as
run_ner.py's flag of that name. With --test-file the saved final model is then scored on the test
file (run_ner.py's do_predict), timed apart: `train_s` is the process up to there.

Last stdout line, JSON: {"f1", "precision", "recall", "accuracy", "test_f1", "test_precision",
"test_recall", "test_accuracy", "train_s", "test_s", "wall_s"}.

    python benchmarks/hf_trainer_ner.py --data-dir ../shared/data/conll2003 --output-dir /tmp/hf-ner \
        --max-train-samples 2500 --seed 1
"""

import argparse
import json
import time

T0 = time.perf_counter()

import numpy as np  # noqa: E402
from seqeval.metrics import accuracy_score, classification_report  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    Trainer,
    TrainingArguments,
    set_seed,
)

from tuneforge.data.conll import read_conll  # noqa: E402


def seqeval_scores(references, predictions) -> dict:
    """`evaluate.load("seqeval").compute(...)` overall scores, as run_ner.py returns them."""
    report = classification_report(references, predictions, output_dict=True, zero_division=0)
    overall = report["micro avg"]
    return {
        "precision": float(overall["precision"]),
        "recall": float(overall["recall"]),
        "f1": float(overall["f1-score"]),
        "accuracy": float(accuracy_score(references, predictions)),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True, help="folder with CoNLL column files")
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--train-file", default="train.txt")
    ap.add_argument("--eval-file", default="valid.txt")
    ap.add_argument("--test-file", default="test.txt", help="scored with the final model; '' skips it")
    ap.add_argument("--max-train-samples", type=int, default=None, help="train on the first N sentences")
    ap.add_argument("--max-eval-samples", type=int, default=None, help="evaluate on the first N sentences")
    ap.add_argument("--max-test-samples", type=int, default=None, help="test on the first N sentences")
    args = ap.parse_args()
    if args.model is None:
        from tuneforge.tasks.base import bundled_minilm

        args.model = bundled_minilm()

    raw = {"train": read_conll(f"{args.data_dir}/{args.train_file}")}
    raw["validation"] = read_conll(f"{args.data_dir}/{args.eval_file}")
    if args.test_file:
        raw["test"] = read_conll(f"{args.data_dir}/{args.test_file}")
    label_list = sorted({t for tags in raw["train"]["tags"] for t in tags})  # run_ner.py: get_label_list
    label_to_id = {label: i for i, label in enumerate(label_list)}
    for split, limit in (
        ("train", args.max_train_samples),
        ("validation", args.max_eval_samples),
        ("test", args.max_test_samples),
    ):
        if split in raw and limit is not None:
            raw[split] = raw[split].select(range(min(limit, len(raw[split]))))

    set_seed(args.seed)  # run_ner.py: "Set seed before initializing model."
    config = AutoConfig.from_pretrained(args.model, num_labels=len(label_list), finetuning_task="ner")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForTokenClassification.from_pretrained(args.model, config=config)
    model.config.label2id = label_to_id
    model.config.id2label = dict(enumerate(label_list))

    def tokenize_and_align_labels(examples):
        enc = tokenizer(examples["tokens"], truncation=True, is_split_into_words=True)
        labels = []
        for i, tags in enumerate(examples["tags"]):
            row, previous = [], None
            for word in enc.word_ids(batch_index=i):
                row.append(-100 if word is None or word == previous else label_to_id[tags[word]])
                previous = word
            labels.append(row)
        enc["labels"] = labels
        return enc

    tok = {k: v.map(tokenize_and_align_labels, batched=True, remove_columns=v.column_names) for k, v in raw.items()}

    def compute_metrics(pred):
        predictions = np.argmax(pred.predictions, axis=2)
        true_predictions, true_labels = [], []
        for p_row, l_row in zip(predictions, pred.label_ids):
            true_predictions.append([label_list[p] for p, lab in zip(p_row, l_row) if lab != -100])
            true_labels.append([label_list[lab] for lab in l_row if lab != -100])
        return seqeval_scores(true_labels, true_predictions)

    training_args = TrainingArguments(
        args.output_dir,
        eval_strategy="no",  # the README's --do_eval: one evaluation, after training
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
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
        data_collator=DataCollatorForTokenClassification(tokenizer),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )
    trainer.train()
    trainer.save_model(f"{args.output_dir}/model")  # tuneforge saves its final model too
    last = trainer.evaluate()  # do_eval, after saving as the script does
    result = {k: last[f"eval_{k}"] for k in ("f1", "precision", "recall", "accuracy")}
    result["train_s"] = round(time.perf_counter() - T0, 2)
    if "test" in tok:
        t0 = time.perf_counter()
        test = trainer.predict(tok["test"], metric_key_prefix="test").metrics
        result.update({f"test_{k}": test[f"test_{k}"] for k in ("f1", "precision", "recall", "accuracy")})
        result["test_s"] = round(time.perf_counter() - t0, 2)
    result["wall_s"] = round(time.perf_counter() - T0, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
