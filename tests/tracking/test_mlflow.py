"""MLflow (tuneforge/tracking/mlflow.py) against a real `mlflow server` on 127.0.0.1, started once for the module:
a job killed after a checkpoint and resumed is one run, FINISHED, holding metrics.jsonl's values at its steps, each
step once, the config as params, the tags and the model; a 2-process ddp job is one run; a run the tracker loses mid-way
is one warning and the training goes on; a record is only queued, and a flush (before each checkpoint) finds every one
in the run. Read back through MLflow's own client.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from tracked import (
    as_params,
    crash_and_resume,
    expected_histories,
    flattened,
    job_flags,
    prepare_forks,
    run_ids_in_checkpoint,
)

from conftest import cli_flags, free_port, last_json, read_jsonl, run_cli, run_forked, sentiment_split, tiny_run_config
from conftest import train_command as train_args

pytest.importorskip("mlflow", reason="the mlflow extra is not installed (pip install 'tuneforge[mlflow]')")
from mlflow.entities import ViewType  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from tuneforge.callbacks import Callback  # noqa: E402


@pytest.fixture(scope="module")
def mlflow_booting(tmp_path_factory):
    """`mlflow server` started (not yet answering) with an SQLite store and proxied artifacts in a temporary folder,
    on a free port: (process, URL, log file). Killed with its process group after the module. MLflow's job runners
    are off: they are processes of their own."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port, log = free_port(), root / "server.log"
    command = [shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow", "server"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "art")]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=out, env=env, start_new_session=True)
    try:
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # a test's server: nothing of it is kept
        proc.wait()


@pytest.fixture(scope="module")
def mlflow_server(mlflow_booting, tiny_bert):
    """The URL of the module's `mlflow server` once it answers. While it starts (seconds of imports), this process
    imports what the forked jobs use (tracked.prepare_forks) and the tiny model is made."""
    proc, url, log = mlflow_booting
    prepare_forks()
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).close()
            return url
        except OSError:
            assert time.monotonic() < deadline, "mlflow server did not come up in 120 s"
            time.sleep(0.2)


LONG = ",".join(["query"] * 120)  # 719 characters (lora_targets of a config file: kept without --adapter lora)


def runs_of(client: MlflowClient, experiment: str) -> list:
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.fixture(scope="module")
def resumed_job(mlflow_server, tmp_path_factory, tiny_bert, cache_dir):
    """The tiny job (tracked.py) reporting to MLflow and TensorBoard with --log-model, killed after checkpoint 2 and
    resumed: (run folder, the resumed attempt's stdout)."""
    d = tmp_path_factory.mktemp("mlflow-job")
    flags = job_flags(d, tiny_bert, cache_dir, "mlflow", "tensorboard", tracking_uri=mlflow_server, log_model=True)
    (d / "long.yaml").write_text(yaml.safe_dump({"lora_targets": LONG}))  # longer than MLflow's 500 characters
    flags += [*cli_flags(experiment_name="resumed"), str(d / "long.yaml")]
    client = MlflowClient(mlflow_server)

    def killed_attempt_sent_the_steps_after_the_checkpoint():
        (run,) = runs_of(client, "resumed")
        assert run.info.status == "RUNNING"
        assert [step for step, _ in history(client, run.info.run_id, "train/loss")] == [1, 2, 3, 4]

    stdout, _ = crash_and_resume(flags, d / "run", d / "logs", killed_attempt_sent_the_steps_after_the_checkpoint)
    return d / "run", stdout


def test_a_resumed_job_is_one_finished_run_with_each_step_once(mlflow_server, resumed_job):
    out, stdout = resumed_job
    client = MlflowClient(mlflow_server)
    (run,) = runs_of(client, "resumed")
    assert run.info.run_id == run_ids_in_checkpoint(out, 2)["mlflow"] == run_ids_in_checkpoint(out, 4)["mlflow"]
    assert run.info.status == "FINISHED" and run.info.run_name == "run"  # the output dir's name
    expected = expected_histories(out)
    assert {"train/loss", "train/lr", "eval/accuracy", "eval/f1", "eval/loss"} <= set(expected)
    assert set(run.data.metrics) == set(expected)
    for key, points in expected.items():
        assert history(client, run.info.run_id, key) == points, key
    assert [step for step, _ in expected["train/loss"]] == [1, 2, 3, 4]
    assert stdout.strip().splitlines() == [json.dumps(last_json(stdout))]  # --quiet --json: MLflow's notes not here


