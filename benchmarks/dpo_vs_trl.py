"""DPO with LoRA: tuneforge against TRL's DPOTrainer + peft (issue 13), same model, pairs, LoRA and optimiser
settings, same machine, whole processes one after the other.

    python benchmarks/dpo_vs_trl.py --train-pairs 64 --eval-pairs 16 --seeds 1

Model: the bundled SmolLM2-135M-Instruct. Pairs: Anthropic hh-rlhf helpful-base
(../shared/data/hh-rlhf/helpful-base/test.jsonl.gz; its 2 identical pairs left out), each dialogue split
by tuneforge's reader into prompt (through the last shared "Assistant:") and the two replies, and kept
when prompt + the longer reply fit 512 tokens (so neither side truncates); the first --train-pairs for
training, the next --eval-pairs for evaluation, written once as prompt/chosen/rejected jsonl that both
sides read. Settings on both: LoRA r 16, alpha 32, no dropout, on q_proj and v_proj; beta 0.1; AdamW lr 5e-5
with 6% warm-up and linear decay, weight decay 0.01; batch 4 pairs (evaluation too); one epoch; fp32;
gradient checkpointing (DPOConfig's default); the reference is the model with its adapters off, computed in
each step.

Checks, before the timed runs:
- the reference log-probs: each training pair's chosen and rejected log-probabilities under the base model,
  from TRL's own precompute pass and from tuneforge's task (its tokens, its `sequence_logps`), one pair at a
  time on both sides, compared pair by pair;
- the first step's loss of each timed run (both start from their reference, so ln 2 when the two agree).

Reported per side: wall time, peak RSS (os.wait4), tokens/s end to end (every pair's prompt + chosen and
prompt + rejected tokens, over the wall time), the loss of the first steps, and the evaluation metrics after
the epoch. Writes benchmarks/results/dpo_vs_trl.json and prints markdown tables.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from _machine import machine_meta
from sft_vs_trl import timed

HERE = Path(__file__).resolve().parent
HH = HERE.parent.parent / "shared/data/hh-rlhf/helpful-base/test.jsonl.gz"
MAX_LENGTH, BATCH, LR = 512, 4, "5e-5"
# the reference check runs one pair at a time on both sides: padded to different widths (TRL pads to a
# multiple of its own), the same tokens take other kernel paths, and sums over ~200 tokens differ by ~1e-3
REFERENCE_BATCH = 1


def write_pairs(model: str, folder: Path, n_train: int, n_eval: int) -> tuple[Path, Path, int]:
    """(train file, eval file, training tokens): pairs that fit MAX_LENGTH whole."""
    from transformers import AutoTokenizer

    from tuneforge.data.preference import encode_pair, read_pairs

    tokenizer = AutoTokenizer.from_pretrained(model)
    kept, tokens = [], []
    for pair in read_pairs(HH, drop_identical=True, log=lambda m: None):
        p, c, r = encode_pair(tokenizer, pair)
        if len(p) + max(len(c), len(r)) <= MAX_LENGTH:
            kept.append(pair)
            tokens.append(2 * len(p) + len(c) + len(r))
        if len(kept) == n_train + n_eval:
            break
    paths = (folder / "train.jsonl", folder / "eval.jsonl")
    for path, part in zip(paths, (kept[:n_train], kept[n_train:])):
        path.write_text("".join(json.dumps(x) + "\n" for x in part))
    return *paths, sum(tokens[:n_train])


def tuneforge_reference(model: str, train: Path, folder: Path) -> tuple[list[float], list[float]]:
    """Each training pair's (chosen, rejected) log-probabilities under the base model, as tuneforge's task
    computes them: its tokens, its collate, `sequence_logps`."""
    import torch

    from tuneforge.configure import build_config
    from tuneforge.tasks import get_task
    from tuneforge.tasks.dpo import sequence_logps

    data = {"train_file": str(train), "validation_file": str(train), "block_size": MAX_LENGTH}
    config = build_config(task="dpo", model=model, precision="fp32", data=data)
    task = get_task(config)
    task.log = lambda m: None
    tokenizer = task.load_tokenizer()
    feats = task.tokenize(task.load_raw(), tokenizer, log=lambda m: None)["train"]
    net = task.load_model(tokenizer).eval()
    chosen, rejected = [], []
    with torch.no_grad():
        for start in range(0, len(feats), REFERENCE_BATCH):
            batch = task.collate(feats[start : start + REFERENCE_BATCH], tokenizer)
            logps = sequence_logps(net(**task.model_inputs(batch)).logits, batch["labels"]).tolist()
            half = len(logps) // 2
            chosen += logps[:half]
            rejected += logps[half:]
    return chosen, rejected


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-pairs", type=int, default=64)
    ap.add_argument("--eval-pairs", type=int, default=16)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--only", default="ab", help="a: TRL, b: tuneforge")
    args = ap.parse_args()
    from tuneforge.tasks.clm import bundled_smollm2

    model = bundled_smollm2()
    work = Path(tempfile.mkdtemp(prefix="bench-dpo-"))
    train, evals, tokens = write_pairs(model, work, args.train_pairs, args.eval_pairs)
    common = ["--model", model, "--train-file", str(train), "--validation-file", str(evals)]

    # the reference log-probs, pair by pair
    trl_cmd = [sys.executable, str(HERE / "trl_dpo.py"), *common, "--output-dir", str(work / "ref")]
    _, _, stdout = timed([*trl_cmd, "--reference-only", "--batch-size", str(REFERENCE_BATCH)], work / "ref.log")
    trl_ref = json.loads(stdout.strip().splitlines()[-1])
    ours = tuneforge_reference(model, train, work)
    gaps = [abs(a - b) for a, b in zip(trl_ref["ref_chosen_logps"] + trl_ref["ref_rejected_logps"], ours[0] + ours[1])]
    reference = {"pairs": len(ours[0]), "max_abs_diff": max(gaps), "mean_chosen_logp": sum(ours[0]) / len(ours[0])}
    print("reference log-probs:", reference, flush=True)

    runs = []
    for seed in args.seeds:
        for variant in args.only:
            out = work / f"{variant}-{seed}"
            if variant == "a":
                cmd = [sys.executable, str(HERE / "trl_dpo.py"), *common, "--output-dir", str(out), "--seed", str(seed)]
                cmd += ["--max-length", str(MAX_LENGTH), "--batch-size", str(BATCH), "--lr", LR]
            else:
                cmd = [sys.executable, "-m", "tuneforge.cli", "train", "--task", "dpo", *common]
                cmd += ["--output-dir", str(out), "--block-size", str(MAX_LENGTH), "--batch-size", str(BATCH)]
                cmd += ["--eval-batch-size", str(BATCH), "--lr", LR, "--epochs", "1", "--gradient-checkpointing"]
                cmd += ["--adapter", "lora", "--lora-dropout", "0", "--lora-targets", "q_proj,v_proj"]
                cmd += ["--precision", "fp32", "--seed", str(seed), "--json", "--quiet", "--logging-steps", "1"]
                cmd += ["--cache-dir", str(work / f"cache-{seed}")]  # tokenization paid every run, as TRL's is
            wall, rss, stdout = timed(cmd, work / f"{variant}-{seed}.log")
            line = json.loads(stdout.strip().splitlines()[-1])
            if variant == "a":
                losses, metrics = line["losses"], line["eval"]
                metrics = {
                    "loss": metrics["loss"],
                    "reward_accuracy": metrics["rewards/accuracies"],
                    "reward_margin": metrics["rewards/margins"],
                }
            else:
                rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                losses = [r["loss"] for r in rows if r["split"] == "train"]
                metrics = {k: line[k] for k in ("loss", "reward_accuracy", "reward_margin")}
            run = {"variant": variant, "seed": seed, "wall_s": round(wall, 1), "peak_rss_mib": rss}
            run.update({"tokens_per_s": round(tokens / wall, 1), "first_losses": [round(x, 6) for x in losses[:3]]})
            run.update({f"eval_{k}": round(v, 4) for k, v in metrics.items()})
            print(run, flush=True)
            runs.append(run)
    meta = machine_meta(**vars(args), train_tokens=tokens, model=model, reference=reference)
    (HERE / "results" / "dpo_vs_trl.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=2) + "\n")
    names = {"a": "TRL DPOTrainer + peft", "b": "tuneforge --task dpo --adapter lora"}
    print(f"\nreference log-probs of {reference['pairs']} pairs: largest gap {reference['max_abs_diff']:.2e}")
    print("| variant | seed | wall s | tokens/s | peak RSS MiB | first step loss | eval loss | reward acc | margin |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        cells = [names[r["variant"]], r["seed"], r["wall_s"], r["tokens_per_s"], r["peak_rss_mib"]]
        cells += [r["first_losses"][0], r["eval_loss"], r["eval_reward_accuracy"], r["eval_reward_margin"]]
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
