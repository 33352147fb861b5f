"""The peer of `tuneforge train --task sft --adapter lora` (benchmarks/sft_vs_trl.py): TRL's SFTTrainer + peft
LoRA on the same chat rows, model and settings.

    python benchmarks/trl_sft.py --model MODEL --train-file train.jsonl --validation-file eval.jsonl --output-dir OUT

The rows are conversational prompt-completion pairs, TRL's form whose loss is on the completion only
(the assistant's reply and its end-of-turn marker), as tuneforge's sft loss is. No packing (TRL's
default), max_length truncation, fp32 on CPU. Prints one JSON line: train_runtime, eval_loss.
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
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=float, default=1)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32)
    ap.add_argument("--lora-dropout", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    def pairs(path: str) -> Dataset:
        rows = [json.loads(x) for x in open(path, encoding="utf-8") if x.strip()]
        return Dataset.from_list(
            [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in rows]  # one reply per row
        )

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    config = SFTConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.lr,
        num_train_epochs=args.epochs,
        lr_scheduler_type="linear",
        warmup_steps=0.06,  # transformers 5: a float below 1 is a share of the steps
        weight_decay=0.01,
        max_length=args.max_length,
        packing=False,
        eval_strategy="epoch",
        save_strategy="no",
        logging_steps=5,
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=args.seed,
        dataloader_num_workers=0,
    )
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=pairs(args.train_file),
        eval_dataset=pairs(args.validation_file),
        processing_class=tokenizer,
        peft_config=lora,
    )
    start = time.perf_counter()
    out = trainer.train()
    loop = time.perf_counter() - start
    evals = [r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r]
    print(json.dumps({"train_runtime": out.metrics["train_runtime"], "loop_s": loop, "eval_loss": evals[-1]}))


if __name__ == "__main__":
    main()
