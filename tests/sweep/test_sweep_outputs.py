"""The sweep folder's outputs and ownership (tuneforge/sweep/outputs.py, folder.py) on real Optuna studies with trials
of every state: keep-best removes only model/ and checkpoint folders tuneforge wrote, of ended trials outside the
best K; --overwrite clears only what a sweep wrote; the folder checks. The sweeps that write these for real are in
test_sweep_study.py."""

import optuna
import pytest
import yaml
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from tuneforge.errors import ConfigError
from tuneforge.sweep import folder as sweep_folder
from tuneforge.sweep.outputs import FOLDER_ATTR, format_table, keep_best, ranked, rows, write_best, write_table
from tuneforge.sweep.trial import TRIAL_CONFIG, TRIAL_LOG

LR = {"optim.lr": FloatDistribution(1e-9, 1.0, log=True)}


def fake_run(folder, checkpoints=(2, 4)):
    """What a finished run leaves: config, metrics, model/, checkpoints, the latest pointer; and the sweep's files."""
    folder.mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl", "result.json", TRIAL_CONFIG, TRIAL_LOG):
        (folder / name).write_text("x")
    (folder / "model").mkdir()
    (folder / "model" / "model.safetensors").write_text("weights")
    for step in checkpoints:
        (folder / f"checkpoint-{step}").mkdir()
    (folder / "latest").write_text(f"checkpoint-{checkpoints[-1]}")


def study_with(tmp_path, trials, direction="minimize"):
    """An Optuna study (in memory) of (state, value) trials, each with a run folder tmp_path/sweep/trial-NNNN."""
    study = optuna.create_study(direction=direction)
    for number, (state, value) in enumerate(trials):
        folder = tmp_path / "sweep" / f"trial-{number:04d}"
        fake_run(folder)
        study.add_trial(
            create_trial(
                state=state,
                value=value,
                params={"optim.lr": 10.0 ** -(number + 1)},
                distributions=LR,
                user_attrs={FOLDER_ATTR: str(folder.resolve())},
                intermediate_values={2: 1.0} if state == TrialState.PRUNED else None,
            )
        )
    return study, tmp_path / "sweep"


def model_kept(sweep, number) -> bool:
    folder = sweep / f"trial-{number:04d}"
    has = [(folder / "model").exists(), (folder / "checkpoint-4").exists(), (folder / "latest").exists()]
    assert len(set(has)) == 1, f"trial {number} lost part of its model: {has}"
    return has[0]


def test_keep_best_removes_the_models_of_the_others_only(tmp_path):
    C, P, F, R = TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.RUNNING
    study, sweep = study_with(tmp_path, [(C, 0.5), (C, 0.3), (P, None), (C, 0.9), (F, None), (R, None), (C, 0.3)])
    for number in range(7):  # the user's files in trial folders, and a file of theirs named like a checkpoint
        (sweep / f"trial-{number:04d}" / "notes.txt").write_text("mine")
    (sweep / "trial-0003" / "checkpoint-9").write_text("a file, not a checkpoint folder")
    removed = keep_best(study, sweep, 2)
    # best two: 0.3 (trial 1, the earlier of the tie) and 0.3 (trial 6); the running (interrupted) trial is untouched
    assert [n for n in range(7) if model_kept(sweep, n)] == [1, 5, 6]
    assert all(p.name in ("model", "latest") or p.name.startswith("checkpoint-") for p in removed)
    assert (sweep / "trial-0003" / "checkpoint-9").read_text() == "a file, not a checkpoint folder"
    for number in range(7):
        folder = sweep / f"trial-{number:04d}"
        assert (folder / "notes.txt").read_text() == "mine"
        assert all((folder / name).exists() for name in ("config.yaml", "metrics.jsonl", TRIAL_LOG, TRIAL_CONFIG))
    assert keep_best(study, sweep, 0) and not model_kept(sweep, 1)  # K=0: none kept


def test_keep_best_leaves_trials_of_other_folders_alone(tmp_path):
    study, sweep = study_with(tmp_path, [(TrialState.COMPLETE, 0.5), (TrialState.COMPLETE, 0.4)])
    other = tmp_path / "elsewhere" / "trial-0000"  # another machine's (or sweep's) trial, with a shared storage
    fake_run(other)
    study.add_trial(
        create_trial(
            value=0.9, params={"optim.lr": 0.1}, distributions=LR, user_attrs={FOLDER_ATTR: str(other.resolve())}
        )
    )
    keep_best(study, sweep, 1)
    assert (other / "model").is_dir() and not model_kept(sweep, 0) and model_kept(sweep, 1)


def test_ranked_follows_the_direction(tmp_path):
    C = TrialState.COMPLETE
    study, _ = study_with(tmp_path, [(C, 0.5), (C, 0.9), (TrialState.FAIL, None), (C, 0.1)], direction="maximize")
    assert [t.number for t in ranked(study)] == [1, 0, 3]


