"""Every bad input: one `error:` line naming the problem and the fix, exit code 2, no traceback,
nothing written. Each case runs the real CLI entry point in this process, with what reaches the file descriptors
captured (`in_process`); a few run it in a fresh process too, so that nothing a library prints as it is first
imported gets past the one line (and the cases that set the environment run in their own).

"Nothing written" is checked on the output dir (never created, or left byte-for-byte as it was)
and on a fresh tokenization cache (still empty: the error came before any tokenization).
"""

import os
import subprocess
from pathlib import Path

import pytest

from conftest import cli_flags, cli_main, gpu_here, run_cli, train_command, write_sentiment_csv


@pytest.fixture
def files(tmp_path):
    train = write_sentiment_csv(tmp_path / "train.csv", 24, seed=1)
    val = write_sentiment_csv(tmp_path / "val.csv", 8, seed=2)
    return train, val


def train_args(tmp_path, tiny_bert, train, val, *extra, positional=()):
    """`train [POSITIONAL]` on these files into tmp_path/out (cache: tmp_path/cache), 1 step of 8, then `extra`."""
    files = cli_flags(train_file=train, validation_file=val, model=tiny_bert)
    where = cli_flags(output_dir=tmp_path / "out", cache_dir=tmp_path / "cache", max_steps=1, batch_size=8)
    return ["train", *positional, *files, *where, *extra]


def in_process(capfd, *args: str) -> subprocess.CompletedProcess:
    """The real CLI entry point with `args` in this process, as a finished process: its exit code and what it
    wrote to stdout and stderr, file descriptors included (the start-up of a fresh process costs more than a
    refusal)."""
    from tuneforge.cli import main

    capfd.readouterr()
    code = main([str(a) for a in args])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["tuneforge", *args], code, out, err)


def train_on(capfd, tmp_path, tiny_bert, files, *extra, train: str | None = None, val: str | None = None):
    """train_args in this process after writing `train` and/or `val` (UTF-8) over the train and validation files."""
    for path, text in zip(files, (train, val)):
        if text is not None:
            path.write_text(text, encoding="utf-8")
    return in_process(capfd, *train_args(tmp_path, tiny_bert, *files, *extra))


def assert_refused(proc, tmp_path, *needles, started: bool = False):
    """One clear error line with every needle, exit 2, no traceback, no output, no tokenization (tmp_path/out and
    tmp_path/cache untouched); `started`: the run had begun, so only the line is checked."""
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    if started:
        return lines[0]
    assert not (tmp_path / "out").exists(), "the output dir was created"
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(cache.iterdir()), "data was tokenized before the error"
    return lines[0]


def test_missing_file(tmp_path, tiny_bert, files):
    _, val = files
    proc = run_cli(*train_args(tmp_path, tiny_bert, tmp_path / "no-such.csv", val), fresh=True)
    assert_refused(proc, tmp_path, "no-such.csv", "does not exist", "check the path")


def test_a_relative_path_that_is_not_there_names_the_folder_it_is_read_from(
    capfd, tmp_path, tiny_bert, files, monkeypatch
):
    """A moved run's config.yaml re-run from another folder: its relative paths (as typed) are read from there,
    which the line did not say."""
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    here = f"(a relative path is read from the current folder {tmp_path / 'elsewhere'})"
    proc = in_process(capfd, *train_args(tmp_path, "../mymodel", *files))
    assert_refused(proc, tmp_path, "model '../mymodel' does not exist", here)
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, "../data/train.csv", files[1]))
    assert_refused(proc, tmp_path, "'../data/train.csv' does not exist", here)
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, tmp_path / "gone.csv", files[1]))
    assert "current folder" not in assert_refused(proc, tmp_path, "gone.csv' does not exist")


def test_unknown_task(tmp_path, tiny_bert, files):
    proc = run_cli(*train_args(tmp_path, tiny_bert, *files, "--task", "sentiment"), fresh=True)
    assert_refused(proc, tmp_path, "unknown task 'sentiment'", "choose one of", "glue/mrpc", "classification")


def test_unknown_glue_task(capfd, tmp_path, tiny_bert, files):
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, *files, "--task", "glue/mrcp"))
    assert_refused(proc, tmp_path, "'mrcp'", "glue/mrpc")


def test_misspelt_text_column(tmp_path, tiny_bert, files):
    proc = run_cli(*train_args(tmp_path, tiny_bert, *files, "--text-column", "txet"), fresh=True)
    assert_refused(proc, tmp_path, "column 'txet' not found", "columns are: text, label", "--text-column")


def test_missing_label_column(capfd, tmp_path, tiny_bert, files):
    reviews = "review,sentiment\ngood film,pos\nbad film,neg\n"
    proc = train_on(capfd, tmp_path, tiny_bert, files, "--text-column", "review", train=reviews)
    assert_refused(proc, tmp_path, "column 'label' not found", "columns are: review, sentiment", "--label-column")


def test_empty_dataset(capfd, tmp_path, tiny_bert, files):
    proc = train_on(capfd, tmp_path, tiny_bert, files, train="text,label\n")
    assert_refused(proc, tmp_path, "train.csv", "no examples")


