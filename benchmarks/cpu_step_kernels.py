"""Why tuneforge trains with eager attention under bf16 on CPU, and without dropout by default.

Times one training step (forward + backward + AdamW) of the bundled MiniLM classifier in train
mode on MRPC-shaped batches, for each attention kernel (torch SDPA, eager) and dropout setting
(the model's 0.1, and 0), in bf16 autocast and fp32:

    python benchmarks/cpu_step_kernels.py --threads 2

Prints a markdown table for benchmarks/README.md and writes benchmarks/results/cpu_step_kernels.json.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from _machine import cpu_step_args, cpu_step_meta

HERE = Path(__file__).resolve().parent


def step_ms(attention: str, dropout: float, bf16: bool, batch: int, length: int, steps: int) -> float:
    from transformers import AutoModelForSequenceClassification

    from tuneforge.tasks.base import bundled_minilm

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        bundled_minilm(),
        num_labels=2,
        attn_implementation=attention,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    ).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[::2, int(length * 0.9) :] = 0  # length-grouped batches still carry a little padding
    inputs = {
        "input_ids": torch.randint(1000, 20000, (batch, length)),
        "attention_mask": mask,
        "token_type_ids": torch.zeros(batch, length, dtype=torch.long),
        "labels": torch.randint(0, 2, (batch,)),
    }

    def one_step():
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        one_step()
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    args = cpu_step_args(__doc__)
    shapes = [(32, 64), (16, 64), (8, 128)]  # MRPC pairs are ~50-100 tokens
    rows = []
    for bf16 in (True, False):
        for batch, length in shapes:
            for attention in ("sdpa", "eager"):
                for dropout in (0.1, 0.0):
                    ms = step_ms(attention, dropout, bf16, batch, length, args.steps)
                    rows.append(
                        {
                            "precision": "bf16" if bf16 else "fp32",
                            "batch": batch,
                            "length": length,
                            "attention": attention,
                            "dropout": dropout,
                            "step_ms": round(ms, 1),
                        }
                    )
                    print(rows[-1], flush=True)
    meta = cpu_step_meta(args, "cpu_step_kernels.py")
    out = HERE / "results" / "cpu_step_kernels.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))

    print(f"\n{meta['date']}, {meta['machine']}, {args.threads} threads: `{meta['command']}`")
    print(
        "| precision | batch x length | sdpa, dropout 0.1 | eager, dropout 0.1 | sdpa, no dropout | eager, no dropout |"
    )
    print("|---|---|---|---|---|---|")
    for precision in ("bf16", "fp32"):
        for batch, length in shapes:
            cell = {
                (r["attention"], r["dropout"]): r["step_ms"]
                for r in rows
                if r["precision"] == precision and (r["batch"], r["length"]) == (batch, length)
            }
            base = cell[("sdpa", 0.1)]
            print(
                f"| {precision} | {batch} x {length} | "
                + " | ".join(
                    f"{cell[k]:.0f} ms ({base / cell[k]:.2f}x)"
                    for k in (("sdpa", 0.1), ("eager", 0.1), ("sdpa", 0.0), ("eager", 0.0))
                )
                + " |"
            )


if __name__ == "__main__":
    main()
