"""The trackers' registry and checks (tuneforge/tracking/__init__.py): `--report-to` as a comma list or repeated, and
every bad input one `error:` line, exit 2, before any training (no output folder made): an unknown name (the valid ones
listed), `none` with another name, --log-model without a tracker that keeps models, a tracking server that does not
answer (in seconds, not after MLflow's minutes of retries), a tracker whose package is not installed (the extra
named). A checkpoint of before trackers still loads.
"""

from __future__ import annotations

import math
import sys
import time

import pytest

from conftest import run_forked, sentiment_split, train_command
from tuneforge.configure import config_from_sources
from tuneforge.files import json_text
from tuneforge.progress import Progress
from tuneforge.tracking import tracker_names, trackers_that


@pytest.mark.parametrize(
    "flags,report_to",
    [
        (["--report-to", "mlflow,tensorboard"], ["mlflow", "tensorboard"]),
        (["--report-to", "jsonl", "tensorboard"], ["jsonl", "tensorboard"]),  # the flag's form of before
        (["--report-to", "wandb", "--report-to", "trackio,jsonl"], ["wandb", "trackio", "jsonl"]),
        (["--report-to", "none"], ["none"]),
        ([], ["jsonl"]),
    ],
)
def test_report_to_takes_a_comma_list_or_several_names(flags, report_to):
    from tuneforge.cli import _flags, build_parser, train_flags

    ns = build_parser("train").parse_args(["train", *flags])
    assert config_from_sources(None, [], _flags(ns, train_flags())).report_to == report_to


def test_the_names_come_from_the_trackers_files():
    assert tracker_names() == ["jsonl", "mlflow", "tensorboard", "trackio", "wandb", "none"]
    assert trackers_that("logs_model") == ["mlflow", "wandb"]


@pytest.fixture
def run_args(tmp_path, tiny_bert):
    def args(*flags: str) -> list[str]:
        files = sentiment_split(tmp_path, 16, 8)
        return train_command(files, tiny_bert, max_steps=1, output_dir=tmp_path / "run") + list(flags)

    return args