def test_label_outside_label_set(capfd, tmp_path, tiny_bert, files):
    proc = train_on(capfd, tmp_path, tiny_bert, files, val="text,label\na fine film,pos\nan odd film,neutral\n")
    assert_refused(proc, tmp_path, "label 'neutral'", "val.csv", "row 2", "[neg, pos]")


def test_non_numeric_regression_label(capfd, tmp_path, tiny_bert, files):
    scores = dict(train="text,label\na fine film,4.5\nan odd film,high\n", val="text,label\na film,1.0\n")
    proc = train_on(capfd, tmp_path, tiny_bert, files, "--task", "regression", **scores)
    assert_refused(proc, tmp_path, "regression label 'high'", "row 2", "not a finite number")


def test_malformed_csv_row(capfd, tmp_path, tiny_bert, files):
    proc = train_on(capfd, tmp_path, tiny_bert, files, train="text,label\na fine film,pos\nan odd, long film,neg\n")
    assert_refused(proc, tmp_path, "malformed row", "Expected 2 fields in line 3, saw 3", "fix that row")


def test_non_utf8_file(capfd, tmp_path, tiny_bert, files):
    train, val = files
    train.write_bytes("text,label\nun film très beau,pos\nnul,neg\n".encode("latin-1"))
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, train, val))
    assert_refused(proc, tmp_path, "not UTF-8", "byte 0xe8", "re-save it as UTF-8")


def test_model_path_not_a_model_folder(capfd, tmp_path, files):
    not_a_model = tmp_path / "my-model"
    not_a_model.mkdir()
    (not_a_model / "weights.txt").write_text("nothing")
    proc = in_process(capfd, *train_args(tmp_path, str(not_a_model), *files))
    assert_refused(proc, tmp_path, "not a Hugging Face model folder", "config.json")


def test_output_dir_holding_a_run_is_refused(capfd, tmp_path, tiny_bert, files):
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "config.yaml").write_text("task: classification\n")
    (out / "metrics.jsonl").write_text('{"split": "eval", "step": 3}\n')
    before = {p: (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns) for p in out.rglob("*")}
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, *files))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "already holds a run" in lines[0] and "--overwrite" in lines[0], proc.stderr
    after = {p: (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns) for p in out.rglob("*")}
    assert after == before


def test_overwrite_with_bad_input_keeps_the_old_run(capfd, tmp_path, tiny_bert, files):
    """--overwrite replaces a run only once the new run's inputs are good: a bad column loses nothing."""
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "config.yaml").write_text("task: classification\n")
    (out / "metrics.jsonl").write_text('{"split": "eval", "step": 3}\n')
    before = {p: (p.read_bytes() if p.is_file() else None) for p in out.rglob("*")}
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, *files, "--overwrite", "--text-column", "nope"))
    assert proc.returncode == 2 and "'nope'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert {p: (p.read_bytes() if p.is_file() else None) for p in out.rglob("*")} == before


def test_unknown_config_key_in_yaml(capfd, tmp_path, tiny_bert, files):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("optim:\n  learning_rate: 3.0e-5\n")
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, *files, positional=[str(cfg)]))
    line = assert_refused(proc, tmp_path, "unknown config key 'optim.learning_rate'", "allowed:")
    assert "lr" in line.split("allowed:")[1].replace(",", " ").split()


def test_unknown_config_key_override(capfd, tmp_path, tiny_bert, files):
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, *files, positional=["data.max_len=64"]))
    line = assert_refused(proc, tmp_path, "unknown config key 'data.max_len'", "allowed:")
    assert "max_length" in line


@pytest.mark.parametrize(
    "flag,value,key", [("--lr", "0", "optim.lr"), ("--batch-size", "-8", "batch_size"), ("--epochs", "0", "epochs")]
)
def test_zero_or_negative_hyperparameter(capfd, tmp_path, tiny_bert, files, flag, value, key):
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, *files, flag, value))
    assert_refused(proc, tmp_path, f"bad value for '{key}'", "greater than 0")


def test_max_length_above_model_limit(capfd, tmp_path, tiny_bert, files):
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, *files, "--max-length", "256"))
    assert_refused(proc, tmp_path, "max_length 256", "limit of 128", "--max-length 128")


def test_an_unset_max_length_past_the_models_positions(capfd, tmp_path, tiny_bert, files):
    """max_length null (a config's, an override's) cut texts at the tokenizer's model_max_length (MiniLM's 512, a hub
    tokenizer's ~1e30: nowhere) on a model of 128 positions: an internal error at the first long text."""
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, *files, "data.max_length=null"))
    assert_refused(proc, tmp_path, "max_length is unset (null)", "model_max_length 512", "--max-length 128")


@pytest.mark.parametrize("value", ["1", "2"])
def test_a_max_length_that_holds_no_text(capfd, tmp_path, tiny_bert, files, value):
    """A max_length at or below the special tokens the tokenizer adds ([CLS], [SEP]): 1 cut nothing (an internal error
    at the first text past the model's positions: the size of tensor a (302) must match ... (128)), 2 cut every text
    to nothing and trained on that; one line, as predict says it."""
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, *files, "--max-length", value))
    assert_refused(proc, tmp_path, f"--max-length {value} leaves no room for a text", "give at least 3")


