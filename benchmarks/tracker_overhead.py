"""What trackers cost a training run: MRPC with the bundled MiniLM, metrics.jsonl alone against MLflow (a real
`mlflow server` on 127.0.0.1, SQLite store) plus TensorBoard, steps/s of the training steps.

Each variant is a whole `tuneforge train` process; the variants alternate, --rounds rounds. Steps/s is taken between
the first and the last training log line (metrics.jsonl's time_s), so start-up, evaluation and export are left out
and every logged step's tracker work is in. --logging-steps 1 (the default here) is the tracker's worst case: a log
line every step (tuneforge's default is 20).

    python benchmarks/tracker_overhead.py --data-dir ../shared/data/glue/MRPC --out /tmp/tracker-bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from _machine import machine_meta

REPO = Path(__file__).resolve().parent.parent


@contextmanager
def mlflow_server(root: Path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    command = [mlflow, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "art")]
    with open(root / "mlflow-server.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def train(args, out: Path, trackers: list[str], url: str) -> dict:
    cmd = [sys.executable, "-m", "tuneforge.cli", "train", "configs/glue-mrpc.yaml", f"data.data_dir={args.data_dir}"]
    cmd += ["--max-steps", str(args.steps), "--logging-steps", str(args.logging_steps), "--eval-strategy", "no"]
    cmd += ["--report-to", ",".join(trackers), "--output-dir", str(out), "--quiet", "--json"]
    cmd += ["--tracking-uri", url] if "mlflow" in trackers else []
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    train_lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_lines = [r for r in train_lines if r.get("split") == "train"]
    first, last = train_lines[0], train_lines[-1]
    return {"steps_per_s": (last["step"] - first["step"]) / (last["time_s"] - first["time_s"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--logging-steps", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    args.data_dir = str(Path(args.data_dir).resolve())
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=False)
    variants = {"jsonl": ["jsonl"], "mlflow+tensorboard": ["jsonl", "mlflow", "tensorboard"]}
    rows: dict[str, list[float]] = {name: [] for name in variants}
    with mlflow_server(out) as url:
        for r in range(args.rounds):
            for name, trackers in variants.items():
                got = train(args, out / f"{name}-{r}", trackers, url)
                rows[name].append(got["steps_per_s"])
                print(f"round {r} {name}: {got['steps_per_s']:.3f} steps/s", file=sys.stderr, flush=True)
    means = {name: statistics.mean(v) for name, v in rows.items()}
    result = {
        **machine_meta(),
        "steps": args.steps,
        "logging_steps": args.logging_steps,
        "steps_per_s": rows,
        "mean_steps_per_s": means,
        "tracked_vs_plain": means["mlflow+tensorboard"] / means["jsonl"],
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
