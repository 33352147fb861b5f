"""The interface of a tracker (`Tracker`) and what one is given: `RunDescription` (names, params, tags),
`Continued` (a resumed job's run id and records, cut from the Reporter's `Resumption`) and `Point` (one metrics.jsonl
record's numeric values at its step). The registry, the checks and the open trackers of a run are in __init__.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar


# ---- what a tracker is given -------------------------------------------------------------------
@dataclass(frozen=True)
class Point:
    """One metrics.jsonl record as trackers log it: its numeric values keyed `SPLIT/NAME` (train/loss, eval/f1)
    at its step."""

    step: int
    metrics: dict[str, float]


# not metrics: the step is where they go; time_s (seconds since the attempt started) is wall-clock, which a re-run step
# does not reproduce (every tracker stamps its own times)
NOT_METRICS = ("step", "split", "time_s")


def point_of(record: Mapping[str, Any]) -> Point | None:
    """The record's numeric values (not NOT_METRICS; booleans and text left out) as a Point; None when it has none.
    A null is the nan it was logged as (metrics.jsonl writes an undefined metric as null), so that a resume re-logs
    the same points the run logged."""
    split = record.get("split", "train")
    metrics = {
        f"{split}/{key}": math.nan if value is None else float(value)
        for key, value in record.items()
        if key not in NOT_METRICS and (value is None or isinstance(value, (int, float)) and not isinstance(value, bool))
    }
    return Point(int(record.get("step", 0)), metrics) if metrics else None


def points_of(records: Iterable[Mapping[str, Any]]) -> tuple[Point, ...]:
    return tuple(p for p in map(point_of, records) if p is not None)


def unlogged(point: Point, last_steps: Mapping[str, int]) -> dict[str, float]:
    """The values of `point` a run does not hold yet: those above the last step logged for their key."""
    return {key: value for key, value in point.metrics.items() if point.step > last_steps.get(key, -1)}


@dataclass(frozen=True)
class RunDescription:
    """What a tracker's run is called and holds besides metrics."""

    output_dir: Path
    experiment: str | None  # --experiment-name (each tracker has its default)
    name: str  # --run-name, else the output dir's name
    tracking_uri: str | None  # --tracking-uri (the trackers with a `uri_variable`)
    params: dict[str, Any]  # the resolved config, nested keys flattened with dots, values as config.yaml holds them
    tags: dict[str, str]  # tuneforge.version, .task, .backend, .device, .world_size
    quiet: bool


@dataclass(frozen=True)
class Continued:
    """A resumed job, as one tracker sees it: its run id from the checkpoint (None: it had no run there), the
    records before the checkpoint (`kept` in metrics.jsonl) and those logged after it (`replayed`: cut from
    metrics.jsonl, logged again as the steps after the checkpoint are re-run)."""

    run_id: str | None
    kept: tuple[Point, ...]
    replayed: tuple[Point, ...]


@dataclass(frozen=True)
class Resumption:
    """A resumed job, as the Reporter knows it: the tracker runs its checkpoint holds ({tracker: run id}) and the
    records before and after the checkpoint (see `Continued`)."""

    runs: dict[str, str]
    kept: tuple[Point, ...]
    replayed: tuple[Point, ...]

    def of(self, name: str) -> Continued:
        return Continued(self.runs.get(name), self.kept, self.replayed)


class Tracker:
    """One tracker's run of one job. Opened in the main process once the run is set up (`__init__`: a new run, or
    the one `continued.run_id` names); then `log` per record, `flush` before each checkpoint, `log_model` at the end
    where asked (trackers with `logs_model`), `close`. An exception from any of them drops the tracker for the rest
    of the run (Trackers warns once and calls `abandon`)."""

    name: ClassVar[str] = ""
    package: ClassVar[str] = ""  # the module its library is imported as
    extra: ClassVar[str] = ""  # pip install 'tuneforge[EXTRA]'
    logs_model: ClassVar[bool] = False  # --log-model: it keeps OUTPUT_DIR/model as the run's artifact
    uri_variable: ClassVar[str | None] = None  # it takes --tracking-uri; the environment variable that is its default
    names_runs: ClassVar[bool] = False  # it takes --experiment-name and --run-name

    run_id: str | None = None  # what the checkpoint keeps to continue this run

    @classmethod
    def check(cls, config) -> None:
        """Before any work, in the launching process: what can be known without opening a run (a tracking server
        answers). One ConfigError line where not."""

    def __init__(self, run: RunDescription, continued: Continued | None) -> None:
        raise NotImplementedError

    def log(self, point: Point) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """What it holds reaches its store (before a checkpoint is written)."""

    def log_model(self, folder: Path) -> None:
        raise NotImplementedError(f"{self.name} keeps no model")

    def close(self, finished: bool) -> None:
        """End the run: finished, or failed (the run stopped on an error)."""
        raise NotImplementedError

    def abandon(self) -> None:
        """Let go of what it holds after it failed (no more calls to its store than needed)."""


def param_text(value: Any) -> str:
    """A param's value as text, for a tracker whose params are text (MLflow): text as is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def first_line(err: BaseException) -> str:
    """'TypeName: the first line of its message' (at most 300 characters)."""
    text = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def library_notes(quiet: bool) -> contextlib.AbstractContextManager:
    """For the block, what a tracker's library prints on stdout goes to stderr (stdout stays for --json), or nowhere
    under --quiet."""
    return contextlib.redirect_stdout(io.StringIO() if quiet else sys.stderr)
