"""The study loop: an Optuna study (ask and tell) whose trials are `tuneforge train` runs.

- Objective: the task's metric (`objective`: --metric, else the config's metric_for_best, else the task's
  best_metric; the direction as the run ranks it, or --direction), read from each trial's result.json; or a score of
  the harness after training (`harness/TASK/METRIC`, harness/after_train.py), which only result.json holds.
- Sampling: each trial's values are drawn by a sampler seeded by (seed, trial number) (`trial_sampler`), so a sweep
  killed half-way and resumed asks the same values as an uninterrupted one with the same seed (a sampler's own
  random state would restart with the new process).
- Intermediate values: while a trial runs, each evaluation in its metrics.jsonl is reported with its step, and the
  pruner asked after each one, in order; a pruned trial's process group is stopped (SIGTERM, then SIGKILL). The
  decision depends only on the evaluations, never on when the sweep read them.
- Resuming: trials this sweep folder left RUNNING in the storage (the sweep was killed) are continued first, each
  from its last checkpoint and told to the same Optuna trial, then new trials run until the study has --trials. A
  study that cannot be written (a full disk) stops the sweep as a kill would, in one line with the database's words.
- Several machines share a study through an RDB storage (Optuna's own mechanism): each sweep asks and tells its own
  trials and continues only the interrupted trials of its own folder.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneforge.errors import ConfigError, UserError
from tuneforge.harness import after_train
from tuneforge.harness.options import is_harness_metric
from tuneforge.processes import usable_cores
from tuneforge.sweep import trial as trials
from tuneforge.sweep.outputs import FOLDER_ATTR
from tuneforge.sweep.trial import TrialProcess

HOST_ATTR = "tuneforge_host"
RECORD_ATTR = "tuneforge_sweep"  # the study's user attribute: what every sweep that joins it must share
POLL_S = 0.2


@dataclass(frozen=True)
class Objective:
    metric: str
    direction: str  # "maximize" or "minimize"
    why: str  # where the metric came from, for the sweep's first line


def objective(config, metric: str | None, direction: str | None) -> Objective:
    """The metric and its direction, resolved as a run picks its best model (run.set_up_training)."""
    from tuneforge.tasks import get_task

    task = get_task(config)
    chosen = metric or config.metric_for_best or task.best_metric
    why = "--metric" if metric else "metric_for_best" if config.metric_for_best else f"task {config.task}'s metric"
    harness = is_harness_metric(chosen)
    if harness and config.harness_after_train is None:  # every trial would train, then have no such score
        raise ConfigError(
            f"{why} {chosen!r} is a score of lm-evaluation-harness after training, and the base config runs none; "
            "give it harness_after_train (harness_after_train.tasks=TASK as an override, or in its YAML)"
        )
    if direction is None:
        higher = after_train.higher_is_better(chosen) if harness else task.higher_is_better(chosen)
        direction = "maximize" if higher else "minimize"
    return Objective(chosen, direction, why)


def trial_sampler(kind: str, seed: int, number: int):
    """A fresh sampler for trial `number`, seeded by (seed, number): the same values for the same history, in any
    process."""
    import numpy as np
    import optuna

    trial_seed = int(np.random.SeedSequence([seed, number]).generate_state(1)[0])
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=trial_seed)
    return optuna.samplers.TPESampler(seed=trial_seed)


def make_pruner(kind: str, startup_trials: int, warmup_steps: int):
    import optuna

    if kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=warmup_steps)
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


def open_study(storage: str, name: str, direction: str, pruner, record: dict[str, Any]):
    """The study in `storage` (created, or loaded: a resumed sweep's, or one that another machine's sweep runs),
    checked to be this sweep's: the direction, and what defines the search (space, metric, sampler, seed, pruner;
    the base config may differ between machines, in its paths)."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError  # optuna's RDB storage is SQLAlchemy's

    try:
        study = optuna.create_study(
            storage=storage, study_name=name, direction=direction, pruner=pruner, load_if_exists=True
        )
    except (ValueError, ImportError, optuna.exceptions.StorageInternalError, SQLAlchemyError) as err:
        first = storage_failure(err) or (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError(f"cannot open the study {name!r} in --storage {storage!r}: {first}") from None
    shared = {k: record[k] for k in ("space", "metric", "seed", "sampler", "pruner")}
    earlier = study.user_attrs.get(RECORD_ATTR)
    if study.direction.name.lower() != direction or (earlier is not None and earlier != shared):
        raise ConfigError(
            f"study {name!r} in {storage!r} belongs to another sweep (another space, metric, direction, sampler, "
            "seed or pruner); pass another --study-name"
        )
    if earlier is None:
        study.set_user_attr(RECORD_ATTR, shared)
    return study


@dataclass(frozen=True)
class Plan:
    """What the loop needs: where trials go, how many, how they are sampled and configured, and what runs after each."""

    folder: Path
    own_storage: bool  # the study is the folder's own study.db, not a --storage other sweeps may share
    trials: int
    parallel: int
    seed: int
    sampler: str
    objective: Objective
    distributions: dict[str, Any]
    write_config: Callable[[Path, dict[str, Any], int], Path]  # (trial folder, params, number) -> its YAML
    threads: int
    after_trial: Callable[[Any], None]  # (study) -> None: the sweep folder's outputs
    storage: str  # the study's storage URL, for the line that says it could not be written


@dataclass
class Active:
    """A trial whose child is running."""

    trial: Any  # optuna.trial.Trial
    folder: Path
    process: TrialProcess
    started: float
    resumed: bool
    pruned_at: int | None = None
    done: set[int] = field(default_factory=set)  # the steps reported
    seen_size: int = -1  # metrics.jsonl's size when last read (read again only once it changes)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _name(number: int, plan: Plan) -> str:
    return f"trial {number} [{number + 1}/{plan.trials}]"


def _params_text(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _launch(study, plan: Plan, trial, resumed: bool) -> Active:
    folder = trials.trial_folder(plan.folder, trial.number).resolve()
    plan.write_config(folder, dict(trial.params), trial.number)
    flags = trials.start_flags(folder, interrupted=resumed)
    process = trials.start(folder, flags, plan.threads)
    how = "resumed from its checkpoint" if "resume" in flags else "started again" if resumed else "started"
    _say(f"{_name(trial.number, plan)} {how}: {_params_text(trial.params)} (log: {folder / trials.TRIAL_LOG})")
    done = set(_stored(study, trial.number).intermediate_values) if resumed else set()
    active = Active(trial, folder, process, time.monotonic(), resumed, done=done)
    if done and trial.should_prune():  # the sweep was killed between a report and the pruner's answer
        active.pruned_at = max(done)
        process.stop()
    return active


def _stored(study, number: int):
    """The stored (frozen) trial `number`."""
    return next(t for t in study.get_trials(deepcopy=False) if t.number == number)


def _ask(study, plan: Plan):
    """A new trial, its values drawn by the sampler of (seed, its number); its folder noted in the storage first."""
    number = len(study.get_trials(deepcopy=False))  # the number the next trial gets (one sweep per study)
    study.sampler = trial_sampler(plan.sampler, plan.seed, number)
    trial = study.ask(plan.distributions)
    trial.set_user_attr(FOLDER_ATTR, str(trials.trial_folder(plan.folder, trial.number).resolve()))
    trial.set_user_attr(HOST_ATTR, socket.gethostname())
    return trial


def interrupted(study, folder: Path, own_storage: bool) -> list:
    """The trials this sweep folder left RUNNING in the storage (its sweep was killed), as Optuna trials to tell.
    In a shared storage, those of this folder's path on this host; in the folder's own study.db, every one (the
    folder may have moved, or the machine come back under another hostname since), noted as this folder's again."""
    import optuna

    root, host = folder.resolve(), socket.gethostname()
    out = []
    for frozen in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        where = Path(str(frozen.user_attrs.get(FOLDER_ATTR, "")))
        if own_storage or (where.is_absolute() and where.parent == root and frozen.user_attrs.get(HOST_ATTR) == host):
            trial = optuna.trial.Trial(study, frozen._trial_id)  # Optuna's handle on a stored trial
            trial.set_user_attr(FOLDER_ATTR, str(trials.trial_folder(root, trial.number)))
            trial.set_user_attr(HOST_ATTR, host)
            out.append(trial)
    return out


def _follow(active: Active, objective: Objective) -> None:
    """Report the trial's new evaluations in order, asking the pruner after each; stop its process when pruned."""
    size = trials.metrics_size(active.folder)
    if active.pruned_at is not None or size == active.seen_size:
        return
    active.seen_size = size
    if why := trials.unlogged_metric(active.folder, objective.metric):  # every trial would train for nothing
        raise ConfigError(
            f"{objective.why} {objective.metric!r} is not a metric of trial {active.trial.number}'s run ({why}); "
            "pass --metric with one of those"
        )
    for step, value in trials.evaluations(active.folder, objective.metric):
        if step in active.done:
            continue
        active.trial.report(value, step)
        active.done.add(step)
        if active.trial.should_prune():
            active.pruned_at = step
            active.process.stop()
            return


def _settle(study, active: Active, plan: Plan) -> str:
    """Tell the storage how an ended trial ended; returns its progress line."""
    import optuna

    trial, metric = active.trial, plan.objective.metric
    code = active.process.poll()
    seconds = time.monotonic() - active.started
    if active.pruned_at is not None:
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        value = _stored(study, trial.number).intermediate_values[active.pruned_at]
        outcome = f"pruned at step {active.pruned_at} ({metric} {value:.4g})"
    else:
        value, why = trials.read_result(active.folder, metric) if code == 0 else (None, "")
        if value is not None:
            study.tell(trial, value)
            outcome = f"{metric} {value:.4g}"
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            scored = trials.harness_metrics(active.folder) if code == 0 else []
            if scored and metric not in scored:  # a misspelt harness metric: every trial would end without it
                raise ConfigError(
                    f"{plan.objective.why} {metric!r} is not a score of trial {trial.number}'s harness run (it has: "
                    f"{', '.join(scored)}); pass --metric with one of those"
                )
            outcome = f"failed ({why or f'exit code {code}: ' + trials.last_error(active.folder)})"
    best = _best_text(study, metric)
    return f"{_name(trial.number, plan)}: {outcome}, {seconds:.0f} s{'; ' + best if best else ''}"


def _best_text(study, metric: str) -> str:
    try:
        best = study.best_trial
    except ValueError:  # none finished yet
        return ""
    return f"best: trial {best.number} ({metric} {best.value:.4g})"


def run_trials(study, plan: Plan) -> None:
    """Continue the interrupted trials, then run new ones until the study has plan.trials, plan.parallel at a time.
    A stop (Ctrl-C, SIGTERM) stops the running trials' processes and leaves them RUNNING in the storage, for
    --resume; it ends as KeyboardInterrupt."""
    running: list[Active] = []
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        waiting = interrupted(study, plan.folder, plan.own_storage)
        while True:
            for active in list(running):
                _follow(active, plan.objective)
                if active.pruned_at is not None or active.process.poll() is not None:
                    _follow(active, plan.objective)  # what it wrote before it ended
                    running.remove(active)
                    _say(_settle(study, active, plan))
                    plan.after_trial(study)
            while len(running) < plan.parallel and (waiting or len(study.get_trials(deepcopy=False)) < plan.trials):
                trial, resumed = (waiting.pop(0), True) if waiting else (_ask(study, plan), False)
                with _stops_held():
                    running.append(_launch(study, plan, trial, resumed))
            if not running:
                return
            time.sleep(POLL_S)
    except ConfigError:  # the objective names no metric the trials have: they end as failed
        import optuna

        for active in running:
            active.process.stop()
            study.tell(active.trial, state=optuna.trial.TrialState.FAIL)
        raise
    except Exception as err:
        why = storage_failure(err)
        if why is None:
            raise
        for active in running:  # left RUNNING in the study, as a stopped sweep's: --resume continues them
            active.process.stop()
        raise UserError(
            f"the study in {plan.storage!r} could not be written ({why}); the sweep stopped, its unfinished trials "
            "stay in the study: free space there (a full disk, a quota) and run the same command with --resume"
        ) from None
    except KeyboardInterrupt:
        for active in running:
            active.process.stop()
        if running:
            numbers = ", ".join(str(a.trial.number) for a in running)
            _say(f"stopped: trial {numbers} stays unfinished in the study; the same command with --resume continues it")
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def storage_failure(err: BaseException) -> str | None:
    """The database's own words where `err` is a failed read or write of the study's storage ("database or disk is
    full", "disk I/O error"), else None. Optuna's StorageInternalError blames "invalid data in the commit" for any
    failure; the SQLAlchemy error it wraps (its cause) says what the database said."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError  # optuna's RDB storage is SQLAlchemy's

    if isinstance(err, optuna.exceptions.StorageInternalError):
        err = err.__cause__ or err
    if not isinstance(err, (SQLAlchemyError, optuna.exceptions.StorageInternalError)):
        return None
    said = str(getattr(err, "orig", None) or err).strip()  # (SQLAlchemy's own text adds the SQL and a link)
    return (said.splitlines() or [type(err).__name__])[0][:200]


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _stops_held():
    """Ctrl-C and SIGTERM held while a trial is forked and taken after, with the trial among the running ones: one
    that came in the fork was raised in an at-fork hook (logging's), where Python drops it, and the sweep went on."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, trials.STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def cpu_threads(parallel: int, nproc: int) -> int:
    """Threads for each trial's process: this machine's cores shared by the trials at once and their processes."""
    cores = usable_cores()
    return max(1, cores // (parallel * max(1, nproc)))
