"""The Trainer's events (`Callback`) and the callbacks every run is built with: evaluation and save cadence,
best-model tracking and early stopping.

Each hook gets the trainer (`.state`, `.model`, `.backend`, `.config`, ...). A run's callbacks hear an event
in this order: the user's, then the built-ins (`BestModel`, `EarlyStopping`, `EvaluationCadence`,
`EndEvaluation`, `SaveCadence`), so at a step's or an epoch's end the run evaluates, tracks the best, and then
saves a checkpoint that holds that evaluation. The user's are taken as given (`user_callbacks`): a class is
instantiated, a transformers TrainerCallback or an object given twice refused.
"""

from __future__ import annotations

import math
from pathlib import Path

from tuneforge.errors import ConfigError


class Callback:
    """Hooks; each gets the trainer (with `.state`, `.model`, `.backend`)."""

    def on_train_begin(self, trainer) -> None: ...
    def on_step_end(self, trainer) -> None: ...
    def on_log(self, trainer, logs: dict) -> None: ...
    def on_evaluate(self, trainer, metrics: dict) -> None: ...
    def on_save(self, trainer, path: Path) -> None: ...
    def on_epoch_end(self, trainer) -> None: ...
    def on_train_end(self, trainer, result: dict) -> None: ...


def user_callbacks(given) -> list:
    """The user's callbacks as instances: a class is instantiated, as transformers' Trainer does; a transformers
    TrainerCallback (its hooks take args, state and control) is refused here, not at the run's first event, and so
    is an object given twice (it would hear each event twice; transformers warns of a class's second callback)."""
    found = []
    for i, callback in enumerate(given or []):
        kind = callback if isinstance(callback, type) else type(callback)
        if any(c.__name__ == "TrainerCallback" and c.__module__.startswith("transformers.") for c in kind.__mro__):
            raise TypeError(
                f"callbacks[{i}] is a transformers TrainerCallback ({kind.__name__}), whose hooks take (args, state, "
                "control); a tuneforge callback's hooks take the trainer (trainer.state, trainer.model, "
                "trainer.config): subclass tuneforge.Callback, and set trainer.state.stop = True where transformers "
                "sets control.should_training_stop (early stopping: early_stopping_patience)"
            )
        again = next((j for j, seen in enumerate(found) if seen is callback), None)
        if again is not None:
            raise TypeError(
                f"callbacks[{i}] is callbacks[{again}] again (an {kind.__name__}): it would hear every event twice; "
                "give it once (two objects of one class are two callbacks)"
            )
        found.append(callback() if isinstance(callback, type) else callback)
    return found


class BestModel(Callback):
    """The best of the run's scheduled evaluations by `metric`: `state.best_metric`, `best_step`, and
    `bad_evals` (evaluations since the best). `keep_weights` (load_best_model_at_end): its weights in
    `weights` (main rank; `restored` from the best checkpoint on a resume) and its metrics in
    `state.best_eval` (every rank: the final model is chosen on it). A nan or infinite value (an undefined
    correlation) is no value: never the best, and any value beats none (a checkpoint's trainer_state.json holds it
    as null, so a resumed run ranks as the run it continues)."""

    def __init__(self, metric: str, greater_is_better: bool, keep_weights: bool, restored: dict | None = None):
        self.metric, self.greater_is_better, self.keep_weights = metric, greater_is_better, keep_weights
        self.weights = restored

    def on_evaluate(self, trainer, metrics: dict) -> None:
        st = trainer.state
        if self.metric not in metrics:
            raise ConfigError(
                f"metric_for_best {self.metric!r} is not computed by this task; choose one of: {', '.join(metrics)}"
            )
        value, best = metrics[self.metric], st.best_metric
        if best is not None and not math.isfinite(best):  # a checkpoint of before: nan written as NaN
            best = None
        defined = value is not None and math.isfinite(value)
        if defined and (best is None or (value > best if self.greater_is_better else value < best)):
            st.best_metric, st.best_step, st.bad_evals = value, st.step, 0
            if self.keep_weights:
                self.weights = trainer.backend.full_state_dict(trainer.model)
                st.best_eval = metrics
        else:
            st.bad_evals += 1


class EarlyStopping(Callback):
    """Stops the run once `patience` evaluations in a row did not improve on the best (`BestModel` counts)."""

    def __init__(self, patience: int, metric: str):
        self.patience, self.metric = patience, metric

    def on_evaluate(self, trainer, metrics: dict) -> None:
        st = trainer.state
        if st.bad_evals and st.bad_evals >= self.patience:
            trainer.report.print(f"early stopping: {self.metric} did not improve for {st.bad_evals} evaluations")
            st.stop = True


