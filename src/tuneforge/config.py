"""Typed run configuration, validated once at the edge.

A run is described by one `TrainConfig` (flat training/launch fields plus the `optim` and
`data` sections, and `backend_options`: the chosen backend's own `Options`, also accepted as
flat keys such as `zero_stage: 3`). It can be built in Python, read from YAML, and overridden
with dotted `key=value` pairs (`optim.lr=3e-5`). Every problem is reported as one `ConfigError`
line that names the key and what is allowed, before any work starts. Every number is finite (no inf or
nan, from YAML, a flag or an override) and within stated bounds that keep it from overflowing what it
feeds (seeds below 2**32, token counts, step counts); a refusal states the range. The CLI's flags are
generated from these fields (cli.py): a field's description is its flag's help.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tuneforge.backends.options import BackendOptions
from tuneforge.errors import ConfigError

NO_FLAG: dict[str, Any] = {"flag": None}  # json_schema_extra of a field that has no CLI flag (key=value only)


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


class _Section(BaseModel):
    # allow_inf_nan: inf and nan (YAML .inf/.nan, `--lr nan`, "1e400") are refused, not trained on
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class OptimConfig(_Section):
    lr: float = Field(
        8e-5, gt=0, le=MAX_LR, description="peak learning rate (a task may have its own default: ner 1.5e-4)"
    )
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


class DataConfig(_Section):
    # sources
    data_dir: str | None = Field(
        None,
        description="a folder with train and validation files (GLUE: the task folder; ner: CoNLL train.txt, "
        "valid.txt; qa: SQuAD JSON files; multiple-choice: train and dev files)",
    )
    train_file: str | None = Field(
        None, description="csv/tsv/jsonl (classification) or .txt (causal LM); without --task it picks the task"
    )
    validation_file: str | None = Field(None, description="validation split (default: split off the training file)")
    text_columns: list[str] | None = Field(
        None, description="text column: once or twice (sentence pairs)", json_schema_extra={"flag": "--text-column"}
    )
    label_column: str | None = Field(None, description="label column (default: label)")
    # seq2seq parallel text / columns
    source_file: str | None = Field(None, description="seq2seq: source lines (one example per line)")
    target_file: str | None = Field(None, description="seq2seq: target lines, parallel to --source-file")
    validation_source_file: str | None = Field(None, description="seq2seq: validation source lines")
    validation_target_file: str | None = Field(None, description="seq2seq: validation target lines")
    source_column: str | None = Field(None, description="seq2seq from csv/jsonl: the source column")
    target_column: str | None = Field(None, description="seq2seq from csv/jsonl: the target column")
    source_prefix: str = Field("", description="text put before every source (e.g. 'translate German to English: ')")
    # multiple choice
    data_format: Literal["auto", "codah"] = Field(
        "auto",
        description="multiple-choice: auto reads SWAG columns (sent1, sent2, ending0..) or question + choices; "
        "codah reads CODAH's headerless TSV (category, question, 4 endings, answer index)",
    )
    # chat / instruction SFT
    chat_format: Literal["auto", "messages", "alpaca"] = Field(
        "auto",
        description="sft: rows with `messages` ([{role, content}]) or Alpaca rows (instruction, input, output); "
        "auto: from the first row",
    )
    chat_template: str | None = Field(
        None, description="sft: a Jinja chat template file, for a tokenizer that has none (or to replace its own)"
    )
    # extractive question answering
    doc_stride: int | None = Field(
        None,
        gt=0,
        le=MAX_TOKENS,
        description="qa: tokens that consecutive windows of a long context share (default: max_length // 3)",
    )
    max_answer_length: int = Field(30, gt=0, le=MAX_TOKENS, description="qa: longest answer, in tokens")
    n_best_size: int = Field(20, gt=0, le=10_000, description="qa: start and end candidates scored per window")
    null_score_diff_threshold: float = Field(
        0.0,
        ge=-1e6,
        le=1e6,
        description="qa (SQuAD v2): answer nothing when the null score beats the best span by more than this",
    )
    # tokenization
    max_length: int | None = Field(128, gt=0, le=MAX_TOKENS, description="tokens per example (seq2seq: per source)")
    max_target_length: int = Field(128, gt=0, le=MAX_TOKENS, description="seq2seq: tokens per target")
    block_size: int | None = Field(
        None, gt=0, le=MAX_TOKENS, description="causal LM: tokens per training block (sft, dpo: the longest sequence)"
    )
    drop_identical_pairs: bool = Field(
        False, description="dpo: drop (and count) pairs whose chosen and rejected are identical instead of refusing"
    )
    packing: bool = Field(True, description="causal LM: pack texts into full blocks of block_size tokens")
    # sampling
    max_train_samples: int | None = Field(
        None,
        gt=0,
        le=MAX_EXAMPLES,
        description="train on the first N training examples the model sees: rows for classification and "
        "seq2seq, packed blocks for clm (one non-blank text each with --no-packing); the label set still comes "
        "from the whole training split",
    )
    max_eval_samples: int | None = Field(None, gt=0, le=MAX_EXAMPLES, description="evaluate on the first N examples")
    group_by_length: bool = Field(True, description="batches of similar lengths (less padding)")
    cache_dir: str | None = Field(None, description="where tokenized datasets are cached")
    split_seed: int = Field(42, ge=0, le=MAX_SEED, json_schema_extra=NO_FLAG)


class TrainConfig(_Section):
    task: str = Field(
        "bbc-news",
        description="task: classification, regression, clm, sft, dpo, seq2seq, ner, qa, multiple-choice, glue/NAME, "
        "bbc-news; "
        "default from the files: --source-file seq2seq, a .txt --train-file clm, another --train-file classification",
    )
    model: str | None = Field(None, description="HF folder or hub id; default: the task's bundled model")
    output_dir: str = Field("runs/latest", description="run folder: config, metrics, checkpoints, model")
    overwrite: bool = Field(False, description="replace an existing run in output_dir")

    # schedule
    # 2 epochs at lr 8e-5: MRPC dev F1 0.005-0.008 below 3 at 5e-5 (seeds 1-3) in two thirds of the time (benchmarks/)
    epochs: float = Field(
        2, gt=0, le=MAX_EPOCHS, description="passes over the training data (a task may have its own default: ner 3)"
    )
    max_steps: int | None = Field(None, gt=0, le=MAX_STEPS, description="optimizer steps (overrides epochs)")
    batch_size: int = Field(16, gt=0, le=MAX_BATCH, description="per process")
    eval_batch_size: int | None = Field(None, gt=0, le=MAX_BATCH, description="per process (default: 2 x batch_size)")
    grad_accum: int = Field(1, gt=0, le=MAX_BATCH, description="micro-batches per optimizer step")
    seed: int = Field(42, ge=0, le=MAX_SEED, description="seed for initialisation and data order")
    skip_nonfinite: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="optimizer steps whose loss or gradients are nan/inf that may be skipped (no update, each "
        "logged); the next one stops the run, which stops at the first by default",
        json_schema_extra={"flag_kwargs": {"metavar": "N"}},
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto: bf16 where the hardware does it natively, fp16 on older GPUs, else fp32"
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
    dpo_beta: float = Field(
        0.1, gt=0, le=1e3, description="dpo: how far the model may move from the reference (the rewards' scale)"
    )
    attn_implementation: str = Field(
        "auto",
        description="attention kernel for training and evaluation: auto (eager under bf16 on CPU when batches "
        "are padded, where it is faster; else the model's default, SDPA for most; packed causal-LM blocks are not "
        "padded) or a transformers name: eager, sdpa, flash_attention_2, ...",
    )

    # evaluation, logging, best model
    eval_strategy: Literal["epoch", "steps", "no"] = Field("epoch", description="when to evaluate")
    eval_steps: int | None = Field(None, gt=0, le=MAX_STEPS, description="evaluate every N steps (eval_strategy steps)")
    logging_steps: int = Field(20, gt=0, le=MAX_STEPS, description="log the training loss every N steps")
    metric_for_best: str | None = Field(None, description="metric that picks the best model (default: the task's)")
    early_stopping_patience: int | None = Field(
        None, gt=0, le=MAX_STEPS, description="stop after N evaluations without improvement"
    )
    load_best_model_at_end: bool = Field(False, description="export the best evaluated model, not the last")
    num_beams: int = Field(1, gt=0, le=1000, description="seq2seq evaluation: beam search width")
    generation_max_length: int = Field(
        128, gt=0, le=MAX_TOKENS, description="seq2seq evaluation: tokens generated at most"
    )

    # checkpoints
    save_strategy: Literal["epoch", "steps", "no"] = Field("no", description="when to save a checkpoint")
    save_steps: int | None = Field(
        None, gt=0, le=MAX_STEPS, description="save every N steps (alone: implies save_strategy steps)"
    )
    save_total_limit: int | None = Field(None, gt=0, le=MAX_STEPS, description="keep only the newest N checkpoints")
    resume: str | None = Field(
        None,
        description="'latest' (the flag alone) or a checkpoint folder",
        json_schema_extra={"flag_kwargs": {"nargs": "?", "const": "latest"}},
    )

    # backend and launch
    backend: str = Field("single", description="parallelism engine: one of the files in tuneforge/backends/")
    nproc: int = Field(1, gt=0, le=4096, description="processes per node (tuneforge launches them)")
    nnodes: int = Field(1, gt=0, le=100_000, description="nodes of a multi-node run")
    node_rank: int = Field(0, ge=0, le=100_000, description="this node's rank in a multi-node run")
    master_addr: str = Field("127.0.0.1", description="address of node 0 (multi-node)")
    master_port: int | None = Field(None, gt=0, lt=65536, description="port on node 0 (multi-node: the same on all)")
    rdzv_endpoint: str | None = Field(None, description="HOST:PORT of a c10d rendezvous (elastic multi-node)")
    hostfile: str | None = Field(None, description="DeepSpeed-style hostfile ('node1 slots=2' per line)")
    max_restarts: int = Field(0, ge=0, le=1000, description="restart failed workers up to N times (they resume)")
    # the chosen backend's own settings (its `Options`); flat keys (zero_stage=3) are moved in here
    backend_options: SerializeAsAny[BackendOptions] = Field(
        default_factory=BackendOptions,
        validate_default=True,
        description="the backend's own settings (its Options), also accepted as flat keys",
    )

    # output
    quiet: bool = Field(False, description="no progress bar or log lines, only errors (and --json)")
    report_to: list[Literal["jsonl", "tensorboard"]] = Field(["jsonl"], description="where metrics are written")

    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        from tuneforge.backends import available_backends

        names = available_backends()
        if value not in names:
            raise ValueError(f"unknown backend {value!r}; choose one of: {', '.join(names)}")
        return value

    @field_validator("backend_options", mode="before")
    @classmethod
    def _options_of_the_backend(cls, value: Any, info: ValidationInfo) -> Any:
        from tuneforge.backends import backend_class, option_owners

        backend = info.data.get("backend")
        if backend is None:  # an unknown backend, reported on its own
            return BackendOptions()
        options = backend_class(backend).Options
        given = value.model_dump() if isinstance(value, BaseModel) else value
        if not isinstance(given, dict):
            return given  # pydantic says what is wrong with it
        for key in list(given):
            if key in options.model_fields:
                continue
            owners = option_owners().get(key)
            if owners and _is_default(key, given[key], owners):
                # says nothing (a config saved before options moved here lists every backend's defaults)
                given = {k: v for k, v in given.items() if k != key}
                continue
            if owners:
                raise PydanticCustomError("backend_option", _foreign_option(key, owners, backend))
            allowed = ", ".join(sorted(options.model_fields)) or "none"
            raise PydanticCustomError(
                "backend_option",
                f"unknown config key 'backend_options.{key}'; backend {backend!r} has options: {allowed}",
            )
        return options.model_validate(given)

    @field_validator("eval_strategy", "save_strategy", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        return "no" if value is False else value  # YAML reads a bare `no` as false

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
    def _save_steps_means_steps(cls, values: Any) -> Any:
        # `--save-steps N` alone must save every N steps, not be silently ignored
        if isinstance(values, dict) and values.get("save_steps") and "save_strategy" not in values:
            values = {**values, "save_strategy": "steps"}
        return values

    @model_validator(mode="before")
    @classmethod
    def _task_and_its_defaults(cls, values: Any) -> Any:
        # the same for the CLI, YAML and the Python API: one place decides the task, then its defaults fill in
        if not isinstance(values, dict):
            return values
        return _with_task_defaults(_task_from_files(values))

    @model_validator(mode="before")
    @classmethod
    def _flat_backend_options(cls, values: Any) -> Any:
        # `zero_stage: 3` (YAML, API) is backend_options.zero_stage
        if not isinstance(values, dict):
            return values
        return nest_backend_options(values)

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.eval_strategy == "steps" and self.eval_steps is None:
            raise ValueError("eval_strategy=steps needs eval_steps (e.g. eval_steps=200)")
        if self.save_strategy == "steps" and self.save_steps is None:
            raise ValueError("save_strategy=steps needs save_steps (e.g. save_steps=500)")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        if self.adapter != "none":
            _check_adapter(self)
        if self.quantize != "none":
            _check_quantize(self)
        if self.early_stopping_patience and self.eval_strategy == "no":
            raise ValueError("early_stopping_patience needs evaluation: set eval_strategy to epoch or steps")
        return self

    # ---- helpers -----------------------------------------------------------------------
    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> TrainConfig:
        """As pydantic's, but an update of the backend or of a backend option (`zero_stage=3`, flat or
        under backend_options) is validated, so the options stay those of the chosen backend."""
        backend_keys = set(update or ()) - (set(type(self).model_fields) - {"backend", "backend_options"})
        if not backend_keys:
            copied = super().model_copy(update=update, deep=deep)
            if update:  # pydantic's copy validates nothing: `Trainer(config, epochs=inf)` is refused here
                build_config(copied.model_dump())
            return copied
        values = self.model_dump()
        if update.get("backend", self.backend) != self.backend:
            values.pop("backend_options")  # the new backend's defaults, not the old one's options
        return build_config(nest_backend_options({**values, **update}, override=True))

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def _check_adapter(config: TrainConfig) -> None:
    from tuneforge.backends import backend_class

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
    if not backend_class(config.backend).supports_adapters:
        raise ValueError(
            f"backend {config.backend!r} does not train adapters (--adapter {config.adapter}); use --backend fsdp for "
            "sharded weights, or single, ddp, deepspeed"
        )
    if not [t for t in config.lora_targets.split(",") if t.strip()]:
        raise ValueError("--lora-targets is empty; pass auto, all-linear or layer names such as q_proj,v_proj")


def _check_quantize(config: TrainConfig) -> None:
    if config.adapter == "none":
        raise ValueError(
            f"--quantize {config.quantize} keeps the base model in 4-bit, which cannot train; add --adapter lora "
            "(QLoRA: the adapters train on the quantized base)"
        )
    if config.backend not in ("single", "ddp"):
        raise ValueError(
            f"--quantize {config.quantize} runs on the single and ddp backends (each rank holds the whole 4-bit "
            f"model); backend {config.backend!r} would shard the packed 4-bit weights: use --backend ddp"
        )


def _task_from_files(values: dict[str, Any]) -> dict[str, Any]:
    """No task given: the data files say which."""
    if "task" in values:
        return values
    data = values.get("data") or {}
    get = data.get if isinstance(data, dict) else lambda key: getattr(data, key, None)
    if get("source_file"):
        return {**values, "task": "seq2seq"}
    if get("train_file"):
        return {**values, "task": "clm" if str(get("train_file")).endswith(".txt") else "classification"}
    return values


def _with_task_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """The task's own defaults (`Task.defaults`: "epochs", "optim.lr", ...) for the keys `values` leaves unset."""
    from tuneforge.tasks import task_class

    name = values.get("task", TrainConfig.model_fields["task"].default)
    try:
        defaults = task_class(name).defaults if isinstance(name, str) else {}
    except ConfigError:
        return values  # an unknown task is reported where the task is built, with the list of tasks
    out = dict(values)
    for key, value in defaults.items():
        section, _, field = key.rpartition(".")
        if not section:
            out.setdefault(field, value)
            continue
        given = out.get(section)
        if isinstance(given, BaseModel):  # a section built in Python: what it was given is its fields_set
            if field not in given.model_fields_set:
                out[section] = given.model_copy(update={field: value})
        else:
            out[section] = {field: value, **(given or {})}
    return out