@pytest.mark.parametrize("family", ["mpnet", "albert"])
def test_gradient_checkpointing_of_a_model_that_cannot(capfd, tmp_path, minilm_dir, files, family):
    """MPNet (all-mpnet-base-v2's family) and ALBERT have no activation checkpointing in transformers: the data were
    tokenized, then an internal error (ValueError: MPNetForSequenceClassification does not support activation
    checkpointing)."""
    from transformers import AlbertConfig, AlbertModel, AutoTokenizer, MPNetConfig, MPNetModel

    from conftest import save_random

    sizes = dict(vocab_size=30527, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    config_class, model_class = {"mpnet": (MPNetConfig, MPNetModel), "albert": (AlbertConfig, AlbertModel)}[family]
    model = save_random(tmp_path / family, model_class, config_class(**sizes))
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(model)
    proc = in_process(capfd, *train_args(tmp_path, model, *files, "--gradient-checkpointing"))
    said = assert_refused(proc, tmp_path, "ForSequenceClassification does not support gradient checkpointing")
    assert "drop --gradient-checkpointing" in said


@pytest.mark.parametrize(
    "kernel, needles",
    [
        # torch's FlexAttention has no backward on a CPU: an internal error at the first step, after all the data work
        ("flex_attention", ("'flex_attention' cannot train on a CPU", "use auto, eager or sdpa")),
        # these two were refused only as the model loaded, after the data were tokenized
        pytest.param(
            "flash_attention_2",
            ("'flash_attention_2' runs on a GPU only", "use auto, eager or sdpa"),
            marks=pytest.mark.skipif(gpu_here(), reason="a GPU is here: the run is not on the CPU"),
        ),
        ("sdpaa", ("'sdpaa' is not a kernel transformers knows", "use one of auto, eager, flash_attention_2,", "sdpa")),
    ],
)
def test_an_attention_kernel_that_cannot_run_here(capfd, tmp_path, tiny_bert, files, kernel, needles):
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, *files, "--attn-implementation", kernel))
    assert_refused(proc, tmp_path, *needles)


@pytest.mark.parametrize(
    "flag, value, said",
    [("--text-column", "txt", "column 'txt' not found"), ("--max-length", "256", "use --max-length 128 or less")],
)
def test_bad_input_under_launched_workers_is_one_line(tmp_path, tiny_bert, files, flag, value, said):
    """Under --nproc 2 each worker printed the line, torch's elastic agent its traceback after it (the other rank its
    broken collective's) and the launcher "training workers failed", exit 1: now the launcher says the line once."""
    args = train_args(tmp_path, tiny_bert, *files, "--backend", "ddp", "--nproc", "2", flag, value)
    assert_refused(run_cli(*args, timeout=300), tmp_path, said)


def test_fewer_training_examples_than_ranks_is_one_line(tmp_path, tiny_bert, files):
    """1 example on 2 ranks: the plan counted a step per epoch, each rank's share of it was dropped (a rank needs one
    example), and the loop went through empty epochs for ever (evaluating at each)."""
    args = train_args(tmp_path, tiny_bert, *files, "--backend", "ddp", "--nproc", "2", "--max-train-samples", "1")
    proc = run_cli(*args, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: 1 training example cannot be shared by 2 data-parallel ranks (each needs at least one); train on "
        "at least 2 examples, or on fewer processes (--nproc)"
    )


def test_predict_bad_column_writes_nothing(capfd, tmp_path, tiny_bert):
    """predict checks its input before loading the model and never leaves a partial output."""
    inp = write_sentiment_csv(tmp_path / "in.csv", 4)
    out = tmp_path / "preds.jsonl"
    proc = in_process(capfd, "predict", tiny_bert, "--input", str(inp), "--output", str(out), "--text-column", "review")
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


# ---- issue #10: input that used to escape as a traceback -------------------------------------
def one_error(result: tuple[int, str, str], expected: str) -> None:
    """A conftest.cli_main (code, stdout, stderr) result: exit 2 and exactly this one line on stderr."""
    code, _, err = result
    assert code == 2, err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.strip()] == [f"error: {expected}"]


def test_text_column_that_is_the_label_column(capfd, tmp_path, tiny_bert, files):
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, *files, "--text-column", "label"))
    line = assert_refused(proc, tmp_path)
    assert line == (
        "error: column 'label' is both the text column and the label column; pass the column holding the text "
        "with --text-column and the one holding the labels with --label-column"
    )


def test_guessed_text_column_that_is_the_label_column(tmp_path, tiny_bert, files, capsys):
    """No --text-column: the guessed text column ('text') is also what --label-column names."""
    one_error(
        cli_main(capsys, *train_args(tmp_path, tiny_bert, *files, "--label-column", "text")),
        "column 'text' is both the text column and the label column; pass the column holding the text with "
        "--text-column and the one holding the labels with --label-column",
    )
    assert not (tmp_path / "out").exists()


