"""The peer of `tuneforge train --task grpo --adapter lora` (benchmarks/grpo_vs_trl.py): TRL's GRPOTrainer + peft
LoRA on the same prompts, model, rewards and settings. TRL generates with transformers' `generate` (no vLLM on
CPU).

    python benchmarks/trl_grpo.py --model MODEL --train-file prompts.jsonl --output-dir OUT --steps 10

The reward functions are tuneforge's built-ins (tuneforge/rewards/builtin.py: accuracy against the `answer`
column, the think/answer format), called by TRL through its own signature, so both sides score alike. Settings
as GRPOConfig's defaults (loss dapo, beta 0, epsilon 0.2, scale_rewards group, temperature 1, one iteration)
except: per_device_train_batch_size = prompts x num_generations (TRL counts completions), max_steps, the
learning rate, linear decay without warm-up, bf16 where the CPU has it, gradient checkpointing off (faster on
CPU at this size: TRL's best setting here), LoRA r/alpha on q_proj, v_proj without dropout. Prints one JSON line:
each step's wall time (from a callback at each step's end), reward, reward per function and completion length.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--train-file", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--max-completion-length", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    import re

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tuneforge.rewards import DEFAULT_FORMAT
    from tuneforge.rewards.builtin import accuracy_reward, format_reward

    check_answer, check_format = accuracy_reward("answer"), format_reward(re.compile(DEFAULT_FORMAT, re.DOTALL))

    def accuracy(prompts, completions, **columns):
        return check_answer(prompts=prompts, completions=completions, **columns)

    def format(prompts, completions, **columns):  # noqa: A001 (TRL logs a function by its name)
        return check_format(prompts=prompts, completions=completions, **columns)

    rows = [json.loads(x) for x in open(args.train_file, encoding="utf-8") if x.strip()]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    config = GRPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        learning_rate=args.lr,
        max_steps=args.steps,
        lr_scheduler_type="linear",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=args.bf16,
        gradient_checkpointing=False,
        seed=args.seed,
        dataloader_num_workers=0,
    )
    lora = LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )  # fmt: skip

    stamps: list[float] = []

    class StepTimes(TrainerCallback):
        def on_train_begin(self, *a, **k):
            stamps.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[accuracy, format],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[StepTimes()],
    )
    trainer.train()
    logs = [r for r in trainer.state.log_history if "reward" in r]
    print(
        json.dumps(
            {
                "step_s": [round(b - a, 3) for a, b in zip(stamps, stamps[1:])],
                "reward": [r["reward"] for r in logs],
                "reward_accuracy": [r.get("rewards/accuracy/mean") for r in logs],
                "reward_format": [r.get("rewards/format/mean") for r in logs],
                "completion_length": [r.get("completions/mean_length") for r in logs],
            }
        )
    )


if __name__ == "__main__":
    main()
