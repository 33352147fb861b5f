"""MLflow: one MLflow run per job, through `MlflowClient` (no fluent API, no global active run).

Where: --tracking-uri, else MLFLOW_TRACKING_URI, else MLflow's own default (sqlite:///mlflow.db in the working
folder). An http(s) server is probed before any work (`check`: one request, a few seconds' timeout), so an unreachable
one is one error line, not minutes of MLflow's HTTP retries (a broken URL, and a folder, MLflow's file store that
it opens only with MLFLOW_ALLOW_FILE_STORE set, are one line too); while the run lasts, MLflow's retries are cut to a
few seconds (MLflow's own settings, set through its API for this process unless the user set them), so a server that
goes away mid-run costs seconds before the tracker is dropped with a warning.

Experiment: --experiment-name, else MLFLOW_EXPERIMENT_NAME, else "tuneforge"; run name: --run-name, else the output
dir's name. Params: the resolved config flattened with dots, values as text (MLflow's params are text: anything but
text as JSON), cut to 500 characters (older MLflow servers' limit; 3.x takes 6000), in batches of 100 (MLflow's
limit), set when the run is created (a resume keeps them: MLflow refuses a changed value, and the resumed config
differs in `resume`). Tags: tuneforge.version, .task, .backend, .device, .world_size (set again on a resume, whose
world may differ). Metrics: each record's numeric values at its step, in batches of at most 1000; characters MLflow
refuses in a key become `_`.

Resume: the run whose id the checkpoint holds continues (status back to RUNNING). The server keeps what the
interrupted attempt logged, after the checkpoint too, so the last step of each of the run's metrics is asked for,
and a value at or below it is not sent again: the re-run steps it has are skipped and every step is in the run once.
Records from before the checkpoint that the server lacks (its attempt was killed before they reached it, or the
tracker had failed) are sent when the run opens; a run id the server does not know starts a new run (a note says
so) that is sent them all.

Asynchronous: a record's metrics are only queued by `log` (the training step never waits on the server); one
background thread of the tracker (`Sender`) sends them, one log_batch a record, in their order. What is queued is
flushed (waited for) before each checkpoint is written (`flush`, through Reporter.checkpoint_trackers), before the
model's upload and at the end (`close`), so a checkpoint's records are in the run before the checkpoint is. The
first error of a send stops the sending (what is queued after it is dropped) and is raised by the tracker's next
call (`log`, `flush`, `log_model` or `close`): the same one warning and dropped tracker as a failure in the step
itself. The run's opening (params, tags, the resume's records) is synchronous: its failure is one error line before
training. (MLflow's own `log_batch(synchronous=False)` is not used: its queue is the process's, shared by every
client of a store and inherited by forked children, sends on 10 threads at once, logs each failed batch as an error
of its own and cannot drop what is queued, and its exit hook waits for every retry.)

--log-model: OUTPUT_DIR/model uploaded under the run's `model/` artifacts (log_artifacts). End: status FINISHED, or
FAILED where the run stopped on an error; MLflow's note of the run's address goes to stderr (none under --quiet).
"""

from __future__ import annotations

import http.client
import queue
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tuneforge.errors import ConfigError
from tuneforge.tracking.base import Continued, Point, RunDescription, Tracker, library_notes, param_text, unlogged

DEFAULT_EXPERIMENT = "tuneforge"
URI_VARIABLE = "MLFLOW_TRACKING_URI"
PROBE_TIMEOUT_S = 5
PARAM_VALUE_LIMIT = 500  # older MLflow servers refuse longer values (3.x takes 6000)
PARAMS_PER_BATCH = 100  # MLflow's limits of one log_batch
METRICS_PER_BATCH = 1000
# MLflow's HTTP settings while the run lasts (where the user set none): 2 retries, 1 s backoff factor, 30 s per
# request (not for the model's upload), instead of 7 retries over ~4 minutes and 120 s
HTTP_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": 2, "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": 1}
HTTP_TIMEOUT_S = 30
REFUSED_IN_KEYS = re.compile(r"[^\w\-. /]")


def tracking_uri(given: str | None) -> str | None:
    """--tracking-uri, else MLFLOW_TRACKING_URI (None: MLflow's default)."""
    from tuneforge.launch import env_flag

    return given or env_flag(URI_VARIABLE)