def test_model_folder_without_weights(capfd, tmp_path, tiny_bert, files):
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    for f in Path(tiny_bert).iterdir():
        if f.suffix != ".safetensors":
            (no_weights / f.name).write_bytes(f.read_bytes())
    proc = in_process(capfd, *train_args(tmp_path, str(no_weights), *files))
    line = assert_refused(proc, tmp_path)
    assert line == (
        f"error: model {str(no_weights)!r} has a config.json but no weights (model.safetensors or "
        "pytorch_model.bin); pass a folder saved with save_pretrained, e.g. OUTPUT_DIR/model"
    )


@pytest.mark.parametrize(
    ("weights", "said"),
    [
        ("tf_model.h5", "holds TensorFlow weights only (tf_model.h5)"),
        ("flax_model.msgpack", "holds Flax weights only (flax_model.msgpack)"),
    ],
)
def test_a_tensorflow_or_flax_model_folder_is_one_line_before_any_data_work(
    capfd, tmp_path, tiny_bert, files, weights, said
):
    """A folder of TensorFlow or Flax weights only (older hub models) passed the weights check: the data were
    tokenized, then loading said 'no file named model.safetensors, or pytorch_model.bin' without a word of why."""
    folder = tmp_path / "other-framework"
    folder.mkdir()
    for f in Path(tiny_bert).iterdir():
        (folder / (weights if f.suffix == ".safetensors" else f.name)).write_bytes(f.read_bytes())
    assert_refused(in_process(capfd, *train_args(tmp_path, str(folder), *files)), tmp_path, said, "PyTorch weights")


def test_model_folder_without_tokenizer_files(tmp_path, tiny_bert, files, capsys):
    """transformers would build a 5-token tokenizer from config.json alone; training would run on it."""
    no_tok = tmp_path / "no-tokenizer"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tok / name).write_bytes((Path(tiny_bert) / name).read_bytes())
    one_error(
        cli_main(capsys, *train_args(tmp_path, str(no_tok), *files)),
        f"model {str(no_tok)!r} has no tokenizer files (tokenizer.json, vocab.txt, ...); save the tokenizer into "
        "that folder with tokenizer.save_pretrained",
    )
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_with_more_tokens_than_the_models_embeddings(capfd, tmp_path, tiny_bert, minilm_dir, files):
    """A token added to the tokenizer and not to the model (tokenizer.add_tokens without resize_token_embeddings)
    has no embedding: training (and predict) stopped at its first text holding it as an internal error
    ('IndexError: index out of range in self'); it is one line before any data work, naming both sizes."""
    from transformers import AutoTokenizer

    from conftest import save_tiny_classifier

    added = tmp_path / "added"
    save_tiny_classifier(added, minilm_dir, {0: "neg", 1: "pos"})
    tokenizer = AutoTokenizer.from_pretrained(added)
    tokenizer.add_tokens(["zorblax"])
    tokenizer.save_pretrained(added)
    said = f"the tokenizer of {str(added)!r} has 30523 tokens, more than the 30522 rows of the model's embeddings"
    rows = "a zorblax film,pos\na dull film,neg\n"
    train, val = "text,label\n" + rows * 4, "text,label\n" + rows
    assert_refused(train_on(capfd, tmp_path, str(added), files, train=train, val=val), tmp_path, said)
    (tmp_path / "in.csv").write_text("text\na zorblax film\n")
    predict = ["predict", added, "--input", tmp_path / "in.csv", "--output", tmp_path / "out"]
    assert_refused(in_process(capfd, *predict), tmp_path, said)


