"""The training loop.

High level:  `Trainer(TrainConfig(task="glue/mrpc")).fit()` builds tokenizer, data and model
from the config. Low level: pass your own model/tokenizer/datasets to `fit`, subclass and
override `forward_step` / `compute_loss`, or add `Callback`s.

Everything backend-specific sits behind `self.backend` (tuneforge/backends/base.py), everything
task-specific behind `self.task` (tuneforge/tasks/base.py).
"""

from __future__ import annotations

import functools
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tuneforge import adapters, checkpoint, export, launch
from tuneforge.backends import check_launchable, get_backend
from tuneforge.backends.base import NonFiniteStep
from tuneforge.checkpoint import Checkpointer
from tuneforge.config import TrainConfig, build_config
from tuneforge.data.samplers import epoch_order, eval_batches, rank_batches
from tuneforge.errors import ConfigError, NonFiniteError
from tuneforge.freezing import freeze_bottom
from tuneforge.progress import Progress
from tuneforge.reporting import Reporter
from tuneforge.schedules import lr_schedule
from tuneforge.tasks import get_task
from tuneforge.tasks.base import EvalTools

TrainState = Progress  # the name of before: `trainer.state` is a Progress


class Callback:
    """Hooks; each gets the trainer (with `.state`, `.model`, `.backend`)."""

    def on_train_begin(self, trainer) -> None: ...
    def on_log(self, trainer, logs: dict) -> None: ...
    def on_evaluate(self, trainer, metrics: dict) -> None: ...
    def on_save(self, trainer, path: Path) -> None: ...
    def on_epoch_end(self, trainer) -> None: ...
    def on_train_end(self, trainer, result: dict) -> None: ...


def _with_length(ds):
    if ds is None or "length" in ds.column_names:
        return ds
    return ds.add_column("length", [len(x) for x in ds["input_ids"]])


