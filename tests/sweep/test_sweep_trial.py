"""One trial's child process (tuneforge/sweep/trial.py): a real `tuneforge train` run forked into a process group of
its own, stopped as a pruned trial is (SIGTERM to the group), then resumed from its checkpoint as an interrupted
trial is; and what the sweep reads of a trial's folder."""

import json
import math
import os
import signal
import time

import pytest

from conftest import write_sentiment_csv
from tuneforge.sweep import trial as trials


def tiny_values(tmp_path, tiny_bert, cache_dir) -> dict:
    train = write_sentiment_csv(tmp_path / "train.csv", 48, seed=1)
    val = write_sentiment_csv(tmp_path / "val.csv", 16, seed=2)
    data = {"train_file": str(train), "validation_file": str(val), "cache_dir": cache_dir}
    run = {"max_steps": 4, "batch_size": 8, "eval_strategy": "steps", "eval_steps": 2, "precision": "fp32"}
    return {"task": "classification", "model": tiny_bert, **run, "data": data}


def wait_for(proc: trials.TrialProcess, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the trial did not end"
        time.sleep(0.05)
    return proc.returncode


def test_a_stopped_trial_ends_with_its_group_and_resumes_from_its_checkpoint(
    tmp_path, tiny_bert, cache_dir, monkeypatch
):
    folder = tmp_path / "trial-0007"
    values = trials.with_checkpoints(tiny_values(tmp_path, tiny_bert, cache_dir), "steps", 2)
    trials.write_trial_config(folder, values, 7)
    marker = tmp_path / "paused"
    for name, value in dict(IN_SAVE="600", STAGE="start", STEP="4", MARKER=str(marker)).items():
        monkeypatch.setenv(f"TUNEFORGE_PAUSE_{name}", value)  # the child inherits it: it pauses in its second save
    flags = trials.start_flags(folder, interrupted=False)
    assert flags == {"output_dir": str(folder)}
    proc = trials.start(folder, flags, threads=1)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (folder / trials.TRIAL_LOG).read_text()[-2000:]
        time.sleep(0.05)
    assert os.getpgid(proc.pid) == proc.pid  # the leader of its own group
    assert proc.stop(grace=20) == -signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of its group is left
    assert [step for step, _ in trials.evaluations(folder, "loss")] == [2, 4]  # step 4's save is where it paused
    assert trials.read_result(folder, "loss") == (None, "no readable result.json")
    assert (folder / "checkpoint-2").is_dir() and not (folder / "model").exists()

    monkeypatch.delenv("TUNEFORGE_PAUSE_IN_SAVE")
    flags = trials.start_flags(folder, interrupted=True)
    assert flags == {"output_dir": str(folder), "resume": "latest"}
    assert wait_for(trials.start(folder, flags, threads=1)) == 0
    log = (folder / trials.TRIAL_LOG).read_text()
    assert log.splitlines()[0].endswith(f"] tuneforge train {folder / trials.TRIAL_CONFIG} --output-dir {folder}")
    assert f"--output-dir {folder} --resume latest\n" in log and f"resumed from {folder / 'checkpoint-2'}" in log
    value, why = trials.read_result(folder, "loss")
    assert why == "" and value == json.loads((folder / "result.json").read_text())["loss"]
    assert [step for step, _ in trials.evaluations(folder, "loss")] == [2, 4]


def test_a_failing_trial_says_why(tmp_path, tiny_bert, cache_dir):
    folder = tmp_path / "trial-0000"
    values = tiny_values(tmp_path, tiny_bert, cache_dir)
    trials.write_trial_config(folder, {**values, "data": {**values["data"], "train_file": str(tmp_path / "no.csv")}}, 0)
    assert wait_for(trials.start(folder, trials.start_flags(folder, interrupted=False), threads=1)) == 2
    assert trials.last_error(folder).startswith("error: ") and "no.csv" in trials.last_error(folder)
    # an interrupted trial that saved nothing starts again over what it wrote
    (folder / "metrics.jsonl").write_text("")
    assert trials.start_flags(folder, interrupted=True) == {"output_dir": str(folder), "overwrite": True}


def test_what_the_sweep_reads_of_a_trial(tmp_path):
    folder = tmp_path / "trial-0000"
    folder.mkdir()
    lines = [
        {"split": "train", "step": 2, "loss": 0.9},
        {"split": "eval", "step": 2, "loss": 0.7, "f1": 0.5},
        {"split": "eval", "step": 4, "f1": 0.6},  # no loss in this one
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"split": "ev')
    assert trials.evaluations(folder, "loss") == [(2, 0.7)] and trials.evaluations(folder, "f1") == [(2, 0.5), (4, 0.6)]
    assert trials.unlogged_metric(folder, "f1") is None and trials.unlogged_metric(folder, "train_loss") is None
    assert trials.unlogged_metric(folder, "acc") == "its evaluations log loss, f1"
    assert trials.unlogged_metric(tmp_path, "acc") is None  # no evaluation yet
    (folder / "result.json").write_text(json.dumps({"accuracy": 0.5, "loss": float("nan")}))
    assert trials.read_result(folder, "f1") == (
        None,
        "result.json has no metric 'f1' (it has: accuracy, loss); pass --metric",
    )
    assert trials.read_result(folder, "loss") == (None, "its loss is nan")
    assert trials.read_result(folder, "accuracy") == (0.5, "")


def test_an_undefined_metric_a_trial_writes_as_null_is_nan_to_the_sweep(tmp_path):
    """A run writes an undefined metric (pearson of constant predictions) as null: the sweep reads it as the nan it
    was, never as a metric the trial lacks (a wrong "pass --metric"), and reports it to the pruner as nan."""
    folder = tmp_path / "trial-0000"
    folder.mkdir()
    lines = [{"split": "eval", "step": 2, "loss": 0.7, "pearson": None}, {"split": "eval", "step": 4, "pearson": 0.1}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (step, first), later = trials.evaluations(folder, "pearson")
    assert step == 2 and math.isnan(first) and later == (4, 0.1)
    assert trials.unlogged_metric(folder, "pearson") is None
    assert trials.unlogged_metric(folder, "spearman") == "its evaluations log loss, pearson"
    (folder / "result.json").write_text(json.dumps({"pearson": None, "loss": 0.7, "model_dir": "m"}))
    assert trials.read_result(folder, "pearson") == (None, "its pearson is nan")
    assert trials.read_result(folder, "f1") == (
        None,
        "result.json has no metric 'f1' (it has: pearson, loss); pass --metric",
    )


def test_trials_save_a_checkpoint_at_each_evaluation_unless_the_config_says(tmp_path):
    assert trials.with_checkpoints({"a": 1}, "steps", 50) == {
        "a": 1,
        "save_strategy": "steps",
        "save_total_limit": 1,
        "save_steps": 50,
    }
    assert trials.with_checkpoints({}, "epoch", None) == {"save_strategy": "epoch", "save_total_limit": 1}
    assert trials.with_checkpoints({"save_strategy": "no"}, "steps", 50) == {"save_strategy": "no"}
    assert trials.with_checkpoints({"save_steps": 7}, "steps", 50) == {"save_steps": 7}
    assert trials.with_checkpoints({}, "no", None) == {}
