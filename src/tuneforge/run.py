"""A run's set-up: what one `Trainer.fit` or `Trainer.validate` works with, built whole before the loop
starts (`Run`), and the steps that build it: seeding, rank-ordered data preparation, the model's attention
kernel, freezing, gradient checkpointing, the step plan, the checkpointer, a resume, the built-in callbacks.

Everything here gets what it needs as arguments; the Trainer calls `set_up_training` / `set_up_evaluation`
and then only reads the `Run` they return.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tuneforge import adapters, checkpoint
from tuneforge.callbacks import BestModel, Callback, built_in_callbacks
from tuneforge.checkpoint import Checkpointer
from tuneforge.data.fingerprint import check_unchanged
from tuneforge.data.order_cache import OrderCache
from tuneforge.errors import CheckpointError, ConfigError, DataError
from tuneforge.freezing import freeze_bottom
from tuneforge.plan import StepPlan
from tuneforge.progress import Progress
from tuneforge.reporting import Reporter
from tuneforge.schedules import rates_at_restored_step, warmup_warning
from tuneforge.tasks.base import no_checkpointing, score_given_classifier_s_last_token
from tuneforge.training_data import TrainingData, load_mixture, load_single

MakeScheduler = Callable[..., Any]  # (optimizer, total_steps, start_step=0) -> LR scheduler


@dataclass(frozen=True)
class Given:
    """What the caller of fit / validate passed in place of the config's model, tokenizer and data."""

    model: torch.nn.Module | None = None
    tokenizer: Any = None
    train_dataset: Any = None
    eval_dataset: Any = None

    def __post_init__(self) -> None:  # checked where the caller gave them, before any work
        object.__setattr__(self, "train_dataset", as_dataset(self.train_dataset, "train_dataset"))
        object.__setattr__(self, "eval_dataset", as_dataset(self.eval_dataset, "eval_dataset"))


def as_dataset(data, name: str):
    """A dataset given to fit / validate as a `datasets.Dataset`: rows (a list of dicts), columns (a dict of
    lists) and pandas DataFrames are converted; anything else is a TypeError saying what is taken."""
    import datasets

    if data is None or isinstance(data, datasets.Dataset):
        return data
    if isinstance(data, list) and all(isinstance(row, dict) for row in data):
        return datasets.Dataset.from_list(data)
    if isinstance(data, dict) and all(isinstance(column, list) for column in data.values()):
        return datasets.Dataset.from_dict(data)
    if type(data).__name__ == "DataFrame" and hasattr(data, "to_dict"):  # pandas, without importing it
        return datasets.Dataset.from_pandas(data, preserve_index=False)
    hint = f": pass one split, e.g. {name}=data['train']" if isinstance(data, datasets.DatasetDict) else ""
    raise TypeError(
        f"{name} must be a datasets.Dataset, a list of row dicts, a dict of column lists or a pandas DataFrame, "
        f"not {type(data).__module__}.{type(data).__qualname__}{hint}"
    )


@dataclass
class Run:
    """One fit or validate: its config (an elastic restart's says `resume: latest`), backend, reporter,
    tokenizer, tokenized data and the model (wrapped by the backend); for training also the optimizer, LR
    schedule, step plan, checkpointer and callbacks (the user's, then the built-ins)."""

    config: Any
    backend: Any
    report: Reporter
    tokenizer: Any
    train_data: Any
    eval_data: Any
    model: torch.nn.Module
    adapter: adapters.Adapter | None = None  # --adapter lora: the adapter around the model
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    plan: StepPlan | None = None
    checkpointer: Checkpointer | None = None
    callbacks: list[Callback] = field(default_factory=list)
    best: BestModel | None = None  # the built-in that tracks the best evaluation (and its weights)
    resumed_from: Path | None = None  # the checkpoint this run continues
    window: torch.Tensor | None = None  # this rank's loss sum and item count since the last log line
    engine: Any = None  # the generation engine on the live model, built at the first in-training generation
    data: TrainingData | None = None  # the features above, with a mixture's plan and its sources' validation sets
    feed: Any = None  # the epoch's Prefetch of collated micro-batches, while the loop is in an epoch
    epoch_last_step: int | None = None  # the step that ends the epoch in progress, while the loop is in one
    data_wait: float = 0.0  # seconds this rank's steps waited for their data
    orders: OrderCache | None = None  # large epochs' orders, kept in the run folder for a resume

    @property
    def data_fingerprints(self) -> dict[str, str]:
        return self.data.fingerprints if self.data else {}