class Cadence(Callback):
    """Acts every `steps` optimizer steps (strategy "steps") or at the end of each epoch ("epoch")."""

    def __init__(self, strategy: str, steps: int | None = None):
        self.strategy, self.steps = strategy, steps

    def act(self, trainer) -> None:
        raise NotImplementedError

    def on_step_end(self, trainer) -> None:
        if self.strategy == "steps" and trainer.state.step % self.steps == 0:
            self.act(trainer)

    def on_epoch_end(self, trainer) -> None:
        if self.strategy == "epoch":
            self.act(trainer)


class EvaluationCadence(Cadence):
    """eval_strategy / eval_steps: a scheduled evaluation (its metrics go to every callback's on_evaluate). With
    "steps", the run's last step is one too (115 steps evaluated every 40: at 40, 80 and 115), so that the model it
    exports has its metrics in result.json (and any checkpoint of that step holds them). A scheduled evaluation like
    the others: it can be the best model and counts for early stopping."""

    def on_step_end(self, trainer) -> None:
        super().on_step_end(trainer)
        st = trainer.state
        if self.strategy == "steps" and st.step >= trainer.run.plan.total_steps and st.last_eval_step != st.step:
            self.act(trainer)

    def act(self, trainer) -> None:
        trainer.evaluate_and_log()


def exports_best(config, state) -> bool:
    """Whether the run exports its best evaluated model (load_best_model_at_end), decided on best_eval, which every
    rank has (the weights are held by the main rank only)."""
    return config.load_best_model_at_end and state.best_eval is not None


def exported_weights_unevaluated(config, state) -> bool:
    """Whether the weights the run would export now had no evaluation: yes unless the last evaluation was of this
    step's weights or the export is the best evaluated model, so that result.json always describes the exported
    model (with eval_strategy "no" that is the run's one evaluation)."""
    return not (state.last_eval_step == state.step or exports_best(config, state))


class EndEvaluation(Callback):
    """At the step a run ends (its last planned step, or a stop), evaluates the weights it exports when no
    evaluation saw them (eval_strategy "no", an epoch cut by max_steps, a callback's stop), before any checkpoint
    of that step: a run continued from that checkpoint keeps the evaluation in metrics.jsonl, as a tracker does.
    Not a scheduled evaluation: only the user's callbacks hear it (it is neither a best-model candidate nor a
    reason to stop early)."""

    def on_step_end(self, trainer) -> None:
        st, run = trainer.state, trainer.run
        if run.eval_data is None:  # fit() given no eval_dataset, with evaluation off
            return
        ends = st.step >= run.plan.total_steps or st.stop
        epoch_evaluation_follows = run.config.eval_strategy == "epoch" and st.step == run.epoch_last_step
        if ends and not epoch_evaluation_follows and exported_weights_unevaluated(run.config, st):
            trainer.evaluate_and_log(scheduled=False)


class SaveCadence(Cadence):
    """save_strategy / save_steps: a checkpoint (every callback's on_save gets its path). The run's last planned
    step is saved too where the cadence does not save it (--max-steps 5 with save_steps 2, or an epoch that
    --max-steps cuts), as transformers' Trainer saves at the end: the run can be continued from where it ended."""

    def on_step_end(self, trainer) -> None:
        super().on_step_end(trainer)
        st, run = trainer.state, trainer.run
        saved_by_cadence = st.step % self.steps == 0 if self.strategy == "steps" else st.step == run.epoch_last_step
        if st.step == run.plan.total_steps and not saved_by_cadence:
            self.act(trainer)

    def act(self, trainer) -> None:
        trainer.save_checkpoint()


def built_in_callbacks(config, metric: str, greater_is_better: bool, best_weights: dict | None) -> list[Callback]:
    """The callbacks of a training run of `config`, in the order they act; the first is its `BestModel`."""
    best = BestModel(metric, greater_is_better, keep_weights=config.load_best_model_at_end, restored=best_weights)
    found = [best]
    if config.early_stopping_patience:
        found.append(EarlyStopping(config.early_stopping_patience, metric))
    if config.eval_strategy != "no":
        found.append(EvaluationCadence(config.eval_strategy, config.eval_steps))
    found.append(EndEvaluation())
    if config.save_strategy != "no":
        found.append(SaveCadence(config.save_strategy, config.save_steps))
    return found
