"""Experiment trackers: where a training run's metrics go besides metrics.jsonl (`--report-to`).

A tracker is one file here, `tuneforge/tracking/<name>.py`, exposing `TRACKER`, a `Tracker` subclass; adding one is
adding a file, and nothing outside this folder names one (the config's allowed names are `tracker_names()`). Each
tracker's library is an optional extra (`pip install 'tuneforge[mlflow]'`), imported only when its run opens.

The interface (`Tracker`) and what a tracker is given are in base.py. This module owns the registry, the
checks made before any work (`check_report_to`, `check_log_model`: config validation; `check_tracker_flags`: a
tracker's flag given this time that no tracker of the run reads; `check_trackers`: packages installed, a tracking
server that answers) and `Trackers`, the open trackers of one run as the Reporter drives
them: every call guarded, and a tracker that fails mid-run is warned about once on stderr and dropped (the run goes
on; metrics.jsonl is its record).

One tracker run per job: only the main process opens them (Reporter.is_main), on every backend and node. A
resumed job (`--resume`, or the launcher's restart after a worker crash) continues the runs whose ids its checkpoint
holds (Progress.tracker_runs). The steps after the checkpoint are re-run bit-exactly and logged again; how each
tracker keeps such a step from being in its run twice is in its module's docstring. A tracker with no run in the
checkpoint (added on the resume, or a checkpoint of before it) starts one and is first sent the records logged
before the checkpoint, so its run holds the whole job too.

metrics.jsonl is written whatever `report_to` says (a resume cuts it back to the checkpoint's records): `jsonl` in
the list is accepted and adds nothing; `none` is the list without a tracker.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import pkgutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from tuneforge.errors import ConfigError, UserError
from tuneforge.tracking.base import (
    Continued,
    Point,
    Resumption,
    RunDescription,
    Tracker,
    first_line,
    point_of,
    points_of,
    unlogged,
)

__all__ = [
    "Continued",
    "Point",
    "Resumption",
    "RunDescription",
    "Tracker",
    "Trackers",
    "check_log_model",
    "check_report_to",
    "check_tracker_flags",
    "check_trackers",
    "describe_run",
    "points_of",
    "tracker_names",
    "trackers_that",
    "unlogged",
    "uri_variables",
]
JSONL = "jsonl"  # metrics.jsonl: always written (reporting.py), accepted in the list
NONE = "none"  # no tracker; alone in the list
NOT_TRACKERS = {"base"}  # the interface


# ---- the registry --------------------------------------------------------------------------------
@functools.cache
def tracker_modules() -> tuple[str, ...]:
    """The trackers: the files of this folder (found without importing them)."""
    names = (m.name for m in pkgutil.iter_modules(__path__))
    return tuple(sorted(n for n in names if n not in NOT_TRACKERS and not n.startswith("_")))


def tracker_names() -> list[str]:
    """Every name --report-to takes."""
    return sorted([JSONL, *tracker_modules()]) + [NONE]


def tracker_class(name: str) -> type[Tracker]:
    return importlib.import_module(f"tuneforge.tracking.{name}").TRACKER


def trackers_that(capability: str) -> list[str]:
    """The trackers with `capability` (a class attribute such as logs_model), for messages and help."""
    return [name for name in tracker_modules() if getattr(tracker_class(name), capability)]


def uri_variables() -> list[str]:
    """The environment variables that give --tracking-uri's default (each tracker's that takes one)."""
    return [tracker_class(name).uri_variable for name in trackers_that("uri_variable")]


def active_names(report_to: Iterable[str]) -> list[str]:
    """The trackers of a run's `report_to` (not jsonl, which is always written, nor none), each once."""
    return list(dict.fromkeys(n for n in report_to if n in tracker_modules()))


def check_report_to(names: list[Any] | None) -> list[Any] | None:
    """The config's `report_to` (split at commas already): known names, `none` alone. ValueError where not."""
    if names is None:
        return names
    unknown = [n for n in names if n not in tracker_names()]
    if unknown:
        raise ValueError(
            f"unknown tracker {unknown[0]!r}; choose from {', '.join(tracker_names())} (several: comma-separated)"
        )
    if NONE in names and len(names) > 1:
        raise ValueError(f"'{NONE}' means no tracker at all and combines with no other name")
    return names


def check_log_model(report_to: Iterable[str]) -> None:
    """--log-model needs a tracker that keeps models. ValueError where the run has none."""
    able = trackers_that("logs_model")
    if not any(name in able for name in active_names(report_to)):
        given = ",".join(report_to) or NONE
        raise ValueError(
            f"--log-model uploads OUTPUT_DIR/model to a tracker that keeps models ({', '.join(able)}), and "
            f"--report-to {given} has none; add one (e.g. --report-to {able[0]}) or drop --log-model"
        )


# a tracker flag -> (what it gives, the capability of the trackers that read it)
TRACKER_FLAGS = {
    "tracking_uri": ("the tracking server or store", "uri_variable"),
    "experiment_name": ("the experiment or project the tracker run goes to", "names_runs"),
    "run_name": ("the tracker run's name", "names_runs"),
}


def check_tracker_flags(
    report_to: Iterable[str], given: Mapping[str, Any], overrides: Mapping[str, Any] | None = None
) -> None:
    """The tracker settings the user gave this time (`given`: the command line's flags; `overrides`: its key=value
    overrides, parsed; not a config file's: a saved config.yaml keeps them whatever its report_to) each read by a
    tracker of `report_to`, and not blank (which would fall back to the default name). ConfigError where not."""
    for key, (what, capability) in TRACKER_FLAGS.items():
        said = _given_now(key, given, overrides or {})
        if said is None:
            continue
        named, blank = said
        if blank:
            raise ConfigError(f"{blank} is blank; give {what}, or drop it for the default")
        readers = trackers_that(capability)
        if not any(name in readers for name in active_names(report_to)):
            shown = ",".join(report_to) or NONE
            raise ConfigError(
                f"{named} is {what} for {' or '.join(readers)}, and --report-to {shown} has none, so it would do "
                f"nothing; add one (e.g. --report-to {readers[0]}) or drop {named}"
            )


