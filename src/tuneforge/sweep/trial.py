"""One trial: its run folder (SWEEP_DIR/trial-NNNN, an ordinary `tuneforge train` run folder), the config it trains
with (sweep-trial.yaml there: the base config with the trial's values), the child process that trains it, what it has
evaluated so far (its metrics.jsonl, read while it runs) and its result (result.json).

The child is forked from the sweep process, which has loaded tuneforge and the libraries a trial uses already
(`warm_up`: a second start-up of Python, torch and transformers per trial would cost more than a small trial), and
trains as `tuneforge train sweep-trial.yaml --output-dir TRIAL [--resume latest | --overwrite]` does (that command is
the first line of its log): the config from the file and flags, the Trainer, its workers forked from the child where
the config asks for several processes (ddp and the others), an error as one `error:` line and its exit code. The child
leads its own process group (stopping a trial stops its workers too), ends with the sweep (Linux: it gets SIGTERM when
the sweep dies, even by SIGKILL) and writes its stdout and stderr to sweep-trial.log. The sweep process never sets up
CUDA, so a forked child can.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tuneforge import checkpoint
from tuneforge.files import write_text
from tuneforge.harness.options import is_harness_metric
from tuneforge.processes import end_with_parent
from tuneforge.reporting import METRICS_FILE, NOT_METRICS, read_metrics_lines

TRIAL_CONFIG = "sweep-trial.yaml"
TRIAL_LOG = "sweep-trial.log"
TRIAL_FILES = (TRIAL_CONFIG, TRIAL_LOG)  # what the sweep writes in a trial's run folder, beside the run's own
RESULT_FILE = "result.json"
STOP_GRACE_S = 10.0  # SIGTERM, then this long before SIGKILL
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}  # held by the sweep while it forks a trial


def trial_folder(sweep_dir: Path, number: int) -> Path:
    return Path(sweep_dir) / f"trial-{number:04d}"


def write_trial_config(folder: Path, values: dict[str, Any], number: int) -> Path:
    """folder/sweep-trial.yaml: the config this trial trains with (its output dir, --resume and --overwrite are the
    sweep's flags)."""
    folder.mkdir(parents=True, exist_ok=True)
    kept = {k: v for k, v in values.items() if k not in ("output_dir", "overwrite", "resume")}
    header = f"# trial {number} of a tuneforge sweep: the base config with this trial's values\n"
    write_text(folder / TRIAL_CONFIG, header + yaml.safe_dump(kept, sort_keys=False), durable=False)
    return folder / TRIAL_CONFIG


def with_checkpoints(values: dict[str, Any], eval_strategy: str, eval_steps: int | None) -> dict[str, Any]:
    """A trial's config values, saving a checkpoint at each evaluation (the newest kept) where they choose no saving
    of their own: an interrupted trial then resumes from its last evaluation, not from the start."""
    if eval_strategy == "no" or any(key in values for key in ("save_strategy", "save_steps")):
        return values
    saving = {"save_strategy": eval_strategy, "save_total_limit": values.get("save_total_limit", 1)}
    if eval_strategy == "steps":
        saving["save_steps"] = eval_steps
    return {**values, **saving}


def start_flags(folder: Path, interrupted: bool) -> dict[str, Any]:
    """The `tuneforge train` flags of a trial's run (config key -> value): its folder, and for an interrupted trial
    its last checkpoint to resume from, or (none saved) the run to start again over."""
    flags: dict[str, Any] = {"output_dir": str(folder)}
    if interrupted and checkpoint.list_checkpoints(folder):
        flags["resume"] = "latest"
    elif interrupted and checkpoint.holds_run(folder):
        flags["overwrite"] = True
    return flags


def command_line(folder: Path, flags: dict[str, Any]) -> str:
    """The `tuneforge train` command that trains as the child does."""
    words = ["tuneforge", "train", str(folder / TRIAL_CONFIG), "--output-dir", flags["output_dir"]]
    words += ["--resume", flags["resume"]] if "resume" in flags else ["--overwrite"] if "overwrite" in flags else []
    return " ".join(words)


@dataclass
class TrialProcess:
    """The `tuneforge train` child of a trial: the leader of its own process group."""

    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit code once it has ended (a signal: minus its number), else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its end is unknown
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def stop(self, grace: float = STOP_GRACE_S) -> int:
        """SIGTERM to its process group (the child and any workers it started), SIGKILL after `grace` seconds; then
        whatever of the group outlived its leader. Returns its exit code (minus the signal's number)."""
        signalled = False
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 30.0)):
            if self.poll() is not None:
                break
            signalled = True
            _signal_group(self.pid, sig)
            deadline = time.monotonic() + wait
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        if signalled:
            _signal_group(self.pid, signal.SIGKILL)
        return self.returncode if self.returncode is not None else -signal.SIGKILL


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # the group has ended
        pass


def start(folder: Path, flags: dict[str, Any], threads: int) -> TrialProcess:
    """Fork the child that trains the trial in `folder` with `flags` (start_flags), its output appended to
    folder/sweep-trial.log (headed by the command), with `threads` CPU threads (OMP_NUM_THREADS)."""
    log_path = folder / TRIAL_LOG
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    ended = not log_path.exists() or log_path.read_bytes()[-1:] in (b"", b"\n")  # a killed run's last line
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"{'' if ended else chr(10)}[{stamp}] {command_line(folder, flags)}\n")
    parent = os.getpid()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # the child never collects what it inherits
    try:
        pid = os.fork()
        if pid == 0:
            _child(folder / TRIAL_CONFIG, flags, log_fd, threads, parent)  # never returns
    finally:
        if os.getpid() == parent:
            gc.unfreeze()
            os.close(log_fd)
    try:
        os.setpgid(pid, pid)  # as the child does: whichever runs first
    except OSError:
        pass
    return TrialProcess(pid)


