"""Backends are discovered by module name: `tuneforge/backends/<name>.py` exposing `BACKEND`.

Adding a backend is adding one file; nothing else names it. Its class attributes say what the
rest of tuneforge needs to know: `Options` (its settings: config keys and CLI flags),
`distributed`, `checkpoint_layout`. Messages that list backends are built from them here.
"""

from __future__ import annotations

import importlib
import pkgutil

from pydantic import BaseModel, ConfigDict

from tuneforge.errors import ConfigError

_NOT_BACKENDS = {"base"}


class BackendOptions(BaseModel):
    """A backend's own settings. Subclass it as `Options` in the backend class: each field (with its
    `description`) becomes a config key under `backend_options` (also accepted flat) and a CLI flag."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def available_backends() -> list[str]:
    return sorted(
        m.name for m in pkgutil.iter_modules(__path__) if m.name not in _NOT_BACKENDS and not m.name.startswith("_")
    )


def backend_class(name: str):
    """The class of backend `name` (its module imported)."""
    names = available_backends()
    if name not in names:
        raise ConfigError(f"unknown backend {name!r}; choose one of: {', '.join(names)}")
    return importlib.import_module(f"tuneforge.backends.{name}").BACKEND


def backend_classes() -> dict:
    """{name: class} of every backend that imports here; one that does not is left out (`tuneforge env` says why)."""
    out = {}
    for name in available_backends():
        try:
            out[name] = backend_class(name)
        except Exception:  # noqa: BLE001 - an engine that fails to import is reported by `tuneforge env`
            continue
    return out


def option_owners() -> dict[str, list[str]]:
    """{option name: the backends whose `Options` have it}, e.g. {"tp_size": ["tp"]}."""
    owners: dict[str, list[str]] = {}
    for name, cls in backend_classes().items():
        for option in cls.Options.model_fields:
            owners.setdefault(option, []).append(name)
    return owners


def get_backend(config, env):
    """Instantiate the backend named by `config.backend` (not yet checked or set up).

    `env`: this process's place in a launched world (`launch.dist_env()`).
    """
    return backend_class(config.backend)(config, env)


def _listed(names: list[str], last: str = "or") -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


def distributed_hint() -> str:
    """'--backend ddp (or deepspeed, fsdp, tp)': the backends that run several processes."""
    names = [name for name, cls in backend_classes().items() if cls.distributed]
    return f"--backend {names[0]}" + (f" (or {', '.join(names[1:])})" if len(names) > 1 else "")


def backends_reading(layouts) -> str:
    """'ddp, fsdp, single or tp': the backends whose checkpoints are in one of `layouts`."""
    return _listed([name for name, cls in backend_classes().items() if cls.checkpoint_layout in layouts])


def check_launchable(config, env, model_config=None) -> None:
    """Config errors a launch would only find in every worker: report them once, in the launching parent."""
    backend = get_backend(config, env)  # unknown backend
    backend.check(model_config)  # backend-specific checks
    if not backend.distributed:
        raise ConfigError(f"backend {backend.name!r} runs one process; for several processes use {distributed_hint()}")
    verdict = backend.usable()
    if verdict != "usable":
        raise ConfigError(
            f"backend {backend.name!r} cannot run on this machine ({verdict.removeprefix('unusable: ')}); see "
            "`tuneforge env`"
        )
