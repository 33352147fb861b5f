"""What a run shows and leaves behind: progress bar, metrics.jsonl (and cutting it back to a checkpoint's
records on a resume), a plot, and the run's experiment trackers (`--report-to`: TensorBoard, MLflow, W&B, trackio;
tuneforge/tracking/), which get every record metrics.jsonl gets.

Only the main rank writes and opens the trackers. Human-readable lines go to stderr so that stdout stays clean for
`--json` (its last line is the result object).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tuneforge.files import json_text, replacing, room_for, write_text
from tuneforge.tracking import Resumption, Trackers, describe_run, points_of

METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"
NOT_METRICS = ("split", "step", "epoch", "time_s", "num_examples")  # a metrics.jsonl record's keys that are no metric


class _DropDeepSpeedCpuNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Setting accelerator to CPU" not in record.getMessage()


def hide_deepspeed_cpu_notice() -> None:
    """Drop DeepSpeed's "Setting accelerator to CPU" warning. transformers' save_pretrained imports
    DeepSpeed whenever it is installed, and DeepSpeed logs that line (to stdout, inside --json output)
    on import: noise on a run that does not use it. The filter outlives DeepSpeed's own logger set-up."""
    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropDeepSpeedCpuNotice) for f in logger.filters):
        logger.addFilter(_DropDeepSpeedCpuNotice())


@contextlib.contextmanager
def quiet_libraries(quiet: bool) -> Iterator[None]:
    """Under `quiet` (a Python caller's; the CLI turns these off for good), transformers', datasets' and the hub's
    notes (a model's load report) and progress bars (loading and writing weights, tokenizing) are off for the block;
    the settings the caller had come back after it."""
    if not quiet:
        yield
        return
    import datasets
    import huggingface_hub.utils as hub
    import transformers

    logs = transformers.utils.logging
    before = (logs.get_verbosity(), logs.is_progress_bar_enabled(), datasets.is_progress_bar_enabled())
    hub_before = (hub.logging.get_verbosity(), hub.are_progress_bars_disabled())
    logs.set_verbosity_error()
    logs.disable_progress_bar()  # the hub's too
    datasets.disable_progress_bars()
    hub.logging.set_verbosity_error()
    try:
        yield
    finally:
        logs.set_verbosity(before[0])
        logs.enable_progress_bar() if before[1] else logs.disable_progress_bar()
        datasets.enable_progress_bars() if before[2] else datasets.disable_progress_bars()
        hub.logging.set_verbosity(hub_before[0])
        hub.disable_progress_bars() if hub_before[1] else hub.enable_progress_bars()


