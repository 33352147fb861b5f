"""Every bad input: one `error:` line naming the problem and the fix, exit code 2, no traceback,
nothing written. Each case runs the real CLI in a fresh process.

"Nothing written" is checked on the output dir (never created, or left byte-for-byte as it was)
and on a fresh tokenization cache (still empty: the error came before any tokenization).
"""

from pathlib import Path

import pytest

from conftest import run_cli, write_sentiment_csv


@pytest.fixture
def files(tmp_path):
    train = write_sentiment_csv(tmp_path / "train.csv", 24, seed=1)
    val = write_sentiment_csv(tmp_path / "val.csv", 8, seed=2)
    return train, val


def train_args(tmp_path, tiny_bert, train, val, *extra, positional=()):
    return [
        "train",
        *positional,
        "--train-file",
        str(train),
        "--validation-file",
        str(val),
        "--model",
        tiny_bert,
        "--output-dir",
        str(tmp_path / "out"),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--max-steps",
        "1",
        "--batch-size",
        "8",
        *extra,
    ]


def assert_refused(proc, tmp_path, *needles):
    """One clear error line with every needle, exit 2, no traceback, no output, no tokenization."""
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    assert not (tmp_path / "out").exists(), "the output dir was created"
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(cache.iterdir()), "data was tokenized before the error"
    return lines[0]


def test_missing_file(tmp_path, tiny_bert, files):
    _, val = files
    proc = run_cli(*train_args(tmp_path, tiny_bert, tmp_path / "no-such.csv", val))
    assert_refused(proc, tmp_path, "no-such.csv", "does not exist", "check the path")


def test_unknown_task(tmp_path, tiny_bert, files):
    proc = run_cli(*train_args(tmp_path, tiny_bert, *files, "--task", "sentiment"))
    assert_refused(proc, tmp_path, "unknown task 'sentiment'", "choose one of", "glue/mrpc", "classification")


def test_unknown_glue_task(tmp_path, tiny_bert, files):
    proc = run_cli(*train_args(tmp_path, tiny_bert, *files, "--task", "glue/mrcp"))
    assert_refused(proc, tmp_path, "'mrcp'", "glue/mrpc")


def test_misspelt_text_column(tmp_path, tiny_bert, files):
    proc = run_cli(*train_args(tmp_path, tiny_bert, *files, "--text-column", "txet"))
    assert_refused(proc, tmp_path, "column 'txet' not found", "columns are: text, label", "--text-column")


def test_missing_label_column(tmp_path, tiny_bert, files):
    train, val = files
    train.write_text("review,sentiment\ngood film,pos\nbad film,neg\n", encoding="utf-8")
    proc = run_cli(*train_args(tmp_path, tiny_bert, train, val, "--text-column", "review"))
    assert_refused(proc, tmp_path, "column 'label' not found", "columns are: review, sentiment", "--label-column")


def test_empty_dataset(tmp_path, tiny_bert, files):
    train, val = files
    train.write_text("text,label\n", encoding="utf-8")
    proc = run_cli(*train_args(tmp_path, tiny_bert, train, val))
    assert_refused(proc, tmp_path, "train.csv", "no examples")


def test_label_outside_label_set(tmp_path, tiny_bert, files):
    train, val = files
    val.write_text("text,label\na fine film,pos\nan odd film,neutral\n", encoding="utf-8")
    proc = run_cli(*train_args(tmp_path, tiny_bert, train, val))
    assert_refused(proc, tmp_path, "label 'neutral'", "val.csv", "row 2", "[neg, pos]")


def test_non_numeric_regression_label(tmp_path, tiny_bert, files):
    train, val = files
    train.write_text("text,label\na fine film,4.5\nan odd film,high\n", encoding="utf-8")
    val.write_text("text,label\na film,1.0\n", encoding="utf-8")
    proc = run_cli(*train_args(tmp_path, tiny_bert, train, val, "--task", "regression"))
    assert_refused(proc, tmp_path, "regression label 'high'", "row 2", "not a number")


def test_malformed_csv_row(tmp_path, tiny_bert, files):
    train, val = files
    train.write_text("text,label\na fine film,pos\nan odd, long film,neg\n", encoding="utf-8")
    proc = run_cli(*train_args(tmp_path, tiny_bert, train, val))
    assert_refused(proc, tmp_path, "malformed row", "Expected 2 fields in line 3, saw 3", "fix that row")


