"""The bases of every options model: a task's, a backend's and a command's own settings.

Each is a pydantic model whose fields are config keys and CLI flags (the field's description is the flag's
help, a Literal its choices). They refuse unknown keys, inf and nan; give each number its bounds. This
module imports pydantic only, so the config at the ground floor can name these bases without knowing
any task or backend.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

PATH: dict[str, Any] = {"path": True}  # json_schema_extra of a field naming a file or folder (besides the INPUT ones)


def home_expanded(field, value: Any) -> Any:
    """`value` of a field marked PATH or INPUT with a leading `~` (each item's, of a list) as the home folder, as the
    shell reads it, also where no shell did (a YAML file, `--input=~/x.csv`); any other value as it is."""
    extra = field.json_schema_extra
    if not (isinstance(extra, dict) and (extra.get("input") or extra.get("path"))):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(home_expanded(field, item) for item in value)
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


class Options(BaseModel):
    """Settings validated once at the edge: unknown keys, inf and nan refused; a number where text is wanted is
    that text (`run_name=2024`: YAML, and so an override, reads 2024 as a number; the flag gives text). A path
    field's leading `~` is the home folder, as the shell reads it, also where no shell did (a YAML file,
    `--output-dir=~/runs`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, coerce_numbers_to_str=True)

    @field_validator("*", mode="before")
    @classmethod
    def _home(cls, value: Any, info: ValidationInfo) -> Any:
        return home_expanded(cls.model_fields[info.field_name], value)


class TaskOptions(Options):
    """A task's own settings. Subclass it as `Options` in the task class: each field becomes a config key
    under `task_options` (also accepted flat, and under `data` where config files of 0.x wrote it) and a
    CLI flag that `train` and `eval` take. A task family shares its parent's options by subclassing them."""

    # the task's own defaults for run keys ("epochs", "optim.lr"): applied where the user (YAML, flags,
    # Python) did not set the key, so the saved config.yaml records what ran
    run_defaults: ClassVar[dict[str, Any]] = {}
    # flags to name when a step's loss or gradients are not finite (besides the learning rate)
    nonfinite_suspects: ClassVar[tuple[str, ...]] = ()

    def idle_options(self) -> dict[str, str]:
        """{option: why these settings never read it, and what would make them}: the options a task reads only with
        another option's value (grpo's --format-pattern needs --reward format). One typed on the command line is
        refused (configure.check_options_given); a config file's is not. None by default."""
        return {}


class BackendOptions(Options):
    """A backend's own settings. Subclass it as `Options` in the backend class: each field becomes a
    config key under `backend_options` (also accepted flat) and a CLI flag."""


def comma_list(value):
    """A list option's raw value as a flat list: a comma-separated string, a number, or a list of either (a
    repeated flag, each maybe comma-separated). For a `mode="before"` field validator."""
    if value is None:
        return None
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for item in items:
        out += [part.strip() for part in item.split(",") if part.strip()] if isinstance(item, str) else [item]
    return out


def one_or_list(value):
    """A list option given one item bare (`text_columns=review`, YAML `reward: accuracy`) as the list its repeatable
    flag makes of it; not split at commas, which a column name or a file path may hold. For a `mode="before"`
    field validator."""
    return [value] if isinstance(value, str) else value