class Reporter:
    def __init__(self, config, is_main: bool = True) -> None:
        hide_deepspeed_cpu_notice()  # also where it is the backend: the run's own lines say where it runs
        self.config = config
        self.is_main = is_main
        self.quiet = config.quiet or not is_main
        self.run_dir = Path(config.output_dir)
        self.bar = None
        self.trackers: Trackers | None = None
        self.resumed: Resumption | None = None  # a resume: what the trackers continue (continue_from)
        self._metrics_file = None
        self._t0 = time.perf_counter()

    def print(self, msg: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def warn(self, msg: str) -> None:
        """A warning line on stderr (main rank), --quiet or not."""
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def start(
        self, total_steps: int, start_step: int, n_train: int, global_batch: int, backend, device: str = ""
    ) -> None:
        """Open metrics.jsonl and the trackers (a failure to open one is its one error line), show the plan.
        `device`: where the run runs (a GPU's name, or the CPU and its class), for the trackers' tags."""
        if not self.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        run = describe_run(self.config, backend, device or backend.device.type)
        self.trackers = Trackers.open(self.config.report_to, run, self.resumed, warn=self.warn)
        self._metrics_file = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")
        self.print(
            f"training {n_train} examples, global batch {global_batch}, {total_steps} steps "
            f"on {backend.name} ({backend.world_size} process{'es' if backend.world_size > 1 else ''}, "
            f"{backend.device.type}, {backend.precision})"
        )
        if not self.quiet:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total_steps, initial=start_step, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True
            )

    def log(self, record: dict) -> None:
        if not self.is_main:
            return
        record = {**record, "time_s": round(time.perf_counter() - self._t0, 3)}
        if self._metrics_file:
            with room_for(self.run_dir / METRICS_FILE):
                self._metrics_file.write(json_text(record) + "\n")
                self._metrics_file.flush()
        if self.trackers is not None:
            self.trackers.log(record)
        split = record.get("split", "train")
        if split == "train" and self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
        elif split == "eval":
            shown = ", ".join(f"{k} {v:.4f}" for k, v in record.items() if isinstance(v, float) and k != "time_s")
            self.print(f"eval @ step {record['step']} (epoch {record.get('epoch')}): {shown}")

    def count_records(self) -> int | None:
        """The records metrics.jsonl holds now (main rank; None on the others, which write none)."""
        if not self.is_main:
            return None
        return len(read_metrics_lines(self.run_dir))

    def checkpoint_trackers(self) -> dict[str, str]:
        """Before a checkpoint: the trackers' runs, {tracker: run id}, for the checkpoint to keep (a resume continues
        them), with what the trackers hold flushed to their stores. Main rank ({} on the others)."""
        if self.trackers is None:
            return {}
        self.trackers.flush()
        return dict(self.trackers.ids)

    def continue_from(self, records: int | None, tracker_runs: dict[str, str]) -> None:
        """A resume: metrics.jsonl cut back to the checkpoint's `records`, and the trackers, once `start` opens them,
        continuing their runs `tracker_runs` (the records cut are those they were sent after the checkpoint, logged
        again as its steps are re-run). Before `start`; main rank."""
        if not self.is_main:
            return
        lines = read_metrics_lines(self.run_dir)
        kept = len(lines) if records is None else records
        self.resumed = Resumption(
            runs=dict(tracker_runs),
            kept=points_of(parsed(lines[:kept])),
            replayed=points_of(parsed(lines[kept:])),
        )
        self.keep_records(records)

    def keep_records(self, records: int | None) -> None:
        """Cut metrics.jsonl back to its first `records` records (a resume: those written before the checkpoint),
        so that it reads like an uninterrupted run. Before `start`; main rank."""
        if not self.is_main or records is None:
            return
        lines = read_metrics_lines(self.run_dir)
        if len(lines) > records:
            write_text(self.run_dir / METRICS_FILE, "".join(ln + "\n" for ln in lines[:records]))

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def stop(self) -> None:
        """A run that stops on an error: the progress bar ends (the error is the last line), metrics.jsonl is
        closed and the trackers' runs end as failed; no result is written. Called again, it does nothing."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._metrics_file:
            with contextlib.suppress(OSError):  # a record a full disk cut short: the error that stopped the run says so
                self._metrics_file.close()
            self._metrics_file = None
        if self.trackers is not None:
            trackers, self.trackers = self.trackers, None
            trackers.close(finished=False)

    def finish(self, result: dict) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if not self.is_main:
            return
        if self._metrics_file:
            self._metrics_file.close()
            self._metrics_file = None
        write_result(self.run_dir, result)
        try:
            plot_run(self.run_dir)
        except Exception as err:  # a plot must never fail a finished run
            self.print(f"(no plot: {err})")
        if self.trackers is not None:  # the model (--log-model), then each tracker run ends as finished
            trackers, self.trackers = self.trackers, None
            if self.config.log_model and result.get("model_dir"):
                trackers.log_model(Path(result["model_dir"]))
            trackers.close(finished=True)


def write_result(run_dir: str | Path, result: dict) -> None:
    """RUN/result.json: the run's result, written whole (`runs` and sweeps read it)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    write_text(Path(run_dir) / RESULT_FILE, json_text(result, indent=2))


def read_metrics_lines(run_dir: Path) -> list[str]:
    """The non-empty lines of RUN/metrics.jsonl (none where there is no file)."""
    path = Path(run_dir) / METRICS_FILE
    return [ln for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def parsed(lines: list[str]) -> list[dict]:
    """The records of metrics.jsonl lines; a line that is not one (cut short by a kill) is left out."""
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in read_metrics_lines(run_dir)]


def plot_run(run_dir: Path) -> Path | None:
    """training loss and eval metrics against steps, saved as RUN/plot.png (replaced whole)."""
    records = read_metrics(run_dir)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("split") == "train"]
    evals = [r for r in records if r.get("split") == "eval"]
    eval_keys = sorted({k for r in evals for k, v in r.items() if isinstance(v, float) and k not in ("time_s", "loss")})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        axes[0].plot([r["step"] for r in evals], [r.get("loss", math.nan) for r in evals], "o-", label="eval loss")
    axes[0].set_xlabel("step"), axes[0].set_title("loss"), axes[0].legend()
    for k in eval_keys:
        axes[1].plot([r["step"] for r in evals], [r.get(k, math.nan) for r in evals], "o-", label=k)
    axes[1].set_xlabel("step"), axes[1].set_title("eval metrics")
    if eval_keys:
        axes[1].legend()
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out = Path(run_dir) / "plot.png"
    try:
        with replacing(out) as tmp:  # written whole: a full disk leaves the plot before, never a truncated one
            fig.savefig(tmp, format="png", dpi=90)
    finally:
        plt.close(fig)
    return out
