"""A run's config resolved: which task and backend it has, their options in place, the task's defaults filled in.

`build_config(values)` is the edge where a run's raw values (a dict from Python, YAML, overrides and flags)
become a `TrainConfig`: the common keys are validated by config.py, then the task (given, or the one the
data files say) and the backend are looked up in their registries, every options key is moved to the
options of the task or backend that owns it (flat, under `data:` as 0.x config files wrote it, or under
`task_options:`/`backend_options:`) and validated there, and the task's own defaults fill the keys the user
left unset. Every problem is one `ConfigError` line naming the key; a key of another task or backend names
its owner.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from tuneforge.backends import DEFAULT_BACKEND, backend_class, option_owners
from tuneforge.config import (
    DataConfig,
    TrainConfig,
    format_error,
    load_yaml,
    meant_key,
    merge_sources,
    validate_config,
)
from tuneforge.errors import ConfigError
from tuneforge.tasks import DEFAULT_TASK, infer_task, task_class, task_option_owners

SECTIONS = ("task_options", "backend_options")


def build_config(values: Mapping[str, Any] | None = None, **kwargs: Any) -> TrainConfig:
    """Validate and resolve `values` (+ kwargs) into a TrainConfig, raising one ConfigError line."""
    given = validate_config({**(values or {}), **kwargs})
    named = {key.rpartition(".")[2]: value for key, value in given.pending_options.items()}
    first_source = given.data.sources[0].path if given.data.sources else None
    data_file = given.data.train_file or first_source or given.data.validation_file  # eval's: the validation file
    task = given.task or infer_task(data_file, named) or DEFAULT_TASK
    backend = given.backend or DEFAULT_BACKEND
    models = {"task_options": task_class(task).Options, "backend_options": backend_class(backend).Options}
    owners = {"task_options": ("task", task), "backend_options": ("backend", backend)}
    sorted_options = _sort_options(given, models, owners)
    resolved = {**given.model_dump(exclude_unset=True), "task": task, "backend": backend}
    resolved.update(_run_defaults(given, models["task_options"].run_defaults))
    for section, model in models.items():
        try:
            resolved[section] = model.model_validate(sorted_options[section])
        except ValidationError as err:
            raise ConfigError(format_error(err, models, prefix=f"{section}.")) from None
    config = validate_config(resolved)
    _check_capabilities(config, backend_class(backend))
    _check_source_options(config, models)
    return config


def source_options(config: TrainConfig, source) -> Any:
    """The task options a mixture's `source` is read with: the run's, with the source's `options` on top."""
    given = {**config.task_options.model_dump(exclude_unset=True), **source.options}
    return type(config.task_options).model_validate(given)


def _check_source_options(config: TrainConfig, models: dict) -> None:
    for source in config.data.sources:
        try:
            source_options(config, source)
        except ValidationError as err:
            why = format_error(err, models, prefix="task_options.")
            raise ConfigError(f"data source {source.name!r}: {why} (in its options)") from None


def resolve(config: TrainConfig, **update: Any) -> TrainConfig:
    """`config` (with `update` on top) built again from what it was given: a config built directly as
    `TrainConfig(...)` gets its task, backend, options and the task's defaults; a resolved one stays equal."""
    if update and config.pending_options:  # its own keys placed first, so that a new backend or task drops them
        config = build_config(config.given_values())
    return build_config(config.given_values(update))


def config_from_sources(yaml_path: str | None, overrides: list[str], flags: dict[str, Any]) -> TrainConfig:
    """YAML file < dotted overrides < explicit CLI flags, resolved."""
    return build_config(merge_sources(yaml_path, overrides, flags))


def load_config_file(path) -> TrainConfig:
    """A saved config.yaml (of this version or an earlier one), resolved."""
    return build_config(load_yaml(path))


# ---- options to their owners ------------------------------------------------------------------------------
def _sort_options(given: TrainConfig, models: dict, owners: dict) -> dict[str, dict[str, Any]]:
    """{section: {option: value}}: the options of the run's task and backend, from the instances given and
    the pending keys; a key of another task or backend (not at its default) or of none is refused."""
    out: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        instance = getattr(given, section)
        out[section] = instance.model_dump(exclude_unset=True) if type(instance) is models[section] else {}
    where: dict[str, str] = {}  # option -> the key it came from (to report a clash)
    for key, value in given.pending_options.items():
        name = key.rpartition(".")[2]
        section = next((s for s in SECTIONS if name in models[s].model_fields), None)
        if section is None:
            _refuse_foreign(key, name, value, models, owners)
            continue
        if name in where and out[section].get(name) != value:
            raise ConfigError(
                f"{name} is given twice with different values ({where[name]}={out[section][name]!r}, "
                f"{key}={value!r}); keep one"
            )
        where[name] = key
        out[section][name] = value
    return out