def test_non_utf8_file(tmp_path, tiny_bert, files):
    train, val = files
    train.write_bytes("text,label\nun film très beau,pos\nnul,neg\n".encode("latin-1"))
    proc = run_cli(*train_args(tmp_path, tiny_bert, train, val))
    assert_refused(proc, tmp_path, "not UTF-8", "byte 0xe8", "re-save it as UTF-8")


def test_model_path_not_a_model_folder(tmp_path, files):
    not_a_model = tmp_path / "my-model"
    not_a_model.mkdir()
    (not_a_model / "weights.txt").write_text("nothing")
    proc = run_cli(*train_args(tmp_path, str(not_a_model), *files))
    assert_refused(proc, tmp_path, "not a Hugging Face model folder", "config.json")


def test_output_dir_holding_a_run_is_refused(tmp_path, tiny_bert, files):
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "config.yaml").write_text("task: classification\n")
    (out / "metrics.jsonl").write_text('{"split": "eval", "step": 3}\n')
    before = {p: (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns) for p in out.rglob("*")}
    proc = run_cli(*train_args(tmp_path, tiny_bert, *files))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "already holds a run" in lines[0] and "--overwrite" in lines[0], proc.stderr
    after = {p: (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns) for p in out.rglob("*")}
    assert after == before


def test_overwrite_with_bad_input_keeps_the_old_run(tmp_path, tiny_bert, files):
    """--overwrite replaces a run only once the new run's inputs are good: a bad column loses nothing."""
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "config.yaml").write_text("task: classification\n")
    (out / "metrics.jsonl").write_text('{"split": "eval", "step": 3}\n')
    before = {p: (p.read_bytes() if p.is_file() else None) for p in out.rglob("*")}
    proc = run_cli(*train_args(tmp_path, tiny_bert, *files, "--overwrite", "--text-column", "nope"))
    assert proc.returncode == 2 and "'nope'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert {p: (p.read_bytes() if p.is_file() else None) for p in out.rglob("*")} == before


def test_unknown_config_key_in_yaml(tmp_path, tiny_bert, files):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("optim:\n  learning_rate: 3.0e-5\n")
    proc = run_cli(*train_args(tmp_path, tiny_bert, *files, positional=[str(cfg)]))
    line = assert_refused(proc, tmp_path, "unknown config key 'optim.learning_rate'", "allowed:")
    assert "lr" in line.split("allowed:")[1].replace(",", " ").split()


def test_unknown_config_key_override(tmp_path, tiny_bert, files):
    proc = run_cli(*train_args(tmp_path, tiny_bert, *files, positional=["data.max_len=64"]))
    line = assert_refused(proc, tmp_path, "unknown config key 'data.max_len'", "allowed:")
    assert "max_length" in line


@pytest.mark.parametrize(
    "flag,value,key", [("--lr", "0", "optim.lr"), ("--batch-size", "-8", "batch_size"), ("--epochs", "0", "epochs")]
)
def test_zero_or_negative_hyperparameter(tmp_path, tiny_bert, files, flag, value, key):
    proc = run_cli(*train_args(tmp_path, tiny_bert, *files, flag, value))
    assert_refused(proc, tmp_path, f"bad value for '{key}'", "greater than 0")


def test_max_length_above_model_limit(tmp_path, tiny_bert, files):
    proc = run_cli(*train_args(tmp_path, tiny_bert, *files, "--max-length", "256"))
    assert_refused(proc, tmp_path, "max_length 256", "limit of 128", "--max-length 128")


def test_predict_bad_column_writes_nothing(tmp_path, tiny_bert):
    """predict checks its input before loading the model and never leaves a partial output."""
    inp = write_sentiment_csv(tmp_path / "in.csv", 4)
    out = tmp_path / "preds.jsonl"
    proc = run_cli("predict", tiny_bert, "--input", str(inp), "--output", str(out), "--text-column", "review")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "column 'review' not found" in lines[0] and "columns are: text, label" in lines[0]
    assert not out.exists() and not list(Path(tmp_path).glob(".preds*"))


def test_download_offline_is_one_clear_line(tmp_path):
    target = tmp_path / "models" / "tiny"
    proc = run_cli(
        "download",
        "prajjwal1/bert-tiny",
        "--local-dir",
        str(target),
        "--include",
        "*.json",
        "--exclude",
        "*.bin",
        env={"HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: could not download model 'prajjwal1/bert-tiny'")
    assert "HF_HUB_OFFLINE" in lines[0] and "--model" in lines[0]
    assert not target.exists()