def device_name(device: torch.device) -> str:
    """Where a run runs: the GPU's name, or the CPU and its class (environment.cpu_class); the device's type else."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        from tuneforge.environment import cpu_class

        return cpu_class()
    return device.type


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_up_evaluation(config, task, backend, given: Given, callbacks: list[Callback]) -> Run:
    report = Reporter(config, is_main=backend.is_main)
    model, tokenizer, data, _ = _load(config, task, backend, report, given, training=False)
    model, _ = backend.wrap(model, None)  # evaluation only: no optimizer
    return Run(config, backend, report, tokenizer, data.train, data.evals, model, callbacks=list(callbacks), data=data)


SCHEDULER_METHODS = ("step", "get_last_lr", "state_dict", "load_state_dict")  # what the loop and checkpoints call


def checked_overrides(make_optimizer, make_scheduler: MakeScheduler):
    """`make_optimizer` and `make_scheduler` (a subclass may override them) whose results are checked as they are
    made: one line naming the override, not an AttributeError at its first use (mid-step for a schedule)."""

    def optimizer_of(model):
        optimizer = make_optimizer(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "make_optimizer returns a torch.optim.Optimizer over the parameters to train (some or all of the "
                f"model's), not {type(optimizer).__name__}"
            )
        return optimizer

    def scheduler_of(optimizer, *args, **kwargs):
        scheduler = make_scheduler(optimizer, *args, **kwargs)
        if not all(callable(getattr(scheduler, name, None)) for name in SCHEDULER_METHODS):
            raise TypeError(
                f"make_scheduler returns an LR scheduler of the optimizer (with {', '.join(SCHEDULER_METHODS)}; "
                "a constant rate: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)), "
                f"not {type(scheduler).__name__}"
            )
        return scheduler

    return optimizer_of, scheduler_of


def on_plateau(scheduler) -> bool:
    """Whether the schedule moves on evaluations' metric (torch's ReduceLROnPlateau), not on optimizer steps."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def check_plateau_schedule(scheduler, config) -> None:
    """A ReduceLROnPlateau is stepped with each scheduled evaluation's metric_for_best (as transformers steps its
    reduce_lr_on_plateau); without scheduled evaluations it would never move: one line before training."""
    if on_plateau(scheduler) and config.eval_strategy == "no":
        raise TypeError(
            "make_scheduler returns a ReduceLROnPlateau, which moves on the metric of scheduled evaluations; "
            "this run has none: set eval_strategy ('steps' with eval_steps, or 'epoch')"
        )


def set_up_training(
    config, task, backend, given: Given, callbacks: list[Callback], make_optimizer, make_scheduler: MakeScheduler
) -> tuple[Run, Progress]:
    """The run and the Progress it starts at (a resume's, or step 0)."""
    make_optimizer, make_scheduler = checked_overrides(make_optimizer, make_scheduler)
    report = Reporter(config, is_main=backend.is_main)
    model, tokenizer, data, adapter = _load(config, task, backend, report, given, training=True)
    check_rows_per_rank(data.epoch_rows, backend.dp_size)
    enable_gradient_checkpointing(model, config, backend)
    model.train()
    model, optimizer = backend.wrap(model, make_optimizer)
    plan = StepPlan.of(config, data.epoch_rows, backend.dp_size, repeats=task.updates_per_batch, mixture=data.mixture)
    run = Run(config, backend, report, tokenizer, data.train, data.evals, model, adapter, optimizer, plan=plan)
    run.data = data
    run.orders = OrderCache(config.output_dir, writes=backend.is_main, data_key=data.fingerprints)
    run.scheduler = make_scheduler(optimizer, plan.total_steps)
    warning = warmup_warning(config.optim.scheduler, config.optim.warmup_steps, plan.total_steps)
    if warning:
        report.warn(warning)
    note = backend.precision_plugin.emulated_note()
    if note:
        report.print(note)
    check_plateau_schedule(run.scheduler, config)
    run.checkpointer = make_checkpointer(run, task)
    # the epoch order is built in units of one optimizer step, so accumulation equals the large batch
    state = Progress(order_global_batch=plan.step_examples, data_fingerprints=run.data_fingerprints)
    best_weights = None
    if config.resume:
        state, best_weights = resume(run, make_scheduler)
    metric = config.metric_for_best or task.best_metric
    built_ins = built_in_callbacks(config, metric, task.higher_is_better(metric), best_weights)
    run.callbacks, run.best = [*callbacks, *built_ins], built_ins[0]
    # loss sum and item count since the last log line, per rank (a resume continues the saved window)
    run.window = torch.tensor([state.log_loss, state.log_count], dtype=torch.float32, device=backend.device)
    return run, state


