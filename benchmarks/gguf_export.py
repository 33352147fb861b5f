"""GGUF export of SmolLM2-135M: `tuneforge export --format gguf` at f16, q8_0 and q4_0, each file loaded back with
transformers' GGUF loader and compared with the source model on WikiText-2 test perplexity and greedy output.

    python benchmarks/gguf_export.py --data ../shared/data/wikitext-2/test.txt --tokens 20480 --window 512

The source is the bundled SmolLM2-135M-Instruct (its Q4_1 GGUF read by transformers and saved once as an fp32 HF
folder, tuneforge.tasks.clm.bundled_smollm2). Reports, for the source and each file:
  - perplexity on the first --tokens tokens of test.txt (the source tokenizer's ids, the same ids for every model),
    in non-overlapping --window-token windows, each scored on its own (window - 1 predictions per window);
  - greedy output (--new-tokens, on fixed prompts) identical to the source's or not;
  - whether the GGUF's tokenizer gives the same ids on the scored text;
  - file size, and the export's wall time (the whole `tuneforge export` process, start-up included).
transformers dequantizes every GGUF tensor to fp32 on load: the perplexity measures the quantized weights' values
(q4_0's rounding), run in fp32, not llama.cpp's kernels. Writes benchmarks/results/gguf_export.json and prints
markdown rows.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village,",
]


def perplexity(model, ids: torch.Tensor, window: int, batch: int) -> float:
    """exp(mean next-token loss) over `ids` cut into windows of `window` tokens, each scored alone."""
    windows = ids[: len(ids) // window * window].view(-1, window)
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(windows), batch):
            chunk = windows[start : start + batch]
            logits = model(chunk).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))
            total += loss.item() * chunk[:, 1:].numel()
            count += chunk[:, 1:].numel()
    return math.exp(total / count)


def greedy(model, tokenizer, new_tokens: int) -> list[list[int]]:
    answers = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            answers.append(out[0, ids.shape[1] :].tolist())
    return answers


def export(source: str, out: Path, quant: str) -> float:
    """Wall seconds of the whole `tuneforge export SOURCE OUT --format gguf --quant QUANT` process."""
    command = [sys.executable, "-m", "tuneforge.cli", "export", source, str(out), "--format", "gguf"]
    start = time.perf_counter()
    subprocess.run([*command, "--quant", quant, "--overwrite"], check=True, capture_output=True)
    return time.perf_counter() - start


def score(model, tokenizer, ids, args, want_greedy=None) -> dict:
    start = time.perf_counter()
    ppl = perplexity(model, ids, args.window, args.batch)
    answers = greedy(model, tokenizer, args.new_tokens)
    row = {"perplexity": round(ppl, 4), "eval_s": round(time.perf_counter() - start, 1)}
    if want_greedy is not None:
        row["greedy_identical"] = sum(a == b for a, b in zip(answers, want_greedy))
    return row, answers


def write_report(rows: dict, args, source: str) -> None:
    """benchmarks/results/gguf_export.json and the markdown rows, each row's perplexity against the source's."""
    from _machine import machine_meta

    base = rows["source (fp32 HF folder)"]["perplexity"]
    for row in rows.values():
        row["vs_source_pct"] = round(100 * (row["perplexity"] / base - 1), 2)
    command = (
        f"python benchmarks/gguf_export.py --data {args.data} --tokens {args.tokens} --window {args.window} "
        f"--quants {' '.join(args.quants)}"
    )
    result = machine_meta(command=command, source=source, prompts=len(PROMPTS), rows=rows, **vars(args))
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "gguf_export.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n`{command}`\n")
    print("| model | file MB | export s | perplexity | vs source | greedy identical | same token ids |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        greedy_cell = f"{row['greedy_identical']}/{len(PROMPTS)}" if "greedy_identical" in row else "-"
        print(
            f"| {name} | {row.get('mb', '-')} | {row.get('export_s', '-')} | {row['perplexity']:.3f} | "
            f"{row['vs_source_pct']:+.2f}% | {greedy_cell} | {row.get('same_token_ids', '-')} |"
        )


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tuneforge.tasks.clm import bundled_smollm2

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data/wikitext-2/test.txt")
    ap.add_argument("--tokens", type=int, default=20480, help="score the first N tokens of the file")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8, help="windows per forward pass")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--quants", nargs="+", default=["f16", "q8_0", "q4_0"])
    ap.add_argument("--out-dir", default="runs/bench-gguf")
    args = ap.parse_args()
    torch.manual_seed(0)

    source = bundled_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(source)
    text = Path(args.data).read_text(encoding="utf-8")[: args.tokens * 8]  # ample characters for N tokens
    ids = torch.tensor(tokenizer(text).input_ids[: args.tokens])
    assert len(ids) == args.tokens, f"{args.data} holds fewer than {args.tokens} tokens"
    scored_text = tokenizer.decode(ids)

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    rows = {}
    rows["source (fp32 HF folder)"], want = score(model, tokenizer, ids, args)
    del model
    out_dir = Path(args.out_dir)
    for quant in args.quants:
        path = out_dir / f"smollm2-135m-{quant}.gguf"
        seconds = export(source, path, quant)
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(out_dir, gguf_file=path.name, dtype=torch.float32).eval()
        load_s = time.perf_counter() - start
        gguf_tokenizer = AutoTokenizer.from_pretrained(out_dir, gguf_file=path.name)
        row, _ = score(model, tokenizer, ids, args, want_greedy=want)
        row.update(
            export_s=round(seconds, 1),
            load_s=round(load_s, 1),
            mb=round(path.stat().st_size / 1e6, 1),
            same_token_ids=gguf_tokenizer(scored_text).input_ids == tokenizer(scored_text).input_ids,
        )
        rows[quant] = row
        del model
        print(quant, row, flush=True)

    write_report(rows, args, source)


if __name__ == "__main__":
    main()