def refused(proc, tmp_path) -> str:
    """The one error line of a run refused before any work."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert not (tmp_path / "run").exists() and proc.stdout == ""
    return lines[0]


def cli_in_fork(args: list[str], block: str | None = None):
    """`tuneforge ARGS` in a child forked from this process; `block`: a package that is not installed there
    (Python's own way: None in sys.modules makes its import fail and find_spec find nothing)."""
    from tuneforge.cli import main

    def run() -> int:
        if block:
            sys.modules[block] = None
        return main(args)

    return run_forked(run, ["tuneforge", *args], 120)


FILE_STORE_WAYS_OUT = "use a database such as sqlite:///mlflow.db, or set MLFLOW_ALLOW_FILE_STORE=true"


@pytest.mark.parametrize(
    "flags,needles",
    [
        (["--report-to", "mlflow,tensorbord"], ["unknown tracker 'tensorbord'", ", ".join(tracker_names())]),
        (["--report-to", "none,mlflow"], ["'none' means no tracker at all"]),
        (["--report-to", "none", "--report-to", "wandb"], ["'none' means no tracker at all"]),
        (["--log-model"], ["--log-model", "(mlflow, wandb)", "--report-to jsonl has none"]),
        (["--report-to", "tensorboard,trackio", "--log-model"], ["--report-to tensorboard,trackio has none"]),
        # a tracker flag given now that no tracker of the run reads: it would do nothing
        (
            ["--report-to", "tensorboard", "--tracking-uri", "http://127.0.0.1:5000"],
            ["--tracking-uri is the tracking server or store for mlflow", "--report-to tensorboard has none"],
        ),
        (["--report-to", "wandb", "--tracking-uri", "sqlite:///m.db"], ["--report-to wandb has none"]),
        (["--report-to", "none", "--tracking-uri", "sqlite:///m.db"], ["--report-to none has none"]),
        (["--experiment-name", "mrpc"], ["--experiment-name is", "(e.g. --report-to mlflow)", "jsonl has none"]),
        (
            ["--report-to", "tensorboard", "--run-name", "lr-8e-5"],
            ["--run-name is the tracker run's name for mlflow or trackio or wandb", "tensorboard has none"],
        ),
        # a key=value override is given this time too
        (
            ["tracking_uri=sqlite:///m.db", "--report-to", "none"],
            ["tracking_uri=sqlite:///m.db is the tracking server or store for mlflow", "--report-to none has none"],
        ),
        (["experiment_name=mrpc"], ["experiment_name=mrpc is", "jsonl has none", "or drop experiment_name=mrpc"]),
        (["run_name=' '", "--report-to", "mlflow"], ["run_name=' ' is blank", "drop it for the default"]),
        (["--report-to", "mlflow", "--run-name", ""], ["--run-name '' is blank", "drop it for the default"]),
        (["--report-to", "wandb", "--experiment-name", " "], ["--experiment-name ' ' is blank"]),
        (["--report-to", "mlflow", "--tracking-uri", "http://127.0.0.1:1"], ["http://127.0.0.1:1 does not answer"]),
        (["--report-to", "mlflow", "--tracking-uri", "https://user:secret@127.0.0.1:1/x"], ["127.0.0.1:1/x"]),
        (
            ["--report-to", "mlflow", "--tracking-uri", "http://127.0.0.1:abc"],
            ["--tracking-uri", "not a valid URL", "Port could not be cast"],
        ),
        (
            ["--report-to", "mlflow", "--tracking-uri", "https://user:secret@127.0.0.1:abc"],
            ["--tracking-uri", "not a valid URL", "Port could not be cast"],
        ),
        (["--report-to", "mlflow", "--tracking-uri", "http://[::1"], ["--tracking-uri", "not a valid URL", "IPv6"]),
        (
            ["--report-to", "mlflow", "--tracking-uri", "http://a b:5000"],
            ["--tracking-uri", "not a valid URL", "control characters"],
        ),
        (["--report-to", "mlflow", "--tracking-uri", "mlruns"], ["'mlruns' is a folder", FILE_STORE_WAYS_OUT]),
        (
            ["--report-to", "mlflow", "--tracking-uri", "file:///tmp/x"],
            ["'file:///tmp/x' is a folder", FILE_STORE_WAYS_OUT],
        ),
    ],
)
def test_bad_tracker_settings_are_one_line_before_any_work(flags, needles, run_args, tmp_path):
    started = time.monotonic()
    line = refused(cli_in_fork(run_args(*flags)), tmp_path)
    assert time.monotonic() - started < 20  # an unreachable server: one probe, not MLflow's retries
    assert all(needle in line for needle in needles), line
    assert "secret" not in line


def test_a_config_file_keeps_its_tracker_settings_whatever_its_report_to(run_args, tmp_path):
    """A saved config.yaml holds tracking_uri, experiment_name and run_name whatever its report_to: it re-runs with
    them and --report-to none (only a flag given this time that would do nothing is refused)."""
    from tuneforge.tracking import check_tracker_flags

    settings = {"tracking_uri": "http://127.0.0.1:1", "experiment_name": "mrpc", "run_name": ""}
    config_file = tmp_path / "config.yaml"
    config_file.write_text("".join(f"{key}: {value!r}\n" for key, value in settings.items()))
    config = config_from_sources(str(config_file), [], {"report_to": ["none"]})
    assert (config.tracking_uri, config.experiment_name, config.run_name) == tuple(settings.values())
    check_tracker_flags(config.report_to, {"report_to": ["none"]})  # nothing given now: nothing refused
    check_tracker_flags(["mlflow"], {"tracking_uri": "sqlite:///m.db", "run_name": "a", "experiment_name": "b"})


@pytest.mark.parametrize("tracker", ["mlflow", "wandb", "trackio"])
def test_a_tracker_whose_package_is_missing_names_its_extra(tracker, run_args, tmp_path):
    line = refused(cli_in_fork(run_args("--report-to", f"jsonl,{tracker}"), block=tracker), tmp_path)
    assert line == (
        f"error: --report-to {tracker} needs the {tracker} package, which is not installed: "
        f"pip install 'tuneforge[{tracker}]'"
    )


def test_a_checkpoint_of_before_trackers_loads_with_no_tracker_runs():
    saved = {"step": 4, "epoch": 0, "consumed": 32, "metrics_records": 5}  # trainer_state.json of before
    assert Progress.from_dict(saved).tracker_runs == {}
    assert Progress.from_dict({**saved, "tracker_runs": {"mlflow": "abc"}}).tracker_runs == {"mlflow": "abc"}


def test_flags_of_the_trackers_are_in_train_help():
    from tuneforge.cli import build_parser

    text = " ".join(build_parser("train")._subparsers._group_actions[0].choices["train"].format_help().split())
    for flag in ("--report-to NAME", "--log-model", "--tracking-uri", "--experiment-name", "--run-name"):
        assert flag in text
    assert "MLFLOW_TRACKING_URI" in text


def test_a_record_read_back_with_a_null_metric_is_the_nan_point_the_run_logged():
    """metrics.jsonl writes an undefined metric (pearson of constant predictions) as null; a resume reads the records
    back for the trackers (a tracker new on the resume gets them all): the point is the one the run logged live."""
    from tuneforge.reporting import parsed
    from tuneforge.tracking.base import point_of

    live = {"split": "eval", "step": 2, "epoch": 0, "pearson": math.nan, "loss": 0.5}
    (read,) = parsed([json_text(live)])
    logged, again = point_of(live), point_of(read)
    assert again.step == logged.step == 2 and set(again.metrics) == set(logged.metrics)
    assert math.isnan(again.metrics["eval/pearson"]) and again.metrics["eval/loss"] == 0.5
