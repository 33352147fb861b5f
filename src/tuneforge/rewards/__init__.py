"""Reward functions for online RL (`--task grpo`): the `--reward` specs, their checking and loading, and the
scoring of a batch of completions with them.

Owns: the settings the built-ins read (RewardSettings), a loaded reward (RewardFunction), the registry of built-in
names (BUILTIN), check_reward_spec (cheap, at config validation: imports neither torch nor the user's file),
load_rewards, score and quoted_prompt (a prompt as messages quote it). The built-ins are in builtin.py, user files
are loaded by user.py, reward models by model.py (imported only when a spec names one).

A spec is one of:
- a built-in: `accuracy`, `format`, `length` (see builtin.py);
- `path/to/file.py:function`, a function with TRL's signature `fn(prompts, completions, **kwargs)` (user.py);
- `model:DIR`, a reward model trained by `tuneforge train --task reward`: `tuneforge.rewards.model.model_reward(DIR)`
  gives its scoring function, with the same signature.

Scoring calls each function once on the whole batch, as TRL's GRPOTrainer does: `fn(prompts=..., completions=...,
trainer_state=..., **columns)` (an `async def` one awaited on one event loop kept for the run, as TRL does), where
`columns` holds every data column of the batch's rows and `completion_ids`, and `trainer_state` the run's progress
(transformers' TrainerState: global_step, max_steps, epoch). It returns one float per completion, or None where it
does not apply (NaN in the table; the task's weighted sum skips it, as TRL's nansum does). A function that raises,
returns something other than a list (or tuple, generator, or 1-d numpy array or tensor, as TRL reads them) of one
value per completion, or a value that is not a finite number or None stops the run with one DataError line naming
it; to name the row behind an exception, the function is called again on each row alone (not for tuneforge's own
errors, such as a reward model's folder that fails to load at the first call: those keep their line, with the
reward's name).
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
import math
import numbers
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from tuneforge.errors import ConfigError, DataError, UserError
from tuneforge.rewards import builtin, user

DEFAULT_FORMAT = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
BUILTIN = ("accuracy", "format", "length")
MODEL_PREFIX = "model:"
FORMS = "the built-ins accuracy, format, length; a function in a file, path/to/file.py:function; or model:DIR"
SHOWN = 60  # characters of a prompt or value an error message quotes


@dataclass(frozen=True)
class RewardSettings:
    format_pattern: str = DEFAULT_FORMAT  # the regex `format` asks the stripped completion to match (re.DOTALL)
    target_length: int = 256  # the `length` reward's target, in completion tokens
    answer_column: str = "answer"  # where `accuracy` reads each row's reference answer


@dataclass(frozen=True)
class RewardFunction:
    name: str  # the spec as the user wrote it: "accuracy", "rewards.py:my_fn", "model:DIR"
    fn: Callable[..., list]  # TRL's signature: fn(prompts, completions, **columns) -> list[float | None]
    columns: tuple[str, ...] = ()  # data columns it needs (accuracy: (answer_column,), a user function: its
    # parameters without a default); the task checks every row has them


def _parse(spec) -> tuple[str, str, str]:
    """(kind, first, second): ("builtin", name, ""), ("file", path, function) or ("model", folder, "")."""
    if not isinstance(spec, str):
        raise ConfigError(f"--reward {spec!r} is a {type(spec).__name__}, not text; give {FORMS}")
    if not spec.strip():
        raise ConfigError(f"--reward {spec!r} is empty; give {FORMS}")
    if spec.startswith(MODEL_PREFIX):
        folder = spec[len(MODEL_PREFIX) :]
        if not folder.strip():
            raise ConfigError(f"--reward {spec!r} names no folder; give model:DIR, a reward model's folder")
        return "model", folder, ""
    if ":" in spec:
        path, function = spec.rsplit(":", 1)
        if not path.strip() or not function.strip():
            missing = "file before" if not path.strip() else "function after"
            raise ConfigError(f"--reward {spec!r} has no {missing} ':'; give path/to/file.py:function")
        return "file", path, function
    return "builtin", spec, ""


def check_reward_spec(spec: str) -> None:
    """ConfigError, one line, unless `spec` is a known built-in, an existing `file.py:function` (not imported
    here) or `model:DIR`."""
    kind, first, second = _parse(spec)
    if kind == "file":
        user.check_user_spec(spec, first, second)
    elif kind == "builtin" and first not in BUILTIN:
        if first.endswith(".py"):
            raise ConfigError(f"--reward {spec!r} names a file but no function; give {spec}:function")
        close = difflib.get_close_matches(first.lower(), BUILTIN, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"--reward {spec!r}: no such reward; {hint}give {FORMS}")


def _identity(spec: str) -> tuple[str, ...]:
    """What a spec names, so that `r.py:f` and `./r.py:f` count as the same reward."""
    kind, first, second = _parse(spec)
    if kind == "builtin":
        return kind, first
    return kind, str(Path(first).expanduser().resolve()), second


def load_rewards(specs: list[str], settings: RewardSettings) -> list[RewardFunction]:
    """The reward functions `specs` name, in order; ConfigError (one line) for a bad or repeated spec or setting."""
    if not specs:
        raise ConfigError(f"no --reward given; give at least one: {FORMS}")
    seen: dict[tuple[str, ...], str] = {}
    functions = []
    for spec in specs:
        check_reward_spec(spec)
        identity = _identity(spec)
        if identity in seen:
            same = "" if seen[identity] == spec else f" (as {seen[identity]!r})"
            raise ConfigError(
                f"--reward {spec!r} is given twice{same}; give each reward once (--reward-weights sets its weight)"
            )
        seen[identity] = spec
        functions.append(_load(spec, settings))
    return functions


def _load(spec: str, settings: RewardSettings) -> RewardFunction:
    kind, first, second = _parse(spec)
    if kind == "file":
        function = user.load_user_function(spec, first, second)
        return RewardFunction(spec, function, user.required_columns(function))
    if kind == "model":
        from tuneforge.rewards.model import model_reward  # torch and a model: only when asked for

        made = model_reward(first)  # a RewardFunction, or a bare function with TRL's signature
        return replace(made, name=spec) if isinstance(made, RewardFunction) else RewardFunction(spec, made)
    if first == "accuracy":
        if not settings.answer_column:
            raise ConfigError("the accuracy reward's answer column is empty; name the column with the answers")
        return RewardFunction(spec, builtin.accuracy_reward(settings.answer_column), (settings.answer_column,))
    if first == "format":
        try:
            pattern = re.compile(settings.format_pattern, re.DOTALL)
        except re.error as error:
            raise ConfigError(
                f"the format reward's pattern {settings.format_pattern!r} is not a valid regex: {error}"
            ) from None
        return RewardFunction(spec, builtin.format_reward(pattern))
    if isinstance(settings.target_length, bool) or not isinstance(settings.target_length, int):
        raise ConfigError(f"the length reward's target {settings.target_length!r} is not a whole number of tokens")
    if settings.target_length < 1:
        raise ConfigError(f"the length reward's target is {settings.target_length} tokens; give 1 or more")
    return RewardFunction(spec, builtin.length_reward(settings.target_length))


def score(
    functions: list[RewardFunction], prompts: list, completions: list, columns: dict[str, list], trainer_state=None
):
    """A float64 tensor [completions, functions] of the rewards, NaN where a function said None; DataError (one
    line naming the function, and the row where it can be known) for a function that fails. `trainer_state` is
    passed to every function as it is (TRL's TrainerState)."""
    import torch

    count = len(completions)
    if len(prompts) != count:
        raise ValueError(f"{len(prompts)} prompts for {count} completions")
    for name, values in columns.items():
        if name in ("prompts", "completions", "trainer_state"):
            raise DataError(f"a data column is named {name!r}, which reward functions receive already; rename it")
        if len(values) != count:
            raise ValueError(f"column {name!r} has {len(values)} values for {count} completions")
    table = torch.full((count, len(functions)), math.nan, dtype=torch.float64)
    for index, function in enumerate(functions):
        try:
            returned = _called(function, prompts, completions, columns, trainer_state)
        except UserError as error:  # tuneforge's own line (a reward model that cannot load): no row is at fault
            raise type(error)(f"reward {function.name!r}: {error}") from error
        except Exception as error:
            raise DataError(_raised(function, error, prompts, completions, columns, trainer_state)) from error
        table[:, index] = torch.tensor(_values(function, returned, count), dtype=torch.float64)
    return table


def _called(function: RewardFunction, prompts: list, completions: list, columns: dict, trainer_state):
    """What the function returns; an `async def` one's result awaited (TRL 1.x takes those too), a generator's or
    other iterator's values read (TRL reads them one by one; here, so that what they raise is the function's)."""
    returned = function.fn(prompts=prompts, completions=completions, trainer_state=trainer_state, **columns)
    returned = _awaited(returned) if inspect.iscoroutine(returned) else returned
    return list(returned) if isinstance(returned, Iterator) else returned


_async_loop: tuple[int, asyncio.AbstractEventLoop, threading.Thread] | None = (
    None  # (its process, the loop, its thread)
)
_async_loop_made = threading.Lock()


def _awaited(coroutine):
    """The coroutine's result, run on one event loop kept for the process on a daemon thread, as TRL's GRPOTrainer
    keeps one: what an async function keeps between calls (an API client, a semaphore) stays bound to a live loop,
    and a caller inside a running loop (a notebook) is not refused. A forked child makes its own."""
    global _async_loop
    with _async_loop_made:
        if _async_loop is None or _async_loop[0] != os.getpid() or not _async_loop[2].is_alive():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="tuneforge-async-rewards", daemon=True)
            thread.start()
            _async_loop = (os.getpid(), loop, thread)
    return asyncio.run_coroutine_threadsafe(coroutine, _async_loop[1]).result()


