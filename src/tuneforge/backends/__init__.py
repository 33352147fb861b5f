"""Backends are discovered by module name: `tuneforge/backends/<name>.py` exposing `BACKEND`.

Adding a backend is adding one file; nothing else names it.
"""

from __future__ import annotations

import importlib
import pkgutil

from tuneforge.errors import ConfigError

_NOT_BACKENDS = {"base"}


def available_backends() -> list[str]:
    return sorted(
        m.name for m in pkgutil.iter_modules(__path__) if m.name not in _NOT_BACKENDS and not m.name.startswith("_")
    )


def get_backend(config):
    """Instantiate the backend named by `config.backend` (not yet set up)."""
    names = available_backends()
    if config.backend not in names:
        raise ConfigError(f"unknown backend {config.backend!r}; choose one of: {', '.join(names)}")
    module = importlib.import_module(f"tuneforge.backends.{config.backend}")
    backend = module.BACKEND(config)
    if hasattr(backend, "validate"):
        backend.validate()
    return backend
