"""`tuneforge runs DIR...`: runs compared side by side.

Owns reading run folders for a comparison (config.yaml flattened to dotted keys, metrics.jsonl's records,
result.json), finding the runs a folder of runs holds (a sweep's trials, one level down), the comparison itself
(the config keys that differ between the runs, their final and best evaluation metrics, wall time, speed, whether
they finished), its table and JSON, and one plot overlaying the runs' curves. It writes nothing but that plot, a
PNG it marks as its own, so that `--overwrite` replaces only such a file. Imports no torch.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tuneforge.config import lower_is_better
from tuneforge.errors import ConfigError, UserError
from tuneforge.files import json_text, replacing
from tuneforge.flags import POSITIONAL, add_model_flags, parse_options
from tuneforge.options import PATH
from tuneforge.reporting import METRICS_FILE, NOT_METRICS

CONFIG_FILE, RESULT_FILE = "config.yaml", "result.json"
FINISHED, UNFINISHED = "finished", "running-or-interrupted"
NOT_COMPARED = ("output_dir",)  # the run's own folder: it differs between any two runs, and names the row already
TIMINGS = ("wall_s", "data_wait_s")  # result.json's floats that are no metric (train's `final:` line skips them)
# the plot: a panel per curve, PANELS_PER_ROW to a row, each PANEL_INCHES, saved at DPI; its PNG text MARK says
# tuneforge wrote it (what --overwrite may replace)
PANELS_PER_ROW, PANEL_INCHES, DPI = 3, (5.0, 3.6), 90
MARGIN_INCHES = (0.8, 0.2, 0.7, 0.55, 0.8, 0.75)  # left, right, top, bottom, between columns, between rows
MARK = ("tuneforge", "runs comparison")
DEFAULT_PLOT = "runs-comparison.png"


@dataclass(frozen=True)
class RunFolder:
    """One run as read from its folder: `config` flattened to dotted keys; `result` None while unfinished."""

    name: str
    path: Path
    config: dict[str, Any]
    records: list[dict]
    result: dict | None


@dataclass(frozen=True)
class Best:
    """The best evaluation of a run by `metric` (`value` at `step`; None where the run has no such evaluation),
    and why that metric: `chosen_by` is "metric_for_best" (the run's config), "run" (what result.json records the
    run picked its best model by) or "default" (neither: the first metric its evaluations log)."""

    metric: str
    greater_is_better: bool
    chosen_by: str
    value: float | None = None
    step: int | None = None


# ---- finding and reading runs ------------------------------------------------------------------
def is_run(path: Path) -> bool:
    """A run folder: `tuneforge train` wrote its config.yaml and metrics.jsonl."""
    return (path / CONFIG_FILE).is_file() and (path / METRICS_FILE).is_file()


def find_runs(dirs: list[str]) -> list[Path]:
    """The run folders `dirs` name, in order: a run folder itself, or the run folders a folder holds (one level
    down, sorted by name). Each run once; a folder that is neither is one error line."""
    found: dict[Path, Path] = {}
    for given in dirs:
        path = Path(given)
        if not path.exists():
            raise ConfigError(f"{given!r} does not exist; pass a run folder (a train run's --output-dir)")
        if not path.is_dir():
            raise ConfigError(f"{given!r} is a file, not a run folder; pass a train run's --output-dir")
        if is_run(path):
            runs = [path]
        else:
            has = [name for name in (CONFIG_FILE, METRICS_FILE) if (path / name).is_file()]
            if has:
                lacks = METRICS_FILE if has == [CONFIG_FILE] else CONFIG_FILE
                raise ConfigError(
                    f"{given!r} holds {has[0]} but no {lacks}: not a run folder tuneforge wrote (a run writes both "
                    "before its first step)"
                )
            runs = sorted((p for p in path.iterdir() if p.is_dir() and is_run(p)), key=lambda p: p.name)
            if not runs:
                raise ConfigError(
                    f"{given!r} is not a run folder (no {CONFIG_FILE} and {METRICS_FILE}) and holds none; pass a "
                    "train run's --output-dir, or a folder of runs such as a sweep's"
                )
        for run in runs:
            found.setdefault(run.resolve(), run)
    return list(found.values())


def run_names(paths: list[Path]) -> list[str]:
    """Each run's name: its folder's, with as many parent folders as tell apart runs of the same name."""
    parts = [p.resolve().parts for p in paths]
    depth = [1] * len(paths)
    while True:
        names = ["/".join(pp[-d:]) for pp, d in zip(parts, depth)]
        clashes = {n for n in names if names.count(n) > 1}
        if not clashes:
            return names
        depth = [d + (n in clashes) for n, d in zip(names, depth)]


def _text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{str(path)!r} is not a text file (byte {err.start} is not UTF-8); is it corrupt?") from None
    except OSError as err:
        raise UserError(f"{str(path)!r} cannot be read ({err.strerror})") from None


def read_records(path: Path) -> list[dict]:
    """metrics.jsonl's records. A line that is not a JSON object is one error line naming it, but for a last line
    not yet ended (a run writing it now)."""
    text = _text(path)
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            if number == len(lines):  # no newline after it: a line still being written
                break
            raise UserError(f"{str(path)!r} line {number} is not a JSON record ({err}); is the file corrupt?") from None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise UserError(f"{str(path)!r} line {number} is not a metrics record (a JSON object with a step)")
        records.append(record)
    return records


def read_result(path: Path) -> dict | None:
    """result.json (None where the run has none: it has not finished)."""
    if not path.exists():
        return None
    try:
        result = json.loads(_text(path))
    except ValueError as err:
        raise UserError(f"{str(path)!r} is not valid JSON ({err}); is the file corrupt?") from None
    if not isinstance(result, dict):
        raise UserError(f"{str(path)!r} is not a run's result (a JSON object); is the file corrupt?")
    return result


def flatten(values: dict, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys: {"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def read_config(path: Path) -> dict[str, Any]:
    """config.yaml as dotted keys."""
    import yaml

    try:
        config = yaml.safe_load(_text(path))
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}" if where else ""
        raise UserError(f"{str(path)!r} is not valid YAML{at}; is the file corrupt?") from None
    if not isinstance(config, dict):
        raise UserError(f"{str(path)!r} is not a run's config (a YAML mapping); is the file corrupt?")
    return flatten(config)


def read_run(path: Path, name: str) -> RunFolder:
    return RunFolder(
        name=name,
        path=path,
        config=read_config(path / CONFIG_FILE),
        records=read_records(path / METRICS_FILE),
        result=read_result(path / RESULT_FILE),
    )


def read_runs(dirs: list[str]) -> list[RunFolder]:
    """The runs `dirs` name (find_runs), read."""
    paths = find_runs(dirs)
    return [read_run(path, name) for path, name in zip(paths, run_names(paths))]


# ---- the comparison ----------------------------------------------------------------------------
def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def differing_keys(runs: list[RunFolder]) -> tuple[list[str], int]:
    """(the config keys whose values differ between the runs, or that some run lacks; how many keys all runs share
    with equal values). output_dir is never compared."""
    keys = list(dict.fromkeys(k for run in runs for k in run.config if k not in NOT_COMPARED))
    missing = object()
    differ = [k for k in keys if len({json.dumps(r.config.get(k, missing), default=repr) for r in runs}) > 1]
    return differ, len(keys) - len(differ)


def best_eval(run: RunFolder) -> Best:
    """The run's best evaluation by its config's metric_for_best; without one, by the metric the run recorded in
    result.json as the one it picked its best model by (the task's own: NER's f1, not the precision it logs
    first); where it recorded none (unfinished, or of an earlier version), by the first metric its evaluations log
    that is not the loss, else by the loss."""
    evals = [r for r in run.records if r.get("split") == "eval"]
    chosen, recorded = run.config.get("metric_for_best"), (run.result or {}).get("metric_for_best")
    greater = None
    if isinstance(chosen, str) and chosen:
        metric, chosen_by = chosen, "metric_for_best"
    elif isinstance(recorded, str) and recorded:
        metric, chosen_by = recorded, "run"
        greater = run.result.get("greater_is_better")
    else:
        logged = [k for r in evals[:1] for k, v in r.items() if _metric_value(v) and k not in NOT_METRICS]
        metric, chosen_by = next((k for k in logged if k != "loss"), "loss"), "default"
    if not isinstance(greater, bool):
        greater = not lower_is_better(metric)
    scored = [(r[metric], r["step"]) for r in evals if _number(r.get(metric)) and math.isfinite(r[metric])]
    if not scored:
        return Best(metric, greater, chosen_by)
    value, step = (max if greater else min)(scored, key=lambda vs: vs[0])
    return Best(metric, greater, chosen_by, float(value), step)


def _metric_value(value: Any) -> bool:
    """A metric's value as run files hold it: a float, or null for one that is undefined (a nan when computed)."""
    return isinstance(value, float) or value is None