def _values(function: RewardFunction, returned, count: int) -> list[float]:
    """The floats a function returned, None as NaN; DataError for anything but one finite number or None each."""
    shape = getattr(returned, "shape", None)  # numpy or torch: TRL reads a 1-d one value by value, as a list
    if shape is not None and callable(getattr(returned, "tolist", None)) and len(shape) == 1:
        returned = returned.tolist()
    if not isinstance(returned, (list, tuple)):
        shown = f" of shape {tuple(shape)}" if shape is not None else ""
        raise DataError(
            f"reward {function.name!r} returned a {type(returned).__name__}{shown}, not a list of {count} values "
            "(a number, or None where it does not apply, per completion)"
        )
    if len(returned) != count:
        raise DataError(f"reward {function.name!r} returned {len(returned)} values for {count} completions")
    values = []
    for row, value in enumerate(returned):
        number = _as_float(value)
        if number is None or math.isinf(number) or (math.isnan(number) and value is not None):
            raise DataError(
                f"reward {function.name!r} returned {_short(repr(value))} for row {row}; "
                "each value must be a finite number, or None where the reward does not apply"
            )
        values.append(number)
    return values


def _as_float(value) -> float | None:
    """`value` as a float (None as NaN), or None when it is not one number."""
    if value is None:
        return math.nan
    if isinstance(value, numbers.Real):
        return float(value)
    size = getattr(value, "size", None)  # numpy: an int; torch: a method (numel counts)
    count = value.numel() if callable(getattr(value, "numel", None)) else size
    if count == 1 and callable(getattr(value, "item", None)):  # a one-value tensor, numpy scalar (np.bool_) or array
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) else None
    return None