def test_the_run_holds_the_config_the_tags_and_the_model(mlflow_server, resumed_job, tmp_path):
    from tuneforge.environment import cpu_class

    out, _ = resumed_job
    client = MlflowClient(mlflow_server)
    (run,) = runs_of(client, "resumed")
    config = as_params(flattened(yaml.safe_load((out / "config.yaml").read_text())))  # the resumed attempt's
    assert config["resume"] == "latest" and run.data.params["resume"] == "null"  # the params of the first start
    assert config["lora_targets"] == LONG and run.data.params["lora_targets"] == LONG[:497] + "..."
    assert run.data.params == {**config, "resume": "null", "lora_targets": LONG[:497] + "..."}
    assert run.data.params["optim.lr"] == config["optim.lr"] and run.data.params["data.max_length"] == "128"
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("tuneforge.")}
    assert tags == {
        "tuneforge.version": importlib.metadata.version("tuneforge"),
        "tuneforge.task": "classification",
        "tuneforge.backend": "single",
        "tuneforge.device": cpu_class(),
        "tuneforge.world_size": "1",
    }
    model = sorted(p.name for p in (out / "model").iterdir())
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "model")) == [f"model/{n}" for n in model]
    copy = client.download_artifacts(run.info.run_id, "model/model.safetensors", str(tmp_path))
    assert Path(copy).read_bytes() == (out / "model" / "model.safetensors").read_bytes()


def test_a_ddp_job_is_one_run_written_by_the_main_process(mlflow_server, tmp_path, tiny_bert, cache_dir):
    run_flags = dict(max_steps=3, batch_size=4, logging_steps=1, eval_strategy="no", precision="fp32", quiet=True)
    flags = train_args(sentiment_split(tmp_path, 24, 8), tiny_bert, **run_flags, cache_dir=cache_dir, json=True)
    flags += cli_flags(backend="ddp", nproc=2, output_dir=tmp_path / "run", experiment_name="ddp")
    proc = run_cli(*flags, "--report-to", "mlflow", "--tracking-uri", mlflow_server)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(mlflow_server)
    (run,) = runs_of(client, "ddp")
    assert run.data.tags["tuneforge.world_size"] == "2" and run.data.tags["tuneforge.backend"] == "ddp"
    assert run.info.status == "FINISHED"
    for key, points in expected_histories(tmp_path / "run").items():
        assert history(client, run.info.run_id, key) == points, key


class LoseTheRunAt(Callback):
    """At the end of step `step`, once the server holds that step's loss (the tracker sends it in the background), the
    run's MLflow run is deleted on the server: the tracker's next send fails."""

    def __init__(self, url: str, experiment: str, step: int):
        self.url, self.experiment, self.step = url, experiment, step

    def on_step_end(self, trainer) -> None:
        if trainer.state.step == self.step:
            client = MlflowClient(self.url)
            (run,) = runs_of(client, self.experiment)
            deadline = time.monotonic() + 60
            while self.step not in [step for step, _ in history(client, run.info.run_id, "train/loss")]:
                assert time.monotonic() < deadline, f"step {self.step} never reached the server"
                time.sleep(0.05)
            client.delete_run(run.info.run_id)


