"""`tuneforge sweep`'s refusals, each one `error:` line and exit 2 before any trial runs (the real CLI entry point, in
this process: nothing here trains)."""

import sys

import pytest
import yaml

from conftest import cli_main, write_sentiment_csv


@pytest.fixture
def base(tmp_path, tiny_bert) -> str:
    """A base config of a tiny classification run."""
    train = write_sentiment_csv(tmp_path / "train.csv", 16, seed=1)
    values = {"task": "classification", "model": tiny_bert, "max_steps": 2, "data": {"train_file": str(train)}}
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def sweep(capsys, tmp_path, base: str, space: str, *flags: str) -> tuple[int, str]:
    """`tuneforge sweep BASE --space FILE FLAGS` into tmp_path/sweep: (exit code, stderr)."""
    (tmp_path / "space.yaml").write_text(space)
    args = [base, "--space", str(tmp_path / "space.yaml"), "--output-dir", str(tmp_path / "sweep"), *flags]
    code, _, err = cli_main(capsys, "sweep", *args)
    return code, err


def one_error(code: int, err: str) -> str:
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_an_unknown_key_is_refused_before_any_trial(capsys, tmp_path, base):
    line = one_error(*sweep(capsys, tmp_path, base, "optim.learning_rate: [0.1, 0.2]\n"))
    assert "key 'optim.learning_rate' = 0.1: unknown config key 'optim.learning_rate'" in line
    assert not (tmp_path / "sweep").exists()


def test_a_bad_range_is_refused(capsys, tmp_path, base):
    line = one_error(*sweep(capsys, tmp_path, base, "optim.lr: {type: float, low: 0.1, high: 0.01, log: true}\n"))
    assert "key 'optim.lr': low (0.1) must be below high (0.01)" in line
    line = one_error(*sweep(capsys, tmp_path, base, "optim.lr: {type: float, low: 0.1, high: 5000}\n"))
    assert "key 'optim.lr' = 5000.0: bad value for 'optim.lr'" in line and "<= 1000" in line
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--trials", "0"], "bad value for --trials"),
        (["--trials", "-3"], "bad value for --trials"),
        (["--parallel", "0"], "bad value for --parallel"),
        (["--seed", "-1"], "bad value for --seed"),
        (["--keep-best", "-1"], "bad value for --keep-best"),
        (["--resume", "--overwrite"], "pass one of them"),
        (  # Optuna's other pruners take neither: a setting that would do nothing
            ["--pruner", "none", "--prune-startup-trials", "5"],
            "--prune-startup-trials sets the median pruner, and --pruner none is not it, so it would do nothing; "
            "drop it, or pass --pruner median",
        ),
        (
            ["--pruner", "hyperband", "--prune-startup-trials", "1", "--prune-warmup-steps", "4"],
            "--prune-startup-trials and --prune-warmup-steps set the median pruner, and --pruner hyperband is not it",
        ),
    ],
)
def test_bad_flags_are_refused(capsys, tmp_path, base, flags, expected):
    assert expected in one_error(*sweep(capsys, tmp_path, base, "optim.lr: [0.1]\n", *flags))


def test_a_bad_base_config_is_refused(capsys, tmp_path, base):
    (tmp_path / "s.yaml").write_text("optim.lr: [0.1]\n")
    code, _, err = cli_main(capsys, "sweep", base, "epochs=-1", "--space", str(tmp_path / "s.yaml"))
    assert "bad value for 'epochs'" in one_error(code, err)
    code, _, err = cli_main(capsys, "sweep", base, "other.yaml", "--space", str(tmp_path / "s.yaml"))
    assert "give one config file and key=value overrides" in one_error(code, err)


@pytest.mark.parametrize(
    "override, said",
    [
        ("num_beams=1", "num_beams (--num-beams) is an option of task 'seq2seq', not of task 'classification'"),
        ("task_options.packing=true", "packing (--packing) is an option of task 'clm' or 'sft'"),
        ("backend_options.zero_stage=2", "zero_stage (--zero-stage) is an option of backend 'deepspeed'"),
    ],
)
def test_another_owners_option_at_its_default_is_refused_as_train_refuses_it(capsys, tmp_path, base, override, said):
    """The base config's key=value overrides are typed now, as train's: another task's or backend's option, at its
    default too, does nothing to the trials (they ran without a word)."""
    (tmp_path / "s.yaml").write_text("optim.lr: [0.1]\n")
    out = tmp_path / "sweep"
    code, _, err = cli_main(
        capsys, "sweep", base, override, "--space", str(tmp_path / "s.yaml"), "--output-dir", str(out)
    )
    assert said in one_error(code, err)
    assert not out.exists()


def test_a_missing_space_file(capsys, tmp_path, base):
    code, _, err = cli_main(capsys, "sweep", base, "--space", str(tmp_path / "nope.yaml"))
    assert "space file" in one_error(code, err) and "does not exist" in err


def test_an_existing_sweep_needs_resume_or_overwrite(capsys, tmp_path, base):
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "sweep.yaml").write_text("space: {}\n")
    line = one_error(*sweep(capsys, tmp_path, base, "optim.lr: [0.1]\n"))
    assert "already holds a sweep; pass --resume to continue it, or --overwrite to start it again" in line
    line = one_error(*sweep(capsys, tmp_path, base, "optim.lr: [0.1]\n", "--resume"))
    assert "was started with another base config" in line


