"""The peer of `tuneforge train --task reward` (benchmarks/reward_vs_trl.py): TRL's RewardTrainer on the same
prompt/chosen/rejected rows, model and settings.

    python benchmarks/trl_reward.py --model MODEL --train-file train.jsonl --validation-file eval.jsonl --output-dir OUT

The score head is initialised right after `torch.manual_seed(seed)` (as tuneforge does), so both start from the
same model: the evaluation before training gives the loss both start from. Settings: RewardConfig's defaults
except the batch size, learning rate, epochs, max_length, linear decay without warm-up, no weight decay, bf16
where asked (the CPU has it), no gradient checkpointing. Prints one JSON line: the evaluation before and after
training (loss, accuracy) and the training time.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--train-file", required=True)
    ap.add_argument("--validation-file", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    def rows(path: str) -> Dataset:
        return Dataset.from_list([json.loads(x) for x in open(path, encoding="utf-8") if x.strip()])

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    torch.manual_seed(args.seed)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1)
    config = RewardConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size * 2,
        learning_rate=args.lr,
        num_train_epochs=1,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_length=args.max_length,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=args.bf16,
        gradient_checkpointing=False,
        seed=args.seed,
        dataloader_num_workers=0,
    )
    trainer = RewardTrainer(
        model=model,
        args=config,
        train_dataset=rows(args.train_file),
        eval_dataset=rows(args.validation_file),
        processing_class=tokenizer,
    )

    def evaluate() -> dict:  # RewardTrainer logs its eval accuracy (the mean over equal batches) with the loss
        loss = trainer.evaluate()["eval_loss"]
        logged = [r for r in trainer.state.log_history if "eval_loss" in r][-1]
        return {"eval_loss": loss, "eval_accuracy": logged.get("eval_accuracy")}

    before = evaluate()
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    after = evaluate()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r and "eval_loss" not in r]
    print(
        json.dumps(
            {
                "before": {"loss": before["eval_loss"], "accuracy": before.get("eval_accuracy")},
                "after": {"loss": after["eval_loss"], "accuracy": after.get("eval_accuracy")},
                "first_step_loss": losses[0] if losses else None,
                "train_s": round(train_s, 2),
                "train_pairs": len(trainer.train_dataset),
            }
        )
    )


if __name__ == "__main__":
    main()