def shown_uri(uri: str) -> str:
    """`uri` without the user and password it may hold."""
    parts = urllib.parse.urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def is_server(uri: str) -> bool:
    """`uri` is an http(s) server's URL; one ConfigError line where it is a broken one (a port that is no number, an
    IPv6 address not closed), before MLflow or the probe meets it as an internal error. (Only http(s): in other
    schemes, such as databricks://PROFILE:PREFIX, what follows a colon is no port.)"""
    if uri.partition(":")[0].lower() not in ("http", "https"):
        return False
    try:
        urllib.parse.urlsplit(uri).port  # noqa: B018 (read for its check: a port that is no number raises)
    except ValueError as err:
        raise ConfigError(f"--tracking-uri (or {URI_VARIABLE}) is not a valid URL ({err})") from None
    return True


def check_file_store(uri: str) -> None:
    """A folder (a path, or a file: URI) is MLflow's file store, which MLflow 3 refuses to open unless
    MLFLOW_ALLOW_FILE_STORE is set: one ConfigError line with both ways out, before any work (MLflow's own message
    comes as the run opens, cut to a line)."""
    import mlflow.environment_variables as settings

    allowed = getattr(settings, "MLFLOW_ALLOW_FILE_STORE", None)  # (MLflow versions that take a folder lack it)
    if allowed is None or allowed.get() or urllib.parse.urlsplit(uri).scheme not in ("", "file"):
        return
    raise ConfigError(
        f"--tracking-uri (or {URI_VARIABLE}) {uri!r} is a folder, MLflow's file store, which MLflow no longer opens "
        "by default; use a database such as sqlite:///mlflow.db, or set MLFLOW_ALLOW_FILE_STORE=true"
    )


def probe(uri: str) -> None:
    """An http(s) tracking server answers one request within PROBE_TIMEOUT_S (any HTTP answer counts: a server
    without /health, or one that wants credentials, is there); else one ConfigError line."""
    url = shown_uri(uri).rstrip("/") + "/health"
    try:
        urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return
    except http.client.InvalidURL as err:  # a host with spaces or control characters
        raise ConfigError(f"--tracking-uri (or {URI_VARIABLE}) {shown_uri(uri)!r} is not a valid URL ({err})") from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise ConfigError(
            f"the MLflow tracking server {shown_uri(uri)} does not answer ({reason}); start it, or pass another "
            "--tracking-uri (or MLFLOW_TRACKING_URI)"
        ) from None