def _given_now(key: str, flags: Mapping[str, Any], overrides: Mapping[str, Any]) -> tuple[str, str] | None:
    """How a tracker setting was given this time (the flag wins, as it does over an override): (its name as the user
    wrote it, that with its value where the value is blank, else ""); None where it was not."""
    if flags.get(key) is not None:
        flag, value = f"--{key.replace('_', '-')}", flags[key]
        return flag, "" if str(value).strip() else f"{flag} {value!r}"
    if overrides.get(key) is not None:
        value = overrides[key]
        return f"{key}={value}", "" if str(value).strip() else f"{key}={value!r}"
    return None


def install(cls: type[Tracker]) -> str:
    return f"pip install 'tuneforge[{cls.extra}]'" if cls.extra else f"pip install {cls.package}"


def check_trackers(config) -> None:
    """Before any work, where the run's trackers open (the launching process, node 0): each one's package is
    installed (else one line naming the extra to install) and its own check passes."""
    for name in active_names(config.report_to):
        cls = tracker_class(name)
        if importlib.util.find_spec(cls.package) is None:
            raise ConfigError(
                f"--report-to {name} needs the {cls.package} package, which is not installed: {install(cls)}"
            )
        cls.check(config)


# ---- a run's description -------------------------------------------------------------------------
def flat_config(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config values as {dotted key: value}, each value as config.yaml holds it (a number stays a number, as
    transformers' WandbCallback and TrackioCallback send theirs: W&B sorts and filters them as numbers)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping) and value:
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def tuneforge_version() -> str:
    try:
        return importlib.metadata.version("tuneforge")
    except importlib.metadata.PackageNotFoundError:  # the source tree on the path, not installed
        return "unknown"


def describe_run(config, backend, device: str) -> RunDescription:
    """The tracker runs' names, params (config.yaml's content, flattened) and tags of a run on `backend`, whose
    `device` is named (a GPU's name, or the CPU and its class)."""
    tags = {
        "tuneforge.version": tuneforge_version(),
        "tuneforge.task": str(config.task),
        "tuneforge.backend": backend.name,
        "tuneforge.device": device,
        "tuneforge.world_size": str(backend.world_size),
    }
    out = Path(config.output_dir)
    return RunDescription(
        output_dir=out,
        experiment=config.experiment_name,
        name=config.run_name or out.resolve().name,
        tracking_uri=config.tracking_uri,
        params=flat_config(config.to_dict()),
        tags=tags,
        quiet=config.quiet,
    )


# ---- the open trackers of one run ----------------------------------------------------------------
def open_tracker(name: str, run: RunDescription, continued: Continued | None) -> Tracker:
    """Tracker `name`'s run; a failure to open it (no package, no server, refused credentials) is one ConfigError
    line, before training starts."""
    cls = tracker_class(name)
    try:
        return cls(run, continued)
    except UserError:
        raise
    except ImportError as err:
        raise ConfigError(
            f"--report-to {name}: {cls.package} does not import ({first_line(err)}); {install(cls)}"
        ) from None
    except Exception as err:
        raise ConfigError(f"--report-to {name}: could not start its run ({first_line(err)})") from None


class Trackers:
    """The open trackers of one run (main process). Each call reaches every tracker still live; one that raises
    is warned about once (`warn`) and dropped. `ids` keeps the run ids of all that opened, dropped ones too, so a
    resume continues their runs."""

    def __init__(self, trackers: list[Tracker], warn: Callable[[str], None]) -> None:
        self.live = list(trackers)
        self.warn = warn
        self.ids = {t.name: t.run_id for t in trackers if t.run_id is not None}

    @classmethod
    def open(cls, report_to: Iterable[str], run: RunDescription, resumed: Resumption | None, warn) -> Trackers:
        """Open the trackers named in `report_to` (on a resume, each continuing its run of the checkpoint). Where
        one fails to open, those opened are closed as failed and the error is raised."""
        opened: list[Tracker] = []
        try:
            for name in active_names(report_to):
                opened.append(open_tracker(name, run, resumed.of(name) if resumed else None))
        except BaseException:
            cls(opened, warn).close(finished=False)
            raise
        return cls(opened, warn)

    def _call(self, tracker: Tracker, what: str, *args) -> None:
        try:
            getattr(tracker, what)(*args)
        except Exception as err:
            self.live.remove(tracker)
            self.warn(
                f"warning: {tracker.name} failed ({first_line(err)}); it gets nothing more from this run, "
                "which goes on (metrics.jsonl has every record)"
            )
            try:
                tracker.abandon()
            except Exception:
                pass

    def log(self, record: Mapping[str, Any]) -> None:
        point = point_of(record)
        if point is not None:
            for tracker in list(self.live):
                self._call(tracker, "log", point)

    def flush(self) -> None:
        for tracker in list(self.live):
            self._call(tracker, "flush")

    def log_model(self, folder: Path) -> None:
        for tracker in list(self.live):
            if tracker.logs_model:
                self._call(tracker, "log_model", folder)

    def close(self, finished: bool) -> None:
        for tracker in list(self.live):
            self._call(tracker, "close", finished)
        self.live = []
