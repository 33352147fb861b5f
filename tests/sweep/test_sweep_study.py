"""Real sweeps (tuneforge/sweep/study.py, trial.py): Optuna SQLite studies of tiny `tuneforge train` trials (4 steps,
an evaluation every 2, on the tiny BERT), each sweep in a process of its own.

One uninterrupted sweep of three trials is the reference: its middle trial draws a learning rate that wrecks the loss
and is pruned at its first evaluation; the other two finish, and only the better keeps its model. The same sweep
SIGKILLed in its first trial (paused in its second checkpoint's save, after the first) and resumed with --resume
reaches the same table, its first trial continued from its checkpoint. A ddp trial (2 processes) gets the loss the
single-process trial of the same values got.
"""

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution

from conftest import Forked, last_json, made_once, parallel_pairs, read_jsonl, run_cli, write_sentiment_csv
from tuneforge.config import load_yaml
from tuneforge.configure import build_config
from tuneforge.sweep import folder as sweep_folder
from tuneforge.sweep.study import trial_sampler

LRS = [0.01, 0.05, 1.0]  # 1.0 wrecks the loss (eval loss ~15 after 2 steps, against ~0.7)


def draws(seed: int, n: int = 3) -> list[float]:
    """The learning rates trials 0..n-1 of a sweep with `seed` draw (TPE starts with random draws)."""
    study = optuna.create_study()
    out = []
    for number in range(n):
        study.sampler = trial_sampler("tpe", seed, number)
        trial = study.ask({"optim.lr": CategoricalDistribution(LRS)})
        study.tell(trial, 0.0)
        out.append(trial.params["optim.lr"])
    return out


# a seed whose trials draw a good rate, the wrecking one, then the best one (ahead of the first at each evaluation, so
# that the median pruner, from one finished trial on, lets it finish); checked by `reference`
SEED, DRAWS = 24, [0.05, 1.0, 0.01]


