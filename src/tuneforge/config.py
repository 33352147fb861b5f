"""Typed run configuration, validated once at the edge.

A run is described by one `TrainConfig` (flat training/launch fields plus the `optim` and
`data` sections). It can be built in Python, read from YAML, and overridden with dotted
`key=value` pairs (`optim.lr=3e-5`). Every problem is reported as one `ConfigError` line that
names the key and what is allowed, before any work starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tuneforge.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class OptimConfig(_Section):
    lr: float = Field(5e-5, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    warmup_steps: int = Field(0, ge=0)
    warmup_ratio: float = Field(0.06, ge=0, lt=1)
    max_grad_norm: float | None = Field(1.0, description="clip gradients to this norm; null disables")
    fused: bool | None = Field(None, description="fused AdamW; null = where available")


class DataConfig(_Section):
    # sources
    data_dir: str | None = None
    train_file: str | None = None
    validation_file: str | None = None
    text_columns: list[str] | None = None
    label_column: str | None = None
    # seq2seq parallel text / columns
    source_file: str | None = None
    target_file: str | None = None
    validation_source_file: str | None = None
    validation_target_file: str | None = None
    source_column: str | None = None
    target_column: str | None = None
    source_prefix: str = ""
    # tokenization
    max_length: int | None = Field(128, gt=0)
    max_target_length: int = Field(128, gt=0)
    block_size: int | None = Field(None, gt=0)
    packing: bool = True
    # sampling
    max_train_samples: int | None = Field(
        None,
        gt=0,
        description="train on the first N training examples the model sees: rows for classification and "
        "seq2seq, packed blocks for clm (one non-blank text each with --no-packing); the label set still comes "
        "from the whole training split",
    )
    max_eval_samples: int | None = Field(None, gt=0)
    group_by_length: bool = True
    cache_dir: str | None = None
    split_seed: int = 42


class TrainConfig(_Section):
    task: str = "bbc-news"
    model: str | None = Field(None, description="HF folder or hub id; default: the task's bundled model")
    output_dir: str = "runs/latest"
    overwrite: bool = False

    # schedule
    epochs: float = Field(3, gt=0)
    max_steps: int | None = Field(None, gt=0)
    batch_size: int = Field(16, gt=0, description="per process")
    eval_batch_size: int | None = Field(None, gt=0)
    grad_accum: int = Field(1, gt=0)
    seed: int = 42
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    gradient_checkpointing: bool = False
    # 0: on CPU dropout's random masks cost ~1/4 of a training step, and short fine-tuning runs did
    # as well or better without it (MRPC, seeds 1-3: benchmarks/README.md)
    dropout: float | None = Field(
        0.0,
        ge=0,
        lt=1,
        description="every dropout probability in the model's config (hidden, attention, "
        "classifier) set to this while training; null keeps the model's own",
    )
    attn_implementation: str = Field(
        "auto",
        description="attention kernel for training and evaluation: auto (eager under bf16 on CPU when batches "
        "are padded, where it is faster; else the model's default, SDPA for most; packed causal-LM blocks are not "
        "padded) or a transformers name: eager, sdpa, flash_attention_2, ...",
    )

    # evaluation, logging, best model
    eval_strategy: Literal["epoch", "steps", "no"] = "epoch"
    eval_steps: int | None = Field(None, gt=0)
    logging_steps: int = Field(20, gt=0)
    metric_for_best: str | None = None
    early_stopping_patience: int | None = Field(None, gt=0)
    load_best_model_at_end: bool = False
    num_beams: int = Field(1, gt=0)
    generation_max_length: int = Field(128, gt=0)

    # checkpoints
    save_strategy: Literal["epoch", "steps", "no"] = "no"
    save_steps: int | None = Field(None, gt=0)
    save_total_limit: int | None = Field(None, gt=0)
    resume: str | None = Field(None, description="'latest' or a checkpoint path")

    # backend and launch
    backend: str = "single"
    nproc: int = Field(1, gt=0)
    nnodes: int = Field(1, gt=0)
    node_rank: int = Field(0, ge=0)
    master_addr: str = "127.0.0.1"
    master_port: int | None = Field(None, gt=0, lt=65536)
    rdzv_endpoint: str | None = None
    hostfile: str | None = None
    max_restarts: int = Field(0, ge=0)
    zero_stage: int = Field(2, ge=0, le=3)
    offload: Literal["none", "optimizer", "params", "both"] = "none"
    deepspeed_config: str | None = None
    tp_size: int | None = Field(None, gt=0)

    # output
    quiet: bool = False
    report_to: list[Literal["jsonl", "tensorboard"]] = ["jsonl"]

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

    @field_validator("eval_strategy", "save_strategy", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        return "no" if value is False else value  # YAML reads a bare `no` as false

    @model_validator(mode="before")
    @classmethod
    def _save_steps_means_steps(cls, values: Any) -> Any:
        # `--save-steps N` alone must save every N steps, not be silently ignored
        if isinstance(values, dict) and values.get("save_steps") and "save_strategy" not in values:
            values = {**values, "save_strategy": "steps"}
        return values

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.eval_strategy == "steps" and self.eval_steps is None:
            raise ValueError("eval_strategy=steps needs eval_steps (e.g. eval_steps=200)")
        if self.save_strategy == "steps" and self.save_steps is None:
            raise ValueError("save_strategy=steps needs save_steps (e.g. save_steps=500)")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        if self.early_stopping_patience and self.eval_strategy == "no":
            raise ValueError("early_stopping_patience needs evaluation: set eval_strategy to epoch or steps")
        return self

    # ---- helpers -----------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


# ---------------------------------------------------------------------------------------
# Building a config from dicts, YAML files and dotted overrides, with actionable errors.

_SECTIONS = {"optim": OptimConfig, "data": DataConfig}


def _allowed_keys(prefix: str) -> list[str]:
    model = TrainConfig if not prefix else _SECTIONS.get(prefix.split(".")[0])
    return sorted(model.model_fields) if model else []


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not isinstance(p, int))
        if e["type"] == "extra_forbidden":
            parent = loc.rsplit(".", 1)[0] if "." in loc else ""
            lines.append(f"unknown config key '{loc}'; allowed: {', '.join(_allowed_keys(parent))}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            where = f"'{loc}'" if loc else "config"
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"bad value for {where}: {msg}{shown}")
    return "; ".join(lines)


def build_config(values: dict[str, Any] | None = None, **kwargs: Any) -> TrainConfig:
    """Validate `values` (+ kwargs) into a TrainConfig, raising one ConfigError line."""
    merged = dict(values or {})
    merged.update(kwargs)
    try:
        return TrainConfig.model_validate(merged)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


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
        raise ConfigError(f"config file {str(p)!r} does not exist; pass a YAML file such as configs/mrpc.yaml")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of keys to values")
    return data


def config_from_sources(yaml_path: str | None, overrides: list[str], flags: dict[str, Any]) -> TrainConfig:
    """YAML file < dotted overrides < explicit CLI flags."""
    values = load_yaml(yaml_path) if yaml_path else {}
    values = apply_overrides(values, overrides)
    for key, value in flags.items():
        if value is None:
            continue
        if "." in key:
            section, name = key.split(".", 1)
            values.setdefault(section, {})[name] = value
        else:
            values[key] = value
    return build_config(values)


def env_flag(name: str) -> str | None:
    """The one sanctioned place (with launch.py) that reads the environment."""
    return os.environ.get(name)
