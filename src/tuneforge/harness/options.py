"""What one lm-evaluation-harness run is (`HarnessSettings`): the harness's task names, where a task's data comes
from when not from the hub (`--harness-data TASK=PATH`), and how much of each task to run. The same model is
`tuneforge eval --harness`'s flags and the train config's `harness_after_train` (a string of task names there, or
a mapping of these fields in YAML). Also how a run's metric names a score of the harness after training
(`is_harness_metric`: `harness/...`). pydantic only: the CLI builds its parser from it before anything heavy loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_ROWS = 10**12
MAX_SHOTS = 1000
MAX_BATCH = 4096
MAX_GEN_TOKENS = 2**24
DATA_EXAMPLE = "piqa=../shared/data/piqa"
METRIC_PREFIX = "harness/"  # a run's metric that is a score of the harness after training (after_train.run_metrics)


def is_harness_metric(name: str) -> bool:
    """A run metric that is a score of the harness after training (`harness/TASK/...`)."""
    return name.startswith(METRIC_PREFIX)


def _names(value: Any) -> Any:
    """'piqa, gsm8k' -> ['piqa', 'gsm8k']; a list's items are split the same way."""
    items = value if isinstance(value, (list, tuple)) else [value] if isinstance(value, str) else None
    if items is None or not all(isinstance(v, str) for v in items):
        return value
    return [name.strip() for item in items for name in item.split(",") if name.strip()]


def _data_specs(value: Any) -> Any:
    """['piqa=PATH', ...] (the repeated flag) -> {'piqa': 'PATH'}; a mapping (YAML) as it is."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        return value
    out: dict[str, str] = {}
    for spec in value:
        name, eq, path = str(spec).partition("=")
        if not eq or not name.strip() or not path.strip():
            raise ValueError(f"{spec!r} is not TASK=PATH (e.g. {DATA_EXAMPLE})")
        if name.strip() in out and out[name.strip()] != path.strip():
            raise ValueError(f"{name.strip()!r} is given two paths ({out[name.strip()]!r}, {path.strip()!r}); keep one")
        out[name.strip()] = path.strip()
    return out


@dataclass(frozen=True)
class Spelling:
    """How the user gives a task's local data, the generation length and a 0-shot run, for the ways out that
    errors name: eval's flags, or a train run's --harness-after-train and harness_after_train keys."""

    data: str = "--harness-data {name}=PATH"
    max_gen_toks: str = "--harness-max-gen-toks N"
    zero_shot: str = "--harness-fewshot 0"


EVAL_SPELLING = Spelling()
TRAIN_SPELLING = Spelling(
    "--harness-after-train {name}=PATH", "harness_after_train.max_gen_toks=N", "harness_after_train.fewshot=0"
)


class HarnessSettings(BaseModel):
    """One harness run: tasks, local data, rows per task, few-shot examples, batch size, generation length."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    tasks: list[str] = Field(
        description="run lm-evaluation-harness on these of its tasks (comma-separated harness task names, e.g. "
        "piqa,hellaswag,arc_easy,gsm8k; NAME=PATH reads that task's data from local files, as --harness-data) "
        "instead of evaluating a config's task",
        json_schema_extra={"flag": "--harness", "flag_kwargs": {"action": "store", "metavar": "TASKS"}},
    )
    data: dict[str, str] | None = Field(
        None,
        description=f"read a task's data from local files instead of the hub: TASK=PATH ({DATA_EXAMPLE}; a "
        "folder of train/validation/test .jsonl/.json/.csv/.tsv/.parquet files, with SPLIT-labels.lst beside as "
        "PIQA ships them, a datasets.save_to_disk folder, or one file: the evaluated split); repeat for several",
        json_schema_extra={"flag": "--harness-data", "flag_kwargs": {"action": "append", "metavar": "TASK=PATH"}},
    )
    limit: int | None = Field(
        None,
        ge=1,
        le=MAX_ROWS,
        description="score the first N rows of each task",
        json_schema_extra={"flag": "--harness-limit", "flag_kwargs": {"metavar": "N"}},
    )
    fewshot: int | None = Field(
        None,
        ge=0,
        le=MAX_SHOTS,
        description="few-shot examples in each prompt (default: each task's own, e.g. 5 for gsm8k)",
        json_schema_extra={"flag": "--harness-fewshot", "flag_kwargs": {"metavar": "N"}},
    )
    batch_size: int = Field(
        8,
        ge=1,
        le=MAX_BATCH,
        description="requests in one forward pass",
        json_schema_extra={"flag": "--harness-batch-size", "flag_kwargs": {"metavar": "N"}},
    )
    max_gen_toks: int | None = Field(
        None,
        ge=1,
        le=MAX_GEN_TOKENS,
        description="most tokens a generation task (gsm8k) generates per row (default: the harness's, 256)",
        json_schema_extra={"flag": "--harness-max-gen-toks", "flag_kwargs": {"metavar": "N"}},
    )

    @model_validator(mode="before")
    @classmethod
    def _tasks_with_data(cls, values: Any) -> Any:
        # `harness_after_train: piqa,gsm8k` (a flag or YAML string): the tasks, every other setting its default; a
        # task given as NAME=PATH (`--harness piqa=../shared/data/piqa`) has its local data said with it
        values = {"tasks": values} if isinstance(values, (str, list)) else values
        unknown = sorted(set(values) - set(cls.model_fields)) if isinstance(values, dict) else []
        if unknown:  # said here, with the keys there are (the config's own line for a key of a section has none)
            raise ValueError(f"unknown key {', '.join(map(repr, unknown))}; allowed: {', '.join(cls.model_fields)}")
        if not isinstance(values, dict) or not isinstance(names := _names(values.get("tasks")), list):
            return values
        inline = [n for n in names if "=" in n]
        if not inline:
            return {**values, "tasks": names}
        given = values.get("data") or []
        if isinstance(given, dict):
            given = [f"{k}={v}" for k, v in given.items()]
        data = (
            _data_specs([*([given] if isinstance(given, str) else given), *inline])
            if isinstance(given, (str, list))
            else given
        )
        return {**values, "tasks": [n.partition("=")[0].strip() for n in names], "data": data}

    @field_validator("data", mode="before")
    @classmethod
    def _split_specs(cls, value: Any) -> Any:
        return _data_specs(value)

    @model_validator(mode="after")
    def _consistent(self) -> HarnessSettings:
        if not self.tasks:
            raise ValueError("--harness needs at least one harness task name (e.g. --harness piqa,gsm8k)")
        doubled = sorted({t for t in self.tasks if self.tasks.count(t) > 1})
        if doubled:
            raise ValueError(f"--harness names {', '.join(doubled)} twice; name each task once")
        stray = [name for name in self.data or {} if name not in self.tasks]
        if stray:
            raise ValueError(
                f"--harness-data names {', '.join(map(repr, stray))}, which --harness does not run "
                f"({', '.join(self.tasks)}); add it to --harness or drop its --harness-data"
            )
        return self

    def summary(self) -> str:
        """'piqa, gsm8k (limit 20, 0-shot)': what a run's headline shows."""
        how = [f"limit {self.limit}"] if self.limit else []
        how += [f"{self.fewshot}-shot"] if self.fewshot is not None else []
        return ", ".join(self.tasks) + (f" ({', '.join(how)})" if how else "")