def _raised(function: RewardFunction, error: Exception, prompts: list, completions: list, columns: dict, state) -> str:
    """The line for a function that raised: its exception and the first row that alone makes it raise, or, when
    none does, the batch's first prompt."""
    found = (0, error) if len(completions) == 1 else _failing_row(function, prompts, completions, columns, state)
    if found is None:
        where = f"on the batch of {len(completions)} completions whose first prompt is {quoted_prompt(prompts[0])}"
    else:
        row, error = found
        where = f"on row {row} of the batch (prompt {quoted_prompt(prompts[row])})"
    message = " ".join(str(error).split())
    return f"reward {function.name!r} raised {type(error).__name__}{': ' if message else ''}{message} {where}"


def _failing_row(function: RewardFunction, prompts: list, completions: list, columns: dict, trainer_state):
    for row in range(len(completions)):
        alone = {name: [values[row]] for name, values in columns.items()}
        try:
            _called(function, [prompts[row]], [completions[row]], alone, trainer_state)
        except Exception as error:
            return row, error
    return None


def quoted_prompt(prompt) -> str:
    """A prompt (text or messages) as an error or warning quotes it: its text, shortened, in quotes."""
    try:
        text = builtin.text_of(prompt, role=None)
    except (TypeError, ValueError):
        text = repr(prompt)
    return repr(_short(text))


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."
