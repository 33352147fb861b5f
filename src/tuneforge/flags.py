"""Command-line flags from pydantic models: each command's options are one model, its flags are generated from
the model's fields (`model_flags`, `add_model_flags`), and its parsed flags become a validated instance in one step
(`parse_options`), where a bad value is one `ConfigError` line naming the flag. pydantic and argparse only (no
torch): the CLI builds a command's parser from this before anything heavy is imported.

A field's flag is `--NAME` (underscores as dashes); its description is the help (the default appended), a Literal
gives the choices, int or float the type, a list a repeatable flag, a bool a switch (`--NAME`; also `--no-NAME` when
it defaults to true), a required field a required flag. A field's `json_schema_extra` may rename its flag
({"flag": "--text-column"}), drop it ({"flag": None}), make it a positional argument (POSITIONAL), add argparse
settings ({"flag_kwargs": {...}}) or word the refusal of a bad value ({"refusal": ...}, see `refusal_line`). A field
marked PATH (options.py: a file or folder) takes a leading `~` as the home folder: `parse_options`, which every
command's options pass through, reads it so, as the config reads its path keys.

It imports nothing of tuneforge but errors.py and options.py (the ground floor): `allowed_range`, the text of a
field's bounds, is the one every refusal states, config.py's included.
"""

from __future__ import annotations

import argparse
import math
import reprlib
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from tuneforge.errors import ConfigError
from tuneforge.options import home_expanded

POSITIONAL: dict[str, Any] = {"positional": True}  # json_schema_extra of a positional argument (MODEL_DIR)
MAX_INPUT_LENGTH = 1 << 20  # --max-length's bound where a command reads a trained model (predict, generate, serve)


def input_max_length_field(description: str):
    """The --max-length of a command that runs a trained model: inputs cut to it, its default the training's."""
    return Field(
        None,
        ge=1,
        le=MAX_INPUT_LENGTH,
        description=description,
        json_schema_extra={"refusal": "{flag} must be between {ge} and {le}, got {value}"},
    )


BOUNDS = ("ge", "gt", "le", "lt")

FlagTable = dict[str, tuple[str, dict[str, Any]]]  # flag -> (options key, argparse kwargs)


def _extra(field) -> dict[str, Any]:
    return field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}


def _type_kwargs(kind, field, key: str) -> dict[str, Any]:
    """argparse settings for a field's type (`kind`: its annotation without None)."""
    if kind is bool:  # on by default: --NAME and --no-NAME (a task may turn the default off: run_defaults)
        return (
            {"action": argparse.BooleanOptionalAction}
            if field.default is True
            else {"action": "store_const", "const": True}
        )
    if typing.get_origin(kind) is Literal:
        return {"choices": list(typing.get_args(kind))}
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        if typing.get_origin(item) is Literal:
            return {"nargs": "+", "choices": list(typing.get_args(item))}
        return {"action": "append"}
    if kind in (int, float):
        return {"type": kind}
    if kind is not str and "flag_kwargs" not in _extra(field):  # e.g. int | Literal["auto"]: pydantic reads it
        raise TypeError(f"config field {key!r} ({field.annotation}) needs json_schema_extra flag settings")
    return {}


def field_flag(name: str, field, key: str) -> tuple[str, tuple[str, dict[str, Any]]] | None:
    """(flag, (key, argparse kwargs)) of one field; None for a field without a flag. A positional argument's
    flag is its name."""
    extra = _extra(field)
    positional = bool(extra.get("positional"))
    flag = name if positional else extra.get("flag", "--" + name.replace("_", "-"))
    if flag is None:
        return None
    kind = field.annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kinds = [k for k in typing.get_args(kind) if k is not type(None)]
        kind = kinds[0] if len(kinds) == 1 else kind
    help_text = field.description or ""
    if kind is bool and field.default is True:
        whose = ", or the task's" if "." in key else ""  # a run's task_options.* and data.*: a task may turn it off
        help_text = f"{help_text} (default: on{whose}; --no-{flag.removeprefix('--')} turns it off)"
    kwargs = _type_kwargs(kind, field, key)
    if "choices" not in kwargs and kind is not bool and not positional:
        kwargs["metavar"] = name.upper()
    if field.is_required() and not positional:
        kwargs["required"] = True
    kwargs.update(extra.get("flag_kwargs", {}))
    shown = None if field.is_required() else field.get_default(call_default_factory=True)  # a factory's: its value
    shown = " ".join(map(str, shown)) if isinstance(shown, list) else shown  # (an empty list: "", not shown)
    if kind is not bool and shown not in (None, "") and "default:" not in help_text:  # one the description states
        help_text = f"{help_text} (default: {shown})" if help_text else f"default: {shown}"
    kwargs["help"] = help_text.replace("%", "%%")
    return flag, (key, kwargs)


