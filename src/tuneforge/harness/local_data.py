"""A harness task's data from local files (`--harness-data TASK=PATH`) instead of the hub: what PATH may be, how
its files become the splits the task's own config names, and the task config with only its data source swapped
(`local_task_config`: the harness's prompts, metrics and filters stay as they are).

PATH is a folder of split files (train / validation / test, by name: valid, dev, val, eval and the like count;
.jsonl, .json, .csv, .tsv or .parquet; a hub snapshot's data/validation-00000-of-00001.parquet too), each
optionally with SPLIT-labels.lst beside it (one label a line: a `label` column, as PIQA ships valid.jsonl +
valid-labels.lst), or a folder written by datasets' save_to_disk, or a single file: the split the task evaluates.
A few-shot run also needs the split the task takes its examples from, with enough rows (`check_fewshot_rows`): the
harness would otherwise draw them from the rows it scores. The rows are read into memory (nothing is written to
the datasets cache). Every problem is one DataError line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tuneforge.errors import DataError

FORMATS = (".jsonl", ".json", ".csv", ".tsv", ".parquet")
LABELS_SUFFIX = "-labels.lst"
# datasets' own split keywords (data_files.py), by the canonical split name
SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")


def canonical_split(name: str) -> str | None:
    """'valid' -> 'validation', 'dev' -> 'validation', 'train' -> 'train'; None for a name of no split."""
    word = re.split(r"[-_.]", name.lower(), maxsplit=1)[0]
    return next((split for split, words in SPLIT_WORDS.items() if word in words), None)


def _read_rows(path: Path, where: str) -> list[dict]:
    """The rows of one data file (and of SPLIT-labels.lst beside it, as a `label` column)."""
    import pandas as pd

    try:
        if path.suffix in (".jsonl", ".json"):
            rows = _json_rows(path.read_text(encoding="utf-8-sig"))
        elif path.suffix == ".parquet":
            rows = pd.read_parquet(path).to_dict("records")
        else:
            # "None" or "NA" in a cell is text, as tuneforge's own tables read it, not a missing value
            sep = "\t" if path.suffix == ".tsv" else ","
            rows = pd.read_csv(path, sep=sep, keep_default_na=False).to_dict("records")
    except (OSError, ValueError, UnicodeDecodeError, ImportError) as err:
        raise DataError(f"{where}: {path.name} cannot be read ({str(err).splitlines()[0][:200]})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise DataError(f"{where}: {path.name} does not hold rows (a JSON object per row)")
    labels = path.with_name(path.name[: -len(path.suffix)] + LABELS_SUFFIX)
    if labels.is_file():
        rows = _with_labels(rows, labels, where)
    return rows


def _json_rows(text: str) -> Any:
    """A JSON array of rows, else JSON lines, whatever the suffix (as `datasets`' json reader takes a file)."""
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _with_labels(rows: list[dict], labels: Path, where: str) -> list[dict]:
    values = [line.strip() for line in labels.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(values) != len(rows):
        raise DataError(f"{where}: {labels.name} has {len(values)} labels for {len(rows)} rows; they must match")
    return [{**row, "label": int(v) if re.fullmatch(r"-?\d+", v) else v} for row, v in zip(rows, values)]


def _split_files(folder: Path) -> dict[str, list[Path]]:
    """{canonical split: its data files}, from the folder and one level below (a hub snapshot's data/)."""
    found: dict[str, list[Path]] = {}
    for path in sorted([*folder.glob("*"), *folder.glob("*/*")]):
        if path.is_file() and path.suffix.lower() in FORMATS:
            split = canonical_split(path.name)
            if split:
                found.setdefault(split, []).append(path)
    return found


def _dataset(rows: list[dict], where: str):
    """The rows as a datasets.Dataset; a column whose values do not share a type is one line."""
    import datasets

    try:
        return datasets.Dataset.from_list(rows)
    except (ValueError, TypeError) as err:  # pyarrow's ArrowInvalid / ArrowTypeError among them
        raise DataError(f"{where}: the rows do not make a table ({str(err).splitlines()[0][:200]})") from None


def read_local(path: str, where: str) -> dict[str, Any]:
    """{split name: datasets.Dataset} of `path` (a folder of split files, a save_to_disk folder, or one file:
    split None, the task's evaluated one). `where`: the spec, for the errors."""
    import datasets

    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{where}: {path!r} does not exist")
    if p.is_file():
        if p.suffix.lower() not in FORMATS:
            raise DataError(f"{where}: {p.name} is not one of {', '.join(FORMATS)}")
        return {None: _dataset(_read_rows(p, where), where)}
    if (p / "dataset_dict.json").is_file() or (p / "dataset_info.json").is_file():
        try:
            loaded = datasets.load_from_disk(str(p))
        except (OSError, ValueError) as err:
            raise DataError(f"{where}: {path!r} cannot be read ({str(err).splitlines()[0][:200]})") from None
        return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {None: loaded}
    files = _split_files(p)
    if not files:
        shown = ", ".join(sorted(f.name for f in p.iterdir())[:6]) or "nothing"
        raise DataError(
            f"{where}: {path!r} holds no train/validation/test data files ({', '.join(FORMATS)}); it holds {shown}"
        )
    return {split: _dataset([r for f in paths for r in _read_rows(f, where)], where) for split, paths in files.items()}


def template_fields(template: Any) -> set[str]:
    """The row fields a task's doc_to_text / doc_to_target / doc_to_choice string reads: a bare name is a column,
    a Jinja template reads its undeclared variables; a function (`!function utils.x`), or a template that asks
    whether a field `is defined` (`answer if answer is defined else target`: either field will do), tells nothing."""
    import jinja2
    from jinja2 import meta, nodes

    if not isinstance(template, str):
        return set()
    if template.isidentifier():
        return {template}
    try:
        parsed = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return set()
    if any(test.name == "defined" for test in parsed.find_all(nodes.Test)):
        return set()
    return set(meta.find_undeclared_variables(parsed))


def check_fields(config: dict, rows, name: str, where: str) -> None:
    """The local rows (after the task's own process_docs) hold every field the task's prompts read."""
    process = config.get("process_docs")
    if callable(process):
        try:
            rows = process(rows)
        except Exception as err:  # the task's own code on rows of the wrong shape: any error, said in one line
            raise DataError(
                f"{where}: the harness's {name} task cannot read these rows ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:200] if str(err) else ''}); they need the fields of its hub data set "
                f"{config.get('dataset_path')}"
            ) from None
    columns = set(rows.column_names)
    wanted = set().union(*(template_fields(config.get(k)) for k in ("doc_to_text", "doc_to_target", "doc_to_choice")))
    missing = sorted(wanted - columns)
    if missing:
        hint = f"; labels may sit beside a split file as SPLIT{LABELS_SUFFIX}" if "label" in missing else ""
        raise DataError(
            f"{where}: the rows lack {', '.join(map(repr, missing))}, which the harness's {name} task reads (they "
            f"have: {', '.join(sorted(columns))}){hint}"
        )


class LocalRows:
    """A task config's `custom_dataset`: the local splits (the harness calls it with the task's metadata, which
    it does not need); shown in the results' configs as where the rows came from. Not a dataclass: the harness
    writes a config's dataclasses out field by field, rows and all."""

    def __init__(self, path: str, splits: dict) -> None:
        self.path, self.splits = path, splits

    def __call__(self, **_: Any):
        import datasets

        return datasets.DatasetDict(self.splits)

    def __repr__(self) -> str:
        return f"local files: {self.path}"


def local_split(local: dict, wanted: str) -> str | None:
    """The local split a task's split `wanted` reads: the same name, else the one split of its kind ('valid' of a
    save_to_disk folder for 'validation'; a folder's files are named by kind already); None where there is none."""
    if wanted in local:
        return wanted
    kind = canonical_split(wanted)
    if kind is None or kind in local:
        return kind
    same = [name for name in local if name and canonical_split(str(name)) == kind]
    return same[0] if len(same) == 1 else None


def fewshot_source(config: dict) -> str | None:
    """The split a task draws its few-shot examples from, as the harness picks it: its few-shot split, else its
    train, validation or test split (TaskConfig's fewshot_config, Task.fewshot_docs); None for fixed examples."""
    fewshot = config.get("fewshot_config") or {}
    if fewshot.get("samples") and not fewshot.get("split"):
        return None
    keys = ("fewshot_split", "training_split", "validation_split", "test_split")
    return fewshot.get("split") or next((config[k] for k in keys if config.get(k)), None)


def check_fewshot_rows(config: dict, local: dict, splits: dict, shots: int, what: str, zero_shot: str) -> None:
    """A run's `shots` few-shot examples come from the split `config` names for them, kept in the `local` config
    with enough rows in `splits`: never from the rows it scores because that split is missing (the harness would
    fall back to them, a row's own answer among its examples), never fewer rows than a prompt takes (the harness's
    sampler fails). `what`: the task, for the errors."""
    scored = config["test_split"] or config["validation_split"]
    source = fewshot_source(config)
    if source != scored and fewshot_source(local) == scored:
        raise DataError(
            f"{what} takes its {shots} few-shot examples from its {source!r} split, and the local data has none, so "
            f"they would be drawn from the {scored!r} rows it scores (a row's own answer among them); add a "
            f"{canonical_split(source) or source} file, or pass {zero_shot}"
        )
    fewshot = local.get("fewshot_config") or {}
    split = fewshot["split"] if "split" in fewshot else local.get("fewshot_split")  # as the harness's FewshotConfig
    needed = shots + (split == local.get("test_split"))  # there it draws one more, to leave a row's own out
    if source in splits and len(splits[source]) < needed:
        raise DataError(
            f"{what}: its {source!r} split has {len(splits[source])} rows, too few for {shots} few-shot examples a "
            f"prompt (the harness draws {needed}); add rows, or ask for fewer ({zero_shot} for none)"
        )


def local_task_config(
    config: dict, name: str, path: str, shots: int | None = None, zero_shot: str = "--harness-fewshot 0"
) -> dict:
    """The harness task `config` (its own YAML, loaded) with its data from `path` instead of the hub: each split it
    names taken from the local split of that kind, or dropped where `path` has none; the split it evaluates must
    be there, and so must the one it takes few-shot examples from when the run has any (`shots`, else the task's
    own count; `zero_shot`: how the user asks for none)."""
    where = f"--harness-data {name}={path}"
    local = read_local(path, where)
    evaluated = "test_split" if config.get("test_split") else "validation_split"
    if None in local:  # one file (or a save_to_disk Dataset): it is the evaluated split
        local = {canonical_split(config[evaluated]) or config[evaluated]: local[None]}
    out, splits = dict(config), {}
    fewshot = dict(config.get("fewshot_config") or {})
    for key in SPLIT_KEYS + ("fewshot_config.split",):
        holder, field = (fewshot, "split") if key == "fewshot_config.split" else (out, key)
        wanted = holder.get(field)
        if not wanted:
            continue
        have = local_split(local, wanted)
        if have is not None:
            splits[wanted] = local[have]
        else:
            holder[field] = None
    if config.get("fewshot_config"):
        out["fewshot_config"] = fewshot
    if not out.get(evaluated):
        what = config[evaluated]
        raise DataError(
            f"{where}: the harness's {name} task scores its {what!r} split, and {path!r} has none (it has: "
            f"{', '.join(sorted(str(s) for s in local))}); add a {canonical_split(what) or what} file"
        )
    if len(splits[config[evaluated]]) == 0:
        raise DataError(f"{where}: its {config[evaluated]!r} split has no rows")
    shots = config.get("num_fewshot") if shots is None else shots
    if shots:
        check_fewshot_rows(config, out, splits, shots, f"{where}: the harness's {name} task", zero_shot)
    check_fields(config, splits[config[evaluated]], name, where)
    out["custom_dataset"] = LocalRows(str(path), splits)
    out["dataset_kwargs"] = None
    out.setdefault("metadata", {})
    out["metadata"] = {**(out["metadata"] or {}), "local_data": str(path)}
    return out
