"""The search space of a sweep: a YAML file mapping config keys to distributions, validated once at the edge.

    optim.lr: {type: float, low: 1.0e-5, high: 1.0e-3, log: true}
    lora_r: {type: int, low: 4, high: 32, step: 4}
    warmup_ratio: {type: float, low: 0.0, high: 0.2}
    batch_size: [8, 16, 32]                 # a list: one of these (or {type: categorical, choices: [...]})

A key is one that `tuneforge train` takes as key=value (`optim.lr`, `epochs`, a task's or backend's option such as
`doc_stride`). `load_space` checks the file's shape and each range (low below high, a log range above 0, every number
finite, choices given and distinct); `check_against_config` then puts each range's ends and each choice into the base
config, as a trial will, and refuses a key that is not a config key, that does not reach the run's config (another
task's option), a LoRA key of trials without adapters, or a value the config refuses. Each problem is one ConfigError
line naming the key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, ValidationError
from pydantic import model_validator as model_check

from tuneforge.config import check_lora_given
from tuneforge.errors import ConfigError
from tuneforge.yaml_files import read_yaml

KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
SET_BY_SWEEP = ("output_dir", "overwrite", "resume")  # each trial's own: the sweep sets them


def _number(value: Any) -> Any:
    """A bound is a number (YAML reads 1e-5, without a dot, as text: taken as the number it spells); never a bool."""
    if isinstance(value, bool):
        raise ValueError("needs a number, not true/false")
    return value


Number = Annotated[float, BeforeValidator(_number)]
Choice = Union[StrictBool, StrictInt, float, str, None]
_NONE = object()  # no earlier choice equal to this one (None is a choice)


class _Distribution(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class FloatRange(_Distribution):
    """A float between low and high (on a log scale with log: true; on a grid of `step` without)."""

    type: Literal["float"]
    low: Number
    high: Number
    log: bool = False
    step: Number | None = Field(None, gt=0)

    @model_check(mode="after")
    def _range(self):
        _check_range(self.low, self.high, self.log, self.step)
        return self

    def samples(self) -> list[Any]:
        return [self.low, self.high]


class IntRange(_Distribution):
    """A whole number between low and high, both included (every `step`; on a log scale with log: true)."""

    type: Literal["int"]
    low: StrictInt
    high: StrictInt
    step: StrictInt = Field(1, ge=1)
    log: bool = False

    @model_check(mode="after")
    def _range(self):
        _check_range(self.low, self.high, self.log, None if self.step == 1 else self.step)
        return self

    def samples(self) -> list[Any]:
        return [self.low, self.high]


class Choices(_Distribution):
    """One of the listed values."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=True)  # inf, nan: refused below, one line

    type: Literal["categorical"]
    choices: list[Choice] = Field(min_length=1)

    @model_check(mode="after")
    def _distinct(self):
        if any(isinstance(c, float) and not math.isfinite(c) for c in self.choices):
            raise ValueError("choices must be finite numbers (no inf or nan)")
        # equal choices (1 and 1.0, true and 1) are one to Optuna: it stores the first of them for either
        problems = []
        for i, choice in enumerate(self.choices):
            first = next((c for c in self.choices[:i] if c == choice), _NONE)
            if first is not _NONE:
                same = repr(first) == repr(choice)
                problems.append(
                    f"{choice!r} is listed more than once" if same else f"{choice!r} is the same choice as {first!r}"
                )
        if problems:
            raise ValueError("; ".join(dict.fromkeys(problems)))
        return self

    def samples(self) -> list[Any]:
        return list(self.choices)


Distribution = Annotated[Union[FloatRange, IntRange, Choices], Field(discriminator="type")]


def _check_range(low: float, high: float, log: bool, step: float | None) -> None:
    if not low < high:
        raise ValueError(f"low ({low:g}) must be below high ({high:g})")
    if log and low <= 0:
        raise ValueError(f"a log range needs low above 0 (got {low:g})")
    if log and step is not None:
        raise ValueError("log and step do not combine: pass one of them")
    if step is not None:
        count = (high - low) / step
        if abs(count - round(count)) > 1e-9 * max(1.0, abs(count)):
            raise ValueError(f"high - low ({high - low:g}) must be a multiple of step ({step:g})")


