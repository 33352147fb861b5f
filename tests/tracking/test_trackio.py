"""trackio (tuneforge/tracking/trackio.py) in its local store, on the job of tracked.offline_job: the killed and
resumed attempts are one trackio run holding metrics.jsonl's values at their steps, each step once, and the config;
the continued attempt, whose checkpoint names no trackio run, starts a run that holds the job's records from its
start. Read back from trackio's SQLite file (this test process never imports trackio: trackio fixes its folder,
TRACKIO_DIR, when imported, and the forked jobs import it with the test's folder).
"""

from __future__ import annotations

import importlib.util
import json
import sqlite3
from pathlib import Path

import pytest
import yaml
from tracked import expected_histories, flattened, offline_job, run_ids_in_checkpoint

if importlib.util.find_spec("trackio") is None:
    pytest.skip("the trackio extra is not installed (pip install 'tuneforge[trackio]')", allow_module_level=True)


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_bert, cache_dir):
    return offline_job(tmp_path_factory, tiny_bert, cache_dir)


def stored(store: Path, project: str = "tuneforge") -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Each run of a trackio project's SQLite file by name, oldest first: {key: [(step, value)] by step}."""
    runs: dict[tuple[str, str], dict[str, list[tuple[int, float]]]] = {}
    with sqlite3.connect(store / f"{project}.db") as db:
        rows = db.execute("SELECT run_id, run_name, step, metrics FROM metrics ORDER BY id").fetchall()
    for run_id, name, step, metrics in rows:
        for key, value in json.loads(metrics).items():
            runs.setdefault((run_id, name), {}).setdefault(key, []).append((step, value))
    return {name: {key: sorted(points) for key, points in run.items()} for (_, name), run in runs.items()}


def test_a_resumed_job_is_one_trackio_run_with_each_step_once(job):
    # the continued attempt's new run is not named 'run' again: trackio resumes the latest run of a name, so a
    # resume of the first would have continued it
    assert run_ids_in_checkpoint(job / "run", 2)["trackio"] == "run"
    assert run_ids_in_checkpoint(job / "run", 6)["trackio"] == "run-2"
    runs = stored(job / "trackio")
    assert list(runs) == ["run", "run-2"]
    resumed, continued = runs["run"], runs["run-2"]
    expected = expected_histories(job / "run")
    assert resumed == {key: [(s, v) for s, v in points if s <= 4] for key, points in expected.items()}
    assert continued == expected  # a new run: the job's records up to its checkpoint first


def test_the_runs_hold_the_config_and_tags(job):
    with sqlite3.connect(job / "trackio" / "tuneforge.db") as db:
        resumed, continued = [json.loads(row[0]) for row in db.execute("SELECT config FROM configs ORDER BY id")]
    config = flattened(yaml.safe_load((job / "run" / "config.yaml").read_text()))  # the continued attempt's
    assert config["resume"] == "latest" and config["max_steps"] == 6 and config["optim.lr"] == 8e-5
    assert {k: v for k, v in continued.items() if not k.startswith(("_", "tuneforge."))} == config
    assert {k: v for k, v in resumed.items() if not k.startswith(("_", "tuneforge."))} == {
        **config,
        "max_steps": None,
    }
    assert resumed["batch_size"] == 8 and resumed["quiet"] is True  # numbers and booleans as such
    assert resumed["tuneforge.task"] == "classification" and resumed["tuneforge.world_size"] == "1"
