"""The prepared folder's layout (data/prepared.py): Arrow stream shards in large record batches that read back as
the features written, and the `length` column stored apart, so that a run opens large data without paging it in."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pyarrow as pa
import pytest

from tuneforge.data import prepared
from tuneforge.errors import DataError
from tuneforge.training_data import RELEASE_EVERY, TrainingData


def features(rows: int) -> datasets.Dataset:
    rng = np.random.default_rng(rows)
    lengths = rng.integers(1, 40, rows)
    ids = [rng.integers(0, 1000, n).tolist() for n in lengths]
    # written by map in datasets' 1,000-row batches, as tokenizing writes them
    return datasets.Dataset.from_dict({"input_ids": ids, "length": lengths.tolist()}).map(lambda r: r)


def record_batches(path) -> list[int]:
    with pa.memory_map(str(path)) as source:
        return [batch.num_rows for batch in pa.ipc.open_stream(source)]


@pytest.mark.parametrize(("record_bytes", "shard_bytes"), [(32 * 2**20, 500 * 2**20), (4_000, 30_000)])
def test_shards_read_back_as_written_in_large_record_batches(tmp_path, monkeypatch, record_bytes, shard_bytes):
    monkeypatch.setattr(prepared, "RECORD_BYTES", record_bytes)
    monkeypatch.setattr(prepared, "SHARD_BYTES", shard_bytes)
    ds = features(2_500).select(range(3, 2_403))  # a selection: what the shards hold is the rows, not the table
    names = prepared.write_split(ds, tmp_path / "train")
    batches = [record_batches(tmp_path / "train" / name) for name in names]
    if record_bytes > ds.data.nbytes:
        assert batches == [[2_400]]  # one file, one record batch (datasets' own writer: 3 of 1,000 rows)
    else:
        assert len(names) > 1 and sum(map(len, batches)) > len(names) and sum(map(sum, batches)) == 2_400
    (tmp_path / "meta.json").write_text(
        json.dumps({"format": prepared.FORMAT, "rows": {"train": len(ds)}, "shards": {"train": names}})
    )
    back = prepared.read_prepared(tmp_path, log=lambda line: None)
    assert back.features["train"].features == ds.features
    assert back.features["train"][:] == ds[:]
    assert back.lengths["train"].dtype == np.uint16
    np.testing.assert_array_equal(back.lengths["train"], ds["length"])


def test_a_run_takes_the_stored_lengths_and_reads_them_where_none_are_stored():
    ds = features(300)
    stored = np.asarray(ds["length"], dtype=np.uint16)
    assert TrainingData(ds, None, train_lengths=stored).length_column() is stored  # the shards are not read
    read = TrainingData(ds, None).length_column()
    assert read.dtype == np.uint16
    np.testing.assert_array_equal(read, stored)
    # lengths of other rows than the features' (a stale column) are not used
    np.testing.assert_array_equal(TrainingData(ds, None, train_lengths=stored[:10]).length_column(), stored)


def test_an_empty_split_is_written_and_read(tmp_path):
    ds = features(5).select([])
    names = prepared.write_split(ds, tmp_path / "validation")
    meta = {"format": prepared.FORMAT, "rows": {"validation": 0}, "shards": {"validation": names}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    back = prepared.read_prepared(tmp_path, log=lambda line: None)
    assert len(back.features["validation"]) == 0 and len(back.lengths["validation"]) == 0


def mapped_kib(path) -> int:
    """This process's resident KiB of its maps of `path` (/proc/self/smaps)."""
    total, ours = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:  # a mapping's header line
            ours = line.rstrip().endswith(str(path))
        elif ours and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_the_pages_a_run_read_are_let_go_and_read_again_the_same(tmp_path):
    ds = features(3_000)
    names = prepared.write_split(ds, tmp_path / "train")
    meta = {"format": prepared.FORMAT, "rows": {"train": len(ds)}, "shards": {"train": names}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    back = prepared.read_prepared(tmp_path, log=lambda line: None)
    data = TrainingData(back.features["train"], None, maps=back.maps)
    shard = tmp_path / "train" / names[0]
    rows = data.train[[5, 2_999, 1_234]]
    for _ in range(RELEASE_EVERY - 1):  # told after each batch; lets go every RELEASE_EVERY batches
        data.release_pages()
    assert mapped_kib(shard) > 0
    data.release_pages()
    assert mapped_kib(shard) == 0
    assert data.train[[5, 2_999, 1_234]] == rows == ds[[5, 2_999, 1_234]]


def damage(folder, how: str) -> None:
    shard = next((folder / "train").glob("*.arrow"))
    if how == "shard-missing":
        shard.unlink()
    elif how == "shard-cut-short":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif how == "shard-empty":
        shard.write_bytes(b"")
    elif how == "lengths-missing":
        (folder / "train" / "lengths.npy").unlink()
    elif how == "lengths-cut-short":
        (folder / "train" / "lengths.npy").write_bytes((folder / "train" / "lengths.npy").read_bytes()[:100])
    else:  # another folder's shard copied over this one's: other rows than meta.json says
        prepared.write_split(features(7), folder / "other")
        shard.write_bytes(next((folder / "other").glob("*.arrow")).read_bytes())


@pytest.mark.parametrize(
    "how",
    ["shard-missing", "shard-cut-short", "shard-empty", "lengths-missing", "lengths-cut-short", "shard-of-other-rows"],
)
def test_a_damaged_prepared_folder_is_one_line_naming_it(tmp_path, how):
    ds = features(300)
    names = prepared.write_split(ds, tmp_path / "train")
    meta = {"format": prepared.FORMAT, "rows": {"train": 300}, "shards": {"train": names}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    damage(tmp_path, how)
    with pytest.raises(DataError) as err:
        prepared.read_prepared(tmp_path, log=lambda line: None)
    message = str(err.value)
    assert message.startswith(f"prepared data {str(tmp_path)!r} is damaged (train/") and "\n" not in message
    assert "prepare it again" in message


def test_a_folder_another_prepare_wrote_meanwhile_is_kept_and_ours_dropped(tmp_path):
    """Two prepares of the same data at once: the second to finish finds the first's folder where it renames its own."""
    ours, theirs = tmp_path / ".key.123.tmp", tmp_path / "key"
    for folder in (ours, theirs):
        prepared.write_split(features(5), folder / "train")
        (folder / "meta.json").write_text(json.dumps({"by": folder.name}))
    assert prepared.move_into_place(ours, theirs) is False
    assert not ours.exists() and json.loads((theirs / "meta.json").read_text()) == {"by": "key"}
    assert prepared.move_into_place(theirs, tmp_path / "new") is True and (tmp_path / "new" / "meta.json").is_file()


def test_a_temporary_folder_of_another_machine_with_our_process_id_is_left_alone(tmp_path, tiny_bert):
    """Two containers (or two nodes) sharing one cache can run prepares under the same process id, small numbers
    in containers; a temporary folder named by the id alone was removed as a leftover of our own under the other's
    write. Ours has a name no other process takes."""
    import os

    from transformers import AutoTokenizer

    from conftest import write_sentiment_csv
    from tuneforge.configure import build_config

    train = write_sentiment_csv(tmp_path / "train.csv", 8)
    config = build_config({"model": tiny_bert, "data": {"train_file": str(train), "cache_dir": str(tmp_path / "c")}})
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    key = prepared.prepared_key(config, tokenizer)
    theirs = prepared.prepared_root(config.data.cache_dir) / f".{key}.{os.getpid()}.tmp"
    (theirs / "train").mkdir(parents=True)
    (theirs / "train" / "part-0.arrow").write_text("another machine's write in progress")
    folder = prepared.save_prepared(config, tokenizer, {"train": features(5)}, None, None, log=lambda line: None)
    assert (folder / "meta.json").is_file()
    assert (theirs / "train" / "part-0.arrow").read_text() == "another machine's write in progress"