def _nonfinite_what(what: str, step: int, local_loss: float) -> str:
    """'the loss at step 7 is nan' (this rank's value, where it is the one), or 'the gradients at step 7 are
    not finite'."""
    if what == "loss":
        return f"the loss at step {step} is " + (str(local_loss) if not math.isfinite(local_loss) else "not finite")
    return f"the {what} at step {step} are not finite"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    def __init__(
        self, config: TrainConfig | dict | None = None, callbacks: list[Callback] | None = None, **overrides: Any
    ):
        if isinstance(config, TrainConfig):
            config = config.model_copy(update=overrides) if overrides else config
        else:
            config = build_config(config or {}, **overrides)
        self.config = config
        self.callbacks = list(callbacks or [])
        self.task = get_task(config)
        self.state = Progress()
        # built by fit / validate
        self.backend = None
        self.report: Reporter | None = None
        self.tokenizer = None
        self.train_data = self.eval_data = None
        self.model = None
        self.optimizer = None
        self.scheduler = None
        self.checkpointer: Checkpointer | None = None
        self.resumed_from: Path | None = None  # the checkpoint this run continues
        self.best_weights: dict | None = None  # load_best_model_at_end: the best evaluation's weights (main rank)
        self.adapter: adapters.Adapter | None = None  # --adapter lora: the adapter around self.model

    # ---- overridable steps (FlagAI's MyTrainer pattern) ------------------------------------
    def forward_step(self, model, batch: dict[str, torch.Tensor]):
        with self.backend.autocast():
            return self.task.forward(model, batch)

    def compute_loss(self, outputs, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, item count) of one micro-batch; the loop normalises by the global count."""
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

    def _set_attention(self, model) -> None:
        wanted = self.config.attn_implementation
        chosen = self.backend.default_attention(padded=self.task.pads_batches) if wanted == "auto" else wanted
        if chosen is None or not hasattr(model, "set_attn_implementation"):
            return
        try:
            model.set_attn_implementation(chosen)
        except (ValueError, ImportError) as e:
            if wanted != "auto":  # asked for by name: say why it cannot be had
                raise ConfigError(
                    f"attn_implementation {wanted!r} is not available for this model: {e}. Use auto, eager or sdpa"
                ) from None

    # ---- public entry points ---------------------------------------------------------------
    def fit(self, model=None, tokenizer=None, train_dataset=None, eval_dataset=None) -> dict:
        """Train; returns the final metrics. Launches its own workers when nproc > 1."""
        cfg = self.config
        if launch.restart_count() > 0 and not cfg.resume and checkpoint.list_checkpoints(Path(cfg.output_dir)):
            cfg = self.config = cfg.model_copy(update={"resume": "latest"})  # elastic restart: continue
        if not cfg.resume and not launch.launched_by_us() and launch.restart_count() == 0:
            checkpoint.prepare_output_dir(cfg)  # also: it can be created and written, before any heavy work
        return self._on_backend(model, lambda: self._fit(model, tokenizer, train_dataset, eval_dataset))

    train = fit

    def validate(self, model=None, tokenizer=None, eval_dataset=None) -> dict:
        """Evaluate a model (the config's, or the task's default) on the validation split."""
        return self._on_backend(model, lambda: self._validate(model, tokenizer, eval_dataset))

    def _on_backend(self, model, run) -> dict:
        """Launch the workers (nproc > 1 from a plain process), or set this process's backend up, `run()`
        on it and hand the result back to the launching process."""
        cfg = self.config
        model_config = getattr(model, "config", None) if model is not None else self.task.peek_model_config()
        if launch.needs_launch(cfg):
            check_launchable(cfg, launch.dist_env(), model_config)
            return launch.launch_workers(cfg)
        self.backend = get_backend(cfg, launch.dist_env())
        self.backend.check(model_config)
        self.backend.setup()
        try:
            return launch.hand_back(run(), self.backend.is_main)
        finally:
            self.backend.teardown()

    def _validate(self, model, tokenizer, eval_dataset) -> dict:
        t0 = time.perf_counter()
        model = self._set_up(model, tokenizer, None, eval_dataset, training=False)
        self.model, _ = self.backend.wrap(model, None)  # evaluation only: no optimizer
        metrics = self.evaluate()
        metrics["wall_s"] = round(time.perf_counter() - t0, 2)
        return metrics

    def _fit(self, model, tokenizer, train_dataset, eval_dataset) -> dict:
        cfg, b = self.config, self.backend
        t0 = time.perf_counter()
        model = self._set_up(model, tokenizer, train_dataset, eval_dataset, training=True)
        self._enable_gradient_checkpointing(model)
        model.train()
        self.model, self.optimizer = b.wrap(model, self.make_optimizer)

        global_batch = cfg.batch_size * b.dp_size
        n_train = len(self.train_data)
        batches_per_epoch = max(1, n_train // global_batch + (n_train % global_batch >= b.dp_size))
        steps_per_epoch = max(1, math.ceil(batches_per_epoch / cfg.grad_accum))
        total_steps = cfg.max_steps or math.ceil(cfg.epochs * steps_per_epoch)
        self.scheduler = self.make_scheduler(total_steps)
        self.checkpointer = self._make_checkpointer(step_examples=global_batch * cfg.grad_accum)
        # the epoch order is built in units of one optimizer step, so accumulation equals the large batch
        self.state = Progress(order_global_batch=global_batch * cfg.grad_accum)
        if cfg.resume:
            total_steps = self._resume(total_steps, steps_per_epoch)
        replace_old = cfg.overwrite and not cfg.resume and launch.restart_count() == 0
        checkpoint.write_run_files(cfg, b.is_main, replace_old=replace_old)
        self.report.start(total_steps, self.state.step, n_train, global_batch * cfg.grad_accum, b)
        for cb in self.callbacks:
            cb.on_train_begin(self)

        lengths = np.asarray(self.train_data["length"])
        # loss sum and item count since the last log line, per rank (a resume continues the saved window)
        window = (self.state.log_loss, self.state.log_count)
        win_loss, win_count = (torch.tensor(v, dtype=torch.float32, device=b.device) for v in window)
        while self.state.step < total_steps and not self.state.stop:
            st = self.state
            order = epoch_order(
                lengths,
                seed=cfg.seed,
                epoch=st.epoch,
                global_batch=st.order_global_batch,
                group_by_length=cfg.data.group_by_length,
            )
            my_batches = rank_batches(
                order, start=st.consumed, global_batch=global_batch, dp_rank=b.dp_rank, dp_size=b.dp_size
            )
            groups = [my_batches[i : i + cfg.grad_accum] for i in range(0, len(my_batches), cfg.grad_accum)]
            for gi, group in enumerate(groups):
                loss_sum, count = self.train_step(group)
                self.scheduler.step()
                st.step += 1
                st.consumed = min(len(order), st.consumed + global_batch * len(group))
                win_loss += loss_sum
                win_count += count
                if st.step % cfg.logging_steps == 0 or st.step == total_steps:
                    self._log_train(win_loss, win_count)
                    win_loss.zero_(), win_count.zero_()
                self.report.advance()
                if cfg.eval_strategy == "steps" and st.step % cfg.eval_steps == 0:
                    self._evaluate_and_track()
                if cfg.save_strategy == "steps" and st.step % cfg.save_steps == 0:
                    self._save(win_loss, win_count)
                if (st.step >= total_steps or st.stop) and gi < len(groups) - 1:
                    break
            else:  # the epoch ran to its end
                st.epoch, st.consumed, st.order_global_batch = st.epoch + 1, 0, global_batch * cfg.grad_accum
                for cb in self.callbacks:
                    cb.on_epoch_end(self)
                if cfg.eval_strategy == "epoch":
                    self._evaluate_and_track()
                if cfg.save_strategy == "epoch":
                    self._save(win_loss, win_count)
        if win_count.item() > 0:
            self._log_train(win_loss, win_count)
        if cfg.eval_strategy == "no" or not self.state.last_eval:
            self._evaluate_and_track(track=False)
        result = self._finish(t0)
        return result

    def _set_up(self, model, tokenizer, train_dataset, eval_dataset, training: bool):
        """What fit and validate share: seed, reporter, tokenizer, data, and the model (its attention set)."""
        cfg, task = self.config, self.task
        seed_everything(cfg.seed)  # same seed on every rank: identical head initialisation
        self.report = Reporter(cfg, is_main=self.backend.is_main)
        task.log = self.report.print
        self.tokenizer = tokenizer or task.load_tokenizer()
        if not training and model is None:
            task.adopt_model_labels()
        if training and cfg.adapter == "lora":  # a target that matches no layer: one line before any data work
            adapters.check_targets(task.peek_model_config(), cfg.lora_targets)
            adapters.check_quantize(cfg)
        splits = ("train", "validation") if training else ("validation",)
        self.train_data, self.eval_data = self._prepare_data(train_dataset, eval_dataset, splits=splits)
        if training and self.train_data is None:  # clm/seq2seq load a validation split alone (for eval)
            raise ConfigError(
                "training needs training data: pass --train-file (seq2seq: --source-file and --target-file)"
            )
        model = model if model is not None else task.load_model(self.tokenizer)
        self._set_attention(model)  # evaluation runs the kernel training runs: the same numbers
        if training and cfg.adapter == "lora":  # LoRA layers in place: `model` keeps its class
            self.adapter = adapters.add_lora(model, cfg, base_model=task.model_path(), log=self.report.print)
        elif training:
            self._freeze(model)
        if training:
            task.set_up_reference(model, self.adapter)
        return model

    def _freeze(self, model) -> None:
        """Keep the embeddings and the bottom layers fixed: config.freeze_embeddings and freeze_layers, whose
        `auto` freezes a classifier's embeddings and bottom layer (a generating model's embeddings are
        usually its output layer too)."""
        config = self.config
        classifier = not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None
        embeddings = classifier if config.freeze_embeddings == "auto" else config.freeze_embeddings == "on"
        layers = int(classifier and embeddings) if config.freeze_layers == "auto" else config.freeze_layers
        if not (layers or embeddings):
            return
        frozen = freeze_bottom(model, layers, embeddings=embeddings)
        total = sum(p.numel() for p in model.parameters())
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        of = f" of {frozen.of}" if frozen.of is not None else ""
        fixed = f"the embeddings and the bottom {frozen.layers}{of} layers" if frozen.layers else "the embeddings"
        chosen = "auto" in (config.freeze_embeddings, config.freeze_layers)
        how = " (a classifier's default; --freeze-layers 0 --freeze-embeddings off trains every weight)"
        self.report.print(
            f"training {trained / 1e6:.1f}M of {total / 1e6:.1f}M parameters: {fixed} stay fixed{how if chosen else ''}"
        )

    def _enable_gradient_checkpointing(self, model) -> None:
        if not self.config.gradient_checkpointing:
            return
        if not self.backend.supports_gradient_checkpointing:
            raise ConfigError(
                f"backend {self.backend.name!r} does not support gradient checkpointing; drop --gradient-checkpointing"
            )
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5; the old name warns
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def _make_checkpointer(self, step_examples: int) -> Checkpointer:
        cfg, b = self.config, self.backend
        meta = checkpoint.describe(
            b.unwrap(self.model),
            b,
            task=cfg.task,
            labels=self.task.label_names,
            step_examples=step_examples,
            adapter=self.adapter.settings() if self.adapter else None,
        )
        return Checkpointer(
            cfg.output_dir,
            b,
            meta,
            save_total_limit=cfg.save_total_limit,
            run_config=cfg,
            tokenizer=self.tokenizer,
            model_info=self.task.export_info(),
        )

    def _resume(self, total_steps: int, steps_per_epoch: int) -> int:
        """Continue from `config.resume`; returns the total steps of the (re-planned) run."""
        cfg, b = self.config, self.backend
        path = checkpoint.find_checkpoint(cfg.resume, cfg.output_dir)
        self.state = st = self.checkpointer.load(path, self.model, self.optimizer, self.scheduler)
        self.resumed_from = path
        if cfg.load_best_model_at_end and st.best_step is not None:
            best = path.parent / f"checkpoint-{st.best_step}"  # the best weights come from the best step's checkpoint
            if checkpoint.has_full_weights(best) and st.best_eval is not None:
                if b.is_main:
                    self.best_weights = checkpoint.full_weights(best, b.unwrap(self.model))
            else:
                self.report.print(
                    f"note: the best model (step {st.best_step}) is not in a readable checkpoint; "
                    "load_best_model_at_end will pick among the evaluations after this resume"
                )
                st.best_metric = st.best_step = st.best_eval = None
        self.report.print(f"resumed from {path} at step {st.step} (epoch {st.epoch}, example {st.consumed})")
        lengths = self.train_data["length"]
        planned = checkpoint.planned_steps(st, lengths, cfg, b.dp_size, steps_per_epoch, total_steps)
        if planned != total_steps:  # the batch geometry changed: the LR schedule over the new total, at this step
            self.scheduler = self.make_scheduler(planned, start_step=st.step)
            self.report.print(
                f"batch geometry changed ({checkpoint.read_meta(path).get('step_examples')} -> "
                f"{self.checkpointer.meta['step_examples']} examples per step): {planned - st.step} steps left to "
                f"finish {cfg.epochs:g} epochs"
            )
        return planned

    def _save(self, win_loss: torch.Tensor, win_count: torch.Tensor) -> Path:
        st = self.state
        st.log_loss, st.log_count = float(win_loss), float(win_count)  # this rank's logging window
        path = self.checkpointer.save(self.model, self.optimizer, self.scheduler, st)
        for cb in self.callbacks:
            cb.on_save(self, path)
        return path

    # ---- one optimizer step ----------------------------------------------------------------
    def train_step(self, micro_batches: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward every micro-batch of one optimizer step, then step.

        The loss is normalised by the number of items (examples or tokens) in the whole global
        accumulated batch, so accumulation and data parallelism equal one large batch.
        """
        b = self.backend
        batches = [self._to_device(self._collate(self.train_data, idx)) for idx in micro_batches]
        counts = torch.stack([self.task.count(bt).to(b.device).float() for bt in batches])
        local_count = counts.sum()
        global_count = b.reduce_sum(local_count)
        scale = b.dp_size / global_count.clamp(min=1)
        total = torch.zeros((), device=b.device)
        for i, batch in enumerate(batches):
            # gradients are synchronised across ranks once per step: on the last micro-batch
            with b.micro_step(self.model, sync=i == len(batches) - 1):
                outputs = self.forward_step(self.model, batch)
                loss_sum, _ = self.compute_loss(outputs, batch)
                b.backward(loss_sum * scale, self.model)
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
        suspects += ["--dpo-beta"] if cfg.task == "dpo" else []
        suspects += ["--lora-alpha"] if cfg.adapter == "lora" else []
        suspects += ["unclipped gradients (--max-grad-norm)"] if not cfg.optim.max_grad_norm else []
        suspects += ["fp16's range (--precision bf16 or fp32)"] if self.backend.precision == "fp16" else []
        return ", ".join(suspects) + " or the data (a row with an extreme value)"

    # ---- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, eval_dataset=None) -> dict[str, float]:
        """Exact metrics over the eval set: each example counted once across ranks."""
        data = eval_dataset if eval_dataset is not None else self.eval_data
        model, b = self.model, self.backend
        was_training = model.training
        model.eval()
        stream = self.task.metric_stream()
        tools = EvalTools(
            forward=functools.partial(self.forward_step, model),
            generate=functools.partial(b.generate, model),
            tokenizer=self.tokenizer,
        )
        bs = self.config.eval_batch_size or self.config.batch_size * 2
        for idx in eval_batches(np.asarray(data["length"]), batch_size=bs, dp_rank=b.dp_rank, dp_size=b.dp_size):
            valid = torch.tensor([i >= 0 for i in idx], device=b.device)
            batch = self._to_device(self._collate(data, [max(i, 0) for i in idx]))
            self.task.eval_step(batch, valid, stream, tools)
        metrics = stream.compute(b)
        model.train(was_training)
        return metrics

    def _evaluate_and_track(self, track: bool = True) -> dict:
        cfg, st = self.config, self.state
        metrics = self.evaluate()
        st.last_eval = metrics
        self.report.log({"split": "eval", "step": st.step, "epoch": st.epoch, **metrics})
        for cb in self.callbacks:
            cb.on_evaluate(self, metrics)
        if not track:
            return metrics
        name = cfg.metric_for_best or self.task.best_metric
        if name not in metrics:
            raise ConfigError(
                f"metric_for_best {name!r} is not computed by this task; choose one of: {', '.join(metrics)}"
            )
        value = metrics[name]
        greater = (
            self.task.greater_is_better if cfg.metric_for_best in (None, self.task.best_metric) else name != "loss"
        )
        better = st.best_metric is None or (value > st.best_metric if greater else value < st.best_metric)
        if better:
            st.best_metric, st.best_step, st.bad_evals = value, st.step, 0
            if cfg.load_best_model_at_end:
                self.best_weights = self.backend.full_state_dict(self.model)
                st.best_eval = metrics
        else:
            st.bad_evals += 1
            if cfg.early_stopping_patience and st.bad_evals >= cfg.early_stopping_patience:
                self.report.print(f"early stopping: {name} did not improve for {st.bad_evals} evaluations")
                st.stop = True
        return metrics

    # ---- helpers ---------------------------------------------------------------------------
    def _prepare_data(self, train_dataset, eval_dataset, splits=("train", "validation")):
        """Tokenized train/eval features; the main rank tokenizes first so others hit the cache."""
        b, task = self.backend, self.task
        given = train_dataset if train_dataset is not None else eval_dataset
        if given is not None and "input_ids" in given.column_names:
            feats = {"train": train_dataset, "validation": eval_dataset}
        else:
            for rank_turn in (True, False):
                if b.is_main == rank_turn:
                    if given is not None:
                        raw = task.prepare_raw({"train": train_dataset, "validation": eval_dataset})
                    else:
                        raw = task.load_raw()
                    task.use_labels(task.label_set(raw))  # the label set, decided from the raw training split
                    raw = {k: v for k, v in task.encode_labels(raw).items() if k in splits}
                    feats = task.tokenize(raw, self.tokenizer, log=self.report.print)
                b.barrier()
        train, evals = (task.select_examples(split, feats.get(split)) for split in ("train", "validation"))
        return _with_length(train), _with_length(evals)

    def _collate(self, data, indices: list[int]) -> dict[str, torch.Tensor]:
        return self.task.collate(data[indices], self.tokenizer)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dev = self.backend.device
        return {k: (v.to(dev, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}

    def make_scheduler(self, total_steps: int, start_step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
        """The LR schedule over `total_steps`, at `start_step` (a resume that re-plans the run)."""
        o = self.config.optim
        warmup = o.warmup_steps or int(o.warmup_ratio * total_steps)
        return lr_schedule(o.scheduler, self.optimizer, warmup, total_steps, start_step)

    def _log_train(self, win_loss: torch.Tensor, win_count: torch.Tensor) -> None:
        totals = self.backend.reduce_sum(torch.stack([win_loss.float(), win_count.float()]))  # the true global mean
        if totals[1] == 0:
            return  # only skipped steps since the last line: no loss to show (each skip has its own record)
        loss = float(totals[0] / totals[1])
        self.state.train_loss = loss
        logs = {
            "split": "train",
            "step": self.state.step,
            "epoch": self.state.epoch,
            "loss": loss,
            "lr": self.scheduler.get_last_lr()[0],
        }
        self.report.log(logs)
        for cb in self.callbacks:
            cb.on_log(self, logs)

    def _finish(self, t0: float) -> dict:
        cfg, st = self.config, self.state
        # decided on best_eval (same on every rank), not on the weights (held by the main rank only)
        use_best = cfg.load_best_model_at_end and st.best_eval is not None
        final_eval = st.best_eval if use_best else st.last_eval
        model_dir = export.export_live(
            self.model,
            self.backend,
            Path(cfg.output_dir) / "model",
            tokenizer=self.tokenizer,
            info=self.task.export_info(),
            state_dict=self.best_weights if use_best else None,
            gather=not use_best,
            adapter=self.adapter,
        )
        result = {k: v for k, v in (final_eval or {}).items()}
        result.update(
            {
                "train_loss": st.train_loss,
                "steps": st.step,
                "wall_s": round(time.perf_counter() - t0, 2),
                "model_dir": str(model_dir),
                "output_dir": str(cfg.output_dir),
            }
        )
        if st.best_step is not None:
            result["best_step"] = st.best_step
        if st.skipped_steps:
            result["skipped_steps"] = st.skipped_steps
        self.report.finish(result)
        for cb in self.callbacks:
            cb.on_train_end(self, result)
        return result
