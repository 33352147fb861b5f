"""Plain-text sources and block packing for language modelling and translation.

- `read_lines`: one UTF-8 text file as lines (with their line breaks kept, as the run_clm recipe
  does with `keep_linebreaks=True`), with one clear error per problem.
- `read_parallel`: two parallel files (source, target), one sentence per line.
- `pack_blocks`: the run_clm `group_texts` recipe done over the whole split at once: every
  token is kept exactly once (the last, shorter block is kept, not dropped).
"""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa

from tuneforge.errors import DataError


def _check_text_file(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise DataError(f"{what} {str(p)!r} does not exist; check the path")
    if not p.is_file():
        raise DataError(f"{what} {str(p)!r} is a folder, not a file; pass a plain text file")
    return p


def read_lines(path: str | Path, what: str = "text file", keep_linebreaks: bool = True) -> list[str]:
    """All lines of a UTF-8 file (a leading BOM dropped); DataError if it holds no text at all."""
    from tuneforge.data.sources import UTF16_BOMS, decode_text

    p = _check_text_file(path, what)
    with open(p, "rb") as fh:
        if fh.read(2).startswith(UTF16_BOMS):
            decode_text(b"\xff\xfe", p, what)  # refused by the one reader of encodings
    try:
        # universal newlines: \n, \r\n and \r end a line, nothing else (unlike str.splitlines)
        with open(p, encoding="utf-8-sig", newline=None) as fh:
            lines = fh.readlines()
    except UnicodeDecodeError as err:
        raise DataError(
            f"{what} {str(p)!r} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start}); "
            "re-save it as UTF-8"
        ) from None
    if not any(line.strip() for line in lines):
        raise DataError(f"{what} {str(p)!r} is empty; give a file with at least one line of text")
    return lines if keep_linebreaks else [line.rstrip("\n") for line in lines]


def read_parallel(source_path: str | Path, target_path: str | Path, split: str) -> datasets.Dataset:
    """Parallel text files -> Dataset(source, target). Lines blank on both sides are skipped."""
    sources = read_lines(source_path, f"{split} source file", keep_linebreaks=False)
    targets = read_lines(target_path, f"{split} target file", keep_linebreaks=False)
    # a trailing blank line (an extra newline at the end) is not a sentence pair
    while sources and not sources[-1].strip():
        sources.pop()
    while targets and not targets[-1].strip():
        targets.pop()
    if len(sources) != len(targets):
        raise DataError(
            f"{split} source file {str(source_path)!r} has {len(sources)} lines but target file {str(target_path)!r} "
            f"has {len(targets)}; parallel files need one sentence per line on both sides"
        )
    pairs = [(s.strip(), t.strip()) for s, t in zip(sources, targets) if s.strip() or t.strip()]
    return datasets.Dataset.from_dict({"source": [s for s, _ in pairs], "target": [t for _, t in pairs]})


def pack_blocks(ds: datasets.Dataset, block_size: int) -> datasets.Dataset:
    """Concatenate every `input_ids` row and cut the stream into blocks of `block_size` tokens.

    Pure Arrow (no Python loop over tokens): the flat token column is re-sliced with new offsets,
    so no token is lost or duplicated. Each block gets its `length`.
    """
    table = (ds.flatten_indices() if ds._indices is not None else ds).data.table  # a selected view: the rows it shows
    column = table.column("input_ids")
    tokens = column.combine_chunks().flatten() if column.num_chunks else pa.array([], pa.int32())
    n = len(tokens)
    starts = np.arange(0, n, block_size, dtype=np.int64)
    offsets = pa.array(np.append(starts, n), pa.int32())
    blocks = pa.ListArray.from_arrays(offsets, tokens)
    lengths = pa.array(np.diff(np.append(starts, n)), pa.int32())
    return datasets.Dataset(pa.table({"input_ids": blocks, "length": lengths}))
