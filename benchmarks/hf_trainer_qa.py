"""The peer for extractive QA: transformers.Trainer as transformers' examples/pytorch/question-answering/run_qa.py
does it, with the settings of its README (the bert-base SQuAD1 command) and its defaults.

AutoModelForQuestionAnswering; run_qa.py's prepare_train_features and prepare_validation_features
(question left-stripped, question first, truncation="only_second", max_seq_length 384, doc_stride 128,
return_overflowing_tokens and return_offsets_mapping; a training window's target is the answer's
first and last token, or [CLS] where the answer is not wholly inside the window); pad_to_max_length
True, run_qa.py's default: every window is padded to 384 tokens and batched by default_data_collator
(that is the recipe, kept as it is, though most SQuAD windows are far shorter). Per-device batch 12
for training, 8 for evaluation, lr 3e-5, 2 epochs (the README's flags), linear schedule, no warmup,
no weight decay, fp32, the model's own dropout, every weight trained, `set_seed` before the model is
built (as run_qa.py). One evaluation, after training (run_qa.py's --do_eval; none during training).
Answers as utils_qa.py's postprocess_qa_predictions (SQuAD v1.1: no null answer): in each window the
20 highest start and end logits (n_best_size) give the candidate spans, inside the context, end >=
start, at most 30 tokens (max_answer_length), scored start + end logit; an example's answer is the
best candidate over all its windows ("empty" where it has none). Scored as the official SQuAD v1.1
evaluation script scores it (its normalize_answer: lower case, punctuation and the articles a/an/the
removed, whitespace collapsed; exact match and token F1, each the best over the gold answers; x100,
as the script and `evaluate`'s squad metric report them), written out here rather than taken from
tuneforge, so the two sides are scored independently.

Differences from the script: the README's command reads the hub's `squad` (--dataset_name squad);
here the same rows (id, question, context, answers {"text", "answer_start"}, in file order) are read
from SQuAD v1.1 JSON files (data[].paragraphs[].qas[]), since run_qa.py's --train_file reads flat
rows only. --max-train-samples N trains on the first N questions with all their windows, as does
--max-eval-samples / --max-test-samples for evaluation: run_qa.py selects N examples before
windowing and then cuts the windows to N again, which drops the windows of the last questions
(trained) or leaves them unanswered (evaluated); only the first selection is kept here, as tuneforge
counts questions too. For timing: no checkpoint every 500 steps (save_strategy no; the final model is
saved), loss logged every 50 steps, no tqdm, the prediction and n-best files that utils_qa.py writes
to the output folder are not written.

With --test-file the saved final model is then scored on the test file (run_qa.py's do_predict), timed
apart: `train_s` is the process up to there (validation scoring included).

Last stdout line, JSON: {"exact_match", "f1", "test_exact_match", "test_f1", "train_s", "test_s", "wall_s"}.

    python benchmarks/hf_trainer_qa.py --data-dir SPLIT_DIR --output-dir /tmp/hf-qa --max-train-samples 600 --seed 1
SPLIT_DIR: the folder benchmarks/tasks_vs_hf_trainer.py --task qa writes (the training subset and the
official dev file's first 400 questions as the validation part, the next 800 as the test part).
"""

import argparse
import collections
import json
import re
import string
import time
from pathlib import Path

T0 = time.perf_counter()

import numpy as np  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForQuestionAnswering,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

MAX_SEQ_LENGTH, DOC_STRIDE, N_BEST_SIZE, MAX_ANSWER_LENGTH = 384, 128, 20, 30
PUNCTUATION = set(string.punctuation)


