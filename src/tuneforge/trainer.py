"""The Trainer: orchestrates a run, and owns the training loop and evaluation.

High level:  `Trainer(TrainConfig(task="glue/mrpc")).fit()` builds tokenizer, data and model
from the config. Low level: pass your own model/tokenizer/datasets to `fit`, subclass and
override `forward_step` / `compute_loss` / `train_step`, or add `Callback`s.

`fit` sets a run up whole (`tuneforge.run`: backend, data, model, optimizer, step plan, checkpointer,
a resume) and then runs the loop: optimizer steps from the step plan (`tuneforge.plan`), logged, with the
callbacks told each step's and epoch's end. Evaluation and save cadence, the evaluation of the exported
weights at the run's end, best-model tracking and early stopping are built-in callbacks (`tuneforge.callbacks`).
Everything backend-specific sits behind `trainer.backend` (tuneforge/backends/base.py), everything
task-specific behind `trainer.task` (tuneforge/tasks/base.py). With `harness_after_train`,
lm-evaluation-harness scores the exported model once fit ends (tuneforge/harness/after_train.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from pathlib import Path
from typing import Any

import torch

from tuneforge import checkpoint, export, launch, run_lock
from tuneforge.artifacts import import_model_code
from tuneforge.backends import backend_classes, check_launchable, get_backend
from tuneforge.backends.base import NonFiniteStep
from tuneforge.callbacks import Callback, exported_weights_unevaluated, exports_best, user_callbacks
from tuneforge.config import TrainConfig, check_given_now
from tuneforge.configure import build_config, resolve
from tuneforge.data.prefetch import Prefetch
from tuneforge.data.samplers import eval_batches, lengths_of
from tuneforge.errors import ConfigError, NonFiniteError, NoRoomError
from tuneforge.harness import after_train
from tuneforge.progress import Progress
from tuneforge.reporting import quiet_libraries, write_result
from tuneforge.run import Given, Run, device_name, on_plateau, set_up_evaluation, set_up_training
from tuneforge.schedules import lr_schedule
from tuneforge.tasks import get_task
from tuneforge.tasks.base import EvalTools, StepTools
from tuneforge.tracking import check_trackers

__all__ = ["Callback", "Trainer", "TrainState"]

TrainState = Progress  # the name of before: `trainer.state` is a Progress


def _nonfinite_what(what: str, step: int, local_loss: float) -> str:
    """'the loss at step 7 is nan' (this rank's value, where it is the one), or 'the gradients at step 7 are
    not finite'."""
    if what == "loss":
        return f"the loss at step {step} is " + (str(local_loss) if not math.isfinite(local_loss) else "not finite")
    return f"the {what} at step {step} are not finite"


def summed_loss(returned) -> torch.Tensor:
    """The loss sum of what `compute_loss` returned: (sum over the batch's items, their count); a subclass's override
    that returns a mean alone is told so (it was "iteration over a 0-d tensor")."""
    if not (isinstance(returned, tuple | list) and len(returned) == 2):
        raise TypeError(
            f"compute_loss returns (the loss summed over the batch's items, their count), not {type(returned).__name__}"
            ": the Trainer divides by the items of the whole step, across accumulation and ranks"
        )
    return returned[0]


class _OfTheRun:
    """`trainer.NAME` reads the run's NAME (None before fit or validate sets a run up)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, trainer, owner=None):
        return self if trainer is None else getattr(trainer.run, self.name, None)

    def __set__(self, trainer, value) -> None:
        raise AttributeError(f"trainer.{self.name} belongs to the run that fit or validate sets up")


@contextlib.contextmanager
def given_back_as_it_was(model):
    """A model given to fit() comes back with its own trainable flags and checkpointing, whatever the run set on it
    (its freezing, --gradient-checkpointing): a second fit of the same object would inherit them, and a forward of
    the user's would recompute every layer in its backward. transformers' Trainer never changes the flags."""
    if model is None:
        yield
        return
    trainable = [(param, param.requires_grad) for param in model.parameters()]
    checkpointing = getattr(model, "is_gradient_checkpointing", None)
    try:
        yield
    finally:
        for param, flag in trainable:
            param.requires_grad_(flag)
        if checkpointing is False and getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()


class Trainer:
    """Fits or validates the model of `config`. `trainer.state` is where the run stands (a Progress);
    `trainer.run` what fit or validate set up, read through `trainer.model`, `.backend`, `.optimizer`,
    `.scheduler`, `.tokenizer`, `.train_data`, `.eval_data` and `.report`."""

    backend = _OfTheRun()
    model = _OfTheRun()  # wrapped by the backend
    optimizer = _OfTheRun()
    scheduler = _OfTheRun()
    tokenizer = _OfTheRun()
    train_data = _OfTheRun()
    eval_data = _OfTheRun()
    report = _OfTheRun()

    def __init__(
        self,
        config: TrainConfig | dict | None = None,
        callbacks: list[Callback | type[Callback]] | None = None,
        *,
        fork_workers: bool = False,
        **overrides: Any,
    ):
        """`fork_workers`: with nproc > 1, start the workers by forking this process when fit or validate is
        called (no second start-up of Python and the libraries; also from a notebook) instead of running this
        process's command again in each of them (which runs the whole script there)."""
        # resolved here (its task, backend, their options and the task's defaults), whether built as
        # TrainConfig(...), by build_config, or given as a dict
        if isinstance(config, TrainConfig):
            config = resolve(config, **overrides)
        else:
            config = build_config(config or {}, **overrides)
        check_given_now(config, {}, overrides)  # given now, as the CLI's flags (a config's own values are kept)
        self.config = config
        self.callbacks = user_callbacks(callbacks)  # a class given: its instance
        self.fork_workers = fork_workers
        self.task = get_task(config)
        self._task_used = False  # by a fit or validate: the next one starts from a fresh task
        self.state = Progress()
        self.run: Run | None = None  # built whole by fit / validate
        self._fitted: tuple[str, Any] | None = None  # the last fit's exported model folder and its eval_dataset

    # ---- overridable steps (FlagAI's MyTrainer pattern) ------------------------------------
    def forward_step(self, model, batch: dict[str, torch.Tensor]):
        with self.backend.autocast():
            return self.task.forward(model, batch)

    def compute_loss(self, outputs, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, item count) of one micro-batch. The step divides every micro-batch's sum by the task's
        `count` of the whole step (known before the first forward, so each backward is scaled as it runs), not by
        the count returned here: an override that leaves items out of the sum still divides by all of them."""
        return self.task.compute_loss(outputs, batch)

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        o = self.config.optim
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            if p.requires_grad:
                (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        fused = o.fused
        if fused is None:  # fused where the parameters' device supports it
            fused = all(p.device.type in ("cpu", "cuda") and p.dtype == torch.float32 for p in decay + no_decay)
        return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=bool(fused))

    def make_scheduler(self, optimizer, total_steps: int, start_step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
        """The LR schedule of `optimizer` over `total_steps`, at `start_step` (a resume that re-plans the run),
        stepped after each optimizer step; an override's torch ReduceLROnPlateau after each scheduled evaluation
        instead, with its metric_for_best."""
        o = self.config.optim
        warmup = o.warmup_steps or int(o.warmup_ratio * total_steps)
        return lr_schedule(o.scheduler, optimizer, warmup, total_steps, start_step)

    # ---- public entry points ---------------------------------------------------------------
    def fit(self, model=None, tokenizer=None, train_dataset=None, eval_dataset=None) -> dict:
        """Train; returns the final metrics. Launches its own workers when nproc > 1."""
        self._fresh_task()
        cfg, restarted = self.config, launch.restart_count() > 0
        if restarted and not cfg.resume and checkpoint.list_checkpoints(Path(cfg.output_dir)):
            cfg = cfg.model_copy(update={"resume": "latest"})  # elastic restart: this run continues the last one
        given = Given(model, tokenizer, train_dataset, eval_dataset)
        again = lambda: self.fit(model, tokenizer, train_dataset, eval_dataset)  # noqa: E731 (in a forked worker)
        lock = self._lock_output_dir(cfg, fresh=not checkpoint.continues_own_run(cfg) and not restarted)
        self._fitted = None  # (a failed fit may have replaced the folder of the one before)
        try:
            with quiet_libraries(cfg.quiet), given_back_as_it_was(model):
                result = self._fit_locked(cfg, given, again)
        finally:
            if lock is not None:
                lock.release()
        if result and result.get("model_dir"):
            self._fitted = (result["model_dir"], eval_dataset)
        return result

    train = fit

    @staticmethod
    def _lock_output_dir(cfg: TrainConfig, fresh: bool) -> run_lock.RunLock | None:
        """Check the output dir (a `fresh` run: one that does not continue its own) and hold it for this run, in
        the launching process (the workers it starts run under its lock); None in the others."""
        if launch.launched_by_us() or launch.process_rank() != 0 or cfg.node_rank != 0:
            return None
        lock = run_lock.take(cfg.output_dir)
        try:
            if fresh:
                checkpoint.prepare_output_dir(cfg)  # also: it can be created and written, before any heavy work
        except BaseException:
            lock.release()
            raise
        return lock

    def _fit_locked(self, cfg: TrainConfig, given: Given, again) -> dict:
        model = given.model
        if launch.process_rank() == 0 and cfg.node_rank == 0:  # where the trackers open: packages, servers
            check_trackers(cfg)
        harness = cfg.harness_after_train if launch.prints_result() else None  # run once, where the result shows
        if harness:
            model_config = getattr(model, "config", None) if model is not None else self.task.peek_model_config()
            after_train.check_after_train(harness, cfg.output_dir, self.task.generates, model_config)
        result = self._on_backend(cfg, model, lambda backend: self._fit(cfg, backend, given), again)
        if harness and result:  # lm-evaluation-harness on the exported model, into OUTPUT_DIR/harness
            scores = after_train.after_training(harness, result["model_dir"], cfg.output_dir, quiet=cfg.quiet)
            result.update(harness=scores, harness_dir=str(after_train.harness_folder(cfg.output_dir)))
            result.update(after_train.run_metrics(scores))
            write_result(cfg.output_dir, result)  # the scores are metrics of the run: `runs` and sweeps read them
        return result

    def validate(self, model=None, tokenizer=None, eval_dataset=None) -> dict:
        """Evaluate a model on the validation split (or `eval_dataset`): the one given; else, after a fit of this
        Trainer, the model that fit exported (the best with load_best_model_at_end) on fit's eval_dataset, as
        transformers' evaluate() after train(); else the config's (or the task's default)."""
        cfg = self.config
        if model is None and self._fitted is not None:
            cfg = cfg.model_copy(update={"model": self._fitted[0]})
            eval_dataset = self._fitted[1] if eval_dataset is None else eval_dataset
        self._fresh_task(cfg)
        given = Given(model, tokenizer, None, eval_dataset)
        again = lambda: self.validate(model, tokenizer, eval_dataset)  # noqa: E731 (in a forked worker)
        with quiet_libraries(cfg.quiet):
            return self._on_backend(cfg, model, lambda backend: self._validate(cfg, backend, given), again)

    def _fresh_task(self, config: TrainConfig | None = None) -> None:
        """The task of `config` (the Trainer's) anew for a second fit or validate of this Trainer (a notebook's next
        cell): a run's set-up gives the task that run's label set, which another run's data or model must not
        inherit. A worker forked for this run (`again`) keeps the task it was forked with: the user's settings on it
        stay."""
        if self._task_used and not launch.launched_by_us():
            self.task = get_task(config or self.config)
        self._task_used = True

    def _on_backend(self, cfg: TrainConfig, model, work, again) -> dict:
        """Launch the workers (nproc > 1 from a plain process; forked ones call `again`, the entry point that
        was called here), or set this process's backend up, do the `work` on it and hand the result back to the
        launching process."""
        model_config = getattr(model, "config", None) if model is not None else self.task.peek_model_config()
        if launch.needs_launch(cfg):
            check_launchable(cfg, launch.dist_env(), model_config)
            self._check_task_fits(get_backend(cfg, launch.dist_env()))
            if self.fork_workers and launch.forks_workers(cfg):
                import_model_code(model_config)  # once here, not again in each forked worker
            return launch.launch_workers(cfg, again if self.fork_workers else None)
        backend = get_backend(cfg, launch.dist_env())
        backend.check(model_config)
        self._check_task_fits(backend)
        backend.setup()
        try:
            return launch.hand_back(work(backend), backend.is_main)
        except Exception as err:
            peer_error = launch.pass_failure_across_ranks(err)  # while the world's store is still there
            if peer_error is not None:  # this rank's failure follows from a peer's user error (or stop)
                raise peer_error from None
            raise
        finally:
            backend.teardown()

    def _check_task_fits(self, backend) -> None:
        """A task that generates while it trains needs the whole model on each rank, one that runs the model again
        in its backward a backend that accumulates a weight's gradients: one line where the backend does not."""
        rerun, refusal = self.task.reruns_in_backward, backend.refuses_repeated_gradients()
        if rerun and refusal:
            raise ConfigError(
                f"{rerun} runs the model again in the backward, so each weight's gradient arrives once per run, and "
                f"backend {backend.name!r} cannot take that: {refusal}; or leave the setting out"
            )
        if self.task.generates_while_training and not backend.holds_whole_model():
            whole = [name for name, cls in backend_classes().items() if cls.distributed and not cls.sharded]
            raise ConfigError(
                f"--task {self.config.task} generates with the model while it trains, and backend {backend.name!r} "
                "(as configured) splits the weights across ranks, so no rank could generate alone; use a backend "
                f"whose ranks each hold the whole model ({', '.join('--backend ' + n for n in whole)}; with "
                "--adapter lora the frozen weights cost no optimizer state)"
            )

    def _validate(self, cfg: TrainConfig, backend, given: Given) -> dict:
        t0 = time.perf_counter()
        self.run = set_up_evaluation(cfg, self.task, backend, given, self.callbacks)
        metrics = self.evaluate()
        metrics["wall_s"] = round(time.perf_counter() - t0, 2)
        return metrics

    def _fit(self, cfg: TrainConfig, backend, given: Given) -> dict:
        t0 = time.perf_counter()
        self.run, self.state = set_up_training(
            cfg, self.task, backend, given, self.callbacks, self.make_optimizer, self.make_scheduler
        )
        plan = self.run.plan
        replace_old = cfg.overwrite and not checkpoint.continues_own_run(cfg) and launch.restart_count() == 0
        checkpoint.write_run_files(cfg, backend.is_main, replace_old=replace_old)
        if replace_old and backend.is_main:  # the replaced run's harness scores are of a model that is gone
            after_train.clear_scores(cfg.output_dir)
        try:
            steps, examples = plan.total_steps, plan.step_examples
            self.report.start(steps, self.state.step, plan.n_train, examples, backend, device_name(backend.device))
            self._fire("on_train_begin")
            self._loop()
            if self.run.window[1].item() > 0:
                self._log_train()
            evaluable = self.run.eval_data is not None  # fit() may be given no eval_dataset, with evaluation off
            if evaluable and exported_weights_unevaluated(cfg, self.state):  # what EndEvaluation did not hear
                self.evaluate_and_log(scheduled=False)
            return self._finish(t0)
        except BaseException as err:
            self.report.stop()  # the trackers' runs end as failed
            if self.run.feed is not None:  # the prefetch thread of the epoch it stopped in
                self.run.feed = self.run.feed.close()
            if isinstance(err, NoRoomError):  # what had no room, and how the run goes on once there is room
                raise NoRoomError(f"{err}{checkpoint.resume_advice(Path(cfg.output_dir), self.state.step)}") from None
            raise

    def _loop(self) -> None:
        """Optimizer steps until the plan's total or a stop: each epoch's steps from the data position, each
        step logged and then heard by the callbacks (evaluation, checkpoint); an epoch's end likewise."""
        run, st, plan = self.run, self.state, self.run.plan
        lengths = run.data.length_column()
        # past the plan's last step with the epoch's data used up: a resume from the run's last checkpoint, written
        # before the epoch's end was counted (stopped in the final evaluation or export); it is counted as it was
        while not st.stop and (st.step < plan.total_steps or st.consumed):
            steps, order_size = plan.epoch_steps(lengths, st, run.backend.dp_rank, run.orders)
            if st.step >= plan.total_steps and len(steps):  # the run ends inside this epoch (--max-steps)
                break
            st.order_digest = steps.order_digest
            run.feed = Prefetch(functools.partial(self._collate, run.train_data), steps, on_wait=self._waited)
            run.epoch_last_step = st.step + len(steps)
            for i, micro_batches in enumerate(steps):
                loss_sum, count = self.train_step(micro_batches)
                if not on_plateau(run.scheduler):  # that one moves on evaluations (evaluate_and_log)
                    run.scheduler.step()
                st.step += 1
                if (i + 1) % plan.repeats == 0:  # the step's data had its last update (a resume starts at one)
                    st.consumed = min(order_size, st.consumed + plan.global_batch * len(micro_batches))
                run.window[0] += loss_sum
                run.window[1] += count
                if st.step % run.config.logging_steps == 0 or st.step == plan.total_steps:
                    self._log_train()
                run.report.advance()
                self._fire("on_step_end")
                if (st.step >= plan.total_steps or st.stop) and i < len(steps) - 1:
                    break
            else:  # the epoch ran to its end
                st.epoch, st.consumed, st.order_global_batch = st.epoch + 1, 0, plan.step_examples
                self._fire("on_epoch_end")
            run.feed = run.feed.close()

    def _fire(self, hook: str, *args, callbacks: list | None = None) -> None:
        """Tell the run's callbacks (or `callbacks`) an event; a callback without that hook skips it."""
        for cb in self.run.callbacks if callbacks is None else callbacks:
            handler = getattr(cb, hook, None)
            if handler is not None:
                handler(self, *args)

    def save_checkpoint(self) -> Path:
        """A checkpoint of the run as it stands (a collective: every rank calls it); returns its path."""
        run, st = self.run, self.state
        st.log_loss, st.log_count = run.window.tolist()  # this rank's logging window
        st.metrics_records = run.report.count_records()
        st.tracker_runs = run.report.checkpoint_trackers()
        path = run.checkpointer.save(run.model, run.optimizer, run.scheduler, st)
        self._fire("on_save", path)
        return path

    # ---- one optimizer step ----------------------------------------------------------------
    def train_step(self, micro_batches: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward every micro-batch of one optimizer step, then step.

        The loss is normalised by the number of items (examples or tokens) in the whole global
        accumulated batch, so accumulation and data parallelism equal one large batch.
        """
        b = self.backend
        feed = self.run.feed
        if feed is not None:  # collated ahead, while the step before trained
            batches = [self._to_device(batch) for batch in feed.take(micro_batches)]
        else:
            batches = [self._to_device(self._collate(self.train_data, idx)) for idx in micro_batches]
        batches = self.task.prepare_step(batches, self._step_tools())  # e.g. GRPO: generated and scored here
        counts = torch.stack([self.task.count(bt).to(b.device).float() for bt in batches])
        local_count = counts.sum()
        global_count = b.reduce_sum(local_count)
        scale = b.dp_size / global_count.clamp(min=1)
        total = torch.zeros((), device=b.device)
        for i, batch in enumerate(batches):
            # gradients are synchronised across ranks once per step: on the last micro-batch
            with b.micro_step(self.model, sync=i == len(batches) - 1):
                outputs = self.forward_step(self.model, batch)
                loss_sum = summed_loss(self.compute_loss(outputs, batch))
                b.backward(loss_sum * scale, self.model)
            # the logits (and a causal LM's key/value cache) go now, not held through the next micro-batch's
            # forward and backward and the optimizer step
            del outputs
            total += loss_sum.detach().float()
        try:
            b.step(self.model, self.optimizer, loss=total)
        except NonFiniteStep as bad:
            self._skip_nonfinite(bad, total)
            return torch.zeros_like(total), torch.zeros_like(local_count)  # nothing of it in the logged loss
        return total, local_count

    def _skip_nonfinite(self, bad: NonFiniteStep, local_loss: torch.Tensor) -> None:
        """A step whose loss or gradients were nan/inf (on any rank; the backend did not update the weights):
        skipped and logged while `skip_nonfinite` allows, else the run stops here, before anything is saved, so
        the last checkpoint stays the latest. A skipped step still counts (its data is consumed, the schedule
        moves on), so the run's plan and a resume are unchanged."""
        cfg, st = self.config, self.state
        what = _nonfinite_what(bad.what, st.step + 1, float(local_loss))
        if bad.applied or st.skipped_steps >= cfg.skip_nonfinite:
            self.report.stop()
            how = (
                "the engine applied that update, so it cannot be skipped"
                if bad.applied
                else f"--skip-nonfinite N skips up to N such steps (this run allows {cfg.skip_nonfinite})"
            )
            raise NonFiniteError(
                f"{what}: training stopped, nothing saved from it (the last checkpoint, if any, stays the latest); "
                f"{self._nonfinite_suspects()} may be at fault; {how}"
            )
        st.skipped_steps += 1
        allowed = f"{st.skipped_steps} of --skip-nonfinite {cfg.skip_nonfinite}"
        self.report.print(f"warning: {what}: step skipped, no update ({allowed})")
        self.report.log({"split": "skipped", "step": st.step + 1, "epoch": st.epoch, "reason": what})

    def _nonfinite_suspects(self) -> str:
        """What of this run's settings and data can turn a loss or gradient nan/inf."""
        cfg = self.config
        suspects = ["the learning rate (--lr)"]
        suspects += list(self.task.options.nonfinite_suspects)
        suspects += ["--lora-alpha"] if cfg.adapter == "lora" else []
        suspects += ["unclipped gradients (--max-grad-norm)"] if not cfg.optim.max_grad_norm else []
        suspects += ["fp16's range (--precision bf16 or fp32)"] if self.backend.precision == "fp16" else []
        return ", ".join(suspects) + " or the data (a row with an extreme value)"

    # ---- generation inside training ----------------------------------------------------------
    def complete(self, prompts: list[list[int]], settings: list[dict]) -> list:
        """Completions of token-id prompts from the live model: the continuous-batching engine over the unwrapped
        model (no copy of the weights), in eval mode, under the run's autocast. `settings`: one dict of
        `SamplingParams` fields (max_tokens, temperature, top_p, seed...) per prompt."""
        from tuneforge.serve.engine import GenerationEngine, SamplingParams

        run = self.run
        if run.engine is None:
            run.engine = GenerationEngine.from_model(
                run.backend.unwrap(run.model), run.tokenizer, max_queue=max(1024, len(prompts))
            )
        weights = run.backend.precision_plugin.weights_for_generation(run.engine.model)
        with run.backend.autocast(), weights:
            return run.engine.generate(prompts, [SamplingParams(**s) for s in settings])

    def _step_tools(self) -> StepTools:
        run, st = self.run, self.state
        return StepTools(
            complete=self.complete,
            model=run.backend.unwrap(run.model),
            autocast=run.backend.autocast,
            reduce_sum=run.backend.reduce_sum,
            gather_objects=run.backend.gather_objects,
            step=st.step + 1,
            epoch=st.epoch,
            seed=run.config.seed,
            device=run.backend.device,
            max_steps=run.plan.total_steps,
        )

    # ---- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, eval_dataset=None) -> dict[str, float]:
        """Exact metrics over the eval set: each example counted once across ranks."""
        run = self.run
        data = eval_dataset if eval_dataset is not None else run.eval_data
        model, b = run.model, run.backend
        was_training = model.training
        model.eval()
        stream = self.task.metric_stream()
        tools = EvalTools(
            forward=functools.partial(self.forward_step, model),
            generate=functools.partial(b.generate, model),
            tokenizer=run.tokenizer,
            complete=self.complete,
            step=self.state.step,
            max_steps=run.plan.total_steps if run.plan is not None else 0,
            epoch=self.state.epoch,
        )
        bs = run.config.eval_batch_size or run.config.batch_size * 2
        for idx in eval_batches(lengths_of(data), batch_size=bs, dp_rank=b.dp_rank, dp_size=b.dp_size):
            valid = torch.tensor([i >= 0 for i in idx], device=b.device)
            batch = self._to_device(self._collate(data, [max(i, 0) for i in idx]))
            self.task.eval_step(batch, valid, stream, tools)
        metrics = stream.compute(b)
        model.train(was_training)
        return metrics

    def evaluate_and_log(self, scheduled: bool = True) -> dict:
        """Evaluate, log the metrics and tell the callbacks: every one of the run's for a scheduled evaluation;
        the user's alone for the final evaluation of a run that had none (the built-ins track scheduled ones)."""
        st = self.state
        metrics = self.evaluate()
        for name, part in self.run.data.eval_parts.items() if self.run.data else ():  # a mixture: each source alone
            metrics.update({f"{name}/{key}": value for key, value in self.evaluate(part).items()})
        st.last_eval, st.last_eval_step = metrics, st.step
        self.report.log({"split": "eval", "step": st.step, "epoch": st.epoch, **metrics})
        self._fire("on_evaluate", metrics, callbacks=None if scheduled else self.callbacks)
        if scheduled and on_plateau(self.run.scheduler):  # after the callbacks, as transformers' _evaluate
            self.run.scheduler.step(metrics[self.run.best.metric])
        return metrics

    # ---- helpers ---------------------------------------------------------------------------
    def _collate(self, data, indices: list[int]) -> dict[str, torch.Tensor]:
        batch = self.task.collate(data[indices], self.tokenizer)
        if self.run.data is not None:  # the rows are copied out: the pages they were read from can go
            self.run.data.release_pages()
        return batch

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dev = self.backend.device
        return {k: (v.to(dev, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}

    def _waited(self, seconds: float) -> None:
        self.run.data_wait += seconds

    def _log_train(self) -> None:
        """The loss since the last log line (the global mean over the ranks' windows); the window empties."""
        run, st = self.run, self.state
        totals = run.backend.reduce_sum(run.window.clone())
        run.window.zero_()
        if totals[1] == 0:
            return  # only skipped steps since the last line: no loss to show (each skip has its own record)
        st.train_loss = float(totals[0] / totals[1])
        logs = {"split": "train", "step": st.step, "epoch": st.epoch, "loss": st.train_loss}
        logs["lr"] = run.scheduler.get_last_lr()[0]
        logs.update(self.task.train_logs(run.backend, st.step))
        run.report.log(logs)
        self._fire("on_log", logs)

    def _finish(self, t0: float) -> dict:
        run, cfg, st = self.run, self.run.config, self.state
        use_best = exports_best(cfg, st)
        model_dir = export.export_live(
            run.model,
            run.backend,
            Path(cfg.output_dir) / "model",
            tokenizer=run.tokenizer,
            info=self.task.export_info(),
            files=self.task.model_files(getattr(run.backend.unwrap(run.model), "config", None)),
            state_dict=run.best.weights if use_best else None,
            gather=not use_best,
            adapter=run.adapter,
        )
        result = {**((st.best_eval if use_best else st.last_eval) or {})}
        result.update(train_loss=st.train_loss, steps=st.step, wall_s=round(time.perf_counter() - t0, 2))
        result["data_wait_s"] = round(run.data_wait, 3)  # (this rank's steps, waiting for their data)
        result.update(model_dir=str(model_dir), output_dir=str(cfg.output_dir))
        if run.best is not None:  # what picked the best model (the task's default where no metric_for_best)
            result.update(metric_for_best=run.best.metric, greater_is_better=run.best.greater_is_better)
        if st.best_step is not None:
            result["best_step"] = st.best_step
        if st.skipped_steps:
            result["skipped_steps"] = st.skipped_steps
        run.report.finish(result)
        self._fire("on_train_end", result)
        return result
