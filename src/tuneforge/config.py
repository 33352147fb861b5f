"""Typed run configuration: inert data, validated once at the edge.

A run is described by one `TrainConfig`: what every run has (model, output, schedule, precision,
adapters, evaluation, checkpoints, launch) plus the `optim` and `data` sections, and two slots for the
options of the run's task and backend (`task_options`, `backend_options`: subclasses of the bases in
options.py). This module names no task and no backend: `configure.build_config` resolves which task and
backend a run has, moves their options into those slots (keys given flat, such as `zero_stage: 3` or
`doc_stride: 64`, and under `data:` as config files of 0.x wrote them) and fills in the task's own
defaults. `TrainConfig(...)` built directly holds such keys in `pending_options` until then.

Every number is finite (no inf or nan, from YAML, a flag or an override) and within stated bounds that keep it
from overflowing what it feeds (seeds below 2**32, token counts, step counts); a refusal states the range.
The CLI's flags are generated from these fields (cli.py, through flags.py): a field's description is its flag's
help; fields marked `EVAL` are also `tuneforge eval`'s, fields marked `INPUT` name a file or folder the run reads.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    Field,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tuneforge.errors import ConfigError
from tuneforge.files import write_text
from tuneforge.flags import allowed_range, shown_value
from tuneforge.harness.options import HarnessSettings, is_harness_metric
from tuneforge.options import PATH, BackendOptions, Options, TaskOptions, comma_list, one_or_list
from tuneforge.tracking import (
    check_log_model,
    check_report_to,
    check_tracker_flags,
    tracker_names,
    trackers_that,
    uri_variables,
)
from tuneforge.yaml_files import read_yaml

NO_FLAG: dict[str, Any] = {"flag": None}  # json_schema_extra of a field that has no CLI flag (key=value only)
EVAL: dict[str, Any] = {"eval": True}  # json_schema_extra of a field `tuneforge eval` takes too
INPUT: dict[str, Any] = {"input": True}  # a file or folder the run reads (never inside what it writes)
LOWER_IS_BETTER = ("loss", "perplexity", "error")  # a metric named with one of these: lower is better


def lower_is_better(metric: str) -> bool:
    """How a metric other than a task's own ranks (metric_for_best, a sweep's --metric, `tuneforge runs`)."""
    return any(word in metric.lower() for word in LOWER_IS_BETTER)


# Upper bounds: every number a run takes is finite and fits what it feeds (numpy's and torch's seeds are
# 32-bit; token counts index int64 tensors and size buffers; step counts and sizes stay far from overflow and
# from values that can only be a typo). A value outside is refused at the edge, naming the key and the range.
MAX_SEED = 2**32 - 1
MAX_EPOCHS = 1_000_000
MAX_STEPS = 10**9  # optimizer steps, and the step counts that are compared with them
MAX_TOKENS = 2**24  # tokens of one example or generation (16M: beyond any model's context)
MAX_BATCH = 2**20  # examples per batch, micro-batches per step
MAX_EXAMPLES = 10**12
MAX_LR = 1e3
Probability = Annotated[float, Field(ge=0, lt=1)]


# Options (options.py): unknown keys refused; inf and nan (YAML .inf/.nan, `--lr nan`, "1e400") refused, not
# trained on
class OptimConfig(Options):
    lr: float = Field(8e-5, gt=0, le=MAX_LR, description="peak learning rate (a task may set its own default)")
    weight_decay: float = Field(0.01, ge=0, le=100, description="AdamW weight decay (not on biases and norms)")
    betas: tuple[Probability, Probability] = Field((0.9, 0.999), json_schema_extra=NO_FLAG)
    eps: float = Field(1e-8, gt=0, le=1, json_schema_extra=NO_FLAG)
    scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "linear", description="learning-rate schedule after the warmup"
    )
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="warmup steps; 0: warmup_ratio of the total steps")
    warmup_ratio: float = Field(0.06, ge=0, lt=1, description="warmup as a fraction of the total steps")
    max_grad_norm: float | None = Field(
        1.0, ge=0, le=1e6, description="clip gradients to this norm; null (or 0) disables"
    )
    fused: bool | None = Field(None, description="fused AdamW; null = where available", json_schema_extra=NO_FLAG)


SOURCE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class SourceConfig(Options):
    """One source of a data mixture (`data.sources`): a local file or folder (read as --train-file / --data-dir
    would be) or a hub dataset, its share of each epoch, and the task options it is read with (its format)."""

    name: str | None = Field(None, pattern=SOURCE_NAME, description="the source's name (default: the file's stem)")
    path: str | None = Field(
        None, description="a training file, or a folder of the task's files", json_schema_extra=INPUT
    )
    hub: str | None = Field(None, description="a Hugging Face hub dataset (instead of path)")
    subset: str | None = Field(None, description="the hub dataset's configuration")
    split: str = Field("train", description="the hub dataset's split to train on")
    weight: float | None = Field(None, gt=0, le=1e6, description="the source's share of each epoch (relative)")
    epochs: float | None = Field(None, gt=0, le=MAX_EPOCHS, description="passes over the source per epoch")
    validation_file: str | None = Field(
        None, description="the source's validation rows (default: 10% held out)", json_schema_extra=INPUT
    )
    options: dict[str, Any] = Field(default_factory=dict, description="task options for this source (its format)")

    @model_validator(mode="after")
    def _one_place(self) -> SourceConfig:
        if (self.path is None) == (self.hub is None):
            raise ValueError("give a source either path (a file or folder) or hub (a hub dataset), one of them")
        if self.name is None:
            stem = Path(self.path).name.split(".")[0] if self.path else self.hub.rsplit("/", 1)[-1]
            # (the name rule's first character is a letter or digit: '_web.jsonl' is 'web')
            self.name = re.sub(r"[^A-Za-z0-9_.-]", "_", stem).lstrip("_.-")[:64] or "source"
        return self


class DataConfig(Options):
    # sources (a task's own, such as seq2seq's parallel files, are its options)
    data_dir: str | None = Field(
        None,
        description="a folder with the task's train and validation files (a GLUE task's folder, CoNLL's "
        "train.txt and valid.txt, SQuAD JSON files, ...)",
        json_schema_extra={**EVAL, **INPUT},
    )
    train_file: str | None = Field(
        None,
        description="csv/tsv/jsonl/json rows or a .txt corpus; without --task its kind picks the task",
        json_schema_extra={**EVAL, **INPUT},
    )
    validation_file: str | None = Field(
        None,
        description="validation split (default: split off the training file)",
        json_schema_extra={**EVAL, **INPUT},
    )
    text_columns: list[str] | None = Field(
        None,
        description="text column: once or twice (sentence pairs)",
        json_schema_extra={"flag": "--text-column", **EVAL},
    )
    label_column: str | None = Field(None, description="label column (default: label)", json_schema_extra=EVAL)
    # tokenization
    max_length: int | None = Field(
        128,
        gt=0,
        le=MAX_TOKENS,
        description="tokens per example (of its input, where the task also has targets)",
        json_schema_extra=EVAL,
    )
    # sampling
    max_train_samples: int | None = Field(
        None,
        gt=0,
        le=MAX_EXAMPLES,
        description="train on the first N training examples the model sees: rows, or packed blocks where a "
        "task packs texts; the label set still comes from the whole training split",
    )
    max_eval_samples: int | None = Field(
        None, gt=0, le=MAX_EXAMPLES, description="evaluate on the first N examples", json_schema_extra=EVAL
    )
    group_by_length: bool = Field(True, description="batches of similar lengths (less padding)")
    cache_dir: str | None = Field(
        None, description="where tokenized datasets are cached", json_schema_extra={**EVAL, **PATH}
    )
    num_workers: int = Field(1, ge=1, le=1024, description="processes that tokenize the data (datasets' num_proc)")
    split_seed: int = Field(42, ge=0, le=MAX_SEED, json_schema_extra=NO_FLAG)
    # a mixture of sources, each with its weight or epochs (in a config file; replaces train_file / data_dir)
    sources: list[SourceConfig] = Field(default_factory=list, json_schema_extra=NO_FLAG)
    allow_changed_data: bool = Field(
        False,
        description="resume although a training file changed since the checkpoint (the rest of the run then "
        "follows the changed data, not the order the interrupted run would have had)",
    )

    @field_validator("text_columns", mode="before")
    @classmethod
    def _one_column(cls, value: Any) -> Any:
        return one_or_list(value)

    @field_validator("sources", mode="before")
    @classmethod
    def _sources(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        for i, item in enumerate(value):
            try:
                SourceConfig.model_validate(item)
            except ValidationError as err:
                what = f"data source {_source_label(item, i)}"
                raise PydanticCustomError(
                    "source", "{what}: {why}", {"what": what, "why": format_error(err, {"": SourceConfig})}
                ) from None
        return value

    @model_validator(mode="after")
    def _mixture(self) -> DataConfig:
        if not self.sources:
            return self
        if self.train_file or self.data_dir:
            given = "--train-file" if self.train_file else "--data-dir"
            raise ValueError(f"data.sources replaces {given}: give the training data one way")
        names = [s.name for s in self.sources]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice:
            raise ValueError(f"two data sources are named {twice!r}; give each its own name")
        weighted = [s.name for s in self.sources if s.weight is not None]
        counted = [s.name for s in self.sources if s.epochs is not None]
        both = next((s.name for s in self.sources if s.weight is not None and s.epochs is not None), None)
        if both or (weighted and counted):
            odd = both or (counted[0] if len(weighted) >= len(counted) else weighted[0])
            raise ValueError(
                f"data source {odd!r} mixes weight and epochs with the other sources; give every source a weight "
                "(shares of each epoch) or every source epochs (passes per epoch)"
            )
        if weighted and len(weighted) < len(names):
            lacking = next(n for n in names if n not in weighted)
            raise ValueError(f"data source {lacking!r} has no weight while others do; give every source a weight")
        if counted and len(counted) < len(names):
            lacking = next(n for n in names if n not in counted)
            raise ValueError(f"data source {lacking!r} has no epochs while others do; give every source epochs")
        return self


def _source_label(item: Any, i: int) -> str:
    """How an error names a source that did not validate: its name, its file's name, or its place in the list."""
    if isinstance(item, dict):
        for key in ("name", "path", "hub"):
            if isinstance(item.get(key), str) and item[key]:
                return repr(item[key] if key == "name" else Path(item[key]).name)
    return f"{i + 1} of the list"


