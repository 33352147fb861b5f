"""The peer of `tuneforge sweep`: transformers' `Trainer.hyperparameter_search` with its Optuna backend on MRPC.

The same search space as benchmarks/sweep-space-mrpc.yaml (learning rate log-uniform, warm-up ratio, weight decay,
epochs), the same number of trials, Optuna's TPE sampler with the same seed and the same median pruner, fed each
evaluation (every --eval-steps steps) as transformers does. The peer at its best settings for this machine: bf16
autocast where the CPU has native bf16, length-grouped batches, dynamic padding. The objective is the dev F1 of the
final model of each trial: a callback also evaluates each trial's last step (transformers evaluates only on its
schedule, so a 115-step trial evaluated every 40 steps reported step 80's F1), as tuneforge does since 2026-11-28;
--no-last-step-evaluation gives the recipe of the rows measured before. Prints one JSON line: {"best_f1",
"best_params", "trials": [...], "wall_s"}.

    python benchmarks/hf_hpsearch_mrpc.py --data-dir ../shared/data/glue/MRPC --output-dir /tmp/hf-hpsearch
"""

import argparse
import json
import os
import time

T0 = time.perf_counter()

import numpy as np  # noqa: E402
import optuna  # noqa: E402
from sklearn.metrics import accuracy_score, f1_score  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from _peer import read_mrpc  # noqa: E402


def hp_space(trial):
    """benchmarks/sweep-space-mrpc.yaml, in transformers' terms."""
    return {
        "learning_rate": trial.suggest_float("learning_rate", 1e-5, 3e-4, log=True),
        # transformers 5 has no warmup_ratio field (hyperparameter_search only warns and drops the value): its
        # warmup_steps is a ratio of the total steps when below 1
        "warmup_steps": trial.suggest_float("warmup_ratio", 0.0, 0.2),
        "weight_decay": trial.suggest_float("weight_decay", 0.0, 0.1),
        "num_train_epochs": trial.suggest_categorical("num_train_epochs", [1, 2]),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--eval-steps", type=int, default=40)
    ap.add_argument("--train-rows", type=int, default=None, help="the first N training rows only (a smoke run)")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None, help="default: where native")
    ap.add_argument("--last-step-evaluation", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    from tuneforge.backends.precision import cpu_has_native_bf16
    from tuneforge.tasks.base import bundled_minilm

    os.makedirs(args.output_dir, exist_ok=True)
    # not `"native bf16" in cpu_class()`: an AVX2 machine's class says "no native bf16" (the peer ran bf16 there)
    bf16 = args.bf16 if args.bf16 is not None else cpu_has_native_bf16()
    model_path = bundled_minilm()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    raw = {"train": read_mrpc(f"{args.data_dir}/train.tsv"), "validation": read_mrpc(f"{args.data_dir}/dev.tsv")}
    if args.train_rows:
        raw["train"] = raw["train"].select(range(args.train_rows))
    tok = {
        k: v.map(lambda ex: tokenizer(ex["sentence1"], ex["sentence2"], truncation=True), batched=True)
        for k, v in raw.items()
    }

    def model_init(trial=None):
        return AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=2)

    def compute_metrics(pred):
        preds = np.argmax(pred.predictions, axis=-1)
        return {"accuracy": accuracy_score(pred.label_ids, preds), "f1": f1_score(pred.label_ids, preds)}

    training_args = TrainingArguments(
        args.output_dir,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64,
        lr_scheduler_type="linear",
        warmup_steps=0.0,  # a float: hyperparameter_search casts each drawn value to the default's type (int(0.15) = 0)
        seed=args.seed,
        use_cpu=True,
        bf16=bf16,
        train_sampling_strategy="group_by_length",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        logging_steps=50,
    )

    class SaysItsWarmUp(TrainerCallback):  # the drawn warm-up is in effect (see hp_space): the log shows it
        def on_train_begin(self, args, state, control, **kwargs):
            steps = args.get_warmup_steps(state.max_steps)
            print(f"trial: lr {args.learning_rate:.3g}, warm-up {steps} of {state.max_steps} steps", flush=True)

    class EvaluatesTheLastStep(TrainerCallback):  # the trial's objective is then its exported model's F1
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= state.max_steps:
                control.should_evaluate = True

    trainer = Trainer(
        callbacks=[SaysItsWarmUp()] + ([EvaluatesTheLastStep()] if args.last_step_evaluation else []),
        model_init=model_init,
        args=training_args,
        train_dataset=tok["train"],
        eval_dataset=tok["validation"],
        data_collator=DataCollatorWithPadding(tokenizer=tokenizer),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )

    def objective(metrics):
        return metrics["eval_f1"]

    storage = f"sqlite:///{args.output_dir}/study.db"  # read back below: transformers returns the best run only
    best = trainer.hyperparameter_search(
        hp_space=hp_space,
        compute_objective=objective,
        n_trials=args.trials,
        direction="maximize",
        backend="optuna",
        sampler=optuna.samplers.TPESampler(seed=args.seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=args.eval_steps),
        storage=storage,
        study_name="hf-hpsearch",
    )
    study = optuna.load_study(study_name="hf-hpsearch", storage=storage)
    trials = [
        {"number": t.number, "state": t.state.name, "value": t.value, "params": t.params, "steps": t.last_step}
        for t in study.trials
    ]
    print(
        json.dumps(
            {
                "best_f1": best.objective,
                "best_params": best.hyperparameters,
                "trials": trials,
                "bf16": bf16,
                "wall_s": round(time.perf_counter() - T0, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
