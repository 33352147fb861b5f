"""Samples/s of each tuneforge backend on MRPC/MiniLM with 2 CPU processes, side by side with
transformers.Trainer + DDP set the same way (global batch 16, fp32, random batches, max length 128).

Throughput is steady state: measured from the metrics.jsonl timestamps between step `--skip`
and the last step (start-up, tokenization and the final evaluation excluded), the same window
for the peer (a step-end callback).

    python benchmarks/backends.py --data-dir ../shared/data/glue/MRPC --max-steps 40
"""

import argparse
import json
import platform
import subprocess
import sys
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = {  # flags of each run, split on spaces
    "single (1 process, batch 16)": "--backend single --batch-size 16",
    "ddp (2x8)": "--backend ddp --nproc 2 --batch-size 8",
    "fsdp (2x8)": "--backend fsdp --nproc 2 --batch-size 8",
    "deepspeed zero-1 (2x8)": "--backend deepspeed --zero-stage 1 --nproc 2 --batch-size 8",
    "deepspeed zero-2 (2x8)": "--backend deepspeed --zero-stage 2 --nproc 2 --batch-size 8",
    "deepspeed zero-3 (2x8)": "--backend deepspeed --zero-stage 3 --nproc 2 --batch-size 8",
    "deepspeed zero-3 + offload optimizer (2x8)": "--backend deepspeed --zero-stage 3 --offload optimizer --nproc 2 "
    "--batch-size 8",
    "tp (2-way, batch 16)": "--backend tp --tp-size 2 --nproc 2 --batch-size 16",
}


def tuneforge_run(name, extra, args):
    out = Path("/tmp/bench-backends") / name.split()[0].replace("/", "_")
    extra = extra.split()
    fixed = "--task glue/mrpc --logging-steps 1 --precision fp32 --no-group-by-length --lr 5e-5 --eval-strategy no "
    fixed += "--max-eval-samples 16 --max-length 128 --overwrite --quiet --json"
    fixed += " --freeze-layers 0 --freeze-embeddings off"  # every weight trains, as under the peer
    output_dir = str(out) + "-" + "-".join(extra[1:4])
    cmd = [str(Path(sys.executable).parent / "tuneforge"), "train", *fixed.split(), "--output-dir", output_dir]
    cmd += ["--data-dir", args.data_dir, "--max-steps", str(args.max_steps), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    run_dir = json.loads(proc.stdout.strip().splitlines()[-1])["output_dir"]
    logs = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r["time_s"] for r in logs if r["split"] == "train"}
    secs = train[args.max_steps] - train[args.skip]
    return {"samples_per_s": round((args.max_steps - args.skip) * 16 / secs, 2), "command": " ".join(cmd)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default=str(HERE.parent.parent / "shared/data/glue/MRPC"))
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=None, help="substrings of variant names to run")
    args = ap.parse_args()
    rows = {}
    hf_cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        str(HERE / "hf_trainer_ddp_mrpc.py"),
        "--data-dir",
        args.data_dir,
        "--max-steps",
        str(args.max_steps + 1),
        "--skip",
        str(args.skip),
    ]
    proc = subprocess.run(
        hf_cmd, capture_output=True, text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    )
    rows["transformers.Trainer + DDP (2x8)"] = (
        json.loads(proc.stdout.strip().splitlines()[-1])
        if proc.returncode == 0
        else {"error": proc.stderr.strip().splitlines()[-1]}
    )
    print(f"peer: {rows['transformers.Trainer + DDP (2x8)']}", file=sys.stderr, flush=True)
    for name, extra in VARIANTS.items():
        if args.only and not any(s in name for s in args.only):
            continue
        rows[name] = tuneforge_run(name, extra, args)
        print(f"{name}: {rows[name]}", file=sys.stderr, flush=True)
    meta = {
        "date": str(date.today()),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        "max_steps": args.max_steps,
        "skip": args.skip,
    }
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "backends.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print("| run | samples/s |\n|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r.get('samples_per_s', r.get('error'))} |")


if __name__ == "__main__":
    main()
