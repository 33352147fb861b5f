"""The harness's tasks by name: finding them in lm-evaluation-harness's own task index (`task_manager`), refusing
an unknown name in one line with the close ones (`refuse_unknown`), and building each task (`build_tasks`):
from its hub data as any harness user has it, or, for a task given `--harness-data`, from its own YAML config
with only the data source swapped (local_data.py). A task whose data cannot be had is one line naming it.
"""

from __future__ import annotations

import difflib
import functools
import re
from pathlib import Path
from typing import Any

from tuneforge.errors import ConfigError, DataError
from tuneforge.harness.local_data import local_task_config
from tuneforge.harness.options import EVAL_SPELLING, Spelling


def _tasks_root() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _entry_yaml(entry: Any) -> Path | None:
    """An index entry's YAML file, for a single task (not a group or tag); lm-eval 0.4.8's entries are dicts."""
    if isinstance(entry, dict):
        return Path(entry["yaml_path"]) if entry.get("type") == "task" and entry.get("yaml_path") else None
    kind = getattr(getattr(entry, "kind", None), "name", "")
    return entry.yaml_path if kind == "TASK" and entry.yaml_path else None


@functools.cache
def _full_index():
    from lm_eval.tasks import TaskManager

    return TaskManager()


@functools.cache
def _yaml_files() -> tuple[tuple[Path, bytes], ...]:
    return tuple((path, path.read_bytes()) for path in _tasks_root().rglob("*.yaml"))


NAMED = re.compile(rb"^\s*(?:-\s*)?(?:task|group|tag):\s*['\"]?([A-Za-z0-9_.\-]+)", re.MULTILINE)


def _single_tasks_in(folders: list[Path], names: tuple[str, ...]):
    """A TaskManager over `folders` only, if it holds each of `names` as a single task; else None."""
    from lm_eval.tasks import TaskManager

    if not folders:
        return None
    small = TaskManager(include_defaults=False, include_path=[str(f) for f in folders])
    return small if all(_entry_yaml(small.task_index.get(n)) for n in names) else None


def task_manager(names: tuple[str, ...]):
    """A TaskManager that knows each of `names`, else one line naming the unknown ones. One over the folders named
    like them (lm_eval/tasks/piqa, .../arc for arc_easy), or else over the folders of the YAML files that write
    `task: NAME` (llama3/instruct/gsm8k for gsm8k_llama), where those hold each name as a single task, which takes
    a second; else the whole index, which reads every task's YAML (many seconds) unless a name is written in none
    of them (a typo: refused after a plain text scan)."""
    root = _tasks_root()
    folders = {root / n for n in names} | {root / n.split("_")[0] for n in names}
    # the harness's own task folders only: a name that is a path ('/', '..', ~/data) names none of them
    folders = sorted(f for f in folders if f.parent == root and f.name != ".." and f.is_dir())
    manager = _single_tasks_in(folders, names)
    if manager is None:
        wanted = {n.encode() for n in names}
        writing = sorted({path.parent for path, text in _yaml_files() if wanted & set(NAMED.findall(text))})
        manager = _single_tasks_in(writing, names)
    if manager is not None:
        return manager
    nowhere = [n for n in names if not any(n.encode() in text for _, text in _yaml_files())]
    if nowhere:
        refuse_unknown(nowhere, sorted({m.decode() for _, text in _yaml_files() for m in NAMED.findall(text)}))
    manager = _full_index()
    unknown = [n for n in names if n not in manager.task_index]
    if unknown:
        refuse_unknown(unknown, manager.all_tasks)
    return manager


def refuse_unknown(unknown: list[str], known: list[str]) -> None:
    """One line naming each unknown task and the known names close to it."""
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=4, cutoff=0.6)
        parts.append(f"{name!r}" + (f" (close: {', '.join(close)})" if close else ""))
    raise ConfigError(
        f"--harness: unknown lm-evaluation-harness task {'; '.join(parts)}; `lm-eval ls tasks` lists the ones it has"
    )


def _task_yaml_config(manager, name: str) -> dict:
    """The harness's own config of task `name`, its includes and functions resolved."""
    path = _entry_yaml(manager.task_index[name])
    if path is None:
        raise ConfigError(
            f"--harness-data {name}=...: {name!r} is not one task of the harness's YAML configs (a group, a tag or a "
            "Python task); give local data to single tasks by their names"
        )
    try:
        from lm_eval.tasks._yaml_loader import load_yaml

        return load_yaml(path, resolve_func=True)
    except ImportError:  # lm-eval before 0.4.10
        from lm_eval.utils import load_yaml_config

        return load_yaml_config(str(path))


def task_specs(
    names: list[str], data: dict[str, str], manager, shots: int | None = None, spelling: Spelling = EVAL_SPELLING
) -> list[str | dict]:
    """What simple_evaluate loads for each task: its name (hub data), or its config with the local data; `shots`:
    the run's few-shot count where it sets one."""
    return [
        local_task_config(_task_yaml_config(manager, n), n, data[n], shots, spelling.zero_shot) if n in data else n
        for n in names
    ]


def build_tasks(specs: list[str | dict], manager, spelling: Spelling = EVAL_SPELLING) -> list:
    """The harness's Task and Group objects for `specs` (a tag's tasks for its name), each built here so that data
    which cannot be had (no network for the hub, a gated data set, a row the task cannot read) is one line naming
    its task; simple_evaluate takes them as they are. lm-eval before `TaskManager.load` gets the specs back."""
    if not hasattr(manager, "load"):
        return list(specs)
    built = []
    for spec in specs:
        name = spec if isinstance(spec, str) else spec["task"]
        try:
            loaded = manager.load([spec])
        except (ConfigError, DataError):
            raise
        except Exception as err:  # the harness's and datasets' own errors are of every kind: one line, named
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:240]
            where = "its local data" if isinstance(spec, dict) else "its data from the Hugging Face hub"
            raise DataError(
                f"harness task {name!r}: could not load {where} ({type(err).__name__}: {first})"
                + (
                    ""
                    if isinstance(spec, dict)
                    else f"; without the hub, pass local files: {spelling.data.format(name=name)}"
                )
            ) from None
        groups = loaded.get("groups") or {}
        built += [groups[name]] if name in groups else list(loaded["tasks"].values())
    return built
