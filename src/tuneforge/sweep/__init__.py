"""`tuneforge sweep CONFIG --space SPACE.yaml --trials N`: a resumable hyperparameter sweep with Optuna.

Each trial is an ordinary run folder, SWEEP_DIR/trial-NNNN, trained by `tuneforge train` in a child process with
the base config and the trial's values; the study (default: sqlite:///SWEEP_DIR/study.db, or a shared RDB --storage)
maximises or minimises the task's metric, prunes trials whose evaluations fall behind, and survives a kill: `--resume`
continues the interrupted trials from their checkpoints and then runs the rest. The sweep folder gets trials.csv,
best.yaml and plots; only the best --keep-best trials keep their models.

This module owns the command: its arguments (SweepOptions, sweep/options.py), every check before the first trial
(the options, the space against the base config, the trackers, the metric, the folder: each bad input one line,
exit 2), and the order of the work. The package: options.py (the arguments), space.py (the search space file),
trial.py (one trial's folder, child process and results), study.py (the Optuna study loop), folder.py (the sweep
folder: checks, record, lock, --overwrite), outputs.py (table, best.yaml, plots, keep-best).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuneforge.errors import ConfigError
from tuneforge.files import json_text
from tuneforge.flags import add_model_flags, parse_options
from tuneforge.sweep.options import SweepOptions

INSTALL = "pip install 'tuneforge[sweep]'"


def _split_config(items: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """(the YAML file, key=value overrides) of the CONFIG arguments."""
    files = [item for item in items if "=" not in item]
    if len(files) > 1:
        raise ConfigError(f"unexpected argument {files[1]!r}; give one config file and key=value overrides")
    return (files[0] if files else None), [item for item in items if "=" in item]


def _import_optuna() -> None:
    try:
        import optuna
    except ImportError:
        raise ConfigError(f"`tuneforge sweep` needs Optuna, which is not installed: {INSTALL}") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep's own lines say what happens


def _threads(parallel: int, nproc: int) -> int:
    """Threads of each trial: OMP_NUM_THREADS where the user set it, else the cores shared by the trials at once."""
    from tuneforge.launch import env_flag
    from tuneforge.sweep.study import cpu_threads

    given = env_flag("OMP_NUM_THREADS")
    return int(given) if given and given.isdigit() and int(given) > 0 else cpu_threads(parallel, nproc)


@dataclass(frozen=True)
class Sweep:
    """A checked sweep: its options, folder, objective, space, base config, and the raw config of a trial's values."""

    options: SweepOptions
    out: Path
    goal: Any  # study.Objective
    distributions: dict[str, Any]  # config key -> Optuna distribution
    config: Any  # the base TrainConfig
    values_of: Callable[[dict[str, Any]], dict[str, Any]]  # params -> the raw config values of a trial
    seed: int
    storage: str


def cmd_sweep(ns: argparse.Namespace) -> int:
    options = parse_options(SweepOptions, ns)  # every flag checked before any work: one line naming it
    _import_optuna()
    from tuneforge.config import apply_overrides, check_given_now, merge_sources
    from tuneforge.configure import build_config, check_options_given
    from tuneforge.sweep import folder as sweep_folder
    from tuneforge.sweep.space import check_against_config, distributions, load_space
    from tuneforge.sweep.study import objective, open_study
    from tuneforge.tracking import check_trackers

    yaml_path, overrides = _split_config(options.config)
    space = load_space(options.space)

    def values_of(params: dict[str, Any]) -> dict[str, Any]:
        return merge_sources(yaml_path, overrides, params)

    config = build_config(values_of({}))
    typed = apply_overrides({}, overrides)
    check_given_now(config, {}, typed)  # as `tuneforge train` checks them
    check_options_given(config, {}, typed)
    check_against_config(space, lambda params: build_config(values_of(params)), options.space)
    check_trackers(config)  # a tracker's package or server: one line here, not every trial failing on it
    goal = objective(config, options.metric, options.direction)
    out = Path(options.output_dir or f"runs/sweep-{Path(yaml_path).stem if yaml_path else 'default'}")
    earlier = (sweep_folder.read_record(out) if options.resume else None) or {}
    record = {
        "config": yaml_path,
        "overrides": overrides,
        "base": values_of({}),
        "space": space.to_record(),
        "metric": goal.metric,
        "direction": goal.direction,
        "seed": config.seed if options.seed is None else options.seed,
        "sampler": options.sampler,
        "pruner": [options.pruner, options.prune_startup_trials, options.prune_warmup_steps],
        "storage": options.storage or earlier.get("storage"),
        "study_name": options.study_name or earlier.get("study_name") or out.resolve().name,
    }
    sweep_folder.check_folder(out, options.resume, options.overwrite, record)
    storage = record["storage"] or sweep_folder.default_storage(out)
    sweep = Sweep(options, out, goal, distributions(space), config, values_of, record["seed"], storage)
    open_it = lambda: open_study(storage, record["study_name"], goal.direction, _pruner(options), record)  # noqa: E731
    study = open_it() if record["storage"] else None  # the user's storage: checked before the folder is made
    lock = sweep_folder.prepare(out, options.resume, options.overwrite, record)
    try:
        study = study or open_it()
        _run(sweep, study)
        return _report(sweep, study)
    finally:
        os.close(lock)


