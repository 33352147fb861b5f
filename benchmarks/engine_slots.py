"""The generation engine alone (no HTTP), SmolLM2-135M greedy, 128 requests of 24-71 tokens joining a 32-row batch
as rows finish: the slotted batch (running_batch.SlotBatch: a slot per row, newcomers' prompts in the running
rows' forward pass) against the left-padded one it replaced for Llama-family models (running_batch.CausalBatch),
at each precision, alternating so that the machine's drift hits both. Also the greedy answers of the two compared
(fp32: identical expected; bf16 rounds differently in the two attentions, so a few answers part after a while).

    python benchmarks/engine_slots.py [--rounds 2]

Prints one JSON line per measurement and a summary line per precision (the median tokens/s of each batch), and
the bound no decode step of 32 rows can beat here: the model's linear layers alone (tokens/s = 32 / their time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tuneforge.generate import Generator
from tuneforge.running_batch import CausalBatch, SlotBatch
from tuneforge.serve.engine import GenerationEngine, SamplingParams
from tuneforge.tasks.clm import bundled_smollm2


def run(generator: Generator, batch_type, prompts, params) -> tuple[float, list[list[int]]]:
    engine = GenerationEngine(generator, max_batch_size=32)
    engine.batch = batch_type(generator.model, engine.batch.pad_id)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    began = time.perf_counter()
    out = engine.generate(prompts, params)
    took = time.perf_counter() - began
    return sum(len(c.token_ids) for c in out) / took, [c.token_ids for c in out]


def linear_floor(model, rows: int = 32, repeats: int = 5) -> float:
    """The tokens/s bound of any decode step of `rows` rows with this model on this machine: every linear layer of
    the model (the output layer included) applied to `rows` inputs, nothing else (no attention, no norms)."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=m.weight.dtype) for m in layers}
    with torch.inference_mode():
        for m in layers:
            m(inputs[m.in_features])
        began = time.perf_counter()
        for _ in range(repeats):
            for m in layers:
                m(inputs[m.in_features])
    return rows / ((time.perf_counter() - began) / repeats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    generator = Generator(bundled_smollm2())
    prompts = [generator.encode_prompt(f"The history of the city number {i} begins") for i in range(128)]
    params = [SamplingParams(max_tokens=24 + (i * 7) % 48, temperature=0, ignore_eos=True) for i in range(128)]
    for dtype in (torch.bfloat16, torch.float32):
        generator.model.to(dtype)
        rates: dict[str, list[float]] = {"CausalBatch": [], "SlotBatch": []}
        answers = {}
        for _ in range(args.rounds):
            for batch_type in (CausalBatch, SlotBatch):
                rate, answers[batch_type.__name__] = run(generator, batch_type, prompts, params)
                rates[batch_type.__name__].append(rate)
                print(json.dumps({"dtype": str(dtype), "batch": batch_type.__name__, "tokens_per_s": round(rate, 1)}))
        floor = round(linear_floor(generator.model), 1)
        print(json.dumps({"dtype": str(dtype), "linear layers alone, 32 rows: tokens_per_s bound": floor}))
        same = sum(a == b for a, b in zip(answers["CausalBatch"], answers["SlotBatch"]))
        medians = {name: round(statistics.median(r), 1) for name, r in rates.items()}
        speedup = round(medians["SlotBatch"] / medians["CausalBatch"], 2)
        summary = {"dtype": str(dtype), "median_tokens_per_s": medians, "speedup": speedup, "same_answers": same}
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