def final_metrics(result: dict | None) -> dict[str, float | None]:
    """result.json's metrics (its float values but the timings; null: undefined), as `tuneforge train` prints them."""
    return {k: v for k, v in (result or {}).items() if _metric_value(v) and k not in TIMINGS}


def progress(run: RunFolder) -> tuple[int | None, float | None]:
    """(steps, wall seconds): result.json's; for an unfinished run, its last record's step and time."""
    if run.result is not None:
        steps, wall = run.result.get("steps"), run.result.get("wall_s")
        return (steps if _number(steps) else None), (float(wall) if _number(wall) else None)
    if not run.records:
        return None, None
    last = run.records[-1]
    return max(r["step"] for r in run.records), (float(last["time_s"]) if _number(last.get("time_s")) else None)


def summary(run: RunFolder, keys: list[str]) -> dict[str, Any]:
    """One run's row of the comparison, as JSON takes it."""
    steps, wall = progress(run)
    best = best_eval(run)
    return {
        "name": run.name,
        "path": str(run.path),
        "status": FINISHED if run.result is not None else UNFINISHED,
        "config": {k: run.config[k] for k in keys if k in run.config},
        "metrics": final_metrics(run.result),
        "best": {
            "metric": best.metric,
            "value": best.value,
            "step": best.step,
            "greater_is_better": best.greater_is_better,
            "chosen_by": best.chosen_by,
        },
        "steps": steps,
        "wall_s": wall,
        "steps_per_s": steps / wall if steps is not None and wall else None,
    }


