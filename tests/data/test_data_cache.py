"""Tokenization cache: an identical second run reuses it (and says so); another tokenizer,
max_length, column choice or data never does."""

import pytest

from conftest import cli_flags, run_cli, train_command, write_sentiment_csv
from tuneforge.configure import build_config
from tuneforge.tasks.classification import ClassificationTask


def cache_state(folder):
    return {p.name: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_second_identical_run_reuses_the_cache(tmp_path, tiny_bert):
    train = write_sentiment_csv(tmp_path / "train.csv", 40, seed=1)
    val = write_sentiment_csv(tmp_path / "val.csv", 10, seed=2)
    cache = tmp_path / "fresh-cache"

    def run(out):
        flags = cli_flags(max_steps=1, batch_size=8, output_dir=tmp_path / out, cache_dir=cache)
        proc = run_cli(*train_command((train, val), tiny_bert), *flags)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    first = run("run1")
    assert "tokenize train: tokenizing 40 examples" in first and "tokenize validation: tokenizing 10 examples" in first
    assert "reusing" not in first
    files = cache_state(cache)
    assert sum(name.endswith(".arrow") for name in files) == 2

    second = run("run2")
    assert (
        "tokenize train: reusing tokenized cache" in second and "tokenize validation: reusing tokenized cache" in second
    )
    assert "tokenizing" not in second
    assert cache_state(cache) == files  # nothing new written, nothing rewritten


@pytest.fixture
def raw_and_task(tmp_path):
    train = write_sentiment_csv(tmp_path / "train.csv", 30, seed=3)

    def make(max_length=128, text_columns=None):
        config = build_config(
            task="classification",
            data={
                "train_file": str(train),
                "validation_file": str(train),
                "max_length": max_length,
                "text_columns": text_columns,
                "cache_dir": str(tmp_path / "cache"),
            },
        )
        task = ClassificationTask(config)
        raw = task.load_raw()
        task.use_labels(task.label_set(raw))
        return task, task.encode_labels(raw)

    return make


def tokenize(task, raw, tokenizer):
    lines = []
    feats = task.tokenize({"train": raw["train"]}, tokenizer, log=lines.append)
    return feats["train"], lines[0]


def ids(ds):
    return [list(x) for x in ds["input_ids"]]


def test_key_covers_tokenizer_and_max_length(raw_and_task, minilm_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    task, raw = raw_and_task()
    base, line = tokenize(task, raw, tok)
    assert "tokenizing 30 examples" in line
    again, line = tokenize(task, raw, AutoTokenizer.from_pretrained(minilm_dir))  # same content, new object
    assert "reusing tokenized cache" in line and ids(again) == ids(base)

    short_task, short_raw = raw_and_task(max_length=6)
    short, line = tokenize(short_task, short_raw, tok)
    assert "tokenizing 30 examples" in line
    assert max(map(len, ids(short))) == 6 < max(map(len, ids(base)))

    other_tok = AutoTokenizer.from_pretrained(minilm_dir)
    assert other_tok.add_tokens(["joyfu"]) == 1  # another vocabulary: 'joyful' now splits differently
    other, line = tokenize(task, raw, other_tok)
    assert "tokenizing 30 examples" in line
    assert ids(other) != ids(base)

    assert len(list((tmp_path / "cache").glob("*.arrow"))) == 3


def test_key_covers_the_data(raw_and_task, minilm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    task, raw = raw_and_task()
    tokenize(task, raw, tok)
    _, line = tokenize(task, {"train": raw["train"].select(range(10))}, tok)
    assert "tokenizing 10 examples" in line
    edited = raw["train"].map(lambda ex: {"text": ex["text"] + "!"})
    _, line = tokenize(task, {"train": edited}, tok)
    assert "tokenizing 30 examples" in line


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_cache_folder_inside_a_data_folder_is_refused(capsys, tmp_path, tiny_bert):
    """The cache inside --data-dir: what it writes counted as the data's content, so a resume found the data
    changed (and was refused) after another run tokenized, and each prepare wrote its shards under a new key."""
    from conftest import cli_main

    data = tmp_path / "sst2"
    data.mkdir()
    for name, n in (("train.tsv", 24), ("dev.tsv", 8)):
        rows = [f"{'a fine film' if i % 2 else 'a dull film'} {i}\t{i % 2}" for i in range(n)]
        (data / name).write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    cache = data / ".cache"
    flags = cli_flags(max_steps=1, batch_size=8, output_dir=tmp_path / "out", cache_dir=cache, data_dir=data)
    code, _, err = cli_main(capsys, "train", "--task", "glue/sst2", "--model", tiny_bert, *flags)
    assert code == 2
    line = error_line(err)
    assert f"{str(cache)!r} is inside --data-dir {str(data)!r}" in line and "choose a --cache-dir outside" in line
    assert not cache.exists() and not (tmp_path / "out").exists()