def _pruner(options: SweepOptions):
    from tuneforge.sweep.study import make_pruner

    return make_pruner(options.pruner, options.prune_startup_trials, options.prune_warmup_steps)


def _run(sweep: Sweep, study) -> None:
    """The trials, and after each the sweep folder's table, best.yaml and models of the best."""
    from tuneforge.sweep import outputs
    from tuneforge.sweep.folder import default_storage
    from tuneforge.sweep.study import Plan, run_trials
    from tuneforge.sweep.trial import warm_up, with_checkpoints, write_trial_config

    options, out, goal, config = sweep.options, sweep.out, sweep.goal, sweep.config
    saves = not any(key.startswith(("save_", "eval_")) for key in sweep.distributions)  # else the space decides

    def trial_values(params: dict) -> dict:
        values = sweep.values_of(params)
        return with_checkpoints(values, config.eval_strategy, config.eval_steps) if saves else values

    def after_trial(study) -> None:
        outputs.keep_best(study, out, options.keep_best)
        outputs.write_table(out, outputs.rows(study), list(sweep.distributions), goal.metric)
        outputs.write_best(out, study, sweep.values_of, goal.metric)

    plan = Plan(
        folder=out,
        own_storage=sweep.storage == default_storage(out),
        trials=options.trials,
        parallel=options.parallel,
        seed=sweep.seed,
        sampler=options.sampler,
        objective=goal,
        distributions=sweep.distributions,
        write_config=lambda folder, params, number: write_trial_config(folder, trial_values(params), number),
        threads=_threads(options.parallel, config.nproc),
        after_trial=after_trial,
        storage=sweep.storage,
    )
    count = f"{options.trials} trial{'s' if options.trials > 1 else ''}"
    print(
        f"sweep: {count} over {', '.join(sweep.distributions)}, {goal.direction[:-1]}ing {goal.metric} ({goal.why}); "
        f"study {study.study_name!r} in {sweep.storage}; trials in {out}/trial-NNNN",
        file=sys.stderr,
        flush=True,
    )
    held = len(study.get_trials(deepcopy=False))
    if held >= options.trials:  # --resume of a sweep that has its trials: say why none runs
        print(
            f"note: the study holds {held} trials already and --trials {options.trials} counts them: no new trial "
            f"runs (an unfinished one is continued); pass --trials {held + 1} or more to run more",
            file=sys.stderr,
            flush=True,
        )
    warm_up(config)
    run_trials(study, plan)
    after_trial(study)  # also where no trial ran (a finished sweep resumed)


def _report(sweep: Sweep, study) -> int:
    """The table (stdout), the plots, and the best trial (a JSON line with --json); exit 1 where none finished."""
    from tuneforge.sweep import outputs

    out, metric = sweep.out, sweep.goal.metric
    print(outputs.format_table(outputs.rows(study), list(sweep.distributions), metric), flush=True)
    if sweep.options.plots:
        for note in outputs.write_plots(study, out):
            print(f"note: {note}", file=sys.stderr, flush=True)
    best = outputs.ranked(study)
    if not best:
        print(f"error: no trial finished; see the logs in {out}/trial-NNNN/sweep-trial.log", file=sys.stderr)
        return 1
    trial = best[0]
    values = ", ".join(f"{k}={v}" for k, v in trial.params.items())
    print(f"best: trial {trial.number}, {metric} {trial.value:.6g} ({values})", flush=True)
    print(f"best config: {out / outputs.BEST} (tuneforge train {out / outputs.BEST})", flush=True)
    if sweep.options.json_output:
        summary = {"best_trial": trial.number, "value": trial.value, "params": trial.params, "metric": metric}
        summary.update(direction=sweep.goal.direction, sweep_dir=str(out), best_config=str(out / outputs.BEST))
        print(json_text(summary), flush=True)
    return 0


def add_arguments(p) -> None:
    """`tuneforge sweep`'s arguments: SweepOptions' fields (sweep/options.py)."""
    add_model_flags(p, SweepOptions)
    p.set_defaults(func=cmd_sweep)