def compare(runs: list[RunFolder]) -> dict[str, Any]:
    """The comparison: {"runs": a summary per run, "differing_keys", "equal_keys": how many are left out}."""
    keys, equal = differing_keys(runs)
    return {"runs": [summary(run, keys) for run in runs], "differing_keys": keys, "equal_keys": equal}


# ---- the table ---------------------------------------------------------------------------------
def _cell(value: Any, width: int = 40) -> str:
    """A config value as the table shows it (YAML's words; a long one cut at its start, where paths differ least)."""
    if isinstance(value, (bool, list, type(None))):
        text = json.dumps(value)
    elif _number(value):
        text = f"{value:g}"
    else:
        text = " ".join(str(value).split())  # one line
    return text if len(text) <= width else "..." + text[-(width - 3) :]


def _metric_cell(metrics: dict[str, float | None], key: str) -> str:
    """A final metric as the table shows it: "-" where the run has none, nan where it is undefined (null)."""
    if key not in metrics:
        return "-"
    value = metrics[key]
    return "nan" if value is None else f"{value:.4f}"


def _best_cell(best: dict) -> str:
    if best["value"] is None:
        return f"- (no {best['metric']})"
    return f"{best['metric']} {best['value']:.4f} @ step {best['step']}"


def table(comparison: dict[str, Any]) -> str:
    """The comparison as an aligned text table (pandas): a row per run."""
    import pandas as pd

    metrics = list(dict.fromkeys(k for row in comparison["runs"] for k in row["metrics"]))
    rows = []
    for row in comparison["runs"]:
        config = {k: _cell(row["config"][k]) if k in row["config"] else "-" for k in comparison["differing_keys"]}
        final = {k: _metric_cell(row["metrics"], k) for k in metrics}
        speed = "-" if row["steps_per_s"] is None else f"{row['steps_per_s']:.2f}"
        wall = "-" if row["wall_s"] is None else f"{row['wall_s']:.1f}"
        rows.append(
            [row["name"], *config.values(), *final.values(), _best_cell(row["best"]), wall, speed, row["status"]]
        )
    columns = ["run", *comparison["differing_keys"], *metrics, "best eval", "wall_s", "steps/s", "status"]
    return pd.DataFrame(rows, columns=columns).to_string(index=False)


