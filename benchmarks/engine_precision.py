"""The generation engine alone (no HTTP), SmolLM2-135M greedy: fp32 against bf16 weights (`tuneforge serve
--precision`), (a) 32 rows that start and end together (48 tokens each), (b) 128 requests of 24-71 tokens joining
a 32-row batch as rows finish, with the share of time in the model's forward (cProfile).

    python benchmarks/engine_precision.py

Prints one JSON line per measurement: tokens/s, and for (b) the seconds in the model's forward, its linear layers
and the decode steps and prefills run.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import time

import torch

from tuneforge.generate import Generator
from tuneforge.serve.engine import GenerationEngine, SamplingParams
from tuneforge.tasks.clm import bundled_smollm2


def tokens_per_s(engine: GenerationEngine, prompts, params) -> tuple[float, float]:
    began = time.perf_counter()
    out = engine.generate(prompts, params)
    took = time.perf_counter() - began
    return sum(len(c.token_ids) for c in out) / took, took


def profiled(engine: GenerationEngine, prompts, params) -> dict:
    profile = cProfile.Profile()
    profile.enable()
    rate, took = tokens_per_s(engine, prompts, params)
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
    out = {"tokens_per_s": round(rate, 1), "s": round(took, 1)}
    for (file, _, name), (_, calls, tottime, cumtime, _) in stats.items():
        if name == "forward" and file.endswith("modeling_llama.py"):  # the outermost one: the whole model
            out["forward_s"] = round(max(out.get("forward_s", 0.0), cumtime), 1)
        elif name == "<built-in method torch._C._nn.linear>":
            out["linear_s"] = round(tottime, 1)
        elif name in ("decode", "prefill") and file.endswith("running_batch.py"):
            out[f"{name}_calls"] = calls
    return out


def main() -> None:
    generator = Generator(bundled_smollm2())
    together = [generator.encode_prompt(f"The history of the city number {i} begins") for i in range(32)]
    joining = [generator.encode_prompt(f"The history of the city number {i} begins") for i in range(128)]
    lengths = [SamplingParams(max_tokens=24 + (i * 7) % 48, temperature=0, ignore_eos=True) for i in range(128)]
    for dtype in (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16):
        generator.model.to(dtype)
        engine = GenerationEngine(generator, max_batch_size=32)
        engine.generate(together[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        rate, _ = tokens_per_s(engine, together, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
        print(json.dumps({"dtype": str(dtype), "rows start together": round(rate, 1)}), flush=True)
    print(json.dumps({"dtype": "torch.bfloat16", "requests joining": profiled(engine, joining, lengths)}), flush=True)


if __name__ == "__main__":
    main()
