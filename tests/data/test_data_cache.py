"""Tokenization cache: an identical second run reuses it (and says so); another tokenizer,
max_length, column choice or data never does."""

import contextlib
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

from conftest import Forked, cli_flags, run_cli, train_command, write_sentiment_csv
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


def test_a_second_run_with_several_workers_says_it_reuses_the_cache(tmp_path, raw_and_task, minilm_dir):
    """A map with N workers caches N shard files (KEY_0000i_of_0000N.arrow), never KEY.arrow: an identical
    second run read them back, but said it was tokenizing again."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    task, raw = raw_and_task()
    task.config.data.num_workers = 2
    first, line = tokenize(task, raw, tok)
    assert "tokenizing 30 examples" in line
    assert len(list((tmp_path / "cache").glob("*_of_00002.arrow"))) == 2
    again, line = tokenize(task, raw, tok)
    assert "reusing tokenized cache" in line and "tokenizing" not in line
    assert ids(again) == ids(first)


def group_ended(pgid: int, timeout: float) -> bool:
    """Whether every process of the group `pgid` has ended (a zombie waiting for init to reap it counts as ended)
    within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(state != "Z" for state, group in process_states() if group == pgid):
            return True
        time.sleep(0.05)
    return False


def process_states() -> list[tuple[str, int]]:
    """(state, process group) of every process in /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
            found.append((fields[0], int(fields[2])))
    return found


@pytest.mark.parametrize(
    "stop, to_group, exit_code, workers",
    [
        (signal.SIGINT, True, 130, 2),
        (signal.SIGTERM, False, -signal.SIGTERM, 2),
        (signal.SIGTERM, False, 143, 2),  # as the command takes it (stops.stopping_as_ctrl_c)
        (signal.SIGTERM, True, 143, 2),  # to the whole group: a scheduler's stop of a job
        (signal.SIGTERM, False, 143, 1),
    ],
    ids=["ctrl-c-in-the-terminal", "kill-of-the-run", "kill-of-the-command", "kill-of-the-job", "no-workers"],
)
def test_a_map_with_workers_stopped_ends_them_with_it(tmp_path, minilm_dir, stop, to_group, exit_code, workers):
    """Ctrl-C (SIGINT to the terminal's whole process group) during a tokenization with --num-workers 2 printed each
    worker's KeyboardInterrupt traceback and ended in 'internal error ... TimeoutError' (datasets waits 0.05 s for
    the workers' results over the interrupt), or hung; a kill of the run alone (SIGTERM) left the workers running
    for ever, holding the run folder's lock ('in use by another tuneforge run that is still going'). The command
    takes SIGTERM as Ctrl-C (exit 143; killed at once, it left datasets' temporary file in the cache): its workers,
    which inherit that, end as before, without a word, and a scheduler's SIGTERM to every process of the job (the
    workers first) no longer leaves the run waiting for ever for the pool's lock a killed worker held."""
    import datasets
    from transformers import AutoTokenizer

    from tuneforge import stops
    from tuneforge.data.tokenize import cached_map

    tok, started = AutoTokenizer.from_pretrained(minilm_dir), tmp_path / "started"

    def slow(batch):  # each process's second batch (the first one written): says so, then takes longer than the test
        if batch["text"][0] == "slow":
            started.touch()
            time.sleep(60)
        return batch

    def tokenize() -> int:
        rows = (["fast"] * 1000 + ["slow"] * 1000) * 2  # cached_map's batches are of 1000 rows; a worker's, 2000
        ds, cache = datasets.Dataset.from_dict({"text": rows}), tmp_path / "cache"
        try:
            with stops.stopping_as_ctrl_c() if exit_code == 143 else contextlib.nullcontext():
                cached_map(ds, slow, tokenizer=tok, settings={}, cache_dir=cache, desc="x", num_proc=workers)
        except stops.StoppedBySignal as stopped:
            return stopped.exit_code
        except KeyboardInterrupt:
            return 130
        return 0

    with tempfile.TemporaryFile() as err:
        child = Forked(tokenize, err.fileno(), err.fileno())
        try:
            while not started.exists():
                assert child.poll() is None, "the map ended before it was stopped"
                time.sleep(0.02)
            (os.killpg if to_group else os.kill)(child.pid, stop)
            assert child.wait(20) == exit_code
            assert group_ended(child.pid, 5), "a tokenizing worker outlived the run"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
        err.seek(0)
        assert "Traceback" not in err.read().decode()
        assert not [p.name for p in (tmp_path / "cache").rglob("*") if "tmp" in p.name]  # nothing of the map is left


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_cache_folder_from_the_environment_that_is_a_file_is_one_line(monkeypatch, capsys, tmp_path, tiny_bert):
    """TUNEFORGE_CACHE naming a file (or a place that cannot be written): --cache-dir is checked before any work,
    the environment's folder was an internal error (NotADirectoryError) once the tokenization began."""
    from conftest import cli_main

    train = write_sentiment_csv(tmp_path / "train.csv", 20, seed=1)
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file\n")
    monkeypatch.setenv("TUNEFORGE_CACHE", str(not_a_folder))
    flags = cli_flags(max_steps=1, batch_size=8, output_dir=tmp_path / "out")
    code, _, err = cli_main(capsys, *train_command((train, train), tiny_bert), *flags)
    assert code == 2
    line = error_line(err)
    assert line.startswith("error: tokenization cache") and f"{str(not_a_folder)!r} is a file" in line, line
    assert "TUNEFORGE_CACHE" in line and not_a_folder.read_text() == "a file\n"


def test_a_cache_folder_without_room_is_one_line(tmp_path, tiny_bert):
    """Writing the tokenization cache failed for want of room (a full disk, a quota; here a file size limit, which
    fails the write the same way): one line naming the folder, where it was an internal error."""
    import resource

    from conftest import run_forked
    from tuneforge.cli import main

    train = write_sentiment_csv(tmp_path / "train.csv", 3000, seed=1)
    cache = tmp_path / "cache"
    args = [*train_command((train, train), tiny_bert), *cli_flags(max_steps=1, output_dir=tmp_path / "out")]
    args += ["--cache-dir", str(cache)]

    def limited() -> int:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        return main(args)

    proc = run_forked(limited, ["tuneforge", *args], timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: tokenize train: the tokenization cache") and "--cache-dir" in line, line
    assert f"{str(cache)!r} has no room for the features (File too large)" in line, line


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


def test_prepare_keeps_the_tokenization_cache_another_process_reads(tmp_path, tiny_bert):
    """A run reading the tokenization cache of the same data as a prepare that ends: the prepare keeps the files
    and says so (it removed them under the run: one opening them at that moment, as a second rank does after the
    first tokenized, failed with FileNotFoundError, and on a network file system a reader of a file removed by
    another machine fails). The run's own prepare, later, removes them."""
    from conftest import quiet_task
    from tuneforge.prepare import drop_tokenized_copies
    from tuneforge.training_data import TrainingData

    train = write_sentiment_csv(tmp_path / "train.csv", 30, seed=3)
    cache = tmp_path / "cache"
    data = dict(train_file=str(train), validation_file=str(train), cache_dir=str(cache))

    def features(log) -> dict:
        task = quiet_task("classification", tiny_bert, **data)
        raw = task.load_raw()
        task.use_labels(task.label_set(raw))
        return task.tokenize(task.encode_labels(raw), task.load_tokenizer(), log=log)

    feats = features(lambda m: None)
    files = sorted(cache.glob("*.arrow"))
    config = tmp_path / "prepare.yaml"
    config.write_text(json.dumps({"task": "classification", "model": tiny_bert, "data": data}))
    proc = run_cli("prepare", str(config))  # (forked: a process of its own)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "removed the tokenization cache" not in proc.stderr
    assert "kept the tokenization cache of these features: another process reads it" in proc.stderr
    assert sorted(cache.glob("*.arrow")) == files and len(files) == 1  # (train and validation: the same rows)
    lines = []
    features(lines.append)  # as the run's second rank
    assert all("reusing tokenized cache" in line for line in lines), lines
    freed, kept = drop_tokenized_copies(TrainingData(feats["train"], feats["validation"]), str(cache))
    assert freed > 0 and not kept
    assert not list(cache.glob("*.arrow")) and not list(cache.glob(".*.lock"))
