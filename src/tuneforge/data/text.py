"""Plain-text sources and block packing for language modelling and translation.

- `read_lines`: one UTF-8 text file as lines (with their line breaks kept, as the run_clm recipe
  does with `keep_linebreaks=True`), with one clear error per problem.
- `read_parallel`: two parallel files (source, target), one sentence per line.
- `pack_blocks`: the run_clm `group_texts` recipe done over the whole split at once: every
  token is kept exactly once (the last, shorter block is kept, not dropped).
"""

from __future__ import annotations

import io
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tuneforge.errors import DataError
from tuneforge.paths import read_from_here

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa


def _check_text_file(path: str | Path, what: str) -> Path:
    from tuneforge.data.sources import not_a_file

    p = Path(path)
    if not p.exists():
        raise DataError(f"{what} {str(p)!r} does not exist{read_from_here(p)}; check the path")
    if why := not_a_file(p):
        raise DataError(f"{what} {str(p)!r} {why}; pass a plain text file")
    return p


def read_lines(path: str | Path, what: str = "text file", keep_linebreaks: bool = True) -> list[str]:
    """All lines of a UTF-8 file (a leading BOM dropped; train.txt.gz and .zst decompressed whole, as the table
    readers do); DataError if it holds no text at all."""
    from tuneforge.data.sources import COMPRESSED, decode_text, decompressed

    p = _check_text_file(path, what)
    if p.suffix.lower() in COMPRESSED:
        lines = io.StringIO(decode_text(decompressed(p), p, what), newline=None).readlines()  # (universal newlines)
    else:
        lines = _file_lines(p, what)
    if not any(line.strip() for line in lines):
        raise DataError(f"{what} {str(p)!r} is empty; give a file with at least one line of text")
    return lines if keep_linebreaks else [line.rstrip("\n") for line in lines]


def _file_lines(p: Path, what: str) -> list[str]:
    from tuneforge.data.sources import UTF16_BOMS, decode_text

    with open(p, "rb") as fh:
        if fh.read(2).startswith(UTF16_BOMS):
            decode_text(b"\xff\xfe", p, what)  # refused by the one reader of encodings
    try:
        # universal newlines: \n, \r\n and \r end a line, nothing else (unlike str.splitlines)
        with open(p, encoding="utf-8-sig", newline=None) as fh:
            return fh.readlines()
    except UnicodeDecodeError as err:
        raise DataError(
            f"{what} {str(p)!r} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start}); "
            "re-save it as UTF-8"
        ) from None


def read_parallel(source_path: str | Path, target_path: str | Path, split: str) -> datasets.Dataset:
    """Parallel text files -> Dataset(source, target). Lines blank on both sides are skipped."""
    import datasets

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


def pack_blocks(ds: datasets.Dataset, block_size: int, into: Path | None = None, rows_at_once: int = 1 << 16):
    """Concatenate every `input_ids` row and cut the stream into blocks of `block_size` tokens (the last, shorter
    block kept), each with its `length`: no token lost or duplicated, order kept.

    Read `rows_at_once` rows at a time, each part's tokens re-sliced with new offsets (no Python loop over tokens),
    the tokens short of a block carried to the next part. With `into` (blocks_file) the blocks are written there a
    part at a time, or read from there when written before, and read memory-mapped: a corpus larger than memory is
    never held whole. Without, they are built in memory.
    """
    import pyarrow as pa

    value_type = ds.features.arrow_schema.field("input_ids").type.value_type
    schema = pa.schema({"input_ids": pa.list_(value_type), "length": pa.int32()})
    return batches_dataset(
        _packed_parts(ds.select_columns(["input_ids"]), block_size, rows_at_once, schema), schema, into
    )


def batches_dataset(parts, schema: pa.Schema, into: Path | None) -> datasets.Dataset:
    """The record batches `parts` as a Dataset: written to `into` a batch at a time and read memory-mapped (a file
    already there is read as it is: its name says what it holds), or, without `into`, in memory."""
    import datasets
    import pyarrow as pa

    if into is None:
        return datasets.Dataset(pa.Table.from_batches(list(parts), schema=schema))
    if not into.exists():  # (ranks packing at once each write their own file; the same bytes replace it)
        # a name no other process takes (containers or nodes sharing the cache may have the same process id)
        tmp = into.with_name(f".{into.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
        try:
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
                for part in parts:
                    writer.write_batch(part)
            tmp.replace(into)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return datasets.Dataset.from_file(str(into))


def blocks_file(features: datasets.Dataset, tag: str) -> Path | None:
    """Where the blocks of features straight from the tokenization cache (a map's output, every row of its files)
    are kept: beside its first file, named after its cache key and `tag` (how they were cut; None: features in
    memory). Not `KEY_00000_of_00002-...`: `datasets` takes every `KEY_*_of_*.arrow` for a shard of its own."""
    files = [Path(f["filename"]) for f in features.cache_files]
    return files[0].with_name(f"{files[0].stem.split('_')[0]}-{tag}.arrow") if files else None


def _packed_parts(ds: datasets.Dataset, block_size: int, rows_at_once: int, schema: pa.Schema):
    """Record batches of whole blocks; the rest of the stream carried on, emitted as the last, short block."""
    carry = None
    for table in ds.with_format("arrow").iter(batch_size=rows_at_once):
        column = table.column("input_ids")
        pieces = ([carry] if carry is not None else []) + [c.flatten().to_numpy() for c in column.chunks]
        flat = np.concatenate(pieces) if pieces else np.empty(0, np.int32)
        whole = len(flat) // block_size * block_size
        if whole:
            yield _batch(flat[:whole], block_size, schema)
        carry = flat[whole:]
    if carry is not None and len(carry):
        yield _batch(carry, block_size, schema)


def _batch(tokens: np.ndarray, block_size: int, schema: pa.Schema) -> pa.RecordBatch:
    import pyarrow as pa

    starts = np.arange(0, len(tokens), block_size, dtype=np.int64)
    offsets = pa.array(np.append(starts, len(tokens)), pa.int32())
    values = pa.array(tokens, schema.field("input_ids").type.value_type)
    lengths = pa.array(np.diff(np.append(starts, len(tokens))), pa.int32())
    return pa.RecordBatch.from_arrays([pa.ListArray.from_arrays(offsets, values), lengths], schema=schema)
