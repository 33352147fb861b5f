"""lm-evaluation-harness on SmolLM2-135M two ways: in-process (`tuneforge eval --harness`'s HFLM) and through
`tuneforge serve` with the harness's own `local-completions` model (token-id prompts, echo, logprobs). Same tasks,
same rows: the scores and the wall time of each.

    python benchmarks/harness_served.py --tasks piqa --limit 300

Tasks read their data from ../shared/data (PIQA's validation split; --tasks piqa,gsm8k adds GSM8K's test split,
generated greedily, --max-gen-toks tokens). The server is a `tuneforge serve --precision fp32` process on 127.0.0.1
(fp32 as the in-process model: the same log-probs, so the same scores are expected; its start-up
is not timed; its first request is); local-completions sends --concurrent requests at a time, each a batch of
--batch-size prompts. Writes benchmarks/results/harness_served.json and prints markdown rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import machine_meta  # noqa: E402
from serve_load import free_port, start, stop  # noqa: E402

DATA = HERE.parent.parent / "shared" / "data"


def scores(results: dict) -> dict:
    return {
        task: {k: round(v, 4) for k, v in metrics.items() if isinstance(v, float) and "stderr" not in k}
        for task, metrics in results["results"].items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a causal LM folder (default: the bundled SmolLM2-135M)")
    ap.add_argument("--tasks", default="piqa")
    ap.add_argument("--limit", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--max-gen-toks", type=int, default=128)
    ap.add_argument("--out", default=str(HERE / "results" / "harness_served.json"))
    args = ap.parse_args()

    from tuneforge.harness.evaluate import load_lm, run_harness
    from tuneforge.harness.options import HarnessSettings
    from tuneforge.tasks.clm import bundled_smollm2

    model = args.model or bundled_smollm2()
    tasks = args.tasks.split(",")
    settings = HarnessSettings(
        tasks=tasks,
        data={t: str(DATA / t) for t in tasks},
        limit=args.limit,
        batch_size=args.batch_size,
        max_gen_toks=args.max_gen_toks,
    )
    rows = {}
    began = time.perf_counter()
    in_process = run_harness(load_lm(model, args.batch_size), settings)
    rows["in-process (HFLM)"] = {"scores": scores(in_process), "wall_s": round(time.perf_counter() - began, 1)}

    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="harness-served-")) / "server.log"
    serve = [sys.executable, "-m", "tuneforge.cli", "serve", model, "--port", str(port), "--precision", "fp32"]
    proc = start(serve, port, log)
    try:
        began = time.perf_counter()
        served = run_harness(
            "local-completions",
            settings,
            model_args={
                "model": model,
                "base_url": f"http://127.0.0.1:{port}/v1/completions",
                "tokenizer": model,
                "tokenizer_backend": "huggingface",
                "num_concurrent": args.concurrent,
                "max_retries": 1,
                "timeout": 600,
            },
        )
        rows["tuneforge serve + local-completions"] = {
            "scores": scores(served),
            "wall_s": round(time.perf_counter() - began, 1),
        }
    finally:
        stop(proc)

    meta = machine_meta(command="python benchmarks/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    Path(args.out).write_text(json.dumps({"meta": meta, "model": model, "rows": rows}, indent=2) + "\n")
    print(json.dumps(meta))
    print(
        "| how | "
        + " | ".join(f"{t} {m}" for t in tasks for m in rows["in-process (HFLM)"]["scores"][t])
        + " | wall s |"
    )
    for name, row in rows.items():
        cells = [str(v) for t in tasks for v in row["scores"][t].values()]
        print(f"| {name} | " + " | ".join(cells) + f" | {row['wall_s']} |")


if __name__ == "__main__":
    main()
