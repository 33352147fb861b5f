"""Large files read memory-mapped (data/mapped.py): the rows, and the features tokenized from them, equal the
in-memory reader's for JSON lines, parquet and plain text; the Arrow copy is a file on disk under the cache's
`raw/`, made again for an edited file, and removed by `tuneforge prepare` (only it); a damaged large file is one
line naming it. The threshold is set to 0 here so that small files take the large files' path."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pandas as pd
import pytest

from conftest import parallel_pairs, quiet_task, run_cli
from test_bad_input import assert_refused, in_process
from test_data_mixture import mixture_config, sources  # noqa: F401 (the fixture)
from tuneforge.data import mapped
from tuneforge.errors import DataError


def rows(n: int = 40) -> list[dict]:
    """Texts with accents, quotes, tabs and a line break inside a value, and an extra column."""
    pairs = parallel_pairs(n, seed=3)
    texts = [f'{en}\t"{de}" é{i}' + ("\nzwei" if i % 9 == 4 else "") for i, (en, de) in enumerate(pairs)]
    return [{"text": text, "id": i} for i, text in enumerate(texts)]


def write(path: Path, kind: str, texts: list[dict]) -> Path:
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in texts), encoding="utf-8")
    elif kind == "parquet":
        pd.DataFrame(texts).to_parquet(path)
    else:  # txt: one row per line, \r\n and blank lines as a Windows editor writes them
        lines = [r["text"].replace("\n", " ") for r in texts]
        path.write_bytes("\r\n".join(lines[:5] + [""] + lines[5:]).encode("utf-8"))
    return path


def read_both(monkeypatch, tiny_gpt2, path: Path, cache: Path):
    """(in memory, memory-mapped): the raw training split and its features, the task reading `path`."""
    out = []
    for threshold in (mapped.LARGE_FILE_BYTES, 0):
        monkeypatch.setattr(mapped, "LARGE_FILE_BYTES", threshold)
        task = quiet_task("clm", tiny_gpt2, train_file=str(path), validation_file=str(path), cache_dir=str(cache))
        raw = task.load_raw()
        feats = task.tokenize(raw, task.load_tokenizer(), log=lambda m: None)
        out.append((raw["train"], feats["train"]))
    return out


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt"])
def test_a_large_file_gives_the_rows_and_features_of_the_in_memory_reader(monkeypatch, tmp_path, tiny_gpt2, kind):
    path = write(tmp_path / f"train.{kind}", kind, rows())
    (small_raw, small_feats), (big_raw, big_feats) = read_both(monkeypatch, tiny_gpt2, path, tmp_path / "cache")
    assert big_raw["text"][:] == small_raw["text"][:] and len(big_raw) == (41 if kind == "txt" else 40)
    assert big_feats["input_ids"][:] == small_feats["input_ids"][:]
    # the large one is a file under the cache's raw/, read memory-mapped, keyed by the file
    files = [Path(f["filename"]) for f in big_raw.cache_files]
    assert files and all(mapped.raw_folder(path, str(tmp_path / "cache")) in f.parents for f in files)
    assert not small_raw.cache_files


def test_an_edited_file_is_converted_again(monkeypatch, tmp_path):
    path = write(tmp_path / "train.jsonl", "jsonl", rows(10))
    monkeypatch.setattr(mapped, "LARGE_FILE_BYTES", 0)
    first = mapped.read_mapped(path, str(tmp_path))
    assert mapped.is_large(path) and first["id"][:] == list(range(10))
    write(path, "jsonl", rows(12))
    second = mapped.read_mapped(path, str(tmp_path))
    assert second["id"][:] == list(range(12))
    assert len(list((tmp_path / "raw").iterdir())) == 2


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('{"text": "a"}\n{"text": "b"\n', "could not be read as json (JSON parse error: Missing a comma"),
        ('{"text": "a"}\n' * 3 + '{"text": 5}\n', "Column(/text) changed from string to number in row 3"),
        ("", "has no examples"),
    ],
    ids=["cut-short-line", "mixed-types", "empty"],
)
def test_a_damaged_large_file_is_one_line_naming_it(monkeypatch, tmp_path, body, needle):
    path = tmp_path / "big.jsonl"
    path.write_text(body)
    monkeypatch.setattr(mapped, "LARGE_FILE_BYTES", 0)
    with pytest.raises(DataError) as err:
        mapped.read_mapped(path, str(tmp_path))
    assert needle in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_damaged_large_file_is_refused_by_train_in_one_line(monkeypatch, capfd, tmp_path, tiny_gpt2):
    path = tmp_path / "big.jsonl"
    path.write_text('{"text": "a b c"}\n' * 50 + '{"text": "cut')
    monkeypatch.setattr(mapped, "LARGE_FILE_BYTES", 0)
    args = ["--task", "clm", "--model", tiny_gpt2, "--train-file", path, "--cache-dir", tmp_path / "cache"]
    assert_refused(in_process(capfd, "train", *args, "--output-dir", tmp_path / "out"), tmp_path, str(path), "json")


def test_what_is_not_read_mapped(monkeypatch, tmp_path):
    """Compressed, CSV, a JSON array and a file with a byte-order mark stay with the in-memory readers."""
    monkeypatch.setattr(mapped, "LARGE_FILE_BYTES", 0)
    kept = {
        "a.jsonl.gz": b"\x1f\x8b",
        "a.csv": b"text\nx\n",
        "a.json": b' [{"text": "x"}]',
        "b.jsonl": b'\xef\xbb\xbf{"text": "x"}\n',
    }
    for name, body in kept.items():
        (tmp_path / name).write_bytes(body)
        assert not mapped.is_large(tmp_path / name), name
    (tmp_path / "c.json").write_bytes(b'{"text": "x"}\n')
    assert mapped.is_large(tmp_path / "c.json") and not mapped.is_large(tmp_path)


def test_prepare_of_large_sources_writes_the_same_shards_and_drops_only_its_copies(
    monkeypatch,
    capfd,
    tmp_path,
    tiny_gpt2,
    sources,  # noqa: F811
):
    both = {}
    for threshold, name in ((mapped.LARGE_FILE_BYTES, "memory"), (0, "mapped")):
        monkeypatch.setattr(mapped, "LARGE_FILE_BYTES", threshold)
        cache = tmp_path / name
        stranger = cache / "raw" / "not-ours" / "keep.arrow"  # a copy of another file: never removed
        stranger.parent.mkdir(parents=True)
        stranger.write_bytes(b"x")
        proc = in_process(capfd, "prepare", mixture_config(tmp_path, tiny_gpt2, str(cache), sources))
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert ("removed the memory-mapped copies of the raw files" in proc.stderr) == (name == "mapped")
        assert [p.relative_to(cache) for p in (cache / "raw").rglob("*") if p.is_file()] == [
            stranger.relative_to(cache)
        ]
        both[name] = {p.relative_to(cache): p.read_bytes() for p in (cache / "prepared").rglob("*") if p.is_file()}
    assert both["mapped"] == both["memory"] and len(both["memory"]) == 3 * 5  # meta, 2 splits × (shard, lengths)


def test_a_copy_another_process_reads_is_kept_by_prepare(monkeypatch, tmp_path, tiny_gpt2):
    """A run reading a large file while a prepare of it ends: the prepare keeps the Arrow copy, which the run's
    tokenizing workers open again by its path (they died at once when it was removed under them)."""
    monkeypatch.setattr(mapped, "LARGE_FILE_BYTES", 0)
    path, cache = write(tmp_path / "train.jsonl", "jsonl", rows()), tmp_path / "cache"
    data = dict(train_file=str(path), validation_file=str(path), cache_dir=str(cache))
    run = quiet_task("clm", tiny_gpt2, **data, num_workers=2)
    raw = run.load_raw()
    config = tmp_path / "prepare.yaml"
    config.write_text(json.dumps({"task": "clm", "model": tiny_gpt2, "data": data}))
    proc = run_cli("prepare", str(config))  # (a process of its own: forked, so the file is read mapped there too)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "removed the memory-mapped copies" not in proc.stderr
    assert len(run.tokenize(raw, run.load_tokenizer(), log=lambda m: None)["train"]) > 0
    # the run's own prepare, later, removes the copy it alone reads
    assert mapped.drop_raw_copies([path], str(cache)) > 0
    assert not list((cache / "raw").iterdir())


# ---- chat rows (--task sft): a large JSON-lines file read a line at a time ------------------------------------
def chat_lines() -> str:
    """messages rows with a system turn, tool calls and a tool result, a U+2028 inside a string, \\r\\n line ends
    and a blank line."""
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, *turns(i)]} for i in range(6)] + [
        {
            "messages": [
                {"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"},
                {"role": "assistant", "content": "It is 3.\u2028Done."},
            ],
            "tools": tools,
        }
    ]
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    return "\r\n".join(lines[:3] + [""] + lines[3:]) + "\r\n"


def turns(i: int) -> list[dict]:
    return [{"role": "user", "content": f"question {i} é"}, {"role": "assistant", "content": f"answer {i}"}]


def sft_raw(monkeypatch, model: str, path: Path, cache: Path, threshold: int) -> datasets.Dataset:
    monkeypatch.setattr(mapped, "LARGE_FILE_BYTES", threshold)
    task = quiet_task("sft", model, train_file=str(path), validation_file=str(path), cache_dir=str(cache))
    return task.load_raw()["train"]


def test_a_large_chat_file_gives_the_rows_of_the_in_memory_reader(monkeypatch, tmp_path, tiny_llama):
    path = tmp_path / "chats.jsonl"
    path.write_text(chat_lines(), encoding="utf-8")
    small = sft_raw(monkeypatch, tiny_llama, path, tmp_path / "cache", mapped.LARGE_FILE_BYTES)
    big = sft_raw(monkeypatch, tiny_llama, path, tmp_path / "cache", 0)
    assert big.to_dict() == small.to_dict() and len(big) == 7 and big.features == small.features
    assert big.cache_files and not small.cache_files
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text("".join(json.dumps({"instruction": f"say {i}", "output": f"{i}"}) + "\n" for i in range(4)))
    assert (
        sft_raw(monkeypatch, tiny_llama, alpaca, tmp_path / "cache", 0).to_dict()
        == sft_raw(monkeypatch, tiny_llama, alpaca, tmp_path / "cache", mapped.LARGE_FILE_BYTES).to_dict()
    )


@pytest.mark.parametrize(
    "bad",
    ['{"messages": [{"role": "user", "content": "hi"}]}', '{"messages": "no"', "[1, 2]"],
    ids=["no-assistant", "not-json", "not-an-object"],
)
def test_a_bad_row_of_a_large_chat_file_is_the_in_memory_readers_line(monkeypatch, tmp_path, tiny_llama, bad):
    path = tmp_path / "chats.jsonl"
    path.write_text(chat_lines() + bad + "\n", encoding="utf-8")
    said = []
    for threshold in (mapped.LARGE_FILE_BYTES, 0):
        with pytest.raises(DataError) as err:
            sft_raw(monkeypatch, tiny_llama, path, tmp_path / "cache", threshold)
        said.append(str(err.value))
    assert said[0] == said[1] and str(path) in said[0] and "\n" not in said[0]
    assert not (tmp_path / "cache" / "raw").exists() or not list((tmp_path / "cache" / "raw").rglob("*.arrow"))


def test_a_file_edited_in_place_with_its_mtime_kept_is_converted_again(monkeypatch, tmp_path):
    from test_fingerprint import edit_keeping_size_and_mtime

    path = write(tmp_path / "train.jsonl", "jsonl", rows(10))
    monkeypatch.setattr(mapped, "LARGE_FILE_BYTES", 0)
    assert mapped.read_mapped(path, str(tmp_path))["id"][:] == list(range(10))
    edit_keeping_size_and_mtime(path, b'"id": 3}', b'"id": 7}')
    assert mapped.read_mapped(path, str(tmp_path))["id"][:] == [0, 1, 2, 7, 4, 5, 6, 7, 8, 9]