class MlflowTracker(Tracker):
    name = "mlflow"
    package = "mlflow"
    extra = "mlflow"
    names_runs = True
    logs_model = True
    uri_variable = URI_VARIABLE

    @classmethod
    def check(cls, config) -> None:
        uri = tracking_uri(config.tracking_uri)
        if uri and is_server(uri):
            probe(uri)
        elif uri:
            check_file_store(uri)

    def __init__(self, run: RunDescription, continued: Continued | None) -> None:
        from mlflow.tracking import MlflowClient

        self.quiet = run.quiet
        self.sender: Sender | None = None
        self._http_settings_set = quick_http_settings()
        try:
            self.client = MlflowClient(tracking_uri=tracking_uri(run.tracking_uri))
            self._open(run, continued)
            self.sender = Sender(self._send)
        except BaseException:
            self.abandon()
            raise

    def _open(self, run: RunDescription, continued: Continued | None) -> None:
        self.run_id = self._continue(continued.run_id) if continued and continued.run_id else None
        self.last_steps: dict[str, int] = {}
        if self.run_id is not None:
            self.last_steps = self._last_steps()
            self.client.update_run(self.run_id, status="RUNNING")
            self._log_batch(tags=run.tags)
        else:
            self._create(run)
        if continued is not None:  # records from before the checkpoint the run lacks
            self._log_points(continued.kept)

    def _continue(self, run_id: str) -> str | None:
        """`run_id` where the server has it (None: it does not, and a new run starts)."""
        from mlflow.exceptions import MlflowException

        try:
            found = self.client.get_run(run_id)
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            found = None
        if found is None or found.info.lifecycle_stage == "deleted":
            print(
                f"note: MLflow run {run_id} of the checkpoint is not on this server: a new run starts", file=sys.stderr
            )
            return None
        return run_id

    def _create(self, run: RunDescription) -> None:
        """A new run in the experiment (made where missing), with the config as its params."""
        from tuneforge.launch import env_flag

        name = run.experiment or env_flag("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=run.name, tags=run.tags).info.run_id
        self._log_batch(params={clean_key(k): cut(param_text(v)) for k, v in run.params.items()})

    def _last_steps(self) -> dict[str, int]:
        """The last step logged of each of the run's metrics."""
        keys = self.client.get_run(self.run_id).data.metrics
        return {key: max(m.step for m in self.client.get_metric_history(self.run_id, key)) for key in keys}

    def _log_batch(self, params: dict[str, str] | None = None, tags: dict[str, str] | None = None) -> None:
        from mlflow.entities import Param, RunTag

        items = [Param(k, v) for k, v in (params or {}).items()] + [RunTag(k, v) for k, v in (tags or {}).items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            chunk = items[i : i + PARAMS_PER_BATCH]
            self.client.log_batch(
                self.run_id,
                params=[x for x in chunk if isinstance(x, Param)],
                tags=[x for x in chunk if isinstance(x, RunTag)],
            )

    def _metrics(self, points) -> list:
        """The metrics of `points` the run does not hold yet, stamped now (by the keys MLflow holds them under, which
        `last_steps` is read by)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        cleaned = (Point(point.step, {clean_key(k): v for k, v in point.metrics.items()}) for point in points)
        return [
            Metric(key, value, now, point.step)
            for point in cleaned
            for key, value in unlogged(point, self.last_steps).items()
        ]

    def _log_points(self, points) -> None:
        self._send(self._metrics(points))

    def _send(self, metrics: list) -> None:
        for i in range(0, len(metrics), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + METRICS_PER_BATCH])

    def log(self, point: Point) -> None:
        metrics = self._metrics([point])
        if metrics:
            self.sender.put(metrics)

    def flush(self) -> None:
        self.sender.wait()

    def log_model(self, folder: Path) -> None:
        # the server's answer to an upload may take long (it stores a large model): MLflow's own request timeout
        self.sender.wait()  # no metric goes out under the upload's settings
        cut = [s for s in self._http_settings_set if s.name == "MLFLOW_HTTP_REQUEST_TIMEOUT"]
        for setting in cut:
            setting.unset()
        try:
            self.client.log_artifacts(self.run_id, str(folder), artifact_path="model")
        finally:
            for setting in cut:
                setting.set(HTTP_TIMEOUT_S)

    def close(self, finished: bool) -> None:
        try:
            self.sender.wait()
            with library_notes(self.quiet):  # MLflow prints the run's address on stdout
                self.client.set_terminated(self.run_id, status="FINISHED" if finished else "FAILED")
        finally:
            self.abandon()

    def abandon(self) -> None:
        if self.sender is not None:  # what is queued is dropped; a request under way is not waited for
            self.sender.stop()
        for setting in self._http_settings_set:
            setting.unset()
        self._http_settings_set = []


class Sender:
    """One background thread that calls `send` with each list `put`, one at a time, in their order. The first error
    stops the sending: what is queued after it is dropped, and the next `put` or `wait` raises it."""

    def __init__(self, send: Callable[[list], None]) -> None:
        self.send = send
        self.queue: queue.Queue[list | None] = queue.Queue()
        self.error: BaseException | None = None
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="tuneforge-mlflow-sender", daemon=True)
        self.thread.start()

    def put(self, items: list) -> None:
        self._raise_error()
        self.queue.put(items)

    def wait(self) -> None:
        """Until all that is queued is sent (or dropped after an error); raises the error where there was one."""
        self.queue.join()
        self._raise_error()

    def stop(self) -> None:
        """Drop what is queued; the thread ends after the call it is in (not waited for)."""
        self.stopped = True
        self.queue.put(None)

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while True:
            items = self.queue.get()
            try:
                if items is None:
                    return
                if self.error is None and not self.stopped:
                    self.send(items)
            except BaseException as err:  # (any: a thread that died would leave `wait` waiting forever)
                self.error = err
            finally:
                self.queue.task_done()


def cut(value: str) -> str:
    return value if len(value) <= PARAM_VALUE_LIMIT else value[: PARAM_VALUE_LIMIT - 3] + "..."


def clean_key(key: str) -> str:
    """`key` with the characters MLflow refuses in metric and param names as `_`."""
    return REFUSED_IN_KEYS.sub("_", key)


def quick_http_settings() -> list:
    """Cut MLflow's HTTP retries and request timeout for this process where the user set none (MLflow's settings,
    through its API); returns those set here, to unset at the end."""
    import mlflow.environment_variables as settings

    wanted = {**HTTP_SETTINGS, "MLFLOW_HTTP_REQUEST_TIMEOUT": HTTP_TIMEOUT_S}
    done = []
    for name, value in wanted.items():
        setting = getattr(settings, name)
        if not setting.is_set():
            setting.set(value)
            done.append(setting)
    return done


TRACKER = MlflowTracker