def _child(config_file: Path, flags: dict[str, Any], log_fd: int, threads: int, parent: int) -> None:
    """The forked child: its own process group, SIGTERM when the sweep dies, its output to the log; then the
    training. Leaves with os._exit, never through the sweep's exit handlers."""
    code = 1
    try:
        os.setpgid(0, 0)
        end_with_parent(parent)  # the sweep dies: so does the trial
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # (held while the sweep forked it)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for the workers a launch starts
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False, buffering=1)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", closefd=False, buffering=1)  # noqa: SIM115
        if "torch" in sys.modules:  # torch reads OMP_NUM_THREADS at its start-up only
            sys.modules["torch"].set_num_threads(threads)
        code = _train(config_file, flags)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code if isinstance(code, int) else 1)


def _train(config_file: Path, flags: dict[str, Any]) -> int:
    """What `tuneforge train CONFIG_FILE FLAGS` does (less its closing lines: the result is result.json); a user error
    is one `error:` line and its exit code."""
    from tuneforge.checkpoint import check_resumable
    from tuneforge.configure import config_from_sources
    from tuneforge.errors import UserError
    from tuneforge.trainer import Trainer

    try:
        config = config_from_sources(str(config_file), [], flags)
        if config.resume:
            check_resumable(config)
        Trainer(config, fork_workers=True).fit()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    return 0


def warm_up(config) -> None:
    """Import in the sweep process what each trial imports (the Trainer, the model's and tokenizer's classes,
    matplotlib for its plot), so that its forked children start in seconds. Never sets up CUDA, and never fails the
    sweep: what it cannot import, the trial imports itself."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401  (the run's plot.png)
    import transformers

    import tuneforge.trainer  # noqa: F401
    from tuneforge.tasks import get_task

    try:
        model_config = get_task(config).peek_model_config()
        for name in getattr(model_config, "architectures", None) or []:
            getattr(transformers, name, None)
        transformers.AutoTokenizer  # noqa: B018  (the tokenizers' modules)
    except Exception:  # noqa: BLE001  (an optimisation only: the trial itself reports any problem)
        pass


# ---- what a trial has written ----------------------------------------------------------------------------------
def metrics_size(folder: Path) -> int:
    """The size of the trial's metrics.jsonl (-1 before the run writes it): what tells a poll there is more to read."""
    path = folder / METRICS_FILE
    return path.stat().st_size if path.exists() else -1


def metric_value(value: object) -> bool:
    """A metric's value as a run's files hold it: a number, or null for one that is undefined (a nan computed)."""
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def evaluations(folder: Path, metric: str) -> list[tuple[int, float]]:
    """(step, value of `metric`) of each evaluation in the trial's metrics.jsonl so far, in order; an undefined
    value (null) as nan, which the pruners prune, as they did when runs wrote it as NaN. A resumed run cuts the file
    back to its checkpoint's records first, so this is always the run's own history."""
    out = []
    for line in read_metrics_lines(folder):  # none before the run writes the file
        try:
            record = json.loads(line)
        except ValueError:  # a line being written
            continue
        logged = record.get("split") == "eval" and metric in record and metric_value(record[metric])
        if logged and isinstance(record.get("step"), int):
            out.append((record["step"], math.nan if record[metric] is None else float(record[metric])))
    return out


RESULT_ONLY = ("train_loss",)  # result.json's metrics that no evaluation logs


def unlogged_metric(folder: Path, metric: str) -> str | None:
    """Where the trial has evaluated but its evaluation logs no `metric` (a misspelt --metric, or a metric of
    another task): why, naming what it logs; None before the first evaluation, or where it logs the metric."""
    if metric in RESULT_ONLY or is_harness_metric(metric):  # the harness scores after training: result.json's
        return None
    for line in read_metrics_lines(folder):
        try:
            record = json.loads(line)
        except ValueError:  # a line being written
            continue
        if record.get("split") == "eval":
            if metric in record:
                return None
            logged = [k for k, v in record.items() if (isinstance(v, float) or v is None) and k not in NOT_METRICS]
            return f"its evaluations log {', '.join(logged) or 'no metric'}"
    return None


def read_result(folder: Path, metric: str) -> tuple[float | None, str]:
    """(the value of `metric` in the trial's result.json, "") or (None, why there is none)."""
    path = folder / RESULT_FILE
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, f"no readable {RESULT_FILE}"
    result = result if isinstance(result, dict) else {}
    value = result.get(metric)
    if metric not in result or not metric_value(value):
        shown = ", ".join(k for k, v in result.items() if isinstance(v, float) or v is None)
        return None, f"{RESULT_FILE} has no metric {metric!r} (it has: {shown or 'none'}); pass --metric"
    if value is None:  # undefined: a run writes a nan as null
        return None, f"its {metric} is nan"
    if not math.isfinite(value):
        return None, f"its {metric} is {value}"
    return float(value), ""


def harness_metrics(folder: Path) -> list[str]:
    """The harness scores after training that the trial's result.json holds (none where it has none)."""
    try:
        result = json.loads((folder / RESULT_FILE).read_text())
    except (OSError, ValueError):
        return []
    return [k for k in result if is_harness_metric(k)] if isinstance(result, dict) else []


def last_error(folder: Path) -> str:
    """The child's `error:` line (else its last line), for the sweep's progress line."""
    try:
        lines = [ln.strip() for ln in (folder / TRIAL_LOG).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if ln.startswith(("error:", "internal error"))]
    return (errors or lines or [""])[-1][:300]