def check_rows_per_rank(rows: int, dp_size: int) -> None:
    """Each data-parallel rank needs an example of every step (a last batch smaller than the ranks is dropped):
    with fewer examples than ranks an epoch had no step, and the loop went through empty epochs for ever."""
    if rows < dp_size:
        raise DataError(
            f"{rows} training example{'s' if rows != 1 else ''} cannot be shared by {dp_size} data-parallel ranks "
            f"(each needs at least one); train on at least {dp_size} examples, or on fewer processes (--nproc)"
        )


def _load(config, task, backend, report: Reporter, given: Given, training: bool):
    """What fit and validate share: seed, tokenizer, data, and the model (its attention set; for training,
    LoRA layers or frozen layers, and the task's reference model). Returns (model, tokenizer, (train, eval),
    adapter)."""
    seed_everything(config.seed)  # same seed on every rank: identical head initialisation
    task.log = report.print  # the task's notes (held-out splits, label schemes) go where the run's go
    task.use_data_parallel(data_parallel_group(backend))
    if given.model is None:  # before the tokenizer's checks (a max_length above the model's): a fix of those met it
        task.check_model_family()
    tokenizer = given.tokenizer or task.load_tokenizer()
    if given.tokenizer is not None:
        task.prepare_given_tokenizer(tokenizer)
    if given.model is None:
        task.check_vocabulary(tokenizer)
        if training:
            task.check_checkpointing()
    else:
        check_given_model(given.model, tokenizer)
    if not training:
        task.adopt_model_labels(given.model.config if given.model is not None else None)
    check_attention_kernel(config.attn_implementation, backend.device)
    if training:
        check_trainable_attention(config.attn_implementation, backend.device)
    if training and config.adapter == "lora":  # a target that matches no layer: one line before any data work
        if given.model is None:
            adapters.check_base_is_standalone(task.model_path())
        adapters.check_targets(task.peek_model_config(), config.lora_targets)
        adapters.check_quantize(config)
    splits = ("train", "validation") if training else ("validation",)
    data = prepare_data(task, backend, tokenizer, given, splits, log=report.print)
    if training and data.train is None:  # a task may load a validation split alone (for eval)
        raise ConfigError(f"training needs training data: pass {task.training_data_flags}")
    if data.evals is None:  # only fit / validate given datasets get here: data files hold 10% out
        _check_needs_no_evaluation(config, training)
    model = given.model if given.model is not None else task.load_model(tokenizer)
    if given.model is not None:
        task.check_given_model_kind(model)
        task.name_given_model_labels(model)
        score_given_classifier_s_last_token(model, tokenizer)
    set_attention(model, config.attn_implementation, backend, task)  # evaluation runs the kernel training runs
    adapter = None
    if training and config.adapter == "lora":  # LoRA layers in place: `model` keeps its class
        adapter = adapters.add_lora(model, config, base_model=task.model_path(), log=report.print)
        saved = adapters.store_frozen_linears(model, backend.precision_plugin.frozen_weight_dtype())
        if saved:
            report.print(
                f"frozen linear weights kept in {backend.precision} (what autocast computes with): "
                f"{saved / 2**20:.0f} MiB less"
            )
    elif training:
        freeze(model, config, log=report.print)
    if training:
        task.set_up_reference(model, adapter)
    return model, tokenizer, data, adapter