# ---------------------------------------------------------------------------------------
# Building a config from dicts, YAML files and dotted overrides, with actionable errors.

_SECTIONS = {"optim": OptimConfig, "data": DataConfig}


def _allowed_keys(prefix: str) -> list[str]:
    if not prefix:
        from tuneforge.backends import option_owners

        return sorted({*TrainConfig.model_fields, *option_owners()})  # backend options are accepted flat too
    model = _SECTIONS.get(prefix.split(".")[0])
    return sorted(model.model_fields) if model else []


def _foreign_option(key: str, owners: list[str], backend: str) -> str:
    names = " or ".join(repr(name) for name in owners)
    return (
        f"{key} (--{key.replace('_', '-')}) is an option of backend {names}, not of backend {backend!r}; "
        f"add --backend {owners[0]}, or drop it"
    )


def _is_default(key: str, value: Any, owners: list[str]) -> bool:
    from tuneforge.backends import backend_class

    return all(backend_class(name).Options.model_fields[key].default == value for name in owners)


def nest_backend_options(values: dict[str, Any], override: bool = False) -> dict[str, Any]:
    """Flat backend options (`zero_stage: 3`) moved under `backend_options`; a new dict.

    `override`: a flat value wins over a nested one (a later layer: YAML < key=value < flags);
    otherwise the two must agree.
    """
    flat = [key for key in values if key not in TrainConfig.model_fields]
    if not flat:
        return values
    from tuneforge.backends import option_owners

    owners = option_owners()
    flat = [key for key in flat if key in owners]
    if not flat:
        return values  # unknown keys: pydantic names them
    out = dict(values)
    nested = out.get("backend_options")
    nested = nested.model_dump() if isinstance(nested, BaseModel) else dict(nested or {})
    for key in flat:
        value = out.pop(key)
        if not override and key in nested and nested[key] != value:
            raise PydanticCustomError(
                "backend_option",
                f"{key} is given twice with different values ({key}={value!r}, "
                f"backend_options.{key}={nested[key]!r}); keep one",
            )
        nested[key] = value
    out["backend_options"] = nested
    return out