@dataclass(frozen=True)
class Setup:
    root: Path
    base: Path
    space: Path

    def args(self, out: Path, *extra: str, config: tuple[str, ...] = ()) -> list[str]:
        flags = ["--space", str(self.space), "--trials", "3", "--output-dir", str(out), "--metric", "loss"]
        flags += ["--seed", str(SEED), "--prune-startup-trials", "1", "--keep-best", "1"]
        return ["sweep", str(self.base), *config, *flags, *extra]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_bert, cache_dir) -> Setup:
    """The data, base config and space, written once a session (made_once: shared by pytest-xdist's workers)."""

    def write(root: Path) -> None:
        train = write_sentiment_csv(root / "train.csv", 48, seed=1)
        val = write_sentiment_csv(root / "val.csv", 16, seed=2)
        base = {
            "task": "classification",
            "model": tiny_bert,
            "max_steps": 4,
            "batch_size": 8,
            "eval_strategy": "steps",
            "eval_steps": 2,
            "logging_steps": 2,
            "precision": "fp32",
            "data": {"train_file": str(train), "validation_file": str(val), "cache_dir": cache_dir},
        }
        (root / "base.yaml").write_text(yaml.safe_dump(base))
        (root / "space.yaml").write_text(f"optim.lr: {LRS}\n")

    root = made_once(tmp_path_factory, "sweep-setup", write)
    return Setup(root, root / "base.yaml", root / "space.yaml")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, setup) -> tuple[Path, subprocess.CompletedProcess]:
    """The uninterrupted sweep, made once a session: (its folder, what it printed)."""
    assert draws(SEED) == DRAWS, f"seed {SEED} no longer draws {DRAWS}; pick another"

    def make(folder: Path) -> None:
        proc = run_cli(*setup.args(folder / "sweep", "--json"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        (folder / "stdout.txt").write_text(proc.stdout)
        (folder / "stderr.txt").write_text(proc.stderr)

    folder = made_once(tmp_path_factory, "sweep-reference", make)
    printed = [(folder / name).read_text() for name in ("stdout.txt", "stderr.txt")]
    return folder / "sweep", subprocess.CompletedProcess([], 0, *printed)


def replaced(args: list[str], **flags) -> list[str]:
    """`args` with other values of the flags given (space=PATH: --space PATH)."""
    out = list(args)
    for name, value in flags.items():
        out[out.index("--" + name.replace("_", "-")) + 1] = str(value)
    return out


def study_of(out: Path):
    return optuna.load_study(study_name=out.name, storage=f"sqlite:///{out}/study.db")


def table(out: Path) -> list[tuple]:
    """(number, state, value, params, intermediate values) of each trial of the sweep in `out`."""
    return [
        (t.number, t.state.name, t.value, t.params, dict(t.intermediate_values))
        for t in study_of(out).get_trials(deepcopy=False)
    ]


def test_a_sweep_is_an_optuna_study_of_train_runs(setup, reference):
    out, proc = reference
    rows = table(out)
    assert [r[1] for r in rows] == ["COMPLETE", "PRUNED", "COMPLETE"]
    assert [r[3]["optim.lr"] for r in rows] == DRAWS  # each trial's values drawn by (seed, its number)
    for number, state, value, _, steps in rows:
        folder = out / f"trial-{number:04d}"
        evals = [r for r in read_jsonl(folder / "metrics.jsonl") if r["split"] == "eval"]
        # every evaluation reported with its step (a pruned trial's up to its pruning)
        assert steps == {r["step"]: r["loss"] for r in evals if r["step"] <= max(steps)}
        if state == "COMPLETE":
            assert list(steps) == [2, 4] and value == json.loads((folder / "result.json").read_text())["loss"]
    assert rows[0][2] != rows[2][2]  # the two finished trials differ: the comparisons below mean something

    assert (out / "trials.csv").read_text().splitlines()[0] == "number,state,loss,duration_s,optim.lr,folder"
    assert len((out / "trials.csv").read_text().splitlines()) == 4
    best = min((r for r in rows if r[1] == "COMPLETE"), key=lambda r: r[2])
    summary = last_json(proc.stdout)
    assert summary["best_trial"] == best[0] and summary["value"] == best[2] and summary["params"] == best[3]
    assert [ln.split()[:2] for ln in proc.stdout.splitlines()[:4]] == [["trial", "state"], ["0", "complete"]] + [
        ["1", "pruned"],
        ["2", "complete"],
    ]
    ends = [ln for ln in proc.stderr.splitlines() if ln.startswith("trial ") and "]: " in ln]
    assert [ln.split(" [")[0] for ln in ends] == ["trial 0", "trial 1", "trial 2"], proc.stderr

    config = build_config(load_yaml(out / "best.yaml"))  # ready to train: the base with the best values
    assert config.optim.lr == best[3]["optim.lr"] and config.max_steps == 4 and config.save_strategy == "no"
    for plot in ("history.png", "parallel_coordinates.png", "importances.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG", plot


def test_pruning_stops_the_hopeless_trial(reference):
    out, proc = reference
    number, state, value, params, steps = table(out)[1]
    assert params == {"optim.lr": 1.0} and state == "PRUNED"
    # pruned at its first evaluation, its loss far above the first trial's: its later evaluations are not reported
    # (a trial this small may have finished before its process was stopped: test_sweep_trial.py stops one)
    assert steps == {2: value} and value > 5 * table(out)[0][4][2]
    assert "trial 1 [2/3]: pruned at step 2" in proc.stderr


def test_only_the_best_trial_keeps_its_model(reference):
    out, _ = reference
    rows = table(out)
    best, worse = sorted((r for r in rows if r[1] == "COMPLETE"), key=lambda r: r[2])
    kept = out / f"trial-{best[0]:04d}"
    assert (kept / "model" / "model.safetensors").exists() and list(kept.glob("checkpoint-*"))
    for number in (worse[0], 1):
        folder = out / f"trial-{number:04d}"
        assert not (folder / "model").exists() and not list(folder.glob("checkpoint-*")), number
        assert (folder / "metrics.jsonl").exists() and (folder / "config.yaml").exists()  # the record stays
        assert (folder / "sweep-trial.log").exists() and (folder / "sweep-trial.yaml").exists()
    assert (out / f"trial-{worse[0]:04d}" / "result.json").exists()


def kill_in_first_trial(setup: Setup, out: Path, log: Path) -> None:
    """Run the sweep until its first trial pauses in the save of step 4 (checkpoint 2 written), then SIGKILL the
    sweep's process group (the trial, in a group of its own, gets SIGTERM as its sweep dies)."""
    from tuneforge.cli import main

    marker = log.with_suffix(".paused")
    pause = dict(TUNEFORGE_PAUSE_IN_SAVE="600", TUNEFORGE_PAUSE_STAGE="start", TUNEFORGE_PAUSE_STEP="4")
    args = setup.args(out)
    with open(log.with_suffix(".out"), "w") as stdout, open(log, "w") as stderr:
        env = {**pause, "TUNEFORGE_PAUSE_MARKER": str(marker)}
        proc = Forked(lambda: main(args), stdout.fileno(), stderr.fileno(), env=env)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, f"the sweep ended before the pause: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, "the trial never reached the pause"
        time.sleep(0.1)
    time.sleep(0.5)  # the sweep reports the evaluation of step 2
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    os.close(sweep_folder.lock(out, wait=30))  # the trial (it shares the sweep's lock) ended with its sweep


def test_a_killed_sweep_resumes_to_the_same_trials(setup, reference, tmp_path):
    out = tmp_path / "sweep"
    kill_in_first_trial(setup, out, tmp_path / "killed.log")
    (first,) = table(out)
    assert first[1] == "RUNNING" and first[3] == {"optim.lr": DRAWS[0]}
    assert (out / "trial-0000" / "checkpoint-2").is_dir() and not (out / "trial-0000" / "model").exists()

    again = run_cli(*setup.args(out))  # without --resume: refused, nothing touched
    assert again.returncode == 2 and "pass --resume to continue it" in again.stderr
    (tmp_path / "other.yaml").write_text("optim.lr: [0.01, 0.05]\n")
    changed = run_cli(*replaced(setup.args(out, "--resume"), space=tmp_path / "other.yaml"))
    assert changed.returncode == 2 and "was started with another space" in changed.stderr

    resumed = run_cli(*setup.args(out, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "trial 0 [1/3] resumed from its checkpoint" in resumed.stderr
    log = (out / "trial-0000" / "sweep-trial.log").read_text()
    assert f"resumed from {out / 'trial-0000' / 'checkpoint-2'} at step 2" in log
    assert table(out) == table(reference[0])  # values, states, params and every reported evaluation
    assert (out / "trials.csv").read_text().count("\n") == 4
    finished = run_cli(*setup.args(out, "--resume"))  # nothing left to run: said, not silent
    assert finished.returncode == 0 and "the study holds 3 trials already" in finished.stderr, finished.stderr
    assert table(out) == table(reference[0])


def test_a_stop_while_a_trial_is_forked_stops_the_sweep(setup, tmp_path):
    """A kill (SIGTERM) or Ctrl-C coming while the sweep forked a trial (a fork of the sweep's process, torch loaded,
    takes a while) was raised in logging's at-fork hook, where Python drops it ('Exception ignored in: <function
    _releaseLock>', a traceback): the sweep went on and ran every trial. (Both signals raise KeyboardInterrupt in
    the sweep: one is tried.)"""
    from tuneforge.cli import main

    out = tmp_path / "sweep"
    first_log = out / "trial-0000" / "sweep-trial.log"  # written just before the first trial's fork

    def sweep() -> int:
        stopped = []

        def stop_in_the_fork() -> None:
            if not stopped and first_log.exists():
                stopped.append(True)
                os.kill(os.getpid(), signal.SIGTERM)

        os.register_at_fork(before=stop_in_the_fork)  # (in this child only)
        return main(setup.args(out))

    with open(tmp_path / "out", "w") as stdout, open(tmp_path / "err", "w") as stderr:
        proc = Forked(sweep, stdout.fileno(), stderr.fileno())
    assert proc.wait(120) == 130
    err = (tmp_path / "err").read_text()
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.strip().splitlines()[-2:] == [
        "stopped: trial 0 stays unfinished in the study; the same command with --resume continues it",
        "interrupted",
    ]
    assert [state for _, state, *_ in table(out)] == ["RUNNING"]


def test_the_trials_of_a_moved_folder_or_another_host_are_continued_where_the_study_is_the_folder_s(tmp_path):
    """A killed sweep whose folder was then moved (or whose machine came back with another hostname: a new
    container) left its trial RUNNING for good: --resume took only trials of its own path and host, so the trial
    was never continued and still counted against --trials. In the folder's own study.db every RUNNING trial is
    the folder's (the lock keeps other sweeps out); in a shared --storage only its own path's and host's are."""
    from tuneforge.sweep.outputs import FOLDER_ATTR
    from tuneforge.sweep.study import HOST_ATTR, interrupted

    out = tmp_path / "moved"
    out.mkdir()
    study = optuna.create_study(storage=f"sqlite:///{out}/study.db", study_name="s")
    trial = study.ask({"optim.lr": CategoricalDistribution(LRS)})
    trial.set_user_attr(FOLDER_ATTR, str(tmp_path / "before" / "trial-0000"))
    trial.set_user_attr(HOST_ATTR, "another-host")
    assert interrupted(study, out, own_storage=False) == []  # a shared storage: maybe another machine's
    (found,) = interrupted(study, out, own_storage=True)
    assert found.number == 0
    attrs = study.trials[0].user_attrs  # the table and keep-best then find it here
    assert attrs[FOLDER_ATTR] == str((out / "trial-0000").resolve()) and attrs[HOST_ATTR] != "another-host"


def test_a_ddp_trial(setup, reference, tmp_path):
    """One trial on 2 ddp processes (batch 4 each: the global batch of 8): the loss of the single-process trial."""
    out = tmp_path / "ddp"
    lr = DRAWS[0]
    (space := tmp_path / "space.yaml").write_text(f"optim.lr: [{lr}]\n")
    proc = run_cli(*replaced(setup.args(out, config=("backend=ddp", "nproc=2", "batch_size=4")), space=space, trials=1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ((_, state, value, params, _),) = table(out)
    assert state == "COMPLETE" and params == {"optim.lr": lr}
    assert "on ddp (2 processes" in (out / "trial-0000" / "sweep-trial.log").read_text()
    assert value == pytest.approx(table(reference[0])[0][2], rel=1e-4)


@pytest.mark.parametrize(
    ("metric", "direction"), [("perplexity", "minimize"), ("loss", "minimize"), ("accuracy", "maximize")]
)
def test_the_objective_ranks_a_metric_as_its_run_does(metric, direction):
    """A perplexity (or a loss, or an error) is lower-is-better, for the sweep and for the run's best model alike."""
    from tuneforge.sweep.study import objective
    from tuneforge.tasks import get_task

    for given, flag in (({"metric_for_best": metric}, None), ({}, metric)):
        config = build_config({"task": "clm", "model": "some-model", "data": {"train_file": "t.txt"}, **given})
        assert objective(config, flag, None).direction == direction
        assert get_task(config).higher_is_better(metric) is (direction == "maximize")


def harness_sweep(root: Path, model: str, gsm8k: Path, metric: str, trials: int):
    """A sweep of a 2-step clm run of `model` (an evaluation each step) with gsm8k (1 row, 2 tokens generated) after
    training, optimising `metric`: (its folder, the process)."""
    text = root / "text.txt"
    text.write_text("".join(f"{en} {de}\n" for en, de in parallel_pairs(20)), encoding="utf-8")
    base = {
        "task": "clm",
        "model": model,
        "max_steps": 2,
        "block_size": 16,
        "batch_size": 4,
        "eval_strategy": "steps",
        "eval_steps": 1,
        "data": {"train_file": str(text), "validation_file": str(text)},
        "harness_after_train": {"tasks": "gsm8k", "data": {"gsm8k": str(gsm8k)}, "limit": 1, "max_gen_toks": 2},
    }
    (root / "base.yaml").write_text(yaml.safe_dump(base))
    (root / "space.yaml").write_text("optim.lr: [0.01, 0.02]\n")
    out = root / "sweep"
    flags = ["--space", str(root / "space.yaml"), "--trials", str(trials), "--output-dir", str(out), "--metric", metric]
    return out, run_cli("sweep", str(root / "base.yaml"), *flags, "--pruner", "none")


def test_a_harness_score_after_training_is_a_sweep_objective(tmp_path, tiny_llama, shared_data):
    """--metric harness/gsm8k/exact_match/flexible-extract: each trial's value is its result.json's score (none of
    its evaluations logs it: no intermediate values), maximised as the harness ranks exact_match."""
    metric = "harness/gsm8k/exact_match/flexible-extract"
    out, proc = harness_sweep(tmp_path, tiny_llama, shared_data / "gsm8k", metric, trials=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = study_of(out)
    assert study.direction.name == "MAXIMIZE"
    [(_, state, value, _, steps)] = table(out)
    result = json.loads((out / "trial-0000" / "result.json").read_text())
    assert state == "COMPLETE" and value == result[metric] and steps == {}


def test_a_misspelt_harness_score_stops_the_sweep_after_its_first_trial(tmp_path, tiny_llama, shared_data):
    """A harness score the trial's harness run does not have would end every trial without a value: one line naming
    those it has, after the first trial."""
    out, proc = harness_sweep(tmp_path, tiny_llama, shared_data / "gsm8k", "harness/gsm8k/exact_match", trials=2)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and errors == [
        "error: --metric 'harness/gsm8k/exact_match' is not a score of trial 0's harness run (it has: "
        "harness/gsm8k/exact_match/strict-match, harness/gsm8k/exact_match/flexible-extract); pass --metric with one "
        "of those"
    ], proc.stderr[-3000:]
    assert [(number, state) for number, state, *_ in table(out)] == [(0, "FAIL")]


@pytest.mark.parametrize(
    ("metric", "direction"),
    [
        ("harness/wikitext/bits_per_byte", "minimize"),
        ("harness/wikitext/word_perplexity", "minimize"),
        ("harness/gsm8k/exact_match/strict-match", "maximize"),
        ("harness/piqa/acc_norm", "maximize"),
    ],
)
def test_the_objective_ranks_a_harness_score_as_the_harness_does(metric, direction):
    """The harness's own ranking of its metrics (bits_per_byte: lower is better, as no word of it says)."""
    from tuneforge.sweep.study import objective

    values = {"task": "clm", "model": "some-model", "data": {"train_file": "t.txt"}, "harness_after_train": "gsm8k"}
    assert objective(build_config(values), metric, None).direction == direction


def test_a_study_that_cannot_be_written_stops_the_sweep_in_one_line_and_stays_resumable(tmp_path):
    """A write of the study that failed (sqlite's 'database or disk is full' on a full disk, 'disk I/O error' past a
    file size limit) ended the sweep in 'internal error': Optuna's StorageInternalError, whose own words blame
    'invalid data in the commit'. It is one line with the database's words and --resume; the study is intact."""
    import resource

    from conftest import run_forked
    from tuneforge.errors import UserError
    from tuneforge.sweep.study import Objective, Plan, make_pruner, open_study, run_trials

    storage = f"sqlite:///{tmp_path}/study.db"
    record = {"space": {}, "metric": "loss", "seed": 0, "sampler": "tpe", "pruner": ["none", 0, 0]}
    no_trial = lambda *args: pytest.fail("no trial starts")  # noqa: E731

    def without_room() -> int:
        study = open_study(storage, "s", "minimize", make_pruner("none", 0, 0), record)
        study.ask({"optim.lr": CategoricalDistribution(LRS)})  # a killed sweep's trial, noted as this folder's again
        plan = Plan(tmp_path, True, 1, 1, 0, "tpe", Objective("loss", "minimize", "--metric"),
                    {"optim.lr": CategoricalDistribution(LRS)}, no_trial, 1, no_trial, storage)  # fmt: skip
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))  # EFBIG, as a full disk's ENOSPC
        try:
            run_trials(study, plan)
        except UserError as err:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            print(err)
            return 0
        return 3

    proc = run_forked(without_room, ["sweep"], timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == (
        f"the study in {storage!r} could not be written (disk I/O error); the sweep stopped, its unfinished trials "
        "stay in the study: free space there (a full disk, a quota) and run the same command with --resume"
    )
    assert [t.state.name for t in optuna.load_study(study_name="s", storage=storage).trials] == ["RUNNING"]