def read_squad(path) -> Dataset:
    """A SQuAD v1.1 JSON file as the hub's squad rows: id, question, context, answers {"text", "answer_start"}."""
    rows = {"id": [], "question": [], "context": [], "answers": []}
    for article in json.loads(Path(path).read_text(encoding="utf-8"))["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                rows["id"].append(str(qa["id"]))
                rows["question"].append(qa["question"])
                rows["context"].append(paragraph["context"])
                answers = qa.get("answers", [])
                rows["answers"].append(
                    {"text": [a["text"] for a in answers], "answer_start": [int(a["answer_start"]) for a in answers]}
                )
    return Dataset.from_dict(rows)


# ---- the official SQuAD v1.1 evaluation script (evaluate-v1.1.py) -------------------------------
def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction: str, ground_truth: str) -> float:
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    common = collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def exact_match_score(prediction: str, ground_truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def squad_v1_scores(predictions: dict, examples) -> dict:
    """{"exact_match", "f1"} x100 over every example; a question without a prediction scores 0, as in the script."""
    exact_match = f1 = 0.0
    for qid, answers in zip(examples["id"], examples["answers"]):
        if qid not in predictions:
            continue
        golds = answers["text"]
        exact_match += max(exact_match_score(predictions[qid], g) for g in golds)
        f1 += max(f1_score(predictions[qid], g) for g in golds)
    return {"exact_match": 100.0 * exact_match / len(examples), "f1": 100.0 * f1 / len(examples)}


# ---- utils_qa.py's postprocess_qa_predictions, SQuAD v1.1 ---------------------------------------
def postprocess_qa_predictions(examples, features, predictions) -> dict:
    """{example id: answer text}: the best span over an example's windows."""
    all_start_logits, all_end_logits = predictions
    assert len(all_start_logits) == len(features), f"{len(all_start_logits)} predictions, {len(features)} features"
    example_id_to_index = {k: i for i, k in enumerate(examples["id"])}
    features_per_example = collections.defaultdict(list)
    for i, example_id in enumerate(features["example_id"]):
        features_per_example[example_id_to_index[example_id]].append(i)
    offset_mappings = list(features["offset_mapping"])  # a Column in datasets 4+: read once
    all_predictions = collections.OrderedDict()
    for example_index, (example_id, context) in enumerate(zip(examples["id"], examples["context"])):
        prelim_predictions = []
        for feature_index in features_per_example[example_index]:
            start_logits, end_logits = all_start_logits[feature_index], all_end_logits[feature_index]
            offset_mapping = offset_mappings[feature_index]
            start_indexes = np.argsort(start_logits)[-1 : -N_BEST_SIZE - 1 : -1].tolist()
            end_indexes = np.argsort(end_logits)[-1 : -N_BEST_SIZE - 1 : -1].tolist()
            for start_index in start_indexes:
                for end_index in end_indexes:
                    if (
                        start_index >= len(offset_mapping)
                        or end_index >= len(offset_mapping)
                        or offset_mapping[start_index] is None
                        or offset_mapping[end_index] is None
                    ):
                        continue
                    if end_index < start_index or end_index - start_index + 1 > MAX_ANSWER_LENGTH:
                        continue
                    prelim_predictions.append(
                        {
                            "offsets": (offset_mapping[start_index][0], offset_mapping[end_index][1]),
                            "score": start_logits[start_index] + end_logits[end_index],
                        }
                    )
        # utils_qa.py sorts by score (stable, descending) and answers the first: the first of the highest;
        # "empty" where there is no span at all, or only one and it has no text
        best = max(prelim_predictions, key=lambda x: x["score"]) if prelim_predictions else None
        text = context[best["offsets"][0] : best["offsets"][1]] if best else ""
        all_predictions[example_id] = "empty" if best is None or (text == "" and len(prelim_predictions) == 1) else text
    return all_predictions


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="", help="folder of the files below (files given as paths without it)")
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--train-file", default="train-v1.1-subset-du2017.json")
    ap.add_argument("--eval-file", default="dev-validation.json")
    ap.add_argument("--test-file", default="test.json", help="scored with the final model; '' skips it")
    ap.add_argument("--max-train-samples", type=int, default=None, help="train on the first N questions")
    ap.add_argument("--max-eval-samples", type=int, default=None, help="evaluate on the first N questions")
    ap.add_argument("--max-test-samples", type=int, default=None, help="test on the first N questions")
    args = ap.parse_args()
    if args.model is None:
        from tuneforge.tasks.base import bundled_minilm

        args.model = bundled_minilm()

    def path(name):
        return Path(args.data_dir) / name if args.data_dir else Path(name)

    raw = {"train": read_squad(path(args.train_file)), "validation": read_squad(path(args.eval_file))}
    if args.test_file:
        raw["test"] = read_squad(path(args.test_file))
    for split, limit in (
        ("train", args.max_train_samples),
        ("validation", args.max_eval_samples),
        ("test", args.max_test_samples),
    ):
        if split in raw and limit is not None:
            raw[split] = raw[split].select(range(min(limit, len(raw[split]))))

    set_seed(args.seed)  # run_qa.py: "Set seed before initializing model."
    config = AutoConfig.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model, use_fast=True)
    model = AutoModelForQuestionAnswering.from_pretrained(args.model, config=config)
    pad_on_right = tokenizer.padding_side == "right"
    max_seq_length = min(MAX_SEQ_LENGTH, tokenizer.model_max_length)

    def tokenize(examples):
        examples["question"] = [q.lstrip() for q in examples["question"]]
        return tokenizer(
            examples["question" if pad_on_right else "context"],
            examples["context" if pad_on_right else "question"],
            truncation="only_second" if pad_on_right else "only_first",
            max_length=max_seq_length,
            stride=DOC_STRIDE,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            padding="max_length",  # run_qa.py's pad_to_max_length True
        )

    def prepare_train_features(examples):
        tokenized = tokenize(examples)
        sample_mapping = tokenized.pop("overflow_to_sample_mapping")
        offset_mapping = tokenized.pop("offset_mapping")
        tokenized["start_positions"], tokenized["end_positions"] = [], []
        for i, offsets in enumerate(offset_mapping):
            input_ids = tokenized["input_ids"][i]
            if tokenizer.cls_token_id in input_ids:
                cls_index = input_ids.index(tokenizer.cls_token_id)
            elif tokenizer.bos_token_id in input_ids:
                cls_index = input_ids.index(tokenizer.bos_token_id)
            else:
                cls_index = 0
            sequence_ids = tokenized.sequence_ids(i)
            answers = examples["answers"][sample_mapping[i]]
            if len(answers["answer_start"]) == 0:
                tokenized["start_positions"].append(cls_index)
                tokenized["end_positions"].append(cls_index)
                continue
            start_char = answers["answer_start"][0]
            end_char = start_char + len(answers["text"][0])
            token_start_index = 0
            while sequence_ids[token_start_index] != (1 if pad_on_right else 0):
                token_start_index += 1
            token_end_index = len(input_ids) - 1
            while sequence_ids[token_end_index] != (1 if pad_on_right else 0):
                token_end_index -= 1
            if not (offsets[token_start_index][0] <= start_char and offsets[token_end_index][1] >= end_char):
                tokenized["start_positions"].append(cls_index)
                tokenized["end_positions"].append(cls_index)
            else:
                while token_start_index < len(offsets) and offsets[token_start_index][0] <= start_char:
                    token_start_index += 1
                tokenized["start_positions"].append(token_start_index - 1)
                while offsets[token_end_index][1] >= end_char:
                    token_end_index -= 1
                tokenized["end_positions"].append(token_end_index + 1)
        return tokenized

    def prepare_validation_features(examples):
        tokenized = tokenize(examples)
        sample_mapping = tokenized.pop("overflow_to_sample_mapping")
        tokenized["example_id"] = []
        context_index = 1 if pad_on_right else 0
        for i in range(len(tokenized["input_ids"])):
            sequence_ids = tokenized.sequence_ids(i)
            tokenized["example_id"].append(examples["id"][sample_mapping[i]])
            tokenized["offset_mapping"][i] = [
                (o if sequence_ids[k] == context_index else None) for k, o in enumerate(tokenized["offset_mapping"][i])
            ]
        return tokenized

    columns = raw["train"].column_names
    features = {"train": raw["train"].map(prepare_train_features, batched=True, remove_columns=columns)}
    for split in ("validation", "test"):
        if split in raw:
            features[split] = raw[split].map(prepare_validation_features, batched=True, remove_columns=columns)

    training_args = TrainingArguments(
        args.output_dir,
        eval_strategy="no",
        per_device_train_batch_size=12,
        per_device_eval_batch_size=8,
        learning_rate=3e-5,
        num_train_epochs=2,
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
        train_dataset=features["train"],
        data_collator=default_data_collator,
        processing_class=tokenizer,
    )

    def score(split) -> dict:
        """trainer_qa.py's evaluate/predict: the windows' logits (example_id and offset_mapping are not model
        inputs: the Trainer drops them), then postprocessing and the SQuAD scores over the questions."""
        output = trainer.predict(features[split], metric_key_prefix=split)
        answers = postprocess_qa_predictions(raw[split], features[split], output.predictions)
        return squad_v1_scores(answers, raw[split])

    trainer.train()
    trainer.save_model(f"{args.output_dir}/model")  # tuneforge saves its final model too
    result = score("validation")
    result["train_s"] = round(time.perf_counter() - T0, 2)
    if "test" in features:
        t0 = time.perf_counter()
        test = score("test")
        result.update({f"test_{k}": v for k, v in test.items()})
        result["test_s"] = round(time.perf_counter() - t0, 2)
    result["wall_s"] = round(time.perf_counter() - T0, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
