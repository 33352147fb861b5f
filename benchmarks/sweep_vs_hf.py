"""`tuneforge sweep` against transformers' `Trainer.hyperparameter_search` (Optuna backend) on MRPC, bundled MiniLM.

The same search space (benchmarks/sweep-space-mrpc.yaml = hf_hpsearch_mrpc.py's hp_space), the same number of
trials, TPE with the same seed, the median pruner with the same start-up trials and warm-up, an evaluation every
--eval-steps steps feeding it, batch 32, the dev F1 of each trial's final model as the objective. Each side is one
whole process, timed from its start to its end. Then, unless --no-resume-check: a second tuneforge sweep with the
same seed is SIGKILLed (its process group) once trial --kill-at has written a checkpoint, resumed with --resume, and
its trials (params, values, states) compared with the uninterrupted sweep's.

    python benchmarks/sweep_vs_hf.py --data-dir ../shared/data/glue/MRPC --out /tmp/sweep-bench --trials 6
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna

from _machine import machine_meta

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def timed(cmd: list[str], log: Path) -> tuple[float, str]:
    t0 = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO)
    if proc.returncode:
        sys.exit(f"{cmd[:3]} failed ({proc.returncode}); see {log}")
    return time.perf_counter() - t0, proc.stdout


def sweep_command(args, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "tuneforge.cli", "sweep", "configs/glue-mrpc.yaml",
        f"data.data_dir={args.data_dir}", "batch_size=32", "eval_strategy=steps", f"eval_steps={args.eval_steps}",
        "--space", str(HERE / "sweep-space-mrpc.yaml"), "--trials", str(args.trials), "--seed", str(args.seed),
        "--metric", "f1", "--direction", "maximize", "--pruner", "median", "--prune-startup-trials", "2",
        "--prune-warmup-steps", str(args.eval_steps), "--parallel", str(args.parallel), "--output-dir", str(out),
        *extra,
    ]  # fmt: skip


def study_trials(out: Path) -> list[dict]:
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out}/study.db")
    return [
        {"number": t.number, "state": t.state.name, "value": t.value, "params": t.params, "steps": t.last_step}
        for t in study.trials
    ]


def best_of(trials: list[dict]) -> dict:
    done = [t for t in trials if t["state"] == "COMPLETE"]
    return max(done, key=lambda t: t["value"])


def killed_and_resumed(args, out: Path) -> dict:
    """A sweep SIGKILLed once trial `kill_at` has a checkpoint, then --resume'd: its trials and times."""
    target = out / f"trial-{args.kill_at:04d}"
    with open(out.parent / "tuneforge-killed.log", "w") as err:
        proc = subprocess.Popen(sweep_command(args, out), stdout=subprocess.DEVNULL, stderr=err, cwd=REPO,
                                start_new_session=True)  # fmt: skip
        while proc.poll() is None and not any(target.glob("checkpoint-*")):
            time.sleep(0.5)
        if proc.poll() is not None:
            return {"error": f"the sweep ended before trial {args.kill_at} wrote a checkpoint (a pruned trial's go)"}
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    resumed_s, _ = timed(sweep_command(args, out, "--resume"), out.parent / "tuneforge-resumed.log")
    log = (target / "sweep-trial.log").read_text() if (target / "sweep-trial.log").exists() else ""
    resumed = "resumed from" in log
    return {"trials": study_trials(out), "resume_s": round(resumed_s, 1), "trial_log_says_resumed": resumed}


def compared(again: dict, reference: list[dict]) -> dict:
    """The killed-and-resumed sweep against the uninterrupted one's trials."""
    if "error" in again:
        return again
    key = lambda trials: [(t["params"], t["value"], t["state"]) for t in trials]  # noqa: E731
    return {
        **again,
        "same_trials_as_uninterrupted": key(again["trials"]) == key(reference),
        "best": best_of(again["trials"]),
    }


def resume_check_only(args, out: Path) -> None:
    reference = study_trials(Path(args.reference).resolve())
    result = {**machine_meta(), "reference": str(args.reference), "kill_at": args.kill_at}
    result["killed_and_resumed"] = compared(killed_and_resumed(args, out / "tuneforge-killed"), reference)
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--eval-steps", type=int, default=40)
    ap.add_argument("--parallel", type=int, default=1, help="tuneforge's trials at once (each on cores/N threads)")
    ap.add_argument("--kill-at", type=int, default=2, help="the trial during which the second sweep is killed")
    ap.add_argument("--reference", help="resume check only, against this uninterrupted sweep folder")
    ap.add_argument("--only", choices=["both", "tuneforge", "peer"], default="both")
    ap.add_argument("--no-resume-check", action="store_true")
    args = ap.parse_args()
    args.data_dir = str(Path(args.data_dir).resolve())
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=False)
    if args.reference:
        return resume_check_only(args, out)
    result = {**machine_meta(), "trials": args.trials, "seed": args.seed, "eval_steps": args.eval_steps}
    result["tuneforge_parallel"] = args.parallel
    if args.only in ("both", "tuneforge"):
        wall, _ = timed(sweep_command(args, out / "tuneforge"), out / "tuneforge.log")
        trials = study_trials(out / "tuneforge")
        result["tuneforge"] = {"wall_s": round(wall, 1), "best": best_of(trials), "trials": trials}
        (out / "result.json").write_text(json.dumps(result, indent=2))  # each phase kept as it ends
    if args.only in ("both", "peer"):
        cmd = [sys.executable, str(HERE / "hf_hpsearch_mrpc.py"), "--data-dir", args.data_dir, "--output-dir",
               str(out / "peer"), "--trials", str(args.trials), "--seed", str(args.seed), "--eval-steps",
               str(args.eval_steps)]  # fmt: skip
        wall, stdout = timed(cmd, out / "peer.log")
        peer = json.loads(stdout.strip().splitlines()[-1])
        result["peer"] = {"wall_s": round(wall, 1), "best": best_of(peer["trials"]), "trials": peer["trials"]}
        (out / "result.json").write_text(json.dumps(result, indent=2))
    if args.only in ("both", "tuneforge") and not args.no_resume_check:
        result["killed_and_resumed"] = compared(killed_and_resumed(args, out / "tuneforge-killed"), trials)
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