def _refuse_foreign(key: str, name: str, value: Any, models: dict, owners: dict, given_now: bool = False) -> None:
    """A pending key that the run's task and backend do not have: dropped when it is another owner's option
    at that owner's default (a config file of an earlier version lists them all) unless `given_now` (typed on this
    command line), else one line."""
    section = key.partition(".")[0] if "." in key else ""
    if section not in ("", "data", *SECTIONS):
        raise ConfigError(f"unknown config key '{key}'")
    for kind, found in (("task", task_option_owners()), ("backend", option_owners())):
        names = found.get(name)
        if not names:
            continue
        if not given_now and all(_default_of(kind, owner, name) == value for owner in names):
            return
        mine = owners[f"{kind}_options"][1]
        raise ConfigError(
            f"{name} (--{name.replace('_', '-')}) is an option of {kind} {' or '.join(map(repr, names))}, not of "
            f"{kind} {mine!r}; add --{kind} {names[0]}, or drop it"
        )
    raise ConfigError(_unknown_key(key, section, models, owners))


def check_options_given(config: TrainConfig, flags: Mapping[str, Any], overrides: Mapping[str, Any]) -> None:
    """The task and backend options typed on this command line (flags, key=value overrides) that the run's task and
    backend do not have, or that its task's other settings never read (its options' `idle_options`): one line, at
    their owner's default too (`--packing` on a classifier would do nothing)."""
    models = {"task_options": type(config.task_options), "backend_options": type(config.backend_options)}
    owners = {"task_options": ("task", config.task), "backend_options": ("backend", config.backend)}
    foreign = {*task_option_owners(), *option_owners()} - {*models["task_options"].model_fields}
    foreign -= {*models["backend_options"].model_fields}
    typed = [name for section, _, name in (key.partition(".") for key in flags) if section in SECTIONS]
    for section, value in overrides.items():  # flat, or under task_options: / backend_options: / data:
        typed += list(value) if section in ("data", *SECTIONS) and isinstance(value, dict) else [section]
    idle = config.task_options.idle_options()
    for name in typed:
        if name in foreign:
            _refuse_foreign(name, name, None, models, owners, given_now=True)
        if name in idle:
            raise ConfigError(f"--{name.replace('_', '-')} {idle[name]} or drop it")


def _default_of(kind: str, owner: str, name: str) -> Any:
    cls = task_class(owner) if kind == "task" else backend_class(owner)
    default = cls.Options.model_fields[name].default
    return None if default is PydanticUndefined else default


def _unknown_key(key: str, section: str, models: dict, owners: dict) -> str:
    if section in SECTIONS:
        kind, name = owners[section]
        allowed = sorted(models[section].model_fields)
        hint = meant_key(key, allowed)
        return f"unknown config key '{key}'{hint}; {kind} {name!r} has options: {', '.join(allowed) or 'none'}"
    if section == "data":
        allowed = sorted(DataConfig.model_fields)
        return f"unknown config key '{key}'{meant_key(key, allowed)}; allowed: {', '.join(allowed)}"
    every = sorted({*TrainConfig.model_fields, *option_owners(), *task_option_owners()} - {"pending_options"})
    return f"unknown config key '{key}'{meant_key(key, every)}; allowed: {', '.join(every)}"


# ---- the task's defaults, and what the chosen backend can do ---------------------------------------------
def _run_defaults(given: TrainConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The task's own defaults ("epochs", "optim.lr") for the keys `given` left unset, as values to merge."""
    out: dict[str, Any] = {}
    for key, value in defaults.items():
        section, _, field = key.rpartition(".")
        if not section:
            if field not in given.model_fields_set:
                out[field] = value
            continue
        part: BaseModel = getattr(given, section)
        if field not in part.model_fields_set:
            out[section] = {**part.model_dump(exclude_unset=True), **out.get(section, {}), field: value}
    return out


def _check_capabilities(config: TrainConfig, backend) -> None:
    if config.adapter != "none" and not backend.supports_adapters:
        raise ConfigError(
            f"backend {config.backend!r} does not train adapters (--adapter {config.adapter}); use one that does: "
            + ", ".join(f"--backend {name}" for name in _backends_with("supports_adapters"))
        )
    if config.quantize != "none" and not backend.supports_quantized_base:
        raise ConfigError(
            f"--quantize {config.quantize} runs where each rank holds the whole 4-bit model; backend "
            f"{config.backend!r} would shard the packed 4-bit weights: use --backend "
            + " or ".join(_backends_with("supports_quantized_base", distributed_first=True))
        )


def _backends_with(capability: str, distributed_first: bool = False) -> list[str]:
    from tuneforge.backends import backend_classes

    names = [name for name, cls in backend_classes().items() if getattr(cls, capability)]
    return sorted(names, key=lambda n: not backend_classes()[n].distributed) if distributed_first else names
