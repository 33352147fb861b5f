"""Where an fp32 CPU training step goes, and what each lever saves (issue 11).

One step = forward + backward + fused AdamW of the bundled MiniLM classifier in train mode, no
dropout, SDPA attention (tuneforge's fp32 settings), on batches of 16 MRPC pairs of a real length
(53 tokens, the median). First a torch.profiler breakdown by kind of kernel, then the step time of:

- all weights trained (tuneforge's defaults before issue 11)
- word embeddings frozen (no dense 30522 x 384 gradient, no AdamW over it)
- the embeddings frozen (`--freeze-layers 0 --freeze-embeddings on`: word, position, type embeddings, layer norm)
- embeddings + bottom 1 / 2 of 6 layers frozen (`--freeze-layers 1`, a classifier's default, / `2`)
- padded to a multiple of 8 / 16 tokens (fewer distinct shapes)
- `torch.compile(dynamic=True)` of the model (compile time reported separately)

    python benchmarks/cpu_fp32_levers.py --threads 2

Prints markdown tables for benchmarks/README.md; writes benchmarks/results/cpu_fp32_levers.json.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from _machine import cpu_step_args, cpu_step_meta

HERE = Path(__file__).resolve().parent
BATCH, LENGTH = 16, 53


def build(freeze_layers: int = 0, freeze_word_embeddings: bool = False, freeze_embeddings: bool = False):
    from transformers import AutoModelForSequenceClassification

    from tuneforge.freezing import freeze_bottom
    from tuneforge.tasks.base import bundled_minilm

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        bundled_minilm(), num_labels=2, attn_implementation="sdpa", hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ).train()  # fmt: skip
    freeze_bottom(model, freeze_layers, embeddings=freeze_embeddings)
    if freeze_word_embeddings:
        model.get_input_embeddings().requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    return model, optimizer


def batch(length: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(BATCH, length, dtype=torch.long)
    mask[::2, LENGTH - 3 :] = 0  # length-grouped batches still carry a little padding
    return {
        "input_ids": torch.randint(1000, 20000, (BATCH, length), generator=g),
        "attention_mask": mask,
        "token_type_ids": torch.zeros(BATCH, length, dtype=torch.long),
        "labels": torch.randint(0, 2, (BATCH,), generator=g),
    }


def stepper(model, optimizer, inputs, forward=None):
    forward = forward if forward is not None else model

    def one_step():
        forward(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return one_step


def time_ms(one_step, steps: int, warmup: int = 2, blocks: int = 3) -> float:
    """ms per step: the fastest of `blocks` runs of `steps` steps (the machine is shared: noise only adds)."""
    for _ in range(warmup):
        one_step()
    best = float("inf")
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(steps):
            one_step()
        best = min(best, (time.perf_counter() - start) / steps * 1000)
    return best


KINDS = {  # profiler op name -> kind (anything else: "other")
    "aten::mm": "GEMMs (linear layers, fwd + bwd)",
    "aten::addmm": "GEMMs (linear layers, fwd + bwd)",
    "aten::bmm": "GEMMs (linear layers, fwd + bwd)",
    "aten::_fused_adamw_": "optimizer (fused AdamW) and zero_grad",
    "Optimizer.zero_grad#AdamW.zero_grad": "optimizer (fused AdamW) and zero_grad",
    "aten::embedding_dense_backward": "embedding gradient (dense, incl. zero fill)",
    "aten::embedding_backward": "embedding gradient (dense, incl. zero fill)",
}


def profile(steps: int) -> list[tuple[str, float]]:
    """(kind, share of the step's self CPU time), largest first."""
    from torch.profiler import profile as torch_profile

    model, optimizer = build()
    one_step = stepper(model, optimizer, batch(LENGTH))
    for _ in range(2):  # warm-up
        one_step()
    with torch_profile() as prof:
        for _ in range(steps):
            one_step()
    shares: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        name = event.key
        if "attention" in name or "softmax" in name:
            kind = "attention (SDPA kernels)"
        elif name in KINDS:
            kind = KINDS[name]
        elif any(k in name for k in ("gelu", "layer_norm", "add", "mul", "tanh", "copy_", "fill_", "sum", "cross")):
            kind = "elementwise, layer norm, GELU, copies, fills"
        else:
            kind = "other (indexing, views, autograd bookkeeping)"
        shares[kind] += event.self_cpu_time_total
    total = sum(shares.values())
    return sorted(((k, v / total) for k, v in shares.items()), key=lambda kv: -kv[1])


def main() -> None:
    args = cpu_step_args(__doc__)
    breakdown = profile(4)
    for kind, share in breakdown:
        print(f"{kind}: {share:.1%}", flush=True)

    rows = []

    def record(lever: str, ms: float, **extra) -> None:
        rows.append({"lever": lever, "step_ms": round(ms, 1), **extra})
        print(rows[-1], flush=True)

    model, optimizer = build()
    record("all weights trained (before)", time_ms(stepper(model, optimizer, batch(LENGTH)), args.steps))
    for multiple in (8, 16):
        padded = -(-LENGTH // multiple) * multiple
        record(
            f"padded to a multiple of {multiple} ({padded} tokens)",
            time_ms(stepper(model, optimizer, batch(padded)), args.steps),
        )
    model, optimizer = build(freeze_word_embeddings=True)
    record("word embeddings frozen", time_ms(stepper(model, optimizer, batch(LENGTH)), args.steps))
    model, optimizer = build(freeze_embeddings=True)
    record("the embeddings frozen", time_ms(stepper(model, optimizer, batch(LENGTH)), args.steps))
    for layers in (1, 2):
        model, optimizer = build(freeze_layers=layers)
        record(
            f"embeddings + bottom {layers} of 6 layers frozen",
            time_ms(stepper(model, optimizer, batch(LENGTH)), args.steps),
        )

    model, optimizer = build()
    compiled = torch.compile(model, dynamic=True)
    start = time.perf_counter()
    first = stepper(model, optimizer, batch(LENGTH), forward=compiled)
    first()
    compile_s = time.perf_counter() - start
    record("torch.compile(dynamic=True), all trained", time_ms(first, args.steps), compile_s=round(compile_s, 1))
    start = time.perf_counter()
    other = stepper(model, optimizer, batch(LENGTH + 17), forward=compiled)
    other()  # a second length: does it recompile?
    record(
        f"torch.compile, a second length ({LENGTH + 17}), first step",
        (time.perf_counter() - start) * 1000,
    )

    meta = cpu_step_meta(args, "cpu_fp32_levers.py")
    out = HERE / "results" / "cpu_fp32_levers.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "breakdown": breakdown, "rows": rows}, indent=2))

    print(f"\n{meta['date']}, {meta['cpu_class']}, {args.threads} threads: `{meta['command']}`")
    print("| kind of kernel | share of an fp32 step |\n|---|---|")
    for kind, share in breakdown:
        print(f"| {kind} | {share:.0%} |")
    base = rows[0]["step_ms"]
    print(f"\n| lever (batch {BATCH} x {LENGTH}) | fp32 step ms | vs all trained |\n|---|---|---|")
    for r in rows:
        extra = f" (compile: {r['compile_s']} s)" if "compile_s" in r else ""
        print(f"| {r['lever']}{extra} | {r['step_ms']:.0f} | {base / r['step_ms']:.2f}x |")


if __name__ == "__main__":
    main()
