"""User reward functions (`--reward path/to/file.py:function`): checking such a spec without running anything,
and loading the function from its file.

The path is relative to the current folder, or absolute. The file is imported as a module of its own under a
unique name (registered in sys.modules, so dataclasses and pickling work in it), with its own folder first on
sys.path while it imports so that it can import modules beside it, as `python file.py` would. The function must
have TRL's signature, `fn(prompts, completions, **kwargs) -> list[float | None]`: it is called with every data
column, `completion_ids` and `trainer_state` by name, so it takes **kwargs; its other named parameters without a
default are data columns it needs (the task checks every row has them). Every bad spec is one ConfigError line.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from tuneforge.errors import ConfigError
from tuneforge.paths import read_from_here

_MODULE_NUMBERS = itertools.count()
SIGNATURE = "fn(prompts, completions, **kwargs) -> list[float | None]"
PASSED = ("prompts", "completions", "completion_ids", "trainer_state")  # scoring's own, beside the columns


def check_user_spec(spec: str, path: str, name: str) -> Path:
    """The file `path` names, once it is an existing .py file and `name` a Python name; ConfigError otherwise."""
    file = Path(path)
    if file.suffix != ".py":
        raise ConfigError(f"--reward {spec!r}: {path!r} is not a .py file; give path/to/file.py:function")
    if not name.isidentifier():
        raise ConfigError(f"--reward {spec!r}: {name!r} is not a Python function name; give path/to/file.py:function")
    if not file.exists():
        raise ConfigError(f"--reward {spec!r}: reward file {path!r} not found{read_from_here(file)}")
    if not file.is_file():
        raise ConfigError(f"--reward {spec!r}: {path!r} is a folder, not a .py file")
    return file


def load_user_function(spec: str, path: str, name: str) -> Callable[..., list]:
    """The function `name` of the .py file at `path`, imported; ConfigError when it cannot be had."""
    file = check_user_spec(spec, path, name)
    module = _import(spec, file)
    if not hasattr(module, name):
        raise ConfigError(f"--reward {spec!r}: {file.name} has no {name!r}; {_defined(module)}")
    function = getattr(module, name)
    if not callable(function):
        kind = type(function).__name__
        raise ConfigError(f"--reward {spec!r}: {name!r} in {file.name} is of type {kind}, not a function")
    _check_signature(spec, function)
    return function


def _import(spec: str, file: Path):
    stem = "".join(c if c.isalnum() else "_" for c in file.stem)
    module_name = f"tuneforge_user_rewards_{stem}_{next(_MODULE_NUMBERS)}"
    module_spec = importlib.util.spec_from_file_location(module_name, file)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"--reward {spec!r}: {str(file)!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    folder = str(file.resolve().parent)
    sys.path.insert(0, folder)
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:
        del sys.modules[module_name]
        raise ConfigError(f"--reward {spec!r}: {file.name} failed to import: {_described(error, file)}") from None
    finally:
        if folder in sys.path:  # unless the file took it out itself
            sys.path.remove(folder)
    return module


def _described(error: BaseException, file: Path) -> str:
    """`Type: message` on one line, with the line of `file` it came from when the traceback passes through it."""
    message = " ".join(str(error).split())
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    if isinstance(error, SyntaxError):
        return text  # its message names the file and line already
    where = file.resolve()
    frames = traceback.extract_tb(error.__traceback__)
    lines = [frame.lineno for frame in frames if Path(frame.filename).resolve() == where]
    return f"{text} (line {lines[-1]})" if lines else text


def _defined(module) -> str:
    """The public callables the module defines itself (not those it imports), up to 10, as a phrase."""
    names = [
        key
        for key, value in vars(module).items()
        if callable(value) and not key.startswith("_") and getattr(value, "__module__", None) == module.__name__
    ]
    if not names:
        return "it defines no functions"
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    return f"it defines {shown}"


def required_columns(function: Callable) -> tuple[str, ...]:
    """The data columns `function` cannot be called without: its named parameters without a default, except
    those scoring passes itself (TRL's `fn(completions, solution, **kwargs)` needs a `solution` column)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return ()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in parameters if p.kind in named and p.default is p.empty and p.name not in PASSED)


def _check_signature(spec: str, function: Callable) -> None:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin or extension function: it will answer when called
        return
    takes_keywords = any(p.kind == p.VAR_KEYWORD for p in parameters)
    positional_only = [p for p in parameters if p.kind == p.POSITIONAL_ONLY and p.default is p.empty]
    if takes_keywords and not positional_only:
        return
    raise ConfigError(
        f"--reward {spec!r}: the function's signature is {inspect.signature(function)}; a reward function takes "
        f"TRL's {SIGNATURE} (it is given every data column, completion_ids and trainer_state by name)"
    )
