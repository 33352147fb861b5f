"""Time to quality on MRPC: dev scores of schedules and frozen layers, as means over seeds.

Each point is `tuneforge train --task glue/mrpc` with the given flags, once per seed; two runs at a
time on one thread each (a 2-core machine), so the wall times here are for comparing points, not
for end-to-end claims (mrpc_vs_hf_trainer.py makes those).

    python benchmarks/mrpc_schedule_sweep.py --data-dir ../shared/data/glue/MRPC --seeds 1 2 3 \\
        --point "--epochs 2 --lr 8e-5 --freeze-layers 0 --freeze-embeddings off" --point "--epochs 2 --lr 8e-5" \\
        --point "--epochs 2 --lr 8e-5 --freeze-layers 2" --precision fp32

Writes benchmarks/results/mrpc_schedule_sweep.json (appending to the points already there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _machine import machine_meta

HERE = Path(__file__).resolve().parent


def one_run(data_dir: str, point: str, seed: int, precision: str) -> dict:
    out = f"/tmp/sweep-mrpc/{abs(hash(point))}-{seed}"
    cmd = [str(Path(sys.executable).parent / "tuneforge"), "train", "--task", "glue/mrpc", "--data-dir", data_dir]
    cmd += [*point.split(), "--seed", str(seed), "--precision", precision, "--output-dir", out]
    cmd += ["--overwrite", "--json", "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    wall = round(time.perf_counter() - t0, 1)
    return {"point": point, "seed": seed, "wall_s": wall, "accuracy": result["accuracy"], "f1": result["f1"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(HERE.parent.parent / "shared/data/glue/MRPC"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--point", action="append", required=True, help="the flags of one point, quoted")
    ap.add_argument("--precision", default="bf16", help="bf16 sweeps 3.5x faster on a bf16 CPU")
    args = ap.parse_args()
    jobs = [(p, s) for p in args.point for s in args.seeds]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda job: one_run(args.data_dir, job[0], job[1], args.precision), jobs))

    out = HERE / "results" / "mrpc_schedule_sweep.json"
    saved = json.loads(out.read_text()) if out.exists() else {"points": []}
    print(f"| point ({args.precision}) | seeds | dev accuracy (mean) | dev F1 (mean) | per seed (acc / F1) |")
    print("|---|---|---|---|---|")
    for point in args.point:
        mine = [r for r in runs if r["point"] == point]
        acc, f1 = (sum(r[k] for r in mine) / len(mine) for k in ("accuracy", "f1"))
        per_seed = ", ".join(f"{r['accuracy']:.3f} / {r['f1']:.3f}" for r in mine)
        print(f"| `{point}` | {' '.join(map(str, args.seeds))} | {acc:.3f} | {f1:.3f} | {per_seed} |")
        saved["points"].append(
            {
                "point": point,
                "precision": args.precision,
                **machine_meta(),
                "runs": mine,
                "accuracy": round(acc, 4),
                "f1": round(f1, 4),
            }
        )
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(saved, indent=2))


if __name__ == "__main__":
    main()