def test_a_folder_of_other_files_is_refused(capsys, tmp_path, base):
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "notes.txt").write_text("mine")
    line = one_error(*sweep(capsys, tmp_path, base, "optim.lr: [0.1]\n"))
    assert "holds files a sweep does not write (notes.txt)" in line
    line = one_error(*sweep(capsys, tmp_path, base, "optim.lr: [0.1]\n", "--resume"))
    assert "holds no sweep to continue" in line
    assert [p.name for p in (tmp_path / "sweep").iterdir()] == ["notes.txt"]


def test_a_tracking_server_that_does_not_answer_is_refused_before_any_trial(capsys, tmp_path, base):
    (tmp_path / "s.yaml").write_text("optim.lr: [0.1]\n")
    args = ["report_to=mlflow", "tracking_uri=http://127.0.0.1:1", "--space", str(tmp_path / "s.yaml")]
    code, _, err = cli_main(capsys, "sweep", base, *args, "--output-dir", str(tmp_path / "sweep"))
    assert "http://127.0.0.1:1 does not answer" in one_error(code, err)
    assert not (tmp_path / "sweep").exists()


def test_a_tracker_override_no_tracker_of_the_trials_reads_is_refused_before_any_trial(capsys, tmp_path, base):
    """As `tuneforge train` refuses it: every trial ran ignoring it."""
    (tmp_path / "s.yaml").write_text("optim.lr: [0.1]\n")
    args = ["tracking_uri=sqlite:///m.db", "--space", str(tmp_path / "s.yaml")]
    code, _, err = cli_main(capsys, "sweep", base, *args, "--output-dir", str(tmp_path / "sweep"))
    assert "tracking_uri=sqlite:///m.db is the tracking server or store for mlflow" in one_error(code, err)
    assert not (tmp_path / "sweep").exists()


def test_a_lora_override_of_trials_without_adapters_is_refused_before_any_trial(capsys, tmp_path, base):
    """As `tuneforge train` refuses lora_r=8 without --adapter lora: every trial ran ignoring it."""
    (tmp_path / "s.yaml").write_text("optim.lr: [0.1]\n")
    args = ["lora_r=8", "--space", str(tmp_path / "s.yaml")]
    code, _, err = cli_main(capsys, "sweep", base, *args, "--output-dir", str(tmp_path / "sweep"))
    assert "lora_r=8 sets up LoRA adapters, and this run has none (--adapter none)" in one_error(code, err)
    assert not (tmp_path / "sweep").exists()


def test_a_metric_the_trials_do_not_log_stops_the_sweep_at_the_first_evaluation(capsys, tmp_path, base):
    """A misspelt --metric is found at the first trial's first evaluation, not after every trial trained for
    nothing: one line naming the metrics there are; the trial is told failed and no other starts."""
    code, err = sweep(capsys, tmp_path, base, "optim.lr: [0.1, 0.2]\n", "--trials", "3", "--metric", "acuracy")
    line = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and line == [
        "error: --metric 'acuracy' is not a metric of trial 0's run (its evaluations log accuracy, f1, loss); pass "
        "--metric with one of those"
    ]
    assert sorted(p.name for p in (tmp_path / "sweep").glob("trial-*")) == ["trial-0000"]
    import optuna

    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{tmp_path / 'sweep' / 'study.db'}")
    assert [t.state.name for t in study.trials] == ["FAIL"]


def test_a_harness_metric_of_a_config_that_runs_no_harness_is_refused_before_any_trial(capsys, tmp_path, base):
    """A score of the harness after training as the objective needs the base config's harness_after_train: without
    it every trial would train and end with no such score."""
    metric = "harness/gsm8k/exact_match/strict-match"
    line = one_error(*sweep(capsys, tmp_path, base, "optim.lr: [0.1, 0.2]\n", "--metric", metric))
    assert line == (
        f"error: --metric {metric!r} is a score of lm-evaluation-harness after training, and the base config runs "
        "none; give it harness_after_train (harness_after_train.tasks=TASK as an override, or in its YAML)"
    )
    assert not (tmp_path / "sweep").exists()


def test_without_optuna_one_line_names_the_extra(capsys, tmp_path, base, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # `import optuna` raises ImportError, as where it is missing
    line = one_error(*sweep(capsys, tmp_path, base, "optim.lr: [0.1]\n"))
    assert "pip install 'tuneforge[sweep]'" in line


def test_the_command_builds_only_its_own_arguments():
    from tuneforge.cli import build_parser

    sub = build_parser("sweep")._subparsers._group_actions[0].choices
    own = {a.dest for a in sub["sweep"]._actions}
    assert {"config", "space", "trials", "resume", "storage", "pruner", "parallel", "keep_best"} <= own
    assert not [a for a in sub["train"]._actions if a.dest != "help"]


@pytest.mark.parametrize("storage", ["notaurl", "nosuchdb://host/db", "sqlite:////nonexistent-dir/study.db"])
def test_a_storage_that_cannot_be_opened_is_refused_before_the_folder_is_made(capsys, tmp_path, base, storage):
    line = one_error(*sweep(capsys, tmp_path, base, "optim.lr: [0.1]\n", "--storage", storage))
    assert f"cannot open the study 'sweep' in --storage {storage!r}" in line
    assert not (tmp_path / "sweep").exists()