def check_given_model(model, tokenizer) -> None:
    """One ConfigError line, before any data work, for a model given to fit() / validate() that cannot run: weights
    on 'meta' (was "Cannot copy out of meta tensor"), a peft PeftModel (its export failed after training: tuneforge
    adds and writes LoRA layers itself), embeddings without a row for each of the tokenizer's tokens (an IndexError
    at the first text holding one)."""
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError(
            "the model given has weights on the 'meta' device (shapes without values); load its weights "
            "(from_pretrained, or to_empty() and load_state_dict) before fit() or validate()"
        )
    peft = sys.modules.get("peft")  # a PeftModel was built with peft imported
    if peft is not None and isinstance(model, peft.PeftModel):
        raise ConfigError(
            f"the model given is a peft {type(model).__name__}: tuneforge adds and exports LoRA layers itself; give "
            "a plain transformers model (model.merge_and_unload() holds this one's weights with its adapter merged), "
            "with adapter='lora' to train LoRA layers on it"
        )
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if isinstance(rows, int) and rows < len(tokenizer):
        raise ConfigError(
            f"the tokenizer has {len(tokenizer)} tokens, more than the model's {rows} token vectors (tokens added "
            "to the tokenizer and not to the model have none); resize the model to it "
            "(model.resize_token_embeddings(len(tokenizer))), or give the model's own tokenizer"
        )


def _check_needs_no_evaluation(config, training: bool) -> None:
    """One line where a run without validation data was asked for what needs it (as transformers' Trainer
    refuses an eval_strategy without an eval_dataset); a run that asks for none trains without evaluating."""
    if not training:
        raise ConfigError("validate() needs validation data: pass eval_dataset=, or a config with a validation file")
    needs = [
        f"{key}={value!r}"
        for key, value, fine in (
            ("eval_strategy", config.eval_strategy, config.eval_strategy == "no"),
            ("early_stopping_patience", config.early_stopping_patience, not config.early_stopping_patience),
            ("load_best_model_at_end", config.load_best_model_at_end, not config.load_best_model_at_end),
        )
        if not fine
    ]
    if needs:
        raise ConfigError(
            f"fit() was given a train_dataset and no eval_dataset, and {', '.join(needs)} needs evaluations: pass "
            "eval_dataset=, or set eval_strategy='no' (and neither early stopping nor load_best_model_at_end) to "
            "train without evaluating"
        )


def data_parallel_group(backend):
    """The process group of the backend's data-parallel ranks (the world where it names none); None in one process."""
    if not (backend.distributed and backend.dp_size > 1):
        return None
    import torch.distributed as dist

    return dist.group.WORLD if backend.dp_group is None else backend.dp_group


def prepare_data(task, backend, tokenizer, given: Given, splits, log) -> TrainingData:
    """Tokenized train/eval features (a mixture's, where the config has data sources and the run trains); the
    main rank reads and tokenizes first, so the others hit the cache."""
    some = given.train_dataset if given.train_dataset is not None else given.eval_dataset
    if some is not None and "input_ids" in some.column_names:
        feats = {"train": given.train_dataset, "validation": given.eval_dataset}
        return _selected(task, feats, {})
    mixed = some is None and bool(task.config.data.sources) and "train" in splits
    for rank_turn in (True, False):
        if backend.is_main == rank_turn:
            data = (
                load_mixture(task, task.config, tokenizer, log) if mixed else _read(task, tokenizer, given, splits, log)
            )
        backend.barrier()
    return replace(
        data,
        train=_with_length(data.train),
        evals=_with_length(data.evals),
        eval_parts={name: _with_length(part) for name, part in data.eval_parts.items()},
    )


def _read(task, tokenizer, given: Given, splits, log) -> TrainingData:
    """The features of the config's data files, or of the raw datasets given to fit / validate."""
    if given.train_dataset is None and given.eval_dataset is None:
        return load_single(task, tokenizer, splits, log)
    raw = task.prepare_raw({"train": given.train_dataset, "validation": given.eval_dataset})
    task.use_labels(task.label_set(raw))  # the label set, decided from the raw training split
    raw = {k: v for k, v in task.encode_labels(raw).items() if k in splits}
    return _selected(task, task.tokenize(raw, tokenizer, log=log), {})


def _selected(task, feats, prints: dict) -> TrainingData:
    train, evals = (task.select_examples(split, feats.get(split)) for split in ("train", "validation"))
    return TrainingData(train, evals, fingerprints=prints)


def _with_length(ds):
    if ds is None or "length" in ds.column_names:
        return ds
    return ds.add_column("length", [len(x) for x in ds["input_ids"]])