def test_table_and_best_config(tmp_path):
    C, P = TrialState.COMPLETE, TrialState.PRUNED
    study, sweep = study_with(tmp_path, [(C, 0.5), (P, None), (C, 0.25)])
    table = rows(study)
    assert [(r.number, r.state, r.value) for r in table] == [
        (0, "complete", 0.5),
        (1, "pruned", None),
        (2, "complete", 0.25),
    ]
    write_table(sweep, table, ["optim.lr"], "loss")
    lines = (sweep / "trials.csv").read_text().splitlines()
    assert lines[0] == "number,state,loss,duration_s,optim.lr,folder"
    assert lines[3].startswith("2,complete,0.25,0.0,0.001,") and lines[3].endswith("trial-0002")
    shown = format_table(table, ["optim.lr"], "loss").splitlines()
    assert shown[0].split() == ["trial", "state", "loss", "duration", "optim.lr"]
    assert shown[2].split() == ["1", "pruned", "0", "s", "0.01"]  # no value; created in no time

    base = {"task": "classification", "optim": {"lr": 0.5, "weight_decay": 0.0}}

    def values_of(params):
        return {**base, "optim": {**base["optim"], "lr": params["optim.lr"]}}

    path = write_best(sweep, study, values_of, "loss")
    text = path.read_text()
    assert text.startswith("# the best trial of this sweep: trial 2, loss 0.25\n")
    assert yaml.safe_load(text) == {"task": "classification", "optim": {"lr": 0.001, "weight_decay": 0.0}}
    assert write_best(tmp_path, optuna.create_study(), values_of, "loss") is None  # no finished trial: no file


# ---- the folder: checks, --overwrite, the lock ---------------------------------------------------------------
RECORD = {"base": {"task": "classification"}, "space": {"optim.lr": {"type": "categorical", "choices": [0.1]}}}


def test_a_folder_of_other_files_is_refused_and_overwrite_keeps_them(tmp_path):
    out = tmp_path / "sweep"
    sweep_folder.check_folder(out, resume=False, overwrite=False, record=RECORD)  # new: fine
    out.mkdir()
    sweep_folder.check_folder(out, resume=False, overwrite=False, record=RECORD)  # empty: fine
    (out / "mine.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds files a sweep does not write \(mine.txt\)"):
        sweep_folder.check_folder(out, resume=False, overwrite=False, record=RECORD)
    sweep_folder.check_folder(out, resume=False, overwrite=True, record=RECORD)
    with pytest.raises(ConfigError, match="holds no sweep to continue"):
        sweep_folder.check_folder(out, resume=True, overwrite=False, record=RECORD)
    (out / "trials.csv").mkdir()  # a folder with the name of a sweep's file
    with pytest.raises(ConfigError, match="holds 'trials.csv', which is not what a sweep writes"):
        sweep_folder.check_folder(out, resume=False, overwrite=True, record=RECORD)


def test_files_named_as_a_sweeps_are_the_users_where_no_sweep_record_is(tmp_path):
    """Without sweep.yaml no sweep wrote there: a trials.csv or trial-0000 of the user's is never cleared or
    written over, --overwrite or not."""
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "trials.csv").write_text("my own table")
    (out / "trial-0000").mkdir()
    with pytest.raises(ConfigError, match=r"holds files a sweep does not write \(trial-0000, trials.csv\)"):
        sweep_folder.check_folder(out, resume=False, overwrite=False, record=RECORD)
    with pytest.raises(ConfigError, match="holds 'trial-0000', which is not what a sweep writes"):
        sweep_folder.check_folder(out, resume=False, overwrite=True, record=RECORD)
    assert (out / "trials.csv").read_text() == "my own table" and (out / "trial-0000").is_dir()


def test_an_earlier_sweep_needs_resume_or_overwrite_and_resume_the_same_sweep(tmp_path):
    out = tmp_path / "sweep"
    lock = sweep_folder.prepare(out, resume=False, overwrite=False, record=RECORD)
    try:
        with pytest.raises(ConfigError, match="another sweep process"):  # the lock is held
            sweep_folder.lock(out, wait=0.3)
    finally:
        import os

        os.close(lock)
    with pytest.raises(ConfigError, match="already holds a sweep; pass --resume to continue it, or --overwrite"):
        sweep_folder.check_folder(out, resume=False, overwrite=False, record=RECORD)
    sweep_folder.check_folder(out, resume=True, overwrite=False, record=RECORD)
    other = {**RECORD, "space": {"optim.lr": {"type": "categorical", "choices": [0.2]}}}
    with pytest.raises(ConfigError, match="was started with another space"):
        sweep_folder.check_folder(out, resume=True, overwrite=False, record=other)
    with pytest.raises(ConfigError, match="was started with another base config"):
        sweep_folder.check_folder(out, resume=True, overwrite=False, record={**RECORD, "base": {}})


def test_overwrite_clears_only_what_a_sweep_wrote(tmp_path):
    out = tmp_path / "sweep"
    fake_run(out / "trial-0000")
    fake_run(out / "trial-0001")
    (out / "trial-0001" / "notes.txt").write_text("mine")
    (out / "mine.txt").write_text("mine")
    (out / "trial-0002").write_text("a file of mine named like a trial")
    for name in ("trials.csv", "best.yaml", "study.db", "history.png", "sweep.yaml"):
        (out / name).write_text("x")
    sweep_folder.clear(out)
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt", "trial-0001", "trial-0002"]
    assert [p.name for p in (out / "trial-0001").iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("name", ["sweep?lr", "lr-5%41", "sweep #2"])
def test_the_default_study_lies_in_the_sweep_folder_whatever_its_name(tmp_path, name):
    """A '?' in the folder's path began the URL's query (the database went to a file beside the folder, named as the
    path up to it) and a '%' an escape (%41 read as 'A': no such folder, the study could not open)."""
    out = tmp_path / name
    out.mkdir()
    optuna.create_study(storage=sweep_folder.default_storage(out), study_name="s")
    assert (out / sweep_folder.DATABASE).is_file() and sorted(p.name for p in tmp_path.iterdir()) == [name]
