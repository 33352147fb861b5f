"""The built-in callbacks every training run has (tuneforge.callbacks): evaluation and save cadence, best-model
tracking and early stopping, heard in order after the user's callbacks; and the hooks a user's callback gets.

Runs are real (tiny BERT, 48 rows). A Trainer whose loss is zeroed (an override the API offers) never moves its
weights (no weight decay), so no evaluation after the first improves on it: early stopping must act."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from conftest import read_jsonl, tiny_run_config
from tuneforge.errors import ConfigError
from tuneforge.trainer import Callback, Trainer


def run_config(tmp_path: Path, tiny_bert: str, cache_dir: str, **extra):
    values = dict(max_steps=8, eval_strategy="steps", eval_steps=1)
    values["optim"] = {"lr": 1e-3, "warmup_ratio": 0.0, "weight_decay": 0.0}
    return tiny_run_config(tmp_path, tiny_bert, cache_dir, **{**values, **extra})


class StandStill(Trainer):
    """Zero loss: the weights never move, so every evaluation equals the first."""

    def compute_loss(self, outputs, batch):
        loss_sum, count = super().compute_loss(outputs, batch)
        return loss_sum * 0.0, count


class Events(Callback):
    def __init__(self):
        self.seen = []

    def on_step_end(self, trainer):
        self.seen.append(("step", trainer.state.step))

    def on_evaluate(self, trainer, metrics):
        self.seen.append(("evaluate", trainer.state.step, trainer.state.bad_evals))

    def on_save(self, trainer, path):
        self.seen.append(("save", trainer.state.step))


def test_early_stopping_stops_after_patience_evaluations_without_improvement(tmp_path, tiny_bert, cache_dir, capsys):
    events = Events()
    config = run_config(tmp_path, tiny_bert, cache_dir, early_stopping_patience=2, save_steps=1, quiet=False)
    result = StandStill(config, callbacks=[events]).fit()

    assert result["steps"] == 3 and result["best_step"] == 1  # evaluations 2 and 3 did not improve on step 1
    assert "early stopping: accuracy did not improve for 2 evaluations" in capsys.readouterr().err
    # the user's callback hears each evaluation before the built-in tracker counts it, then the checkpoint
    assert events.seen == [
        ("step", 1), ("evaluate", 1, 0), ("save", 1),
        ("step", 2), ("evaluate", 2, 0), ("save", 2),
        ("step", 3), ("evaluate", 3, 1), ("save", 3),
    ]  # fmt: skip
    run = tmp_path / "run"
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "eval"] == [1, 2, 3]
    saved = json.loads((run / "checkpoint-3" / "trainer_state.json").read_text())  # holds step 3's evaluation
    assert saved["stop"] is True and saved["bad_evals"] == 2 and saved["best_step"] == 1
    again = StandStill(config.model_copy(update={"resume": "latest"})).fit()  # a resume of it trains nothing: said
    assert again["steps"] == 3
    assert "note: nothing more trains from step 3: the run had stopped there" in capsys.readouterr().err


def test_without_patience_the_run_goes_on_and_the_best_is_still_tracked(tmp_path, tiny_bert, cache_dir):
    result = StandStill(run_config(tmp_path, tiny_bert, cache_dir, max_steps=4)).fit()
    assert result["steps"] == 4 and result["best_step"] == 1


class UndefinedFirst(StandStill):
    """Its first evaluation's accuracy is undefined (nan, as a correlation of constant predictions is); the weights
    never move, so every later evaluation is equal."""

    def evaluate(self, eval_dataset=None):
        metrics = super().evaluate(eval_dataset)
        first = self.state.step == 1 and eval_dataset is None
        return {**metrics, "accuracy": math.nan} if first else metrics


def test_an_undefined_metric_is_never_the_best_and_any_value_beats_it(tmp_path, tiny_bert, cache_dir):
    """A nan first evaluation once stayed the best (nothing compares greater than nan): the export was step 1's
    and early stopping counted every later evaluation as no improvement. A resumed run reads it as null."""
    config = run_config(tmp_path, tiny_bert, cache_dir, max_steps=3, load_best_model_at_end=True, save_steps=1)
    result = UndefinedFirst(config).fit()
    assert result["best_step"] == 2 and result["accuracy"] >= 0  # the first defined value; step 3 only equals it
    saved = json.loads((tmp_path / "run" / "checkpoint-1" / "trainer_state.json").read_text())
    assert saved["best_metric"] is None and saved["best_step"] is None and saved["bad_evals"] == 1


def test_a_best_metric_the_task_does_not_compute_is_one_error_at_the_first_evaluation(tmp_path, tiny_bert, cache_dir):
    trainer = Trainer(run_config(tmp_path, tiny_bert, cache_dir, metric_for_best="bleu"))
    with pytest.raises(ConfigError, match=r"^metric_for_best 'bleu' is not computed by this task; choose one of: "):
        trainer.fit()
    assert trainer.state.step == 1


def test_a_callback_with_only_some_hooks_is_told_only_those(tmp_path, tiny_bert, cache_dir):
    """A callback need not subclass Callback: the hooks it lacks (on_step_end came later) are skipped."""

    class OnlyEnd:
        def on_train_end(self, trainer, result):
            self.result = result

    only = OnlyEnd()
    result = Trainer(run_config(tmp_path, tiny_bert, cache_dir, max_steps=1), callbacks=[only]).fit()
    assert only.result == result


def test_the_last_step_is_evaluated_so_the_result_describes_the_exported_model(tmp_path, tiny_bert, cache_dir):
    """5 steps evaluated every 2: step 5 is evaluated too, on schedule (every callback hears it, then the checkpoint
    of step 5 holds it), and result.json holds that evaluation; at 4 steps, step 4's evaluation is not repeated; with
    load_best_model_at_end the last step is one more candidate and the export is the best."""

    def evals(run: Path) -> list[dict]:
        return [r for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "eval"]

    events = Events()
    config = run_config(tmp_path / "a", tiny_bert, cache_dir, max_steps=5, eval_steps=2, save_steps=5)
    result = Trainer(config, callbacks=[events]).fit()
    written = evals(tmp_path / "a" / "run")
    assert [r["step"] for r in written] == [2, 4, 5]
    assert [e[:2] for e in events.seen if e[0] != "step"] == [
        ("evaluate", 2),
        ("evaluate", 4),
        ("evaluate", 5),
        ("save", 5),
    ]
    assert result["loss"] == written[-1]["loss"] and result["accuracy"] == written[-1]["accuracy"]
    assert json.loads((tmp_path / "a" / "run" / "result.json").read_text())["loss"] == written[-1]["loss"]
    saved = json.loads((tmp_path / "a" / "run" / "checkpoint-5" / "trainer_state.json").read_text())
    assert saved["last_eval_step"] == 5 and saved["last_eval"]["loss"] == written[-1]["loss"]

    Trainer(run_config(tmp_path / "b", tiny_bert, cache_dir, max_steps=4, eval_steps=2)).fit()
    assert [r["step"] for r in evals(tmp_path / "b" / "run")] == [2, 4]

    best = run_config(tmp_path / "c", tiny_bert, cache_dir, max_steps=5, eval_steps=2, load_best_model_at_end=True)
    result = StandStill(best).fit()
    assert [r["step"] for r in evals(tmp_path / "c" / "run")] == [2, 4, 5] and result["best_step"] == 2


class StopAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer):
        trainer.state.stop = trainer.state.step == self.step


def eval_steps(run: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "eval"]


def as_written_before_last_eval_step(checkpoint_dir: Path) -> None:
    """Rewrite a checkpoint as one written before checkpoints kept the last evaluation's step (manifest included)."""
    state_file = checkpoint_dir / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state.pop("last_eval_step") is not None and state["last_eval"]
    state_file.write_text(json.dumps(state))
    manifest_file = checkpoint_dir / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    data = state_file.read_bytes()
    manifest["files"]["trainer_state.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_file.write_text(json.dumps(manifest))


def test_the_runs_end_evaluates_what_no_evaluation_saw_and_never_repeats_one(tmp_path, tiny_bert, cache_dir):
    """An epoch cut by max_steps (6 steps an epoch, 8 steps) and a callback's stop (at 3, evaluating every 2) end
    with an evaluation of the exported weights; a run resumed from its last checkpoint, one written before
    checkpoints kept the last evaluation's step, does not evaluate that step again."""
    cut = run_config(tmp_path / "epoch", tiny_bert, cache_dir, max_steps=8, eval_strategy="epoch", eval_steps=None)
    assert Trainer(cut).fit()["steps"] == 8 and eval_steps(tmp_path / "epoch" / "run") == [6, 8]

    stop = Trainer(run_config(tmp_path / "stop", tiny_bert, cache_dir, eval_steps=2), callbacks=[StopAt(3)]).fit()
    assert stop["steps"] == 3 and eval_steps(tmp_path / "stop" / "run") == [2, 3]

    config = run_config(tmp_path / "old", tiny_bert, cache_dir, max_steps=4, eval_steps=2, save_steps=2)
    Trainer(config).fit()
    as_written_before_last_eval_step(tmp_path / "old" / "run" / "checkpoint-4")
    Trainer(config.model_copy(update={"resume": "latest"})).fit()
    assert eval_steps(tmp_path / "old" / "run") == [2, 4]


def test_the_end_evaluation_comes_before_the_last_checkpoint(tmp_path, tiny_bert, cache_dir):
    """eval_strategy no: the run's one evaluation is of its last step, heard by the user's callbacks before the
    checkpoint of that step, which holds it (a run continued from it keeps the record in metrics.jsonl, as a
    tracker keeps it). An old checkpoint's evaluation, taken as of its own step, does not count for a later one."""
    events = Events()
    config = run_config(tmp_path / "no", tiny_bert, cache_dir, max_steps=4, eval_strategy="no", save_steps=2)
    result = Trainer(config, callbacks=[events]).fit()
    assert [e[:2] for e in events.seen if e[0] != "step"] == [("save", 2), ("evaluate", 4), ("save", 4)]
    written = read_jsonl(tmp_path / "no" / "run" / "metrics.jsonl")
    saved = json.loads((tmp_path / "no" / "run" / "checkpoint-4" / "trainer_state.json").read_text())
    assert saved["last_eval_step"] == 4 and saved["metrics_records"] == len(written)
    assert written[-1]["split"] == "eval" and result["loss"] == written[-1]["loss"]

    cut = dict(max_steps=8, eval_strategy="epoch", eval_steps=None, save_strategy="epoch", save_steps=None)
    Trainer(run_config(tmp_path / "epoch", tiny_bert, cache_dir, **{**cut, "max_steps": 6})).fit()
    as_written_before_last_eval_step(tmp_path / "epoch" / "run" / "checkpoint-6")
    Trainer(run_config(tmp_path / "epoch", tiny_bert, cache_dir, **cut, resume="latest")).fit()
    assert eval_steps(tmp_path / "epoch" / "run") == [6, 8]


class CountSteps(Callback):
    steps = 0

    def on_step_end(self, trainer):
        type(self).steps += 1


def test_a_callback_given_as_a_class_is_instantiated_as_transformers_does(tmp_path, tiny_bert, cache_dir):
    """transformers' Trainer(callbacks=[MyCallback]) makes one instance of a class; here the class's hooks were
    called unbound: 'Callback.on_train_begin() missing 1 required positional argument', after the model loaded."""
    trainer = Trainer(run_config(tmp_path, tiny_bert, cache_dir, max_steps=2), callbacks=[CountSteps])
    assert isinstance(trainer.callbacks[0], CountSteps)
    trainer.fit()
    assert CountSteps.steps == 2


def test_a_transformers_callback_is_refused_in_one_line_before_the_run(tmp_path, tiny_bert, cache_dir):
    """A TrainerCallback's hooks take (args, state, control): it failed at the run's first event with 'missing 2
    required positional arguments', after the model loaded and config.yaml was written."""
    from transformers import EarlyStoppingCallback

    config = run_config(tmp_path, tiny_bert, cache_dir)
    with pytest.raises(TypeError, match=r"^callbacks\[1\] is a transformers TrainerCallback \(EarlyStoppingCallback\)"):
        Trainer(config, callbacks=[Events(), EarlyStoppingCallback(2)])
    assert not (tmp_path / "run").exists()


def test_the_same_callback_object_given_twice_is_refused_in_one_line(tmp_path, tiny_bert, cache_dir):
    """It heard every event twice (a counter counted each step twice, a stopping rule judged each evaluation
    twice); transformers warns of a second callback of a class. Two objects of one class stay two callbacks."""
    config = run_config(tmp_path, tiny_bert, cache_dir)
    events = Events()
    with pytest.raises(TypeError, match=r"^callbacks\[2\] is callbacks\[0\] again \(an Events\)"):
        Trainer(config, callbacks=[events, Events(), events])
    assert len(Trainer(config, callbacks=[Events(), Events(), CountSteps, CountSteps]).callbacks) == 4
    assert not (tmp_path / "run").exists()
