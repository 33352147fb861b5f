"""Cheap checks of the folders a user names (--output-dir, --cache-dir, --output, --local-dir), done before
any heavy work so a bad path is one line, not a traceback after minutes of tokenizing; where a relative path that
is not there was read from (`read_from_here`); and what a run writes in
its output dir (`is_run_entry`), the only entries `--overwrite` ever removes. Imports no torch."""

from __future__ import annotations

import errno
import os
import re
import tempfile
from pathlib import Path

from tuneforge.errors import ConfigError


def read_from_here(path: str | os.PathLike) -> str:
    """For a line saying `path` is not there: where a relative path was looked for (a saved config's paths are as
    typed, so re-run from another folder they name other places); nothing for an absolute one."""
    if Path(path).expanduser().is_absolute():
        return ""
    return f" (a relative path is read from the current folder {os.getcwd()})"


URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # https://, hf://, s3://: a place `datasets` would fetch from


def check_local(flag: str, path: str | os.PathLike | None) -> None:
    """A file or folder given to be read is a local path, and a file there can be opened. A URL is refused as typed:
    read as a path it named a missing relative file 'https:/host/...' (pathlib folds the '//'), said to be read from
    the current folder. A file open() refuses (its permissions) is refused before any reader (or the fingerprint of
    the inputs, which reads them first) ends in an internal error."""
    if path and URL.match(str(path)):
        raise ConfigError(
            f"{flag} {str(path)!r} is a URL; tuneforge reads local files and folders: download it first (a hub "
            "dataset's files: tuneforge download REPO_ID --repo-type dataset --local-dir DIR) and pass its local path"
        )
    if path and Path(path).is_file():
        try:
            Path(path).open("rb").close()
        except OSError as err:
            raise ConfigError(f"{flag} {str(path)!r} cannot be read ({err.strerror}); check its permissions") from None


def check_output_dir(path: str, flag: str = "--output-dir", what: str = "output dir") -> None:
    """The folder `path` (given with `flag`) exists and is writable or can be created; checked before any
    heavy work.

    Creates nothing that stays: where the folder does not exist yet, a probe folder is made (and
    removed) in its nearest existing parent, since permissions alone do not tell (root, /proc). An empty name
    (an unset shell variable) is refused rather than read as the current folder."""
    if not path.strip():
        raise ConfigError(f"{flag} is empty; name a folder ({what})")
    out = Path(path).expanduser()
    parent = out
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        how = "is a file" if parent == out else f"cannot be created: {str(parent)!r} is a file"
        raise ConfigError(f"{what} {str(out)!r} {how}; choose another {flag}")
    why = None
    if not os.access(parent, os.W_OK | os.X_OK):
        why = f"{str(parent)!r} is not writable"
    elif parent != out:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".tuneforge-probe-", dir=parent))
        except OSError as err:  # /proc: ENOENT; a read-only mount: EROFS
            why = f"{str(parent)!r} takes no new folders" + ("" if err.errno == errno.ENOENT else f": {err.strerror}")
    if why:
        verb = "cannot be written" if parent == out else "cannot be created"
        raise ConfigError(f"{what} {str(out)!r} {verb} ({why}); choose another {flag}")


# ---- what a run writes in its output dir ------------------------------------------------------
# The run folder's own entries are a fixed set of names (not a record written beside them): a run of any
# version, or one killed half-way, is recognised the same way, and nothing else is ever counted as the run's.
RUN_FILES = ("config.yaml", "metrics.jsonl", "result.json", "latest", "plot.png", "deepspeed_config.json")
RUN_FOLDERS = ("model", "tensorboard", "data-order")
CHECKPOINT_NAME = re.compile(r"checkpoint-\d+")
# temporaries of files.replacing (.tmp-NAME.PID), of a checkpoint save and of files.discard
RUN_TEMPORARY = re.compile(
    r"\.tmp-(checkpoint-\d+-\d+-\d+|deleted-.+|(" + "|".join(map(re.escape, RUN_FILES + RUN_FOLDERS)) + r")\.\d+)"
)


