"""What a sweep leaves in its folder besides the trials' run folders: the table of trials (trials.csv, and the same
table printed), best.yaml (the base config with the best trial's values: `tuneforge train best.yaml` trains it), the
plots (Optuna's matplotlib ones: optimisation history, parallel coordinates, parameter importances), and the pruning of
the trials' models to the best K (`keep_best`): only model/ and checkpoint-N/ folders, which tuneforge wrote, of
trials that have ended."""

from __future__ import annotations

import csv
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tuneforge.files import discard, replacing, write_text
from tuneforge.paths import CHECKPOINT_NAME, is_run_entry

TABLE = "trials.csv"
BEST = "best.yaml"
# file -> (the plot's function in optuna.visualization.matplotlib, the finished trials it needs)
PLOTS = {
    "history.png": ("plot_optimization_history", 1),
    "parallel_coordinates.png": ("plot_parallel_coordinate", 1),
    "importances.png": ("plot_param_importances", 2),
}
FOLDER_ATTR = "tuneforge_folder"  # a trial's user attribute: its run folder (absolute)


@dataclass(frozen=True)
class Row:
    """One trial of the table."""

    number: int
    state: str
    value: float | None
    duration_s: float | None
    params: dict[str, Any]
    folder: str


def rows(study) -> list[Row]:
    out = []
    for t in study.get_trials(deepcopy=False):
        duration = t.duration.total_seconds() if t.duration is not None else None
        state = t.state.name.lower()
        out.append(Row(t.number, state, t.value, duration, dict(t.params), str(t.user_attrs.get(FOLDER_ATTR, ""))))
    return out


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)


def write_table(folder: Path, table: list[Row], keys: list[str], metric: str) -> Path:
    """folder/trials.csv: number, state, the metric, duration, each parameter, the trial's run folder."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["number", "state", metric, "duration_s", *keys, "folder"])
    for r in table:
        value = "" if r.value is None else repr(r.value)
        duration = "" if r.duration_s is None else f"{r.duration_s:.1f}"
        writer.writerow([r.number, r.state, value, duration, *(r.params.get(k, "") for k in keys), r.folder])
    write_text(folder / TABLE, buffer.getvalue(), durable=False)
    return folder / TABLE


def format_table(table: list[Row], keys: list[str], metric: str) -> str:
    """The table as aligned text columns."""
    head = ["trial", "state", metric, "duration", *keys]
    body = [
        [
            str(r.number),
            r.state,
            _shown(r.value),
            "" if r.duration_s is None else f"{r.duration_s:.0f} s",
            *(_shown(r.params.get(k)) for k in keys),
        ]
        for r in table
    ]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [head, *body])


def ranked(study) -> list:
    """The finished (complete) trials, best first (ties: the earlier trial first)."""
    done = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE" and t.value is not None]
    sign = -1.0 if study.direction.name == "MAXIMIZE" else 1.0
    return sorted(done, key=lambda t: (sign * t.value, t.number))


def write_best(folder: Path, study, values_of: Callable[[dict[str, Any]], dict[str, Any]], metric: str) -> Path | None:
    """folder/best.yaml: the base config with the best trial's values (None while no trial has finished)."""
    best = ranked(study)
    if not best:
        return None
    trial = best[0]
    header = (
        f"# the best trial of this sweep: trial {trial.number}, {metric} {trial.value:.6g}\n"
        f"# tuneforge train {folder / BEST}\n"
    )
    write_text(folder / BEST, header + yaml.safe_dump(values_of(dict(trial.params)), sort_keys=False), durable=False)
    return folder / BEST


def keep_best(study, sweep_dir: Path, k: int) -> list[Path]:
    """Remove model/ and checkpoint-N/ of every ended trial (in this sweep folder) but the best `k` complete ones
    (and the `latest` pointer, which would name a removed checkpoint): the run entries of those names and kinds
    (paths.is_run_entry), nothing else; running (or interrupted) trials are never touched. Returns what was removed."""
    kept = {t.number for t in ranked(study)[:k]}
    removed = []
    root = sweep_dir.resolve()
    for t in study.get_trials(deepcopy=False):
        if t.number in kept or t.state.name in ("RUNNING", "WAITING"):
            continue
        folder = Path(str(t.user_attrs.get(FOLDER_ATTR, "")))
        if not folder.is_absolute() or folder.parent != root or not folder.is_dir():
            continue  # another machine's trial (a shared storage), or gone
        for entry in sorted(folder.iterdir()):
            if entry.name in ("model", "latest") or CHECKPOINT_NAME.fullmatch(entry.name):
                if is_run_entry(entry):
                    discard(entry) if entry.is_dir() else entry.unlink()
                    removed.append(entry)
    return removed


def write_plots(study, folder: Path) -> list[str]:
    """The plots of PLOTS that the finished trials allow; returns a note for each one not written (and why)."""
    finished = len(ranked(study))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from optuna.visualization import matplotlib as optuna_plots
    except ImportError as err:
        return [f"no plots: {err.name or err} is not installed"]
    notes = []
    for name, (function, needs) in PLOTS.items():
        if finished < needs:
            notes.append(f"no {name}: it needs {needs} finished trial{'s' if needs > 1 else ''} ({finished} finished)")
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
                axes = getattr(optuna_plots, function)(study)
            figure = getattr(axes, "figure", None) or axes.flat[0].figure
            with replacing(folder / name) as tmp:
                figure.savefig(tmp, format="png", dpi=90, bbox_inches="tight")
            plt.close(figure)
        except (ImportError, ValueError, RuntimeError, ZeroDivisionError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            notes.append(f"no {name}: {first}")
    return notes
