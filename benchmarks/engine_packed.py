"""The generation engine alone (no HTTP) with and without serving's packed linear layers
(tuneforge/serve/packed_linear.py): SmolLM2-135M greedy, 128 requests of 24-71 tokens joining a 32-row batch (the
workload of engine_slots.py), two copies of the model in one process, alternating --rounds times so that the
machine's drift hits both; the greedy answers compared (fp32: packed computes the same sums in another order).

    python benchmarks/engine_packed.py [--rounds 3] [--dtype float32|bfloat16]

First the verdict of each distinct linear shape (the start-up timing `tuneforge serve` runs: packed and plain ms at
32 rows), then one JSON line per run and a summary. Writes benchmarks/results/engine_packed-DTYPE.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from _machine import machine_meta
from engine_slots import run
from tuneforge.generate import Generator
from tuneforge.running_batch import SlotBatch
from tuneforge.serve.engine import SamplingParams
from tuneforge.serve.packed_linear import PackedLinear, fastest_time, pack_linear_layers
from tuneforge.tasks.clm import bundled_smollm2

HERE = Path(__file__).resolve().parent


def shape_timings(model, rows: int) -> list[dict]:
    """Per distinct linear shape: plain and packed ms for `rows` rows (the verdict's inputs)."""
    seen, out = set(), []
    for layer in model.modules():
        key = (getattr(layer, "in_features", None), getattr(layer, "out_features", None))
        if type(layer) is not torch.nn.Linear or key in seen:
            continue
        seen.add(key)
        x = torch.randn(rows, layer.in_features, dtype=layer.weight.dtype)
        packed = PackedLinear(layer, rows)
        with torch.inference_mode():
            plain_s = fastest_time(lambda layer=layer, x=x: layer(x))
            packed_s = fastest_time(lambda packed=packed, x=x: packed(x))
        out.append({"shape": list(key), "plain_ms": round(plain_s * 1e3, 3), "packed_ms": round(packed_s * 1e3, 3)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    plain, packed = (Generator(bundled_smollm2()) for _ in range(2))
    for g in (plain, packed):
        g.model.to(dtype)
    shapes = shape_timings(plain.model, 32)
    print(json.dumps({"shapes": shapes}))
    began = time.perf_counter()
    swapped = pack_linear_layers(packed.model, 32)
    print(json.dumps({"packed_layers": swapped, "decided_in_s": round(time.perf_counter() - began, 2)}))
    prompts = [plain.encode_prompt(f"The history of the city number {i} begins") for i in range(128)]
    params = [SamplingParams(max_tokens=24 + (i * 7) % 48, temperature=0, ignore_eos=True) for i in range(128)]
    rates: dict[str, list[float]] = {"plain": [], "packed": []}
    answers = {}
    for _ in range(args.rounds):
        for name, g in (("plain", plain), ("packed", packed)):
            rate, answers[name] = run(g, SlotBatch, prompts, params)
            rates[name].append(round(rate, 1))
            print(json.dumps({"engine": name, "tokens_per_s": round(rate, 1)}), flush=True)
    medians = {name: statistics.median(r) for name, r in rates.items()}
    summary = {
        "median_tokens_per_s": medians,
        "speedup": round(medians["packed"] / medians["plain"], 2),
        "same_answers": sum(a == b for a, b in zip(answers["plain"], answers["packed"])),
    }
    print(json.dumps(summary))
    meta = machine_meta(dtype=args.dtype, rounds=args.rounds, threads=torch.get_num_threads())
    result = {"meta": meta, "shapes": shapes, "packed_layers": swapped, "rates": rates, **summary}
    (HERE / "results" / f"engine_packed-{args.dtype}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