class Space(BaseModel):
    """config key -> its distribution, in the file's order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    params: dict[str, Distribution] = Field(min_length=1)

    @model_check(mode="before")
    @classmethod
    def _shorthands(cls, values: Any) -> Any:
        """A list is categorical; a mapping with choices but no type too."""
        params = values.get("params") if isinstance(values, dict) else None
        if not isinstance(params, dict):
            return values
        out = {}
        for key, dist in params.items():
            if isinstance(dist, list):
                dist = {"type": "categorical", "choices": dist}
            elif isinstance(dist, dict) and "type" not in dist and "choices" in dist:
                dist = {"type": "categorical", **dist}
            out[key] = dist
        return {**values, "params": out}

    @model_check(mode="after")
    def _keys(self):
        for key in self.params:
            if not KEY.fullmatch(key):
                raise ValueError(f"{key!r} is not a config key (dotted names such as optim.lr or epochs)")
            if key in SET_BY_SWEEP:
                raise ValueError(f"{key!r} is set by the sweep for each trial; it cannot be searched")
        return self

    def to_record(self) -> dict[str, Any]:
        """The space as plain data (the sweep's record: a resumed sweep must search the same one)."""
        return {key: dist.model_dump(exclude_defaults=False) for key, dist in self.params.items()}


def _error_line(error: dict) -> str:
    """One pydantic error of a Space as `key 'K': what` (the distribution's field named where there is one)."""
    loc = [str(p) for p in error["loc"]]
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "union_tag_not_found" or error["type"] == "union_tag_invalid":
        message = "needs a type: float, int or categorical (or a list of choices)"
    if len(loc) < 2:
        return message if loc[:1] != ["params"] else f"{message} (a mapping of config keys to distributions)"
    key, field = loc[1], loc[3:]
    got = error.get("input")
    if field[:1] == ["choices"] and len(field) > 1:
        return f"key {key!r}: each choice is a number, text, true/false or null (got {got!r})"
    if len(loc) == 2 and error["type"] == "model_attributes_type":
        return f"key {key!r}: needs a distribution, {{type: float, low: L, high: H}} or a list of choices (got {got!r})"
    shown = f" (got {got!r})" if field and not isinstance(got, (dict, list)) else ""
    where = f"{'.'.join(field)}: " if field else ""
    if error["type"] == "extra_forbidden":
        return f"key {key!r}: {where}unknown field; a distribution has type, low, high, step, log or choices"
    return f"key {key!r}: {where}{message}{shown}"


def load_space(path: str) -> Space:
    """The validated space of a YAML file, or one ConfigError line naming each problem."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"space file {path!r} does not exist; pass a YAML file of config keys and distributions")
    raw = read_yaml(file, "space file")
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(
            f"space file {path!r} must map config keys to distributions (e.g. optim.lr: {{type: float, low: 1.0e-5, "
            "high: 1.0e-3, log: true}})"
        )
    try:
        return Space.model_validate({"params": {str(k): v for k, v in raw.items()}})
    except ValidationError as err:
        lines = [_error_line(e) for e in err.errors()]
        raise ConfigError(f"space file {path!r}: " + "; ".join(dict.fromkeys(lines))) from None


# ---- the space against the run's config ------------------------------------------------------------------------
def value_at(config: BaseModel, key: str) -> tuple[bool, Any]:
    """(found, value) of a dotted config key in a built config: a section's field (`optim.lr`), a top-level field,
    or an option of the run's task or backend given flat (`doc_stride`, `data.doc_stride` as 0.x configs wrote)."""
    parts = key.split(".")
    paths = [parts]
    if len(parts) == 1 or (len(parts) == 2 and parts[0] == "data"):
        paths += [["task_options", parts[-1]], ["backend_options", parts[-1]]]
    for path in paths:
        node: Any = config
        for part in path:
            if not (isinstance(node, BaseModel) and part in type(node).model_fields):
                break
            node = getattr(node, part)
        else:
            return True, node
    return False, None


def _same(landed: Any, given: Any) -> bool:
    if isinstance(landed, BaseModel):
        return False
    if isinstance(landed, (int, float)) and isinstance(given, (int, float)) and not isinstance(given, bool):
        return not isinstance(landed, bool) and float(landed) == float(given)
    return landed == given


def check_against_config(space: Space, build: Callable[[dict[str, Any]], BaseModel], where: str) -> None:
    """Put each range's ends and each choice into the base config (`build(params)`: the config a trial with these
    values gets) and check that it is accepted and lands on that key. `where`: the space file, for the lines."""
    for key, dist in space.params.items():
        for value in dist.samples():
            try:
                config = build({key: value})
                if "adapter" not in space.params:  # a trial without adapters ignores its LoRA settings
                    check_lora_given(config.adapter, {}, {key: value})
            except ConfigError as err:
                raise ConfigError(f"space file {where!r}: key {key!r} = {value!r}: {err}") from None
            found, landed = value_at(config, key)
            if not found:
                raise ConfigError(
                    f"space file {where!r}: key {key!r} is not an option of this run (task {config.task!r}, "
                    f"backend {config.backend!r}); it would change nothing"
                )
            if isinstance(landed, BaseModel):
                raise ConfigError(
                    f"space file {where!r}: key {key!r} is a section of the config; name one of its keys "
                    f"({', '.join(f'{key}.{k}' for k in list(type(landed).model_fields)[:4])}, ...)"
                )
            if not _same(landed, value):
                raise ConfigError(
                    f"space file {where!r}: key {key!r} = {value!r} does not reach the run's config (it trains with "
                    f"{landed!r}); check that the key is this run's"
                )


def distributions(space: Space) -> dict[str, Any]:
    """The space as Optuna distributions (optuna imported here, by the sweep that has checked it is installed)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, Any] = {}
    for key, dist in space.params.items():
        if isinstance(dist, FloatRange):
            out[key] = FloatDistribution(dist.low, dist.high, log=dist.log, step=dist.step)
        elif isinstance(dist, IntRange):
            out[key] = IntDistribution(dist.low, dist.high, log=dist.log, step=dist.step)
        else:
            out[key] = CategoricalDistribution(dist.choices)
    return out
