"""The peer of `tuneforge train --task dpo --adapter lora` (benchmarks/dpo_vs_trl.py): TRL's DPOTrainer + peft
LoRA on the same prompt/chosen/rejected rows, model and settings.

    python benchmarks/trl_dpo.py --model MODEL --train-file train.jsonl --validation-file eval.jsonl --output-dir OUT
    python benchmarks/trl_dpo.py ... --reference-only     # the per-pair reference log-probs, no training

The reference is the model with its adapters off (TRL's default for a peft model), computed in each step
(precompute_ref_log_probs False, its default), as tuneforge does. fp32 on CPU, gradient checkpointing on
(DPOConfig's default), dropout off (its default). Prints one JSON line: the per-step training losses, the
first step's mean chosen / rejected log-probs, the evaluation metrics; with --reference-only, each pair's
reference log-probs (TRL's own precompute pass).
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
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--epochs", type=float, default=1)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reference-only", action="store_true")
    args = ap.parse_args()

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    def rows(path: str) -> Dataset:
        return Dataset.from_list([json.loads(x) for x in open(path, encoding="utf-8") if x.strip()])

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    config = DPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.lr,
        num_train_epochs=args.epochs,
        lr_scheduler_type="linear",
        warmup_steps=0.06,
        weight_decay=0.01,
        beta=args.beta,
        max_length=args.max_length,
        eval_strategy="epoch",
        save_strategy="no",
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=args.seed,
        dataloader_num_workers=0,
        precompute_ref_log_probs=args.reference_only,
        precompute_ref_batch_size=args.batch_size,
    )
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )
    trainer = DPOTrainer(
        model=model,
        args=config,
        train_dataset=rows(args.train_file),
        eval_dataset=rows(args.validation_file),
        processing_class=tokenizer,
        peft_config=lora,
    )
    if args.reference_only:
        ds = trainer.train_dataset
        print(
            json.dumps(
                {"ref_chosen_logps": list(ds["ref_chosen_logps"]), "ref_rejected_logps": list(ds["ref_rejected_logps"])}
            )
        )
        return
    start = time.perf_counter()
    out = trainer.train()
    loop = time.perf_counter() - start
    history = trainer.state.log_history
    steps = [r for r in history if "loss" in r and "eval_loss" not in r and "train_runtime" not in r]
    evals = [r for r in history if "eval_loss" in r][-1]
    print(
        json.dumps(
            {
                "train_runtime": out.metrics["train_runtime"],
                "loop_s": loop,
                "losses": [r["loss"] for r in steps],
                "first_logps_chosen": steps[0].get("logps/chosen"),
                "first_logps_rejected": steps[0].get("logps/rejected"),
                "eval": {k[5:]: v for k, v in evals.items() if k.startswith("eval_")},
            }
        )
    )


if __name__ == "__main__":
    main()
