"""Backends are discovered by module name: `tuneforge/backends/<name>.py` exposing `BACKEND`.

Adding a backend is adding one file; nothing else names it. Its class attributes say what the
rest of tuneforge needs to know: `Options` (its settings: config keys and CLI flags),
`distributed`, `checkpoint_layout` (a layout of `layouts.py`: how its checkpoints lie on disk) and
`precision_type` (a class of `precision.py`: autocast, grad scaler, refusals). Messages that list
backends are built from them here.
"""

from __future__ import annotations

import importlib
import pkgutil

from tuneforge.errors import ConfigError
from tuneforge.options import BackendOptions

__all__ = [
    "DEFAULT_BACKEND",
    "BackendOptions",
    "available_backends",
    "backend_class",
    "get_backend",
    "check_launchable",
]
DEFAULT_BACKEND = "single"  # one process
_NOT_BACKENDS = {"base", "precision", "layouts"}  # the parts backends are made of


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
        except ImportError:  # an engine that fails to import is reported by `tuneforge env`
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
    cls = backend_class(config.backend)
    if not cls.distributed and (config.nproc > 1 or config.nnodes > 1):
        raise ConfigError(f"backend {cls.name!r} runs one process; for --nproc > 1 use {distributed_hint()}")
    return cls(config, env)


def distributed_hint() -> str:
    """'--backend ddp (or deepspeed, fsdp, tp)': the backends that run several processes."""
    names = [name for name, cls in backend_classes().items() if cls.distributed]
    return f"--backend {names[0]}" + (f" (or {', '.join(names[1:])})" if len(names) > 1 else "")


def check_launchable(config, env, model_config=None) -> None:
    """Config errors a launch would only find in every worker: report them once, in the launching parent."""
    backend = get_backend(config, env)  # unknown backend, or one that runs one process
    backend.check(model_config)  # backend-specific checks
    verdict = backend.usable()
    if verdict != "usable":
        raise ConfigError(
            f"backend {backend.name!r} cannot run on this machine ({verdict.removeprefix('unusable: ')}); see "
            "`tuneforge env`"
        )