class TrainConfig(Options):
    task: str | None = Field(
        None,
        description="the task (its list: `tuneforge train --help`); default: the one the data files say, else "
        "the registry's default",
        json_schema_extra=EVAL,
    )
    model: str | None = Field(
        None, description="HF folder or hub id; default: the task's bundled model", json_schema_extra=INPUT
    )
    output_dir: str = Field(
        "runs/latest", description="run folder: config, metrics, checkpoints, model", json_schema_extra=PATH
    )
    overwrite: bool = Field(False, description="replace an existing run in output_dir")

    # schedule
    # 2 epochs at lr 8e-5: MRPC dev F1 0.005-0.008 below 3 at 5e-5 (seeds 1-3) in two thirds of the time (benchmarks/)
    epochs: float = Field(
        2, gt=0, le=MAX_EPOCHS, description="passes over the training data (a task may set its own default)"
    )
    max_steps: int | None = Field(None, gt=0, le=MAX_STEPS, description="optimizer steps (overrides epochs)")
    batch_size: int = Field(16, gt=0, le=MAX_BATCH, description="per process", json_schema_extra=EVAL)
    eval_batch_size: int | None = Field(
        None, gt=0, le=MAX_BATCH, description="per process (default: 2 x batch_size)", json_schema_extra=EVAL
    )
    grad_accum: int = Field(1, gt=0, le=MAX_BATCH, description="micro-batches per optimizer step")
    seed: int = Field(
        42, ge=0, le=MAX_SEED, description="seed for initialisation and data order", json_schema_extra=EVAL
    )
    skip_nonfinite: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="optimizer steps whose loss or gradients are nan/inf that may be skipped (no update, each "
        "logged); the next one stops the run, which stops at the first by default",
        json_schema_extra={"flag_kwargs": {"metavar": "N"}},
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="auto: bf16 where the hardware does it natively, fp16 on older GPUs, else fp32",
        json_schema_extra=EVAL,
    )
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward (less memory)")
    # 0: on CPU dropout's random masks cost ~1/4 of a training step, and short fine-tuning runs did
    # as well or better without it (MRPC, seeds 1-3: benchmarks/README.md)
    dropout: float | None = Field(
        0.0,
        ge=0,
        lt=1,
        description="every dropout probability in the model's config (hidden, attention, "
        "classifier) set to this while training; null keeps the model's own",
    )
    # auto: a classifier keeps its embeddings and bottom layer fixed. On MRPC (seeds 1-3) that made an fp32 step
    # ~1.3x faster at the dev F1 of training every weight; 2 layers lost F1 (benchmarks/README.md). A generating
    # model trains every weight: its embeddings are usually its output layer too.
    freeze_embeddings: Literal["auto", "on", "off"] = Field(
        "auto",
        description="keep the embeddings fixed while training (no gradient or optimizer update for the "
        "vocabulary's rows: faster); auto: on for models that predict no tokens (classifiers), off for "
        "generating ones",
    )
    freeze_layers: int | Literal["auto"] = Field(
        "auto",
        description="keep the bottom N transformer layers (and the embeddings) fixed while training: their "
        "backward is skipped; auto: 1 where the embeddings are frozen by auto (classifiers), else 0",
        json_schema_extra={"flag_kwargs": {"metavar": "N"}},
    )
    # adapters: LoRA through peft (tuneforge/adapters.py)
    adapter: Literal["none", "lora"] = Field(
        "none",
        description="lora: train low-rank adapters (peft) and the task's head, every base weight fixed; "
        "OUTPUT_DIR/model is then an adapter folder (`tuneforge export --merge` makes a standalone one)",
    )
    lora_r: int = Field(16, gt=0, le=65536, description="LoRA rank")
    lora_alpha: float = Field(
        32, gt=0, le=1e5, description="LoRA scaling numerator (the update is scaled by alpha / r)"
    )
    lora_dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the LoRA branch's input")
    lora_targets: str = Field(
        "auto",
        description="the linear layers that get adapters: auto (peft's choice for the architecture, e.g. "
        "query,value for BERT, q_proj,v_proj for Llama), all-linear, or comma-separated names (q_proj,v_proj)",
    )
    quantize: Literal["none", "4bit"] = Field(
        "none",
        description="4bit: load the base model in 4-bit NF4 through bitsandbytes and train LoRA adapters on it "
        "(QLoRA; needs --adapter lora)",
    )
    attn_implementation: str = Field(
        "auto",
        description="attention kernel for training and evaluation: auto (eager under bf16 on CPU when batches "
        "are padded, where it is faster; else the model's default, SDPA for most; packed causal-LM blocks are not "
        "padded) or a transformers name: eager, sdpa, flash_attention_2, ...",
    )

    # evaluation, logging, best model
    eval_strategy: Literal["epoch", "steps", "no"] = Field(
        "epoch",
        description="when to evaluate; the run's end also evaluates the model it exports where no evaluation "
        "saw those weights (result.json holds that model's metrics)",
    )
    eval_steps: int | None = Field(
        None,
        gt=0,
        le=MAX_STEPS,
        description="evaluate every N steps and at the last (alone: implies eval_strategy steps)",
    )
    logging_steps: int = Field(20, gt=0, le=MAX_STEPS, description="log the training loss every N steps")
    metric_for_best: str | None = Field(
        None,
        description="metric that picks the best model (default: the task's); higher is better but for a loss, "
        "perplexity or error",
    )
    early_stopping_patience: int | None = Field(
        None, gt=0, le=MAX_STEPS, description="stop after N evaluations without improvement"
    )
    load_best_model_at_end: bool = Field(False, description="export the best evaluated model, not the last")
    # lm-evaluation-harness on the exported model (tuneforge/harness/): task names, or in YAML a mapping of
    # HarnessSettings' fields (tasks, data: {TASK: PATH}, limit, fewshot, batch_size, max_gen_toks)
    harness_after_train: HarnessSettings | None = Field(
        None,
        description="after training, run lm-evaluation-harness on the exported model into OUTPUT_DIR/harness with "
        "these of its tasks (comma-separated, e.g. piqa,gsm8k; NAME=PATH reads a task's data from local files, as "
        "eval's --harness-data); in YAML, or as harness_after_train.tasks=... overrides, also limit, fewshot, "
        "batch_size, max_gen_toks",
        json_schema_extra={"flag_kwargs": {"metavar": "TASKS"}},
    )

    # checkpoints
    save_strategy: Literal["epoch", "steps", "no"] = Field("no", description="when to save a checkpoint")
    save_steps: int | None = Field(
        None, gt=0, le=MAX_STEPS, description="save every N steps (alone: implies save_strategy steps)"
    )
    save_total_limit: int | None = Field(
        None, gt=0, le=MAX_STEPS, description="keep the newest N checkpoints, plus the best one (by metric_for_best)"
    )
    resume: str | None = Field(
        None,
        description="'latest' (the flag alone) or a checkpoint folder",
        json_schema_extra={"flag_kwargs": {"nargs": "?", "const": "latest"}, **INPUT},
    )

    # backend and launch
    backend: str | None = Field(
        None,
        description="parallelism engine: one of the files in tuneforge/backends/ (default: one process)",
        json_schema_extra=EVAL,
    )
    nproc: int = Field(
        1, gt=0, le=4096, description="processes per node (tuneforge launches them)", json_schema_extra=EVAL
    )
    nnodes: int = Field(1, gt=0, le=100_000, description="nodes of a multi-node run")
    node_rank: int = Field(0, ge=0, le=100_000, description="this node's rank in a multi-node run")
    master_addr: str = Field("127.0.0.1", description="address of node 0 (multi-node)")
    master_port: int | None = Field(None, gt=0, lt=65536, description="port on node 0 (multi-node: the same on all)")
    rdzv_endpoint: str | None = Field(None, description="HOST:PORT of a c10d rendezvous (elastic multi-node)")
    hostfile: str | None = Field(None, description="DeepSpeed-style hostfile ('node1 slots=2' per line)")
    max_restarts: int = Field(0, ge=0, le=1000, description="restart failed workers up to N times (they resume)")
    # the run's task's and backend's own settings (their `Options`), put here by configure.build_config
    task_options: SerializeAsAny[TaskOptions] = Field(
        default_factory=TaskOptions, description="the task's own settings (its Options), also accepted as flat keys"
    )
    backend_options: SerializeAsAny[BackendOptions] = Field(
        default_factory=BackendOptions,
        description="the backend's own settings (its Options), also accepted as flat keys",
    )
    # keys of a task's or backend's options given to `TrainConfig(...)` directly (flat, under data, or as a
    # task_options/backend_options mapping), by dotted key, until configure.build_config moves them to their owner
    pending_options: dict[str, Any] = Field(default_factory=dict, exclude=True, json_schema_extra=NO_FLAG)

    # output
    quiet: bool = Field(
        False,
        description="no progress bar or log lines: only errors and the result (its last lines; with --json the JSON "
        "line alone)",
        json_schema_extra=EVAL,
    )
    # experiment trackers (tuneforge/tracking/, which names them); metrics.jsonl is written whatever this says
    report_to: list[str] = Field(
        ["jsonl"],
        description=f"where metrics go besides OUTPUT_DIR/metrics.jsonl, which is always written: "
        f"{', '.join(tracker_names())} (comma-separated; none: no tracker); a tracker's package is an extra: "
        "pip install 'tuneforge[NAME]'",
        json_schema_extra={"flag_kwargs": {"nargs": "+", "action": "extend", "metavar": "NAME"}},
    )
    log_model: bool = Field(
        False,
        description="at the end, upload OUTPUT_DIR/model as an artifact of the tracker runs that keep models "
        f"({', '.join(trackers_that('logs_model'))})",
    )
    tracking_uri: str | None = Field(
        None,
        description=f"the tracking server or store of {', '.join(trackers_that('uri_variable'))} "
        f"(http://HOST:PORT, sqlite:///FILE); default: {', '.join(uri_variables())}, else the tracker's own",
    )
    experiment_name: str | None = Field(
        None,
        description="the experiment or project the tracker runs go to (default: the tracker's own environment "
        "variable where set, else tuneforge)",
    )
    run_name: str | None = Field(None, description="the tracker runs' name (default: the output dir's name)")

    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()

    @field_validator("eval_strategy", "save_strategy", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        return "no" if value is False else value  # YAML reads a bare `no` as false

    @field_validator("report_to", mode="before")
    @classmethod
    def _trackers(cls, value: Any) -> Any:
        return check_report_to(comma_list(value))  # `--report-to mlflow,tensorboard` as a repeated flag does

    @field_validator("metric_for_best")
    @classmethod
    def _evaluated_metric(cls, value: str | None) -> str | None:
        if value is not None and is_harness_metric(value):  # scored once, after the model is chosen
            raise PydanticCustomError(
                "metric_for_best",
                "names a score of lm-evaluation-harness after training, which comes once the model is exported: "
                "it cannot pick the model among the run's evaluations (to tune runs for it: tuneforge sweep "
                "--metric {metric})",
                {"metric": value},
            )
        return value

    @field_validator("freeze_layers", mode="before")
    @classmethod
    def _layers_or_auto(cls, value: Any) -> Any:
        if value == "auto":
            return value
        try:
            layers = int(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: YAML's .inf
            # (no upper bound: a count above the model's layers freezes them all, and overflows nothing)
            layers = -1
        if layers < 0 or isinstance(value, (bool, float)) and value != layers:
            raise PydanticCustomError("freeze_layers", "needs a number of layers (0 or more) or auto")
        return layers

    @field_validator("freeze_embeddings", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value  # YAML: on/off/true

    @model_validator(mode="before")
    @classmethod
    def _steps_mean_steps(cls, values: Any) -> Any:
        # `--save-steps N` or `--eval-steps N` alone must act every N steps, not be silently ignored
        for what in ("save", "eval"):
            if isinstance(values, dict) and values.get(f"{what}_steps") and f"{what}_strategy" not in values:
                values = {**values, f"{what}_strategy": "steps"}
        return values

    @model_validator(mode="before")
    @classmethod
    def _hold_options(cls, values: Any) -> Any:
        # keys this model does not have are a task's or a backend's options (or typos): held, by dotted key, for
        # configure.build_config, which knows the owners
        if not isinstance(values, dict):
            return values
        out, pending = {}, dict(values.get("pending_options") or {})
        for key, value in values.items():
            if value is None and key in ("optim", "data", "task_options", "backend_options"):
                continue  # a YAML section whose keys are all commented out: its defaults
            if key == "data" and isinstance(value, dict):
                out[key] = {k: v for k, v in value.items() if k in DataConfig.model_fields}
                pending.update({f"data.{k}": v for k, v in value.items() if k not in DataConfig.model_fields})
            elif key in ("task_options", "backend_options") and isinstance(value, dict):
                pending.update({f"{key}.{k}": v for k, v in value.items()})
            elif key in cls.model_fields:
                out[key] = value
            else:
                pending[key] = value
        out.pop("pending_options", None)
        return {**out, "pending_options": pending} if pending else out

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.eval_strategy == "steps" and self.eval_steps is None:
            raise ValueError("eval_strategy=steps needs eval_steps (e.g. eval_steps=200)")
        if self.save_strategy == "steps" and self.save_steps is None:
            raise ValueError("save_strategy=steps needs save_steps (e.g. save_steps=500)")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        ignored = [f"--{key} {value}" for key, value in (("nproc", self.nproc), ("nnodes", self.nnodes)) if value > 1]
        if self.hostfile and ignored:  # DeepSpeed's launcher would start what the hostfile says, silently
            raise ValueError(
                f"--hostfile decides the workers (its hosts and their slots), so {' and '.join(ignored)} would be "
                "ignored; drop it, or change the hostfile's slots"
            )
        if self.adapter != "none":
            _check_adapter(self)
        if self.quantize != "none" and self.adapter == "none":
            raise ValueError(
                f"--quantize {self.quantize} keeps the base model in 4-bit, which cannot train; add --adapter lora "
                "(QLoRA: the adapters train on the quantized base)"
            )
        if self.early_stopping_patience and self.eval_strategy == "no":
            raise ValueError("early_stopping_patience needs evaluation: set eval_strategy to epoch or steps")
        if self.log_model:
            check_log_model(self.report_to)
        return self

    @model_validator(mode="after")
    def _keywords_given_now(self, info: ValidationInfo) -> TrainConfig:
        """`TrainConfig(...)`'s keywords are the Python API's settings given now, checked as the CLI's flags are
        (check_given_now); a LoRA key at its default passes, since a saved config.yaml given whole holds them all.
        A mapping validated with a context (a config file's values: validate_config) is not checked."""
        if info.context is None:
            given = {key: getattr(self, key) for key in self.model_fields_set}
            check_given_now(self, {}, {k: v for k, v in given.items() if k not in LORA_KEYS or v != _default(k)})
        return self

    # ---- helpers -----------------------------------------------------------------------
    def given_values(self, update: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """What this config was given (fields set, its options' fields set, pending keys), with `update` on top:
        the input that builds it again. A new task or backend in `update` starts from its own options' defaults;
        an options key in `update` (flat: `zero_stage=3`) replaces the one given before."""
        update = dict(update or {})
        values = {**self.model_dump(exclude_unset=True), **self.pending_options}
        for name, section in (("task", "task_options"), ("backend", "backend_options")):
            if name in update and update[name] != getattr(self, name):
                values.pop(section, None)
            elif isinstance(values.get(section), dict):
                values[section] = {k: v for k, v in values[section].items() if k not in update}
        return {**values, **update}

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> TrainConfig:
        """As pydantic's, but an update is validated (pydantic's copy validates nothing, and `epochs=inf` must be
        refused); options keys in it wait in pending_options for configure.build_config."""
        if not update:
            return super().model_copy(deep=deep)
        return validate_config(self.given_values(update))

    def inputs(self) -> dict[str, Any]:
        """flag -> value of every field marked INPUT (the files and folders the run reads; None where not given),
        its task's options included."""
        found = {}
        for part in (self, self.data, self.task_options):
            for name, field in type(part).model_fields.items():
                extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
                if extra.get("input"):
                    found[extra.get("flag") or "--" + name.replace("_", "-")] = getattr(part, name)
        return found

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def save(self, path: str | os.PathLike) -> None:
        write_text(path, yaml.safe_dump(self.to_dict(), sort_keys=False))  # whole: a kill leaves the one before


LORA_KEYS = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets")


def _default(key: str) -> Any:
    return TrainConfig.model_fields[key].default


def check_lora_given(adapter: str, flags: Mapping[str, Any], overrides: Mapping[str, Any]) -> None:
    """LoRA settings given this time (the command line's flags, and its key=value overrides, named as written) need
    --adapter lora: a run without adapters would ignore them. A config file's are not checked: a saved LoRA run's
    config.yaml re-runs with --adapter none. ConfigError where they would do nothing."""
    if adapter == "lora":
        return
    given = [f"--{key.replace('_', '-')}" for key in LORA_KEYS if flags.get(key) is not None]
    given += [
        f"{key}={overrides[key]}" for key in LORA_KEYS if overrides.get(key) is not None and flags.get(key) is None
    ]
    if given:
        raise ConfigError(
            f"{', '.join(given)} set{'s' if len(given) == 1 else ''} up LoRA adapters, and this run has none "
            f"(--adapter {adapter}), so {'it' if len(given) == 1 else 'they'} would do nothing; add --adapter lora "
            f"or drop {'it' if len(given) == 1 else 'them'}"
        )


def check_given_now(config: TrainConfig, flags: Mapping[str, Any], overrides: Mapping[str, Any]) -> None:
    """The LoRA and tracker settings given this time (flags; key=value overrides or Python keywords) that `config`
    would ignore: one ConfigError (what train, prepare and sweep check before any work, and TrainConfig's and
    Trainer's keywords)."""
    check_tracker_flags(config.report_to, flags, overrides)
    check_lora_given(config.adapter, flags, overrides)


def _check_adapter(config: TrainConfig) -> None:
    freezes = {
        "freeze_layers": config.freeze_layers not in ("auto", 0),
        "freeze_embeddings": config.freeze_embeddings == "on",
    }
    given = [f"--{k.replace('_', '-')} {getattr(config, k)}" for k, on in freezes.items() if on]
    if given:
        raise ValueError(
            f"{' and '.join(given)} do not combine with --adapter {config.adapter}: an adapter run keeps every base "
            "weight fixed already; drop them"
        )
    if not [t for t in config.lora_targets.split(",") if t.strip()]:
        raise ValueError("--lora-targets is empty; pass auto, all-linear or layer names such as q_proj,v_proj")


# ---------------------------------------------------------------------------------------
# One-line errors, and configs from YAML files and dotted overrides.

SECTIONS = {"": TrainConfig, "optim": OptimConfig, "data": DataConfig}


def field_at(loc: str, options: Mapping[str, type[BaseModel]] | None = None):
    """The pydantic FieldInfo of a dotted config key (None when there is none); `options`: the models of the
    task_options and backend_options sections, where they are known."""
    section, _, name = loc.rpartition(".")
    model = {**SECTIONS, **(options or {})}.get(section)
    return model.model_fields.get(name) if model else None


def meant_key(loc: str, allowed: list[str]) -> str:
    """'; did you mean optim.lr?' for an unknown dotted key: the section that has its name (`lr` given flat, as
    its flag --lr reads), else the close spelling among `allowed`, its own section's keys; '' where none is."""
    section, _, name = loc.rpartition(".")
    name = name.replace("-", "_")  # a flag's spelling
    homes = [
        f"{part}.{name}" if part else name
        for part, model in SECTIONS.items()
        if part != section and name in model.model_fields and name != "pending_options"
    ]
    close = difflib.get_close_matches(name, [n for n in allowed if n != "pending_options"], n=1)
    meant = homes or [f"{section}.{n}" if section else n for n in close]
    return f"; did you mean {meant[0]}?" if meant else ""


def format_error(err: ValidationError, options: Mapping[str, type[BaseModel]] | None = None, prefix: str = "") -> str:
    """A ValidationError as one line naming each key, what was wrong and the allowed range. `prefix`: the
    section the validated model sits in (`task_options.`)."""
    lines = []
    for e in err.errors():
        loc = prefix + ".".join(str(p) for p in e["loc"] if not isinstance(p, int))
        if e["type"] == "extra_forbidden":
            parent, _, _ = loc.rpartition(".")
            model = {**SECTIONS, **(options or {})}.get(parent)
            names = sorted(model.model_fields) if model else []
            lines.append(f"unknown config key '{loc}'{meant_key(loc, names)}; allowed: {', '.join(names)}")
        elif not e["loc"] and e["type"] == "value_error":  # a whole model's check (its message names the flags)
            lines.append(e["msg"].removeprefix("Value error, "))
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            where = f"'{loc}'" if loc else "config"
            shown = "" if isinstance(got, dict) or e["type"] == "source" else f" (got {shown_value(got)})"
            field = field_at(loc, options) if loc else None
            allowed = allowed_range(field) if field is not None else None
            lines.append(f"bad value for {where}: {msg}{shown}" + (f"; allowed: {allowed}" if allowed else ""))
    return "; ".join(lines)


def validate_config(values: Mapping[str, Any]) -> TrainConfig:
    """`values` as a TrainConfig (options keys pending, not yet resolved), or one ConfigError line."""
    try:
        return TrainConfig.model_validate(dict(values), context={"source": "mapping"})  # not keywords given now
    except ValidationError as err:
        raise ConfigError(format_error(err)) from None


def _parse_scalar(text: str) -> Any:
    # YAML gives numbers, booleans, null and [lists] their natural types.
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=value` strings to a nested dict (returns a new dict)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in values.items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. optim.lr=3e-5)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: the key {key.strip()!r} has an empty part (e.g. optim.lr=3e-5)")
        node = out
        for p in parts[:-1]:
            if node.get(p) is None:  # unset, or a section left empty (null) in the YAML, as a flag fills it
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r}: '{p}' is not a section")
        node[parts[-1]] = _parse_scalar(raw)
    return out


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():  # `tuneforge train MODEL_DIR`, as eval takes one
        raise ConfigError(
            f"config file {str(p)!r} is a folder, not a YAML file (a model folder goes to --model, a data folder to "
            "--data-dir)"
        )
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass a YAML file such as configs/glue-mrpc.yaml")
    data = read_yaml(p, "config file") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of keys to values")
    return data


def merge_sources(yaml_path: str | None, overrides: list[str], flags: dict[str, Any]) -> dict[str, Any]:
    """The raw values of a run: YAML file < dotted overrides < explicit CLI flags (`data.max_length`:
    dotted flag keys go to their section); unset flags (None) are left out. An options key a later layer sets,
    in any spelling (`zero_stage`, `backend_options.zero_stage`), replaces the earlier layers' in every spelling."""
    values = _shorthand_as_section(load_yaml(yaml_path) if yaml_path else {})
    for item in overrides:
        key, eq, raw = item.partition("=")
        key = _shorthand_key(key.strip(), _parse_scalar(raw)) if eq else key.strip()
        values = apply_overrides(_forget_option(values, key), [f"{key}={raw}" if eq else item])
    for key, value in flags.items():
        if value is None:
            continue
        key = _shorthand_key(key, value)
        values = _forget_option(values, key)
        if "." in key:
            section, name = key.split(".", 1)
            if values.get(section) is None:  # unset, or null in the YAML
                values[section] = {}
            if not isinstance(values[section], dict):  # `optim: adamw` in the YAML: refused, not replaced
                raise ConfigError(f"'{section}' is a section of keys, not {shown_value(values[section])}")
            values[section][name] = value
        else:
            values[key] = value
    return values


# a section that a plain value stands for the tasks of (`harness_after_train: piqa,gsm8k`): a later layer's plain
# value replaces those tasks only, so that its other keys (limit, ...) given in an earlier layer stay
SHORTHAND_SECTION, SHORTHAND_KEY = "harness_after_train", "tasks"


def _shorthand_as_section(values: dict[str, Any]) -> dict[str, Any]:
    plain = values.get(SHORTHAND_SECTION)
    return {**values, SHORTHAND_SECTION: {SHORTHAND_KEY: plain}} if isinstance(plain, (str, list)) else values


def _shorthand_key(key: str, value: Any) -> str:
    """`harness_after_train` given task names is `harness_after_train.tasks`; null (no run) replaces the section."""
    plain = key == SHORTHAND_SECTION and isinstance(value, (str, list))
    return f"{SHORTHAND_SECTION}.{SHORTHAND_KEY}" if plain else key


def _forget_option(values: dict[str, Any], key: str) -> dict[str, Any]:
    """`values` without the options key that `key` (dotted) names, in any of its spellings; a key of the
    config's own fields is left alone (the later layer simply replaces it)."""
    section, _, name = key.rpartition(".")
    if section not in ("", "data", "task_options", "backend_options"):
        return values
    if name in SECTIONS.get(section, TrainConfig).model_fields or name in TrainConfig.model_fields:
        return values
    out = {k: v for k, v in values.items() if k != name}
    for part in ("data", "task_options", "backend_options"):
        if isinstance(out.get(part), dict):
            out[part] = {k: v for k, v in out[part].items() if k != name}
    return out