def set_attention(model, wanted: str, backend, task) -> None:
    """The attention kernel: `wanted` by name, or (auto) the backend's choice for the task's batches."""
    chosen = backend.default_attention(padded=task.pads_batches) if wanted == "auto" else wanted
    if chosen is None or not hasattr(model, "set_attn_implementation"):
        return
    try:
        model.set_attn_implementation(chosen)
    except (ValueError, ImportError) as e:
        if wanted != "auto":  # asked for by name: say why it cannot be had
            raise ConfigError(
                f"attn_implementation {wanted!r} is not available for this model: {e}. Use auto, eager or sdpa"
            ) from None


def check_attention_kernel(wanted: str, device: torch.device) -> None:
    """One line before any data work for a kernel name transformers does not know (a misspelling), and for a flash
    kernel on a CPU, where none runs: transformers refused both only as the model loaded, after the data work."""
    from transformers.integrations.hub_kernels import is_kernel
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = ["auto", "eager", *sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())]
    # transformers still takes the old paged|NAME spellings, and a Hub kernel by its repository (org/name)
    if wanted not in known and wanted.removeprefix("paged|") not in known and not is_kernel(wanted):
        raise ConfigError(
            f"attn_implementation {wanted!r} is not a kernel transformers knows; use one of {', '.join(known)}, or a "
            "Hub kernel as org/name"
        )
    if "flash" in wanted and device.type == "cpu":
        raise ConfigError(
            f"attn_implementation {wanted!r} runs on a GPU only, and this run is on the CPU; use auto, eager or sdpa"
        )


def check_trainable_attention(wanted: str, device: torch.device) -> None:
    """One line before any data work for a kernel that cannot train here: torch's FlexAttention has no backward on a
    CPU (an internal error at the first step)."""
    if "flex_attention" in wanted and device.type == "cpu":
        raise ConfigError(
            f"attn_implementation {wanted!r} cannot train on a CPU (torch's FlexAttention has no backward there); "
            "use auto, eager or sdpa"
        )


def freeze(model, config, log) -> None:
    """Keep the embeddings and the bottom layers fixed: config.freeze_embeddings and freeze_layers, whose
    `auto` freezes a classifier's embeddings and bottom layer (a generating model's embeddings are
    usually its output layer too)."""
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
    log(f"training {trained / 1e6:.1f}M of {total / 1e6:.1f}M parameters: {fixed} stay fixed{how if chosen else ''}")


def enable_gradient_checkpointing(model, config, backend) -> None:
    if not config.gradient_checkpointing:
        return
    if not backend.supports_gradient_checkpointing:
        raise ConfigError(
            f"backend {backend.name!r} does not support gradient checkpointing; drop --gradient-checkpointing"
        )
    if not getattr(model, "supports_gradient_checkpointing", False):  # a given model, or one with its own code
        raise ConfigError(no_checkpointing(type(model).__name__))
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5; the old name warns
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # transformers also hooks the embeddings' output to require grad, which only reentrant checkpointing needs (as
    # peft notes); frozen embeddings' output would then run the backward of every frozen layer, for no gradient
    disable = getattr(model, "disable_input_require_grads", None)
    if disable is not None:
        disable()


def make_checkpointer(run: Run, task) -> Checkpointer:
    cfg, b = run.config, run.backend
    meta = checkpoint.describe(
        b.unwrap(run.model),
        b,
        task=cfg.task,
        labels=task.label_names,
        step_examples=run.plan.step_examples,
        adapter=run.adapter.settings() if run.adapter else None,
    )
    return Checkpointer(
        cfg.output_dir,
        b,
        meta,
        save_total_limit=cfg.save_total_limit,
        run_config=cfg,
        tokenizer=run.tokenizer,
        model_info=task.export_info(),
        model_files=task.model_files(getattr(b.unwrap(run.model), "config", None)),
    )


