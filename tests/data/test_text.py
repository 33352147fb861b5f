"""Packing (data/text.py `pack_blocks`): the blocks are the same however many rows are read at a time, in memory
or written to a file beside the cache (read memory-mapped, reused, never half-written), and hold every token once
in order; a gzip'd text file read as the plain one."""

from __future__ import annotations

import gzip

import datasets
import numpy as np
import pytest

from tuneforge.data.text import blocks_file, pack_blocks
from tuneforge.errors import DataError


def token_rows(n: int = 50, seed: int = 0) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 30_000, rng.integers(0, 40)).tolist() for _ in range(n)]  # empty rows too
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
    return datasets.Dataset.from_dict({"input_ids": rows}, features=features)


def test_blocks_are_the_same_in_any_parts_and_in_a_file(tmp_path):
    rows = token_rows()
    stream = [t for row in rows["input_ids"] for t in row]
    whole = pack_blocks(rows, 16)
    assert [t for block in whole["input_ids"] for t in block] == stream  # every token once, in order
    assert whole["length"][:-1] == [16] * (len(whole) - 1) and 0 < whole["length"][-1] <= 16
    for rows_at_once in (1, 3, 7, 1000):
        assert pack_blocks(rows, 16, rows_at_once=rows_at_once).to_dict() == whole.to_dict()
    saved = rows.map(lambda batch: batch, batched=True, cache_file_name=str(tmp_path / "abc.arrow"))
    into = blocks_file(saved, "blocks16")
    assert into == tmp_path / "abc-blocks16.arrow" and blocks_file(rows, "blocks16") is None
    mapped = pack_blocks(saved, 16, into=into, rows_at_once=5)
    assert mapped.to_dict() == whole.to_dict() and mapped.cache_files[0]["filename"] == str(into)
    written = into.stat().st_mtime_ns
    assert pack_blocks(saved, 16, into=into).to_dict() == whole.to_dict() and into.stat().st_mtime_ns == written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abc-blocks16.arrow", "abc.arrow"]  # no temporary left


def test_an_empty_split_packs_into_no_blocks(tmp_path):
    rows = token_rows().select(range(0))
    assert len(pack_blocks(rows, 8)) == 0


def test_a_compressed_text_file_gives_the_lines_of_the_plain_one(tmp_path):
    from tuneforge.data.text import read_lines

    plain = tmp_path / "train.txt"
    plain.write_bytes("\ufeffone line\r\nzwei Zeile é\r\n\r\nlast\rpart".encode())
    packed = tmp_path / "train.txt.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_lines(packed) == read_lines(plain) == ["one line\n", "zwei Zeile é\n", "\n", "last\n", "part"]
    assert read_lines(packed, keep_linebreaks=False) == read_lines(plain, keep_linebreaks=False)
    packed.write_bytes(packed.read_bytes()[:20])
    with pytest.raises(DataError, match="is not a whole gzip file"):
        read_lines(packed)


def test_a_compressed_text_file_trains_a_causal_lm_without_a_task(capfd, tmp_path, tiny_gpt2):
    from test_bad_input import in_process

    lines = "".join(f"line {i} of the cat and the dog\n" for i in range(60))
    (tmp_path / "train.TXT.gz").write_bytes(gzip.compress(lines.encode()))
    args = ["--model", tiny_gpt2, "--train-file", tmp_path / "train.TXT.gz", "--max-steps", "1", "--no-packing"]
    proc = in_process(capfd, "train", *args, "--output-dir", tmp_path / "run", "--cache-dir", tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "holding out 10% of the training text" in proc.stderr
