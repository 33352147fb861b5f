"""Reward models: tuneforge (`--task reward`) against TRL's RewardTrainer (issue 25), same model, pairs and
settings, same machine, whole processes one after the other.

    python benchmarks/reward_vs_trl.py --train-pairs 256 --eval-pairs 64 --seeds 1 2

Model: the bundled SmolLM2-135M-Instruct with a fresh one-output score head (its last token's score),
initialised from the same seed on both sides, fully fine-tuned. (MiniLM's tokenizer has no eos token, on which
TRL 1.16's RewardTrainer fails: `endswith(None)`.) Pairs: Anthropic hh-rlhf harmless-base
(../shared/data/hh-rlhf/harmless-base/test.jsonl.gz), split by tuneforge's reader into prompt (through the last
shared "Assistant:") and the two replies, written once as prompt/chosen/rejected text rows both sides read, kept
where prompt + the longer reply fits 256 tokens (so no side drops or truncates any); the first --train-pairs
train, the next --eval-pairs evaluate. Settings on both: batch 16 pairs, AdamW lr 2e-5, linear decay without
warm-up, no weight decay, one epoch, bf16 autocast where the CPU has it, no gradient checkpointing, each side's
own tokenization (TRL's recipe on both: text + eos).

Reported per side and seed: the evaluation loss before training (the loss both start from: equal when the two
compute the same thing), the evaluation loss and pairwise accuracy after the epoch, the whole process's wall time
and peak RSS. Writes benchmarks/results/reward_vs_trl.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from _machine import machine_meta
from _process import timed

HERE = Path(__file__).resolve().parent
HH = HERE.parent.parent / "shared/data/hh-rlhf/harmless-base/test.jsonl.gz"
MAX_LENGTH, BATCH, LR = 256, 16, "2e-5"


def write_pairs(model: str, folder: Path, n_train: int, n_eval: int) -> tuple[Path, Path]:
    from transformers import AutoTokenizer

    from tuneforge.data.preference import read_pairs

    tokenizer = AutoTokenizer.from_pretrained(model)
    kept = []
    for pair in read_pairs(HH, drop_identical=True, log=lambda m: None):
        longest = max(len(tokenizer(pair["prompt"] + side)["input_ids"]) for side in (pair["chosen"], pair["rejected"]))
        if isinstance(pair["prompt"], str) and longest + 1 <= MAX_LENGTH:
            kept.append(pair)
        if len(kept) == n_train + n_eval:
            break
    paths = (folder / "train.jsonl", folder / "eval.jsonl")
    for path, part in zip(paths, (kept[:n_train], kept[n_train:])):
        path.write_text("".join(json.dumps(x) + "\n" for x in part))
    return paths


def run_tuneforge(model, train, valid, out: Path, seed: int, bf16: bool) -> dict:
    common = ["--task", "reward", "--validation-file", str(valid), "--max-length", str(MAX_LENGTH)]
    common += ["--eval-batch-size", str(2 * BATCH), "--seed", str(seed), "--precision", "bf16" if bf16 else "fp32"]
    common += ["--cache-dir", str(out) + "-cache", "--quiet", "--json"]
    evaluate = [sys.executable, "-m", "tuneforge.cli", "eval", model, *common, "--output-dir", str(out) + "-eval"]
    _, _, before = timed(evaluate, out.with_suffix(".eval.log"))
    cmd = [sys.executable, "-m", "tuneforge.cli", "train", *common, "--model", model, "--train-file", str(train)]
    cmd += ["--batch-size", str(BATCH), "--lr", LR, "--epochs", "1", "--warmup-ratio", "0", "--weight-decay", "0"]
    cmd += ["--eval-strategy", "no", "--logging-steps", "1", "--output-dir", str(out), "--overwrite"]
    wall, rss, stdout = timed(cmd, out.with_suffix(".log"))
    before, after = json.loads(before.strip().splitlines()[-1]), json.loads(stdout.strip().splitlines()[-1])
    first = next(json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in x)
    return {
        "before": {"loss": before["loss"], "accuracy": before["accuracy"]},
        "after": {"loss": after["loss"], "accuracy": after["accuracy"]},
        "first_step_loss": first["loss"],
        "train_s": after.get("wall_s"),
        "wall_s": round(wall, 1),
        "peak_rss_mib": rss,
    }


def run_trl(model, train, valid, out: Path, seed: int, bf16: bool) -> dict:
    cmd = [sys.executable, str(HERE / "trl_reward.py"), "--model", model, "--train-file", str(train)]
    cmd += ["--validation-file", str(valid), "--output-dir", str(out), "--max-length", str(MAX_LENGTH)]
    cmd += ["--batch-size", str(BATCH), "--lr", LR, "--seed", str(seed)] + (["--bf16"] if bf16 else [])
    wall, rss, stdout = timed(cmd, out.with_suffix(".log"))
    return {**json.loads(stdout.strip().splitlines()[-1]), "wall_s": round(wall, 1), "peak_rss_mib": rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-pairs", type=int, default=256)
    ap.add_argument("--eval-pairs", type=int, default=64)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    from tuneforge.backends.precision import cpu_has_native_bf16
    from tuneforge.tasks.clm import bundled_smollm2

    model, bf16 = bundled_smollm2(log=lambda m: None), cpu_has_native_bf16()
    results: dict = {"machine": machine_meta(), "settings": {**vars(args), "bf16": bf16, "max_length": MAX_LENGTH}}
    with tempfile.TemporaryDirectory() as tmp:
        train, valid = write_pairs(model, Path(tmp), args.train_pairs, args.eval_pairs)
        for seed in args.seeds:
            for side, run in (("tuneforge", run_tuneforge), ("trl", run_trl)):
                results[f"{side}-seed{seed}"] = run(model, train, valid, Path(tmp) / f"{side}-{seed}", seed, bf16)
                print(side, seed, results[f"{side}-seed{seed}"], flush=True)
    (HERE / "results" / "reward_vs_trl.json").write_text(json.dumps(results, indent=2))
    print("| side | seed | loss before | first-step loss | loss after | accuracy after | train s | wall s | RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, r in results.items():
        if "-seed" in key:
            side, seed = key.split("-seed")
            cells = [side, seed, round(r["before"]["loss"], 5), round(r["first_step_loss"], 4)]
            cells += [round(r["after"]["loss"], 4), round(r["after"]["accuracy"], 4), r["train_s"], r["wall_s"]]
            print("| " + " | ".join(map(str, [*cells, r["peak_rss_mib"]])) + " |")


if __name__ == "__main__":
    main()