def test_a_tracker_that_fails_mid_run_is_one_warning_and_the_run_goes_on(mlflow_server, tmp_path, tiny_bert, cache_dir):
    from tuneforge.trainer import Trainer

    values = dict(max_steps=5, eval_strategy="no", report_to=["mlflow", "tensorboard"], experiment_name="lost")
    config = tiny_run_config(tmp_path, tiny_bert, cache_dir, tracking_uri=mlflow_server, **values)
    trainer = Trainer(config, callbacks=[LoseTheRunAt(mlflow_server, "lost", step=2)])

    def fit() -> int:
        trainer.fit()
        return 0

    proc = run_forked(fit, ["Trainer.fit"], 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: mlflow failed"), proc.stderr[-3000:]
    assert "must be in the 'active' state" in warnings[0]
    run = tmp_path / "run"
    assert (run / "result.json").exists() and (run / "model" / "model.safetensors").exists()
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "train"] == [1, 2, 3, 4, 5]
    client = MlflowClient(mlflow_server)
    lost = client.search_runs([client.get_experiment_by_name("lost").experiment_id], run_view_type=ViewType.ALL)
    assert [step for step, _ in history(client, lost[0].info.run_id, "train/loss")] == [1, 2]


def test_a_record_is_only_queued_and_a_flush_finds_every_one_in_the_run(mlflow_server, tmp_path):
    """Logging is asynchronous: right after 100 records are logged the server holds few of them (the step did not wait
    for it); after `flush` (what every checkpoint calls first, Reporter.checkpoint_trackers) it holds each one, once.
    A send that fails in the background (the run deleted on the server) is raised by the tracker's next call."""
    from mlflow.exceptions import MlflowException

    from tuneforge.tracking import Point, RunDescription
    from tuneforge.tracking.mlflow import MlflowTracker

    run = RunDescription(tmp_path, "queued", "queued", mlflow_server, {"lr": "0.1"}, {"tuneforge.task": "x"}, True)
    tracker = MlflowTracker(run, None)
    client = MlflowClient(mlflow_server)
    expected = [(step, 1.0 / step) for step in range(1, 101)]
    try:
        for step, loss in expected:
            tracker.log(Point(step, {"train/loss": loss}))
        assert len(history(client, tracker.run_id, "train/loss")) < len(expected)
        tracker.flush()
        assert history(client, tracker.run_id, "train/loss") == expected
        assert client.get_run(tracker.run_id).data.params == {"lr": "0.1"}
        client.delete_run(tracker.run_id)
        tracker.log(Point(101, {"train/loss": 0.0}))  # queued: its send fails in the background
        with pytest.raises(MlflowException, match="must be in the 'active' state"):
            tracker.flush()
        with pytest.raises(MlflowException, match="must be in the 'active' state"):
            tracker.log(Point(102, {"train/loss": 0.0}))
    finally:
        tracker.abandon()


def test_a_resumed_run_does_not_log_again_the_steps_of_a_metric_whose_key_mlflow_refuses(mlflow_server, tmp_path):
    """An embedding run's `eval/ndcg@10` is `eval/ndcg_10` in MLflow (`@` refused in keys): a resume asks the server
    for that key's last step and must skip the steps it holds, kept and re-run ones alike."""
    from tuneforge.tracking import Continued, Point, RunDescription
    from tuneforge.tracking.mlflow import MlflowTracker

    run = RunDescription(tmp_path, "odd-keys", "odd-keys", mlflow_server, {"lr": "0.1"}, {"tuneforge.task": "x"}, True)
    points = [Point(step, {"eval/ndcg@10": step / 10, "train/loss": 1.0 / step}) for step in (1, 2, 3)]
    killed = MlflowTracker(run, None)
    for point in points[:2]:  # step 2 logged after the checkpoint of step 1
        killed.log(point)
    killed.close(finished=False)
    resumed = MlflowTracker(run, Continued(killed.run_id, kept=tuple(points[:1]), replayed=tuple(points[1:2])))
    for point in points[1:]:  # step 2 re-run, then step 3
        resumed.log(point)
    resumed.close(finished=True)
    client = MlflowClient(mlflow_server)
    assert set(client.get_run(killed.run_id).data.metrics) == {"eval/ndcg_10", "train/loss"}
    assert history(client, killed.run_id, "eval/ndcg_10") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [step for step, _ in history(client, killed.run_id, "train/loss")] == [1, 2, 3]