def _field_at(loc: str, backend: str | None):
    """The pydantic FieldInfo of a dotted config key (None when there is none)."""
    from tuneforge.backends import backend_class

    section, _, name = loc.rpartition(".")
    model = {"": TrainConfig, "optim": OptimConfig, "data": DataConfig}.get(section)
    if section == "backend_options" and backend:
        model = backend_class(backend).Options
    return model.model_fields.get(name) if model else None


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e16 else f"{value:g}"


def allowed_range(field) -> str | None:
    """'a finite number > 0 and <= 1000' (or 'a whole number ...'): a numeric field's stated bounds; None for others."""
    kinds = [field.annotation, *typing.get_args(field.annotation)]
    metadata, each = field.metadata, ""
    if typing.get_origin(field.annotation) is tuple:  # (beta1, beta2): the items' own bounds
        item = typing.get_args(field.annotation)[0]
        kinds = [typing.get_args(item)[0]]
        metadata = [m for info in typing.get_args(item)[1:] for m in getattr(info, "metadata", [info])]
        each = "each "
    if any(typing.get_origin(k) is Literal for k in kinds):
        return None  # a number or a word: the field's own message says which
    if int in kinds:
        kind = "a whole number"
    elif float in kinds:
        kind = "a finite number"
    else:
        return None
    symbols = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    bounds = [
        f"{symbol} {_number(getattr(m, name))}"
        for m in metadata
        for name, symbol in symbols.items()
        if getattr(m, name, None) is not None
    ]
    return f"{each}{kind} {' and '.join(bounds)}".strip() + (" (or null)" if type(None) in kinds else "")


