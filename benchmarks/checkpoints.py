"""Checkpoint save/load time and size for MiniLM (MRPC) per backend, and mid-epoch resume
start-up vs transformers.Trainer resuming to the same step.

    python benchmarks/checkpoints.py --data-dir ../shared/data/glue/MRPC
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
BACKENDS = {  # flags of each run, split on spaces
    "single": "--backend single --batch-size 16",
    "ddp (2 proc)": "--backend ddp --nproc 2 --batch-size 8",
    "fsdp (2 proc)": "--backend fsdp --nproc 2 --batch-size 8",
    "deepspeed zero-3 (2 proc)": "--backend deepspeed --zero-stage 3 --nproc 2 --batch-size 8",
    "tp (2 proc)": "--backend tp --tp-size 2 --nproc 2 --batch-size 16",
}


def tf(args, out, extra, timings):
    fixed = "train --task glue/mrpc --precision fp32 --eval-strategy no --max-eval-samples 16 --logging-steps 1 "
    fixed += "--quiet --json --freeze-layers 0 --freeze-embeddings off"  # every weight trains, as under the peer
    cmd = [sys.executable, str(HERE / "_timed_tuneforge.py"), *fixed.split(), "--data-dir", args.data_dir]
    cmd += ["--output-dir", str(out), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TUNEFORGE_TIMINGS": str(timings)})
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    return time.perf_counter() - t0


def du(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default=str(HERE.parent.parent / "shared/data/glue/MRPC"))
    ap.add_argument("--resume-step", type=int, default=100)
    ap.add_argument("--resume-only", action="store_true", help="reuse the per-backend rows of the last run")
    args = ap.parse_args()
    root = Path("/tmp/bench-ckpt")
    saved = root / "backend-rows.json"
    rows = json.loads(saved.read_text()) if args.resume_only else {}
    for name, flags in ({} if args.resume_only else BACKENDS).items():
        extra = flags.split()
        out = root / name.split()[0]
        timings = root / f"{name.split()[0]}.jsonl"
        timings.unlink(missing_ok=True)
        tf(
            args,
            out,
            [*extra, "--max-steps", "2", "--save-steps", "1", "--save-strategy", "steps", "--overwrite"],
            timings,
        )
        tf(args, out, [*extra, "--max-steps", "3", "--resume", str(out / "checkpoint-1")], timings)
        t = [json.loads(x) for x in timings.read_text().splitlines()]
        rows[name] = {
            "save_s": [x["save_s"] for x in t if "save_s" in x][0],
            "load_s": [x["load_s"] for x in t if "load_s" in x][0],
            "size_mb": round(du(out / "checkpoint-1") / 2**20, 1),
        }
        print(name, rows[name], file=sys.stderr, flush=True)
    saved.write_text(json.dumps(rows))
    # mid-epoch resume start-up: both resume from step N of epoch 1 (batch 8) and train one more step
    k = args.resume_step
    base = ["--batch-size", "8", "--no-group-by-length", "--max-length", "512"]
    out = root / "resume"
    tf(
        args,
        out,
        [*base, "--max-steps", str(k), "--save-steps", str(k), "--save-strategy", "steps", "--overwrite"],
        root / "r.jsonl",
    )
    tf_wall = tf(
        args, out, [*base, "--max-steps", str(k + 1), "--resume", str(out / f"checkpoint-{k}")], root / "r.jsonl"
    )
    hf = [sys.executable, str(HERE / "hf_trainer_resume.py"), "--data-dir", args.data_dir, "--step", str(k)]
    subprocess.run([*hf, "--phase", "save"], check=True, capture_output=True)
    t0 = time.perf_counter()
    subprocess.run([*hf, "--phase", "resume"], check=True, capture_output=True)
    hf_wall = time.perf_counter() - t0
    rows["resume"] = {"step": k, "tuneforge_s": round(tf_wall, 1), "transformers_s": round(hf_wall, 1)}
    meta = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "checkpoints.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
