"""GRPO with LoRA: tuneforge against TRL's GRPOTrainer + peft (issue 25), same model, prompts, rewards and
settings, same machine, whole processes one after the other.

    python benchmarks/grpo_vs_trl.py --steps 10 --seeds 1 2

Model: the bundled SmolLM2-135M-Instruct. Prompts: GSM8K train questions (../shared/data/gsm8k/train.jsonl),
the first --prompts, each as [system: the think/answer instruction of configs/gsm8k-grpo-lora.yaml, user: the
question], with the row's `answer`; both sides render them with the model's chat template. Rewards: accuracy +
format (tuneforge's built-ins on both sides, weights 1). Settings on both: 8 completions per prompt, 2 prompts
per step, --max-completion-length tokens, temperature 1, loss dapo, beta 0, epsilon 0.2, scale_rewards group,
one iteration; LoRA r 16, alpha 32, no dropout, on q_proj and v_proj; AdamW lr 2e-5, linear decay without
warm-up, no weight decay; bf16 autocast where the CPU has it, fp32 otherwise; no gradient checkpointing.

Reported per side and seed: the wall time per step (the mean of steps 2..N: step 1 holds one-off start-up work
on both sides), the whole process's wall time and peak RSS (os.wait4), and the mean reward over the last half of
the steps. Writes benchmarks/results/grpo_vs_trl.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from _machine import machine_meta
from _process import timed

HERE = Path(__file__).resolve().parent
GSM8K = HERE.parent.parent / "shared/data/gsm8k/train.jsonl"
SYSTEM = (
    "Solve the problem. First think step by step inside <think> </think> tags, then give only the final number "
    "inside <answer> </answer> tags."
)
G, PROMPTS_PER_STEP, LR = 8, 2, "2e-5"


def write_prompts(folder: Path, n: int) -> Path:
    rows = [json.loads(x) for x in GSM8K.read_text().splitlines()[:n]]
    path = folder / "prompts.jsonl"
    with path.open("w") as f:
        for row in rows:
            prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["question"]}]
            f.write(json.dumps({"prompt": prompt, "answer": row["answer"]}) + "\n")
    return path


def run_tuneforge(model: str, prompts: Path, out: Path, args, seed: int, bf16: bool) -> dict:
    cmd = [sys.executable, "-m", "tuneforge.cli", "train", "--task", "grpo", "--model", model]
    cmd += ["--train-file", str(prompts), "--validation-file", str(prompts), "--max-eval-samples", "2"]
    cmd += ["--reward", "accuracy", "--reward", "format", "--num-generations", str(G)]
    cmd += ["--batch-size", str(PROMPTS_PER_STEP), "--max-completion-length", str(args.max_completion_length)]
    cmd += ["--max-steps", str(args.steps), "--lr", LR, "--warmup-ratio", "0", "--weight-decay", "0"]
    cmd += ["--adapter", "lora", "--lora-r", "16", "--lora-alpha", "32", "--lora-dropout", "0"]
    cmd += ["--eval-strategy", "no", "--seed", str(seed), "--output-dir", str(out), "--overwrite", "--quiet"]
    cmd += ["--precision", "bf16" if bf16 else "fp32", "--logged-samples", "0"]
    wall, rss, _ = timed(cmd, out.with_suffix(".log"))
    train = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["split"] == "train"]
    stamps = [0.0] + [r["time_s"] for r in train]
    return {
        "step_s": [round(b - a, 3) for a, b in zip(stamps, stamps[1:])],
        "reward": [r["reward"] for r in train],
        "reward_accuracy": [r["reward_accuracy"] for r in train],
        "reward_format": [r["reward_format"] for r in train],
        "completion_length": [r["completion_length"] for r in train],
        "gen_tokens_per_s": [r["gen_tokens_per_s"] for r in train],
        "wall_s": round(wall, 1),
        "peak_rss_mib": rss,
    }


def run_trl(model: str, prompts: Path, out: Path, args, seed: int, bf16: bool) -> dict:
    cmd = [sys.executable, str(HERE / "trl_grpo.py"), "--model", model, "--train-file", str(prompts)]
    cmd += ["--output-dir", str(out), "--steps", str(args.steps), "--prompts-per-step", str(PROMPTS_PER_STEP)]
    cmd += ["--num-generations", str(G), "--max-completion-length", str(args.max_completion_length), "--lr", LR]
    cmd += ["--seed", str(seed)] + (["--bf16"] if bf16 else [])
    wall, rss, stdout = timed(cmd, out.with_suffix(".log"))
    return {**json.loads(stdout.strip().splitlines()[-1]), "wall_s": round(wall, 1), "peak_rss_mib": rss}


def summary(result: dict) -> dict:
    steps = result["step_s"][1:] or result["step_s"]
    half = len(result["reward"]) // 2
    return {
        "s_per_step": round(statistics.mean(steps), 2),
        "last_half_reward": round(statistics.mean(result["reward"][half:]), 4),
        "wall_s": result["wall_s"],
        "peak_rss_mib": result["peak_rss_mib"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--max-completion-length", type=int, default=128)
    ap.add_argument("--only", choices=["tuneforge", "trl"])
    args = ap.parse_args()
    from tuneforge.backends.precision import cpu_has_native_bf16
    from tuneforge.tasks.clm import bundled_smollm2

    model, bf16 = bundled_smollm2(log=lambda m: None), cpu_has_native_bf16()
    results: dict = {"machine": machine_meta(), "settings": {**vars(args), "G": G, "prompts_per_step": 2, "bf16": bf16}}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = write_prompts(Path(tmp), PROMPTS_PER_STEP * args.steps)
        for seed in args.seeds:
            for side, run in (("tuneforge", run_tuneforge), ("trl", run_trl)):
                if args.only and side != args.only:
                    continue
                raw = run(model, prompts, Path(tmp) / f"{side}-{seed}", args, seed, bf16)
                results[f"{side}-seed{seed}"] = {"summary": summary(raw), "raw": raw}
                print(side, seed, results[f"{side}-seed{seed}"]["summary"], flush=True)
    out = HERE / "results" / "grpo_vs_trl.json"
    out.write_text(json.dumps(results, indent=2))
    print("| side | seed | s/step | last-half reward | wall s | peak RSS MiB |\n|---|---|---|---|---|---|")
    for key, value in results.items():
        if "-seed" in key:
            s = value["summary"]
            side, seed = key.split("-seed")
            cells = [side, seed, s["s_per_step"], s["last_half_reward"], s["wall_s"], s["peak_rss_mib"]]
            print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