def _format_error(err: ValidationError, backend: str | None = None) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not isinstance(p, int))
        if e["type"] == "backend_option":  # already one whole line
            lines.append(e["msg"])
        elif e["type"] == "extra_forbidden":
            parent = loc.rsplit(".", 1)[0] if "." in loc else ""
            lines.append(f"unknown config key '{loc}'; allowed: {', '.join(_allowed_keys(parent))}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            where = f"'{loc}'" if loc else "config"
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            field = _field_at(loc, backend) if loc else None
            allowed = allowed_range(field) if field is not None else None
            lines.append(f"bad value for {where}: {msg}{shown}" + (f"; allowed: {allowed}" if allowed else ""))
    return "; ".join(lines)


def build_config(values: dict[str, Any] | None = None, **kwargs: Any) -> TrainConfig:
    """Validate `values` (+ kwargs) into a TrainConfig, raising one ConfigError line."""
    merged = dict(values or {})
    merged.update(kwargs)
    try:
        return TrainConfig.model_validate(merged)
    except ValidationError as err:
        backend = merged.get("backend", TrainConfig.model_fields["backend"].default)
        raise ConfigError(_format_error(err, backend if isinstance(backend, str) else None)) from None


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
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r}: '{p}' is not a section")
        node[parts[-1]] = _parse_scalar(raw)
    return out


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass a YAML file such as configs/glue-mrpc.yaml")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of keys to values")
    return data


def config_from_sources(yaml_path: str | None, overrides: list[str], flags: dict[str, Any]) -> TrainConfig:
    """YAML file < dotted overrides < explicit CLI flags."""
    values = nest_backend_options(load_yaml(yaml_path)) if yaml_path else {}
    values = nest_backend_options(apply_overrides(values, overrides), override=True)
    for key, value in flags.items():
        if value is None:
            continue
        if "." in key:
            section, name = key.split(".", 1)
            values.setdefault(section, {})[name] = value
        else:
            values[key] = value
    return build_config(values)