def notes(comparison: dict[str, Any]) -> list[str]:
    """The lines above the table: what was left out, and how each best evaluation was chosen."""
    runs, keys = comparison["runs"], comparison["differing_keys"]
    shown = f"the {len(keys)} that differ are shown" if keys else "none differs"
    lines = [
        f"{len(runs)} run{'s' if len(runs) != 1 else ''}; {comparison['equal_keys']} config keys equal in all of "
        f"them are left out ({shown}; output_dir is the run's folder); final metrics from {RESULT_FILE}"
    ]
    ways: dict[tuple, list[str]] = {}
    for row in runs:
        best = row["best"]
        ways.setdefault((best["metric"], best["greater_is_better"], best["chosen_by"]), []).append(row["name"])
    why = {
        "metric_for_best": "its metric_for_best",
        "run": "the metric the run chose its best model by",
        "default": f"no metric_for_best set or recorded in {RESULT_FILE}: the first metric its evaluations log, or "
        "the loss",
    }
    for (metric, greater, chosen_by), names in ways.items():
        which = "every run" if len(names) == len(runs) else ", ".join(names)
        lines.append(
            f"best eval of {which}: by {metric}, {'higher' if greater else 'lower'} is better ({why[chosen_by]})"
        )
    return lines


# ---- the plot ----------------------------------------------------------------------------------
def written_by_runs(path: Path) -> bool:
    """A PNG file holding this command's mark (what --overwrite may replace)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.info.get(MARK[0]) == MARK[1]
    except Exception:  # not an image at all: PIL raises UnidentifiedImageError, OSError, ValueError...
        return False


def check_plot_destination(out: Path, overwrite: bool) -> None:
    """--plot: a .png file, absent unless `overwrite`, which replaces only a comparison plot tuneforge wrote.
    Checked before any run is read."""
    from tuneforge.paths import check_output_dir

    if out.suffix.lower() != ".png":
        raise ConfigError(f"--plot {str(out)!r}: the plot is a PNG file; give a name ending in .png")
    if out.is_symlink() or (out.exists() and not out.is_file()):
        raise ConfigError(f"--plot {str(out)!r} is not a plain file; choose another path")
    check_output_dir(str(out.parent), "--plot", "the folder of --plot")
    if out.exists() and not overwrite:
        raise ConfigError(f"--plot {str(out)!r} exists; pass --overwrite to replace it, or choose another path")
    if out.exists() and not written_by_runs(out):
        raise ConfigError(
            f"--plot {str(out)!r} is not a comparison plot tuneforge wrote, and tuneforge never replaces files it did "
            "not write; move it away or choose another path"
        )


def curves(runs: list[RunFolder]) -> list[tuple[str, str, str]]:
    """The plot's panels: (title, split, key): the training loss, then each metric the evaluations log."""
    evals = [r for run in runs for r in run.records if r.get("split") == "eval"]
    metrics = sorted({k for r in evals for k, v in r.items() if isinstance(v, float) and k not in NOT_METRICS})
    return [("train loss", "train", "loss"), *((f"eval {k}", "eval", k) for k in metrics)]