def resume(run: Run, make_scheduler: MakeScheduler) -> tuple[Progress, dict | None]:
    """Continue from `config.resume`: model, optimizer, scheduler and RNG states restored into `run`, metrics.jsonl
    cut back to the checkpoint and the tracker runs to continue handed to the reporter, the plan (and LR schedule)
    re-made where the batch geometry changed. Returns the restored Progress and, for load_best_model_at_end, the best
    evaluation's weights (main rank)."""
    cfg, report = run.config, run.report
    path = checkpoint.find_checkpoint(cfg.resume, cfg.output_dir)
    checkpoint.check_same_optimizer(path, cfg)
    st = run.checkpointer.load(path, run.model, run.optimizer, run.scheduler)
    run.resumed_from = path
    # metrics.jsonl reads like an uninterrupted run; the trackers continue the checkpoint's runs
    report.continue_from(st.metrics_records, st.tracker_runs)
    best_weights = _best_weights(path, st, run) if cfg.load_best_model_at_end else None
    check_unchanged(st.data_fingerprints, run.data_fingerprints, str(path), cfg.data.allow_changed_data, report.print)
    if st.data_fingerprints == run.data_fingerprints:  # (changed data, allowed: its order changes with it)
        _check_same_order(path, st, run)
    st.data_fingerprints = run.data_fingerprints  # (--allow-changed-data: the data the rest of the run trains on)
    report.print(f"resumed from {path} at step {st.step} (epoch {st.epoch}, example {st.consumed})")
    changed = checkpoint.settings_changed(path, cfg)
    if changed:  # (one that orders the epoch otherwise was refused mid-epoch, above)
        report.print(f"note: the resumed run trains on with settings other than its checkpoint's: {'; '.join(changed)}")
    plan = run.plan.resumed_at(st, run.data.length_column(), run.orders)
    if plan.total_steps != run.plan.total_steps:  # the batch geometry changed: the schedule over the new total
        run.scheduler = make_scheduler(run.optimizer, plan.total_steps, start_step=st.step)
        report.print(
            f"batch geometry changed ({checkpoint.read_meta(path).get('step_examples')} -> "
            f"{plan.step_examples} examples per step): {plan.total_steps - st.step} steps left to "
            f"finish {cfg.epochs:g} epochs"
        )
    else:  # the restored optimizer holds the checkpoint's schedule's rate; this run's may differ
        rates_at_restored_step(run.scheduler)
    run.plan = plan
    _say_nothing_left(st, plan.total_steps, report.print)
    return st, best_weights


def _say_nothing_left(st: Progress, total_steps: int, say) -> None:
    """A resume that trains nothing more says why, rather than re-evaluating and exporting the same weights without
    a word: the run had stopped (early stopping, a callback's state.stop, which an elastic restart must keep), or
    the checkpoint is at the run's last step (a --max-steps at or below it)."""
    why = (
        "the run had stopped there (early stopping, or a callback set state.stop)"
        if st.stop
        else f"the run's {total_steps} steps are done"
        if st.step >= total_steps
        else None
    )
    if why:
        say(f"note: nothing more trains from step {st.step}: {why}; the run ends there and writes that step's model")


def _check_same_order(path: Path, st: Progress, run: Run) -> None:
    """A checkpoint in the middle of an epoch continues that epoch's order: the settings that decide it (seed, the
    examples and their lengths, length grouping) may change at an epoch's end only."""
    size = int(st.order_digest.split(":")[0]) if st.order_digest else 0  # the interrupted epoch's examples
    if not 0 < st.consumed < size:
        return
    steps, _ = run.plan.epoch_steps(run.data.length_column(), st, 0, run.orders)
    if steps.order_digest != st.order_digest:
        changed = "; ".join(checkpoint.settings_changed(path, run.config)) or (
            "another --seed, --max-train-samples, --max-length or --group-by-length than its config.yaml"
        )
        raise CheckpointError(
            f"checkpoint {str(path)!r} stopped in the middle of epoch {st.epoch} (example {st.consumed} of {size}), "
            f"and this run orders that epoch's examples otherwise ({changed}), so some would be trained twice and "
            "others never; resume with the checkpoint's settings (they may change at an epoch's end), or start a new "
            "run"
        )


def _best_weights(path: Path, st: Progress, run: Run) -> dict | None:
    """The best evaluation's weights, from the best step's checkpoint (main rank); where that checkpoint cannot
    be read, the best is forgotten and picked again among the evaluations after the resume."""
    if st.best_step is None:
        return None
    best = path.parent / f"checkpoint-{st.best_step}"
    if checkpoint.has_full_weights(best) and st.best_eval is not None:
        return checkpoint.full_weights(best, run.backend.unwrap(run.model)) if run.backend.is_main else None
    run.report.print(
        f"note: the best model (step {st.best_step}) is not in a readable checkpoint; "
        "load_best_model_at_end will pick among the evaluations after this resume"
    )
    st.best_metric = st.best_step = st.best_eval = None
    return None