def model_flags(model: type[BaseModel], prefix: str = "", skip: tuple[str, ...] = ()) -> FlagTable:
    """Every flag of `model`'s fields (but those in `skip`): flag -> (prefix + field name, argparse kwargs)."""
    out = {}
    for name, field in model.model_fields.items():
        if name not in skip:
            made = field_flag(name, field, prefix + name)
            if made:
                out[made[0]] = made[1]
    return out


def add_model_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    prefix: str = "",
    skip: tuple[str, ...] = (),
) -> None:
    """Add `model`'s flags to a parser (or an argument group). A flag left out is None in the namespace, so that
    `parse_options` takes the field's default: each default is written once, in the model."""
    for flag, (key, kwargs) in model_flags(model, prefix, skip).items():
        if flag.startswith("-"):
            parser.add_argument(flag, dest=key, default=None, **kwargs)
        else:
            parser.add_argument(flag, **kwargs)


def field_bounds(field) -> dict[str, Any]:
    """A numeric field's stated bounds: {"ge": 1, "le": 65536}."""
    return {name: getattr(m, name) for m in field.metadata for name in BOUNDS if getattr(m, name, None) is not None}


def _wording(field, value: Any) -> str | None:
    """The field's own refusal text for `value`: {"refusal": TEXT}, or {"refusal": {"low": TEXT, "high": TEXT,
    "non_finite": TEXT}} by the side of the bounds `value` is on (nan counts as low)."""
    wording = _extra(field).get("refusal")
    if wording is None or isinstance(wording, str):
        return wording
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) and "non_finite" in wording:
        return wording["non_finite"]
    bounds = field_bounds(field)
    below = value != value or ("ge" in bounds and value < bounds["ge"]) or ("gt" in bounds and value <= bounds["gt"])
    return wording.get("low" if below else "high")


def shown_value(value: Any, limit: int = 120) -> str:
    """`value`'s repr for a refusal, cut to `limit` characters: a data file given as a config holds megabytes, and
    YAML aliases make a list of 10**9 items from a few lines, so only its first items and levels are written."""
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxtuple, short.maxdict, short.maxset = 4, 6, 6, 6, 6
    short.maxstring = short.maxother = limit
    text = short.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


def refusal_line(model: type[BaseModel], error: Mapping[str, Any]) -> str:
    """One pydantic error of `model` as a line naming the flag: the field's own wording (formatted with {flag},
    {value} and its bounds {ge} {gt} {le} {lt}), else "bad value for --FLAG: ... (got V); allowed: RANGE". An
    error of the whole model (a check across fields) is its own message."""
    message = str(error["msg"]).removeprefix("Value error, ")
    if not error["loc"]:
        return message
    name = str(error["loc"][0])
    field = model.model_fields.get(name)
    if field is None:  # a key the model does not have (from a dict)
        return f"unknown option {name!r}; allowed: {', '.join(model.model_fields)}"
    made = field_flag(name, field, name)
    flag = made[0] if made else name
    if error["type"] == "missing":
        return f"{flag} is required"
    value = error.get("input")
    wording = _wording(field, value)
    if wording:
        return wording.format(flag=flag, value=value, **field_bounds(field))
    allowed = allowed_range(field)
    return f"bad value for {flag}: {message} (got {shown_value(value)})" + (f"; allowed: {allowed}" if allowed else "")


def parse_options(model: type[BaseModel], values: argparse.Namespace | Mapping[str, Any]):
    """An instance of `model` from parsed flags (or a dict, where a key the model lacks is refused): those left
    out (None) take the field's default; a PATH field's leading `~` is the home folder. A bad value raises one
    ConfigError line naming its flag."""
    if isinstance(values, argparse.Namespace):  # it holds the CLI's own entries too (command, func)
        values = {k: v for k, v in vars(values).items() if k in model.model_fields}
    fields = {k: home_expanded(model.model_fields[k], v) if k in model.model_fields else v for k, v in values.items()}
    fields = {k: v for k, v in fields.items() if v is not None}
    try:
        return model.model_validate(fields)
    except ValidationError as err:
        raise ConfigError("; ".join(refusal_line(model, e) for e in err.errors())) from None