def is_run_entry(entry: Path) -> bool:
    """`entry` (a child of an output dir) is one tuneforge writes there: by name, and of the kind it writes."""
    name = entry.name
    if entry.is_symlink():
        return False
    if name in RUN_FILES:
        return entry.is_file()
    if name in RUN_FOLDERS or CHECKPOINT_NAME.fullmatch(name):
        return entry.is_dir()
    return bool(RUN_TEMPORARY.fullmatch(name))


def run_entries(out: Path) -> list[Path]:
    """The entries of output dir `out` that a tuneforge run wrote (none if it is not a folder)."""
    return sorted(e for e in out.iterdir() if is_run_entry(e)) if out.is_dir() else []


def foreign_entries(out: Path) -> list[Path]:
    """What output dir `out` holds that no tuneforge run writes: the user's, never removed."""
    return sorted(e for e in out.iterdir() if not is_run_entry(e)) if out.is_dir() else []


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_inputs_outside_run(out: str | os.PathLike, inputs: dict[str, str | None]) -> None:
    """No input of a run (flag -> path) is one of the entries the run writes (or clears) in output dir `out`:
    training from OUT/model, or with a config file OUT/config.yaml, would replace what it reads."""
    root = Path(out).expanduser().resolve()
    for flag, given in inputs.items():
        if not given or not Path(given).expanduser().exists():
            continue  # a hub id, or a missing file the readers name in their own words
        path = Path(given).expanduser().resolve()
        if not _inside(path, root) or path == root:
            continue
        top = root / path.relative_to(root).parts[0]
        if top.name in RUN_FILES or top.name in RUN_FOLDERS or CHECKPOINT_NAME.fullmatch(top.name):
            raise ConfigError(
                f"{flag} {given!r} is inside what the run writes in --output-dir {str(out)!r} ({top.name}), so the "
                f"run would replace its own input; move it out of {top.name!r} or choose another --output-dir"
            )


def check_cache_outside_inputs(cache: str | os.PathLike, flag: str, inputs: dict[str, str | None]) -> None:
    """The cache folder `cache` (given with `flag`) is not inside a folder the run reads (flag -> path): what the
    cache writes would count as that folder's content, in the resume's check of the data and in the key of its
    prepared data."""
    check_outside_inputs(cache, "cache dir", flag, inputs)


def check_outside_inputs(folder: str | os.PathLike, what: str, flag: str, inputs: dict[str, str | None]) -> None:
    """The folder a run writes (`what`, given with `flag`: its cache, its output dir) is not inside a folder the run
    reads (flag -> path), whose content fingerprint would then count what the run writes: a resume would find the
    data changed, its tokenized and prepared data would never be found again."""
    root = Path(folder).expanduser().resolve()
    for input_flag, given in inputs.items():
        if given and Path(given).expanduser().is_dir() and _inside(root, Path(given).expanduser().resolve()):
            raise ConfigError(
                f"{what} {str(folder)!r} is inside {input_flag} {given!r}, so what the run writes there would count "
                "as that input's content (a resume would find the data changed, prepared data would not be found "
                f"again); choose a {flag} outside it"
            )


def check_no_clashes(out: str | os.PathLike) -> None:
    """No entry of output dir `out` has a name the run writes but another kind (a file `model`, a folder
    `config.yaml`): the run would replace it, and it is not a run's, so it is the user's."""
    root = Path(out)
    for name in RUN_FILES + RUN_FOLDERS:
        entry = root / name
        if (entry.exists() or entry.is_symlink()) and not is_run_entry(entry):
            kind = "folder" if name in RUN_FOLDERS else "file"
            raise ConfigError(
                f"output dir {str(out)!r} holds {name!r}, which is not the {kind} a run writes there; move it or "
                "choose another --output-dir"
            )