def _margins(cols: int, rows: int) -> dict[str, float]:
    """subplots_adjust's fractions for fixed margins in inches (MARGIN_INCHES): room for the tick labels, titles
    and the figure's title at any grid, without tight_layout's trial drawing (most of a plot's time)."""
    left, right, top, bottom, between_cols, between_rows = MARGIN_INCHES
    width, height = PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows
    axes_width = (width - left - right - between_cols * (cols - 1)) / cols
    axes_height = (height - top - bottom - between_rows * (rows - 1)) / rows
    return {
        "left": left / width,
        "right": 1 - right / width,
        "top": 1 - top / height,
        "bottom": bottom / height,
        "wspace": between_cols / axes_width,
        "hspace": between_rows / axes_height,
    }


def plot_runs(runs: list[RunFolder], out: Path) -> Path:
    """One PNG overlaying the runs' curves (reporting.plot_run's, a run's own): a panel per curve, a line per run,
    a legend with the runs' names; written whole (one rename), marked as tuneforge's. A bare matplotlib Figure,
    drawn by Agg: no pyplot state, no display."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = curves(runs)
    cols = min(PANELS_PER_ROW, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    colors = matplotlib.colormaps["tab10" if len(runs) <= 10 else "tab20"]
    for ax, (title, split, key) in zip(axes.flat, panels):
        steps = set()
        for i, run in enumerate(runs):
            points = [(r["step"], r[key]) for r in run.records if r.get("split") == split and _number(r.get(key))]
            if points:
                style = "-" if split == "train" else "o-"
                ax.plot(*zip(*points), style, color=colors(i % colors.N), label=run.name, markersize=3)
                steps.update(step for step, _ in points)
        ax.set_title(title), ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(steps) == 1:  # one point: its step the one tick
            ax.set_xticks(sorted(steps))
        if ax.lines:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(f"tuneforge runs: {len(runs)} run{'s' if len(runs) != 1 else ''}")
    fig.subplots_adjust(**_margins(cols, rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI, metadata={MARK[0]: MARK[1]})
    return out


# ---- CLI ---------------------------------------------------------------------------------------
class RunsOptions(BaseModel):
    """`tuneforge runs`'s arguments, checked before any run is read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dirs: list[str] = Field(
        min_length=1,
        description="run folders (a train run's --output-dir), or folders holding runs (a sweep's), whose run "
        "folders one level down are compared, sorted by name",
        json_schema_extra={**POSITIONAL, **PATH, "flag_kwargs": {"action": "store", "nargs": "+", "metavar": "DIR"}},
    )
    plot: str = Field(
        DEFAULT_PLOT, description="the plot overlaying the runs' curves: a .png file to write", json_schema_extra=PATH
    )
    overwrite: bool = Field(False, description="replace --plot where it is a comparison plot tuneforge wrote")
    print_json: bool = Field(
        False, description="last stdout line: the comparison as JSON", json_schema_extra={"flag": "--json"}
    )


def cmd_runs(ns: argparse.Namespace) -> int:
    options = parse_options(RunsOptions, ns)
    out = Path(options.plot)
    check_plot_destination(out, options.overwrite)
    runs = read_runs(options.dirs)
    comparison = compare(runs)
    print("\n".join([*notes(comparison), table(comparison)]), flush=True)
    comparison["plot"] = str(plot_runs(runs, out))
    print(f"plot written to {comparison['plot']}", flush=True)
    if options.print_json:
        print(json_text(comparison), flush=True)
    return 0


def add_arguments(p) -> None:
    """`tuneforge runs`'s arguments: RunsOptions' fields (the CLI lists the command and its help)."""
    add_model_flags(p, RunsOptions)
    p.set_defaults(func=cmd_runs)