def test_model_folder_with_corrupt_weights(tmp_path, tiny_bert, files, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in Path(tiny_bert).iterdir():
        (broken / f.name).write_bytes(b"not a safetensors file" if f.suffix == ".safetensors" else f.read_bytes())
    one_error(
        cli_main(capsys, *train_args(tmp_path, str(broken), *files)),
        f"model {str(broken)!r}: model.safetensors is not a readable safetensors file (Error while deserializing "
        "header: header too large); save the model again with save_pretrained",
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def weights_renamed(model_dir: str, out: Path, prefix: str) -> str:
    """A copy of the model folder `model_dir` whose weights' names start with `prefix`, as a state dict saved from
    a wrapper (DDP's 'module.') is named."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in Path(model_dir).iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    weights = load_file(out / "model.safetensors")
    save_file({prefix + k: v for k, v in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


def test_a_folder_none_of_whose_weights_the_model_names_is_refused(capfd, tmp_path, minilm_dir, tiny_gpt2, files):
    """transformers starts every weight it does not find random and says so in a warning the command line
    silences: a folder of weights named 'module.bert...' trained, and predicted, from random weights without a
    word; one line naming both namings (the causal LM's own loading too)."""
    from conftest import save_tiny_classifier

    wrapped = weights_renamed(
        save_tiny_classifier(tmp_path / "c", minilm_dir, {0: "neg", 1: "pos"}), tmp_path / "w", "module."
    )
    said = ("none of the model's weights is in the folder (its weights are named like 'module.bert.", "random")
    (tmp_path / "in.csv").write_text("text\na fine film\n")
    predict = ["predict", wrapped, "--input", tmp_path / "in.csv", "--output", tmp_path / "out.jsonl"]
    assert_refused(in_process(capfd, *predict), tmp_path, *said)
    assert not (tmp_path / "out.jsonl").exists()
    for model, extra in ((wrapped, ()), (weights_renamed(tiny_gpt2, tmp_path / "g", "module."), ("--task", "clm"))):
        proc = train_on(capfd, tmp_path, model, files, *extra)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "none of the model's weights is in the folder (its weights are named like 'module." in proc.stderr
        assert not (tmp_path / "out" / "model").exists()


LFS = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"ab" * 32 + b"\nsize 438011953\n"


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("cut short", "(PytorchStreamReader failed reading zip archive: failed finding central directory)"),
        ("a Git LFS pointer", "pytorch_model.bin is a Git LFS pointer, not the weights"),
    ],
)
def test_a_pytorch_model_bin_that_is_no_readable_pytorch_file_is_one_line(
    capfd, tmp_path, tiny_bert, tiny_gpt2, files, damage, said
):
    """A pytorch_model.bin cut short (a download stopped) or the pointer Git LFS leaves where it fetched nothing was
    an internal error (RuntimeError: PytorchStreamReader failed ...; UnpicklingError) in training, generate and
    predict, where a broken model.safetensors is one line; so is it, the causal LM's own loading too."""
    import torch
    from safetensors.torch import load_file

    for model, extra in ((tiny_bert, ()), (tiny_gpt2, ("--task", "clm"))):
        folder = tmp_path / f"bin-{Path(model).name}"
        folder.mkdir()
        for f in Path(model).iterdir():
            if f.suffix != ".safetensors":
                (folder / f.name).write_bytes(f.read_bytes())
        torch.save(load_file(Path(model) / "model.safetensors"), folder / "pytorch_model.bin")
        whole = (folder / "pytorch_model.bin").read_bytes()
        (folder / "pytorch_model.bin").write_bytes(whole[: len(whole) // 2] if damage == "cut short" else LFS)
        proc = train_on(capfd, tmp_path, str(folder), files, *extra)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert said in proc.stderr.strip().splitlines()[-1]
    proc = in_process(capfd, "generate", folder, "--prompt", "The dog")
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and said in proc.stderr, proc.stderr


def test_a_hub_cache_folder_names_its_snapshot_which_loads(capfd, tmp_path, minilm_dir, files):
    """~/.cache/huggingface/hub/models--ORG--NAME holds the model in snapshots/REVISION, its files links to blobs:
    the cache folder itself was 'not a Hugging Face model folder (no config.json)'; one line naming the snapshot
    refs/main names and the hub id, and the snapshot, links and all, predicts."""
    from conftest import save_tiny_classifier

    model = Path(save_tiny_classifier(tmp_path / "classifier", minilm_dir, {0: "neg", 1: "pos"}))
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / ("a1" * 20)
    for folder in (repo / "blobs", repo / "refs", snapshot):
        folder.mkdir(parents=True)
    (repo / "refs" / "main").write_text("a1" * 20)
    for i, f in enumerate(sorted(model.iterdir())):
        (repo / "blobs" / f"blob{i}").write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(f"../../blobs/blob{i}")
    said = f"is a hub cache folder, not a model folder; pass {str(snapshot)!r} or the hub id 'org/tiny'"
    assert_refused(in_process(capfd, *train_args(tmp_path, str(repo), *files)), tmp_path, said)
    (tmp_path / "in.csv").write_text("text\na fine film\n")
    predict = ["predict", snapshot, "--input", tmp_path / "in.csv", "--output", tmp_path / "out.jsonl"]
    assert in_process(capfd, *predict).returncode == 0 and (tmp_path / "out.jsonl").read_text().count("label_id") == 1


def test_output_dir_that_cannot_be_created(capfd, tmp_path, tiny_bert, files):
    proc = in_process(capfd, *train_args(tmp_path, tiny_bert, *files)[:-6], "--output-dir", "/proc/forbidden/run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        "error: output dir '/proc/forbidden/run' cannot be created ('/proc' takes no new folders); choose another "
        "--output-dir"
    )
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_output_dir_under_a_file(tmp_path, tiny_bert, files, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    args = train_args(tmp_path, tiny_bert, *files)
    args[args.index("--output-dir") + 1] = str(blocker / "run")
    one_error(
        cli_main(capsys, *args),
        f"output dir {str(blocker / 'run')!r} cannot be created: {str(blocker)!r} is a file; choose another "
        "--output-dir",
    )


def test_empty_output_dir_is_refused_not_read_as_the_current_folder(tmp_path, tiny_bert, files, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the old code wrote the run (Path("") is ".")
    args = train_args(tmp_path, tiny_bert, *files)
    args[args.index("--output-dir") + 1] = ""
    one_error(cli_main(capsys, *args), "--output-dir is empty; name a folder (output dir)")
    assert not (tmp_path / "model").exists() and not (tmp_path / "config.yaml").exists()


@pytest.mark.parametrize("kind", ["a device", "a named pipe"])
def test_train_file_that_is_a_device_or_a_pipe(tmp_path, tiny_bert, files, capsys, kind):
    """`--train-file <(zcat rows.gz)` names a pipe, `/dev/null` a device: neither can be read as a table (and a
    pipe can be read once); each is refused as what it is (the old message called both a folder)."""
    path = "/dev/null"
    if kind == "a named pipe":
        path = str(tmp_path / "rows.csv")
        os.mkfifo(path)
    args = train_args(tmp_path, tiny_bert, *files)
    args[args.index("--train-file") + 1] = path
    one_error(
        cli_main(capsys, *args),
        f"{path!r} is a pipe or a device, not a regular file; pass a csv/tsv/json/jsonl/parquet/txt file",
    )


def test_cache_dir_that_cannot_be_created(tmp_path, tiny_bert, files, capsys):
    args = train_args(tmp_path, tiny_bert, *files)
    args[args.index("--cache-dir") + 1] = "/proc/forbidden/cache"
    one_error(
        cli_main(capsys, *args),
        "cache dir '/proc/forbidden/cache' cannot be created ('/proc' takes no new folders); choose another "
        "--cache-dir",
    )
    assert not (tmp_path / "out").exists()


def test_override_without_a_value(tmp_path, tiny_bert, files, capsys):
    one_error(
        cli_main(capsys, *train_args(tmp_path, tiny_bert, *files, positional=["optim.lr"])),
        "'optim.lr' is neither a config file nor a key=value override; did you mean optim.lr=VALUE? "
        "(a config file is a YAML file such as configs/glue-mrpc.yaml)",
    )
    assert not (tmp_path / "out").exists()


def test_single_training_label_is_refused(capfd, tmp_path, tiny_bert, files):
    train, _ = files
    positives = "text,label\na fine film,pos\na great film,pos\nlovely,pos\n"
    proc = train_on(capfd, tmp_path, tiny_bert, files, train=positives, val="text,label\nan ok film,pos\n")
    line = assert_refused(proc, tmp_path)
    assert line == (
        f"error: the train data ({train}) has a single label, 'pos'; a classifier needs examples of at least two "
        "labels: add rows with another label (or pick the label column with --label-column)"
    )


@pytest.mark.parametrize("command", ["predict", "generate", "serve", "eval"])
def test_model_commands_on_a_checkpoint_folder(run_with_checkpoint, tmp_path, capsys, command):
    run, data = run_with_checkpoint
    ckpt = str(run / "checkpoint-1")
    extra = {
        "predict": ["--input", str(data), "--output", str(tmp_path / "p.jsonl")],
        "generate": ["--prompt", "hello"],
        "serve": ["--port", "0"],
        "eval": ["--task", "classification", "--validation-file", str(data)],
    }[command]
    one_error(
        cli_main(capsys, command, ckpt, *extra),
        f"model {ckpt!r} is a training checkpoint, not a model folder; pass OUTPUT_DIR/model, or run "
        f"`tuneforge export {ckpt} OUT_DIR` first and pass OUT_DIR",
    )
    assert not (tmp_path / "p.jsonl").exists()


def test_predict_on_a_run_output_dir(run_with_checkpoint, tmp_path, capsys):
    run, data = run_with_checkpoint
    one_error(
        cli_main(capsys, "predict", str(run), "--input", str(data), "--output", str(tmp_path / "p.jsonl")),
        f"model {str(run)!r} is a run's output dir, not a model folder; pass {str(run / 'model')!r}",
    )


def test_predict_output_that_cannot_be_written(run_with_checkpoint, capsys):
    run, data = run_with_checkpoint
    model = str(run / "model")
    one_error(
        cli_main(capsys, "predict", model, "--input", str(data), "--output", "/proc/forbidden/p.jsonl"),
        "the folder of --output '/proc/forbidden' cannot be created ('/proc' takes no new folders); choose another "
        "--output",
    )


@pytest.mark.parametrize("command", ["predict", "serve"])
def test_negative_max_length_for_predict_and_serve(run_with_checkpoint, tmp_path, capsys, command):
    """Was an internal OverflowError from the tokenizer."""
    run, data = run_with_checkpoint
    extra = ["--input", str(data), "--output", str(tmp_path / "p.jsonl")] if command == "predict" else ["--port", "0"]
    one_error(
        cli_main(capsys, command, str(run / "model"), *extra, "--max-length", "-5"),
        "--max-length must be between 1 and 1048576, got -5",
    )


def test_generate_with_an_unreadable_config(tmp_path, tiny_gpt2, capsys):
    broken = tmp_path / "broken-gpt2"
    broken.mkdir()
    for f in Path(tiny_gpt2).iterdir():
        if f.is_file():
            (broken / f.name).write_bytes(b"{not json" if f.name == "config.json" else f.read_bytes())
    code, _, err = cli_main(capsys, "generate", str(broken), "--prompt", "A man")
    assert code == 2 and "Traceback" not in err
    [line] = [line for line in err.splitlines() if line.strip()]
    assert line.startswith(f"error: could not load the model config from {str(broken)!r}: ")


def test_clm_block_size_with_no_targets(tmp_path, tiny_gpt2, capsys):
    """A block of one token has no next-token target: the run trained on nothing and logged a nan loss."""
    text = tmp_path / "train.txt"
    text.write_text("a man is riding a red bike.\nthe dog is holding a blue ball.\n", encoding="utf-8")
    out = tmp_path / "out"
    where = cli_flags(output_dir=out, cache_dir=tmp_path / "cache")
    args = train_command((text, text), tiny_gpt2, task="clm", block_size=1) + where
    one_error(
        cli_main(capsys, *args),
        "block size 1 leaves no next-token targets (token t predicts token t+1); use --block-size 2 or more",
    )
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_download_local_dir_that_cannot_be_created(capsys):
    one_error(
        cli_main(capsys, "download", "prajjwal1/bert-tiny", "--local-dir", "/proc/forbidden/tiny"),
        "folder '/proc/forbidden/tiny' cannot be created ('/proc' takes no new folders); choose another --local-dir",
    )


def test_unexpected_exception_is_one_internal_error_line_with_a_report_file(
    tmp_path, tiny_bert, files, capsys, monkeypatch
):
    """The handler under test is cli.main's: a bug deep inside a command becomes one line (exit 1, never 2),
    and the traceback goes to a file that names the command and the exception."""
    import tempfile

    import tuneforge.predict

    def broken(*args, **kwargs):
        raise KeyError("boom inside predict")

    monkeypatch.setattr(tuneforge.predict, "predict_file", broken)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _, val = files
    code, out, err = cli_main(capsys, "predict", tiny_bert, "--input", str(val), "--output", str(tmp_path / "p"))
    assert code == 1 and out == "" and "Traceback" not in err
    [line] = [line for line in err.splitlines() if line.strip()]
    [report] = list(tmp_path.glob("tuneforge-error-*.txt"))
    assert line == (
        f"internal error (a bug in tuneforge, not in your input): KeyError: 'boom inside predict'; the full "
        f"traceback is in {report}; please report it to the tuneforge issue tracker with that file and the output "
        "of `tuneforge env`"
    )
    text = report.read_text()
    assert f"command: tuneforge predict {tiny_bert} --input {val}" in text
    assert "Traceback (most recent call last)" in text and "KeyError: 'boom inside predict'" in text
    assert 'raise KeyError("boom inside predict")' in text


def test_an_internal_error_of_a_command_line_that_is_not_utf8_still_writes_its_report(
    tmp_path, tiny_bert, files, capsys, monkeypatch
):
    """An argument holding a byte that is not UTF-8 (a Latin-1 file name: a lone surrogate in argv) made the
    handler itself fail writing the report: UnicodeEncodeError and its traceback on stderr."""
    import tempfile

    import tuneforge.predict

    def broken(*args, **kwargs):
        raise KeyError("boom inside predict")

    monkeypatch.setattr(tuneforge.predict, "predict_file", broken)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _, val = files
    out_file = str(tmp_path / "caf\udce9.jsonl")
    code, out, err = cli_main(capsys, "predict", tiny_bert, "--input", str(val), "--output", out_file)
    assert code == 1 and "Traceback" not in err
    [report] = list(tmp_path.glob("tuneforge-error-*.txt"))
    assert f"the full traceback is in {report}" in err
    assert "--output " + str(tmp_path / "caf\\udce9.jsonl") in report.read_text()


def test_download_malformed_repo_id(capsys):
    one_error(
        cli_main(capsys, "download", "not/a/valid/id"),
        "'not/a/valid/id' is not a hub repo id (Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
        "'not/a/valid/id'. Use `repo_type` argument if needed.); pass one like "
        "sentence-transformers/all-MiniLM-L6-v2",
    )


def test_seq2seq_source_and_target_the_same_column(tmp_path, capsys):
    table = tmp_path / "pairs.csv"
    table.write_text("en,de\na man,ein Mann\n", encoding="utf-8")
    columns = cli_flags(source_column="en", target_column="en", output_dir=tmp_path / "out")
    one_error(
        cli_main(capsys, "train", "--task", "seq2seq", "--train-file", str(table), *columns),
        "--source-column and --target-column both name 'en'; pass the column holding the inputs and the one holding "
        "the outputs",
    )
    assert not (tmp_path / "out").exists()


def test_serve_without_its_web_packages(run_with_checkpoint, capsys, monkeypatch):
    import sys

    run, _ = run_with_checkpoint
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` raises ImportError, as when not installed
    expected = "`tuneforge serve` needs fastapi and uvicorn (uvicorn is missing): pip install fastapi uvicorn"
    one_error(cli_main(capsys, "serve", str(run / "model"), "--port", "0"), expected)


def test_generate_from_an_empty_prompt(tiny_gpt2, capsys):
    """GPT-2's tokenizer adds no BOS: an empty prompt was an internal RuntimeError deep inside generate."""
    result = cli_main(capsys, "generate", tiny_gpt2, "--prompt", "")
    one_error(
        result, "prompt 1 ('') has no tokens; a causal language model continues a text, so give it at least a word"
    )
    assert result[1] == ""  # nothing on stdout


@pytest.mark.parametrize("task", ["classification", "clm", "seq2seq"])
def test_one_training_example_and_no_validation_data(tmp_path, tiny_bert, tiny_gpt2, capsys, task):
    """10% of one example is no example: sklearn's ValueError escaped as an internal error."""
    if task == "classification":
        (tmp_path / "one.csv").write_text("text,label\na film,pos\n", encoding="utf-8")
        data, model = ["--train-file", str(tmp_path / "one.csv")], tiny_bert
        expected = "1 row: too few to hold out 10% for validation; add rows or pass --validation-file"
    elif task == "clm":
        (tmp_path / "one.txt").write_text("a single line of text\n", encoding="utf-8")
        data, model = ["--train-file", str(tmp_path / "one.txt")], tiny_gpt2
        expected = "1 line: too few to hold out 10% for validation; add text or pass --validation-file"
    else:
        (tmp_path / "a.en").write_text("a man\n", encoding="utf-8")
        (tmp_path / "a.de").write_text("ein Mann\n", encoding="utf-8")
        data = ["--source-file", str(tmp_path / "a.en"), "--target-file", str(tmp_path / "a.de")]
        model = None
        expected = (
            "1 sentence pair: too few to hold out 10% for validation; add pairs or pass --validation-source-file "
            "and --validation-target-file"
        )
    out = tmp_path / "out"
    args = ["train", "--task", task, *data, "--output-dir", str(out), "--cache-dir", str(tmp_path / "cache"), "--quiet"]
    one_error(cli_main(capsys, *args, *(["--model", model] if model else [])), f"the training data has only {expected}")
    assert not out.exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "task,dataset",
    [("ner", "conll2003"), ("qa", "squad"), ("multiple-choice", "swag/regular")],
)
def test_the_token_and_span_tasks_without_data_load_the_hub_and_say_so_offline(task, dataset, tiny_bert, tmp_path):
    proc = run_cli(
        "train",
        "--task",
        task,
        "--model",
        tiny_bert,
        "--output-dir",
        str(tmp_path / "out"),
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: could not load {dataset} from the Hugging Face hub") and "pass --data-dir" in line
    assert not (tmp_path / "out").exists()


def write_family_case_data(folder: Path, task: str) -> list[str]:
    """A small training file of `task`'s kind in `folder`, as the flags that pass it."""
    import json

    from conftest import write_conll, write_parallel

    if task == "ner":
        return ["--train-file", str(write_conll(folder / "train.txt", 8))]
    if task == "seq2seq":
        en, de = write_parallel(folder, "train", 8)
        return ["--source-file", str(en), "--target-file", str(de)]
    context = "Anna lives in Paris and works for Siemens."
    rows = {
        "qa": {
            "question": "Where does Anna live?",
            "context": context,
            "answers": {"text": ["Paris"], "answer_start": [14]},
        },
        "multiple-choice": {"question": "Anna lives in", "choices": ["Paris.", "the sea."], "label": 0},
        "clm": {"text": context},
    }
    train = folder / "train.jsonl"
    train.write_text(json.dumps(rows[task]) + "\n" + json.dumps(rows[task]) + "\n", encoding="utf-8")
    return ["--train-file", str(train)]


@pytest.mark.parametrize(
    "task,model,family,kind,usual",
    [
        ("multiple-choice", "tiny_gpt2", "gpt2", "multiple-choice model", "bert, roberta or deberta-v2"),
        ("ner", "tiny_gemma3", "gemma3_text", "token-classification model", "bert, roberta or deberta-v2"),
        ("qa", "tiny_gemma3", "gemma3_text", "question-answering model", "bert, roberta or deberta-v2"),
        ("clm", "tiny_t5", "t5", "causal language model", "llama, qwen2 or gpt2"),
        ("seq2seq", "tiny_gpt2", "gpt2", "sequence-to-sequence model", "t5 or bart"),
    ],
)
def test_a_model_family_without_the_tasks_head_before_any_data_work(
    request, tmp_path, capfd, task, model, family, kind, usual
):
    """transformers has no class of the task's kind for the model's family (no GPT2ForMultipleChoice, no Gemma 3
    reader or tagger): the run tokenized all its data, then stopped in transformers' words ('Unrecognized
    configuration class <class '...Gemma3TextConfig'> for this kind of AutoModel: AutoModelForQuestionAnswering');
    it is one line naming the family and the task, before the data are read, and before the tokenizer's checks (GPT-2's
    64 positions: the default max_length 128 was refused first, and --max-length 64 only met the family's refusal)."""
    if model == "tiny_gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        from conftest import save_tiny_causal_lm

        sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
        path = save_tiny_causal_lm(tmp_path / "gemma3", Gemma3ForCausalLM, Gemma3TextConfig, **sizes)
    else:
        path = request.getfixturevalue(model)
    where = cli_flags(task=task, model=path, output_dir=tmp_path / "out", cache_dir=tmp_path / "cache")
    proc = in_process(capfd, "train", *write_family_case_data(tmp_path, task), *where)
    assert_refused(
        proc,
        tmp_path,
        f"model {path!r} is of the {family} family, for which transformers has no {kind} (task {task!r} needs one); "
        f"give a model of a family that has one, such as {usual}",
    )
