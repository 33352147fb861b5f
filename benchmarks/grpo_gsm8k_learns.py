"""Does GRPO learn here: GSM8K test accuracy (greedy) and the format reward of the bundled SmolLM2-135M-Instruct
before and after a CPU-sized run of the shipped config (configs/gsm8k-grpo-lora.yaml), on a fixed subset of the
test questions (the first --questions of ../shared/data/gsm8k/test.jsonl), issue 25.

    python benchmarks/grpo_gsm8k_learns.py --questions 200

Both evaluations are `tuneforge eval` with the config's prompt settings (question column, its system prompt,
192 completion tokens, the chat template) and rewards (accuracy, format): greedy completions, each reward's mean
over the questions. Writes benchmarks/results/grpo_gsm8k_learns.json and prints a markdown table; the figures
are reported as they come out, whatever they are.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

from _machine import machine_meta
from _process import timed

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIG = ROOT / "configs" / "gsm8k-grpo-lora.yaml"
TEST = ROOT.parent / "shared/data/gsm8k/test.jsonl"


def evaluate(model: str, options: dict, questions: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "tuneforge.cli", "eval", model, "--task", "grpo", "--validation-file", str(TEST)]
    cmd += ["--max-eval-samples", str(questions), "--eval-batch-size", "32", "--output-dir", str(out)]
    cmd += ["--prompt-column", options["prompt_column"], "--system-prompt", options["system_prompt"]]
    cmd += ["--max-completion-length", str(options["max_completion_length"]), "--json", "--quiet"]
    for reward in options["reward"]:
        cmd += ["--reward", reward]
    wall, rss, stdout = timed(cmd, out.with_suffix(".log"))
    return {**json.loads(stdout.strip().splitlines()[-1]), "wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=200)
    args = ap.parse_args()
    from tuneforge.tasks.clm import bundled_smollm2

    base = bundled_smollm2(log=lambda m: None)
    options = yaml.safe_load(CONFIG.read_text())["task_options"]
    results: dict = {"machine": machine_meta(), "config": str(CONFIG.relative_to(ROOT)), "questions": args.questions}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        results["before"] = evaluate(base, options, args.questions, tmp / "before")
        print("before", results["before"], flush=True)
        train = [sys.executable, "-m", "tuneforge.cli", "train", str(CONFIG), "--output-dir", str(tmp / "run")]
        wall, rss, stdout = timed([*train, "--json", "--quiet"], tmp / "run.log")
        results["training"] = {**json.loads(stdout.strip().splitlines()[-1]), "wall_s": round(wall, 1), "rss": rss}
        steps = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
        results["training"]["per_step"] = [
            {k: r.get(k) for k in ("step", "reward", "reward_accuracy", "reward_format", "completion_length")}
            for r in steps
            if r["split"] == "train"
        ]
        print("training", results["training"]["wall_s"], "s", flush=True)
        results["after"] = evaluate(str(tmp / "run" / "model"), options, args.questions, tmp / "after")
        print("after", results["after"], flush=True)
    (HERE / "results" / "grpo_gsm8k_learns.json").write_text(json.dumps(results, indent=2))
    print("| | accuracy | format reward | total reward |\n|---|---|---|---|")
    for when in ("before", "after"):
        r = results[when]
        print(f"| {when} | {r['accuracy']:.4f} | {r['reward_format']:.4f} | {r['reward']:.4f} |")


if __name__ == "__main__":
    main()
