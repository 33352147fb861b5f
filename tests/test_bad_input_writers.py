"""Writers never destroy what tuneforge did not write: `train --overwrite`, `export`, `predict --output`,
`download --local-dir`, and the CLI-level bad inputs of `generate`, `chat` and `serve`. A destination that would
lose a user's file, or an input of the same command, is refused with one `error:` line (exit 2) before any work,
and nothing on disk changes (`refused` snapshots every file's bytes and mtime before and after)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import cli_flags, cli_main, write_sentiment_csv


def snapshot(*roots: Path) -> dict:
    """Every path under `roots`, with the bytes and mtime of each file: equal snapshots mean nothing changed
    (folders by their listing only: a probe folder made and removed to test writability changes their mtime)."""
    return {
        p: (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
        for root in roots
        for p in sorted(Path(root).rglob("*"))
    }


def refused(capsys, roots: tuple[Path, ...], *args: str, needles: tuple[str, ...] = ()) -> str:
    """`tuneforge ARGS` in this process: exit 2, one `error:` line holding every needle, nothing under
    `roots` changed. Returns the line."""
    before = snapshot(*roots)
    code, _, err = cli_main(capsys, *args)
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    assert snapshot(*roots) == before, "a refused command changed files on disk"
    return lines[0]


def old_run(folder: Path) -> None:
    """What an earlier run of tuneforge leaves in its output dir (the names it writes)."""
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text("{}")
    (folder / "checkpoint-3").mkdir()
    (folder / "checkpoint-3" / "meta.json").write_text("{}")
    (folder / "tensorboard").mkdir()
    (folder / "config.yaml").write_text("task: classification\n")
    (folder / "metrics.jsonl").write_text('{"split": "eval", "step": 3}\n')
    (folder / "latest").write_text("checkpoint-3\n")
    (folder / "result.json").write_text("{}")
    (folder / ".tmp-checkpoint-4-123-456").mkdir()


# ---- train --overwrite ----------------------------------------------------------------------------
USERS = ("my_reviews.csv", "my_val.csv", "notes.txt", "drafts", ".tmp-mine", "checkpoint-notes.txt", "latest.txt")


def test_overwrite_keeps_the_users_files_and_the_runs_own_inputs(tmp_path, tiny_bert, capsys, monkeypatch):
    """Issue 23 #3: --overwrite emptied the whole output dir, the training file it had just read included, and
    `--output-dir .` the working folder. Now only the entries a run writes go."""
    proj = tmp_path / "proj"
    old_run(proj)
    write_sentiment_csv(proj / "my_reviews.csv", 24, seed=1)
    write_sentiment_csv(proj / "my_val.csv", 8, seed=2)
    for name in ("notes.txt", ".tmp-mine", "checkpoint-notes.txt", "latest.txt"):
        (proj / name).write_text(f"the user's {name}")
    (proj / "drafts").mkdir()
    (proj / "drafts" / "idea.md").write_text("an idea")
    kept = {p: v for p, v in snapshot(proj).items() if p.relative_to(proj).parts[0] in USERS}
    monkeypatch.chdir(proj)
    args = cli_flags(train_file="my_reviews.csv", validation_file="my_val.csv", model=tiny_bert, output_dir=".")
    args += cli_flags(max_steps=1, batch_size=8, cache_dir=tmp_path / "cache", overwrite=True, quiet=True)
    code, _, err = cli_main(capsys, "train", *args)
    assert code == 0, err
    after = snapshot(proj)
    assert {p: v for p, v in after.items() if p.relative_to(proj).parts[0] in USERS} == kept  # byte for byte
    assert not (proj / "checkpoint-3").exists() and not (proj / ".tmp-checkpoint-4-123-456").exists()
    assert (proj / "model" / "model.safetensors").exists() and (proj / "config.yaml").exists()


def test_a_folder_of_user_files_with_no_run_is_written_into_without_overwrite(tmp_path):
    from tuneforge.checkpoint import holds_run
    from tuneforge.paths import foreign_entries, run_entries

    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "latest.txt").write_text("x")
    (folder / "model").write_text("a file named model is not a run's model folder")
    (folder / "checkpoint-best").mkdir()
    assert not holds_run(folder) and run_entries(folder) == []
    assert [p.name for p in foreign_entries(folder)] == ["checkpoint-best", "latest.txt", "model"]


@pytest.mark.parametrize("name,kind", [("model", "file"), ("config.yaml", "folder"), ("latest", "folder")])
def test_a_user_entry_with_a_run_name_of_another_kind_is_refused(tmp_path, tiny_bert, capsys, name, kind):
    out = tmp_path / "out"
    out.mkdir()
    (out / name).mkdir() if kind == "folder" else (out / name).write_text("mine")
    train = write_sentiment_csv(tmp_path / "train.csv", 16)
    args = cli_flags(model=tiny_bert, train_file=train, validation_file=train, output_dir=out, overwrite=True)
    refused(capsys, (tmp_path,), "train", *args, needles=(f"holds {name!r}, which is not the",))


def with_old_run(tmp_path) -> Path:
    out = tmp_path / "out"
    old_run(out)
    return out


@pytest.mark.parametrize(
    "where,flag",
    [
        ("model", "--model"),
        ("checkpoint-3", "--model"),
        ("checkpoint-3/train.csv", "--train-file"),
        ("model/val.csv", "--validation-file"),
        ("config.yaml", "the config file"),
    ],
)
def test_overwrite_refuses_a_run_whose_input_is_inside_what_it_replaces(tmp_path, tiny_bert, capsys, where, flag):
    out = with_old_run(tmp_path)
    train = write_sentiment_csv(tmp_path / "train.csv", 16)
    files = {"--model": tiny_bert, "--train-file": str(train), "--validation-file": str(train)}
    target = out / where
    if flag == "--model":
        shutil.copytree(tiny_bert, target, dirs_exist_ok=True)
    elif flag == "the config file":
        target.write_text(f"task: classification\nmodel: {tiny_bert}\n")
    else:
        write_sentiment_csv(target, 16)
    positional = [str(target)] if flag == "the config file" else []
    if flag != "the config file":
        files[flag] = str(target)
    args = ["train", *positional, *[a for kv in files.items() for a in kv], "--output-dir", str(out), "--overwrite"]
    needles = (f"{flag} {str(target)!r} is inside what the run writes", where.split("/")[0], "choose another")
    refused(capsys, (tmp_path,), *args, "--cache-dir", str(tmp_path / "cache"), needles=needles)


def test_chat_template_inside_the_old_model_folder_is_refused(tmp_path, tiny_llama, capsys):
    out = with_old_run(tmp_path)
    template = out / "model" / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n' * 4)
    args = cli_flags(task="sft", model=tiny_llama, train_file=chats, validation_file=chats, output_dir=out)
    refused(
        capsys,
        (tmp_path,),
        "train",
        *args,
        "--chat-template",
        str(template),
        "--overwrite",
        needles=("--chat-template",),
    )


def test_an_output_dir_inside_the_data_folder_is_refused(tmp_path, tiny_bert, capsys):
    """A run inside its --data-dir made the folder's content fingerprint count the run's own files: a resume
    found the data changed, and its tokenized and prepared data were never found again."""
    data = tmp_path / "sst"
    data.mkdir()
    (data / "train.tsv").write_text("sentence\tlabel\n" + "a fine film\t1\nawful\t0\n" * 8)
    (data / "dev.tsv").write_text("sentence\tlabel\n" + "a fine film\t1\nawful\t0\n" * 2)
    args = cli_flags(task="glue/sst2", data_dir=data, model=tiny_bert, output_dir=data / "runs" / "a", max_steps=1)
    refused(capsys, (tmp_path,), "train", *args, needles=("output dir", "is inside --data-dir", "--output-dir"))


# ---- export ------------------------------------------------------------------------------------------
def export_case(case: str, run: Path, tmp: Path) -> tuple[list[str], tuple[str, ...]]:
    """(export arguments, needles) of one bad export."""
    ckpt = run / "checkpoint-1"
    dest = tmp / "dest"
    if case == "into the checkpoint":
        return [str(ckpt), str(ckpt), "--overwrite"], ("is the checkpoint", "choose a folder outside it")
    if case == "into the run folder":
        return [str(ckpt), str(run), "--overwrite"], ("overlaps the checkpoint",)
    if case == "into a folder inside the checkpoint":
        return [str(ckpt), str(ckpt / "hf"), "--overwrite"], ("overlaps the checkpoint",)
    if case == "over user files":
        dest.mkdir()
        (dest / "config.json").write_text("{}")
        for name in ("notes.txt", "data.csv", "a.md", "b.md"):
            (dest / name).write_text("mine")
        return [str(ckpt), str(dest), "--overwrite"], ("a.md, b.md, data.csv and 1 more", "move them out")
    if case == "not empty":
        dest.mkdir()
        (dest / "notes.txt").write_text("mine")
        return [str(ckpt), str(dest)], ("is not empty", "--overwrite")
    if case == "onto a file":
        dest.write_text("mine")
        return [str(ckpt), str(dest)], ("is a file",)
    if case == "under a file":
        dest.write_text("mine")
        return [str(ckpt), str(dest / "sub" / "hf")], ("cannot be created", "is a file")
    if case == "missing checkpoint":
        return [str(run / "checkpoint-9"), str(dest)], ("does not exist",)
    if case == "a model folder":
        return [str(run / "model"), str(dest)], ("not a complete tuneforge checkpoint",)
    if case == "base without merge":
        return [str(ckpt), str(dest), "--base", str(run / "model")], ("--base goes with --merge",)
    if case == "merge a non-adapter":
        return [str(run / "model"), str(dest), "--merge"], ("is not an adapter folder",)
    raise AssertionError(case)


EXPORT_CASES = [
    "into the checkpoint",
    "into the run folder",
    "into a folder inside the checkpoint",
    "over user files",
    "not empty",
    "onto a file",
    "under a file",
    "missing checkpoint",
    "a model folder",
    "base without merge",
    "merge a non-adapter",
]


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_bad_export(run_with_checkpoint, tmp_path, capsys, case):
    run, _ = run_with_checkpoint
    args, needles = export_case(case, run, tmp_path)
    refused(capsys, (tmp_path, run), "export", *args, needles=needles)


def test_export_overwrite_replaces_an_earlier_export(run_with_checkpoint, tmp_path, capsys):
    run, _ = run_with_checkpoint
    dest = tmp_path / "dest"
    for _ in range(2):
        code, _, err = cli_main(capsys, "export", str(run / "checkpoint-1"), str(dest), "--overwrite")
        assert code == 0, err
    assert (dest / "model.safetensors").exists()


def test_export_overwrite_never_replaces_a_model_folder_tuneforge_did_not_write(run_with_checkpoint, tmp_path, capsys):
    """A downloaded HF model holds only model files, as an export does; without the tuneforge.json every export
    writes it is the user's, and --overwrite would have replaced it whole."""
    run, _ = run_with_checkpoint
    theirs = tmp_path / "downloaded"
    shutil.copytree(run / "model", theirs)
    (theirs / "tuneforge.json").unlink()
    before = {p.name: p.read_bytes() for p in theirs.iterdir()}
    code, _, err = cli_main(capsys, "export", str(run / "checkpoint-1"), str(theirs), "--overwrite")
    assert code == 2 and "holds a model tuneforge did not write" in err, err
    assert {p.name: p.read_bytes() for p in theirs.iterdir()} == before


# ---- predict --output -----------------------------------------------------------------------------------
def predict_case(case: str, run: Path, data: Path, tmp: Path) -> tuple[list[str], tuple[str, ...]]:
    model = str(run / "model")
    inp = tmp / "in.csv"
    shutil.copy(data, inp)
    out = tmp / "preds.jsonl"
    if case == "output is the input":
        return [model, "--input", str(inp), "--output", str(inp)], ("is the --input file",)
    if case == "output inside the model":
        return [model, "--input", str(inp), "--output", str(run / "model" / "p.jsonl")], ("inside the model folder",)
    if case == "output over a model file":
        return [model, "--input", str(inp), "--output", str(run / "model" / "config.json")], ("inside the model",)
    if case == "output is a folder":
        return [model, "--input", str(inp), "--output", str(tmp)], ("is a folder",)
    if case == "output is a user file":
        out.write_text("my own notes\n")
        return [model, "--input", str(inp), "--output", str(out)], ("not a predictions file",)
    if case == "output is a user's rows with an index":  # pandas' reset_index().to_json(lines=True): was replaced
        out.write_text('{"index": 0, "text": "my own row", "label": "pos"}\n')
        return [model, "--input", str(inp), "--output", str(out)], ("not a predictions file",)
    if case == "input is a folder":
        return [model, "--input", str(tmp), "--output", str(out)], ("is a folder, not a file",)
    if case == "input missing":
        return [model, "--input", str(tmp / "nope.csv"), "--output", str(out)], ("does not exist",)
    if case == "input of another format":
        (tmp / "in.xlsx").write_text("x")
        return [model, "--input", str(tmp / "in.xlsx"), "--output", str(out)], ("unknown format",)
    if case == "input not UTF-8":
        inp.write_bytes("text\nun film très beau\n".encode("utf-16"))
        return [model, "--input", str(inp), "--output", str(out)], ("not UTF-8",)
    if case == "input with only a header":
        inp.write_text("text,label\n")
        return [model, "--input", str(inp), "--output", str(out)], ("no examples",)
    if case == "batch size 0":
        return [model, "--input", str(inp), "--output", str(out), "--batch-size", "0"], ("--batch-size",)
    if case == "missing model":
        return [str(tmp / "no-model"), "--input", str(inp), "--output", str(out)], ("no-model",)
    raise AssertionError(case)


PREDICT_CASES = [
    "output is the input",
    "output inside the model",
    "output over a model file",
    "output is a folder",
    "output is a user file",
    "output is a user's rows with an index",
    "input is a folder",
    "input missing",
    "input of another format",
    "input not UTF-8",
    "input with only a header",
    "batch size 0",
    "missing model",
]


@pytest.mark.parametrize("case", PREDICT_CASES)
def test_bad_predict(run_with_checkpoint, tmp_path, capsys, case):
    run, data = run_with_checkpoint
    args, needles = predict_case(case, run, data, tmp_path)
    refused(capsys, (tmp_path, run), "predict", *args, needles=needles)


def test_predict_replaces_its_own_earlier_predictions(run_with_checkpoint, tmp_path, capsys):
    run, data = run_with_checkpoint
    out = tmp_path / "preds.jsonl"
    for _ in range(2):
        code, _, err = cli_main(capsys, "predict", str(run / "model"), "--input", str(data), "--output", str(out))
        assert code == 0, err


# ---- writes without room ------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["export", "predict"])
def test_a_write_without_room_is_one_line_and_keeps_the_earlier_one(run_with_checkpoint, tmp_path, capsys, command):
    """An export or --output whose write failed for want of room (a full disk, a quota; here a file size limit)
    ended in 'internal error' (safetensors' SafetensorError is no OSError; predict's OSError was not caught): one
    line naming what it wrote, and the earlier export or predictions, which it would have replaced, stay whole."""
    from conftest import cli_without_room

    run, data = run_with_checkpoint
    if command == "export":
        out, then = tmp_path / "exported", ""
        args = ["export", str(run / "checkpoint-1"), str(out), "--overwrite"]
    else:
        out, then = tmp_path / "preds.jsonl", " or choose another --output"
        args = ["predict", str(run / "model"), "--input", str(data), "--output", str(out)]
    code, _, err = cli_main(capsys, *args)  # the earlier one
    assert code == 0, err
    before = snapshot(tmp_path)
    line = cli_without_room(args, 512)
    what = "the model folder" if command == "export" else "--output"
    assert line == f"error: {what} {str(out)!r} has no room (File too large); free space there{then}", line
    assert snapshot(tmp_path) == before


# ---- download, generate, chat, serve: the CLI-level bad inputs -------------------------------------------------
def test_download_into_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("mine")
    refused(
        capsys,
        (tmp_path,),
        "download",
        "prajjwal1/bert-tiny",
        "--local-dir",
        str(tmp_path / "f"),
        needles=("is a file",),
    )


def test_download_into_a_folder_of_user_files(tmp_path, capsys):
    (tmp_path / "README.md").write_text("my readme")
    args = ["download", "prajjwal1/bert-tiny", "--local-dir", str(tmp_path)]
    refused(capsys, (tmp_path,), *args, needles=("holds files that no download put there (README.md)",))


def test_download_into_an_earlier_downloads_folder_is_allowed(tmp_path, capsys):
    (tmp_path / ".cache" / "huggingface").mkdir(parents=True)
    (tmp_path / "config.json").write_text("{}")
    _, _, err = cli_main(capsys, "download", "prajjwal1/bert-tiny", "--local-dir", str(tmp_path))
    assert "holds files" not in err  # offline in the tests: the hub answers (or not), the folder is not refused


MODEL_COMMAND_CASES = {  # id -> (command, model: missing | classifier | gpt2 | a file | an empty folder, flags, needle)
    "generate: missing model": ("generate", "missing", ["--prompt", "hello"], "does not exist"),
    "generate: a classifier": ("generate", "classifier", ["--prompt", "hello"], ""),
    "generate: a file as the model": ("generate", "a file", ["--prompt", "hello"], ""),
    "generate: max new tokens 0": (
        "generate",
        "gpt2",
        ["--prompt", "a", "--max-new-tokens", "0"],
        "--max-new-tokens must be between 1",
    ),
    "generate: num beams 0": ("generate", "gpt2", ["--prompt", "a", "--num-beams", "0"], "--num-beams"),
    "generate: top-p 2": ("generate", "gpt2", ["--prompt", "a", "--top-p", "2", "--do-sample"], "--top-p"),
    "generate: negative temperature": (
        "generate",
        "gpt2",
        ["--prompt", "a", "--temperature", "-1", "--do-sample"],
        "--temperature",
    ),
    "chat: missing model": ("chat", "missing", [], "does not exist"),
    "chat: a classifier": ("chat", "classifier", [], ""),
    "chat: a file as the model": ("chat", "a file", [], ""),
    "chat: an empty folder": ("chat", "an empty folder", [], "no config.json"),
    "chat: max new tokens 0": ("chat", "gpt2", ["--max-new-tokens", "0"], "--max-new-tokens must be between 1"),
    "serve: missing model": ("serve", "missing", ["--port", "0"], "does not exist"),
    "serve: a file as the model": ("serve", "a file", ["--port", "0"], ""),
    "serve: an empty folder": ("serve", "an empty folder", ["--port", "0"], "no config.json"),
    "serve: port -1": ("serve", "gpt2", ["--port", "-1"], "--port"),
}


@pytest.mark.parametrize("case", list(MODEL_COMMAND_CASES))
def test_bad_model_commands(run_with_checkpoint, tiny_gpt2, tmp_path, capsys, monkeypatch, case):
    import io
    import sys

    run, data = run_with_checkpoint
    command, which, flags, needle = MODEL_COMMAND_CASES[case]
    (tmp_path / "empty").mkdir()
    model = {
        "missing": str(tmp_path / "no-model"),
        "classifier": str(run / "model"),
        "gpt2": tiny_gpt2,
        "a file": str(data),
        "an empty folder": str(tmp_path / "empty"),
    }[which]
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # chat reads no line: it must fail before asking
    refused(capsys, (tmp_path, run), command, model, *flags, needles=(needle,))


# ---- resume onto the wrong base --------------------------------------------------------------------------
def resume_case(case: str, run: Path, data: Path, tmp: Path, tiny_bert: str, tiny_gpt2: str):
    """(train arguments, needles) of one resume from a checkpoint that does not fit the run."""
    ckpt = str(run / "checkpoint-1")
    common = cli_flags(output_dir=tmp / "out", cache_dir=tmp / "cache", max_steps=2, batch_size=8, quiet=True)
    if case == "another task and model":
        text = tmp / "t.txt"
        text.write_text("a man is riding a red bike.\nthe dog is holding a blue ball.\n" * 4)
        args = cli_flags(task="clm", model=tiny_gpt2, train_file=text, validation_file=text, resume=ckpt)
        return args + common, ("does not match this run: task is 'classification' in the checkpoint but 'clm'",)
    if case == "another model":
        args = cli_flags(model=tiny_gpt2, train_file=data, validation_file=data, resume=ckpt, max_length=32)
        return args + common, ("does not match this run: model_type is 'bert' in the checkpoint but 'gpt2'",)
    if case == "other labels":
        three = tmp / "three.csv"
        three.write_text("text,label\na,x\nb,y\nc,z\nd,x\ne,y\nf,z\n")
        args = cli_flags(model=tiny_bert, train_file=three, validation_file=three, resume=ckpt)
        args += ["--allow-changed-data"]  # (other data: refused first without it, test_data_mixture.py)
        return args + common, ("does not match this run: labels is ['neg', 'pos'] in the checkpoint",)
    if case == "a model folder":
        args = cli_flags(model=tiny_bert, train_file=data, validation_file=data, resume=str(run / "model"))
        return args + common, ("is not a complete tuneforge checkpoint",)
    if case == "a missing checkpoint":
        args = cli_flags(model=tiny_bert, train_file=data, validation_file=data, resume=str(tmp / "gone"))
        return args + common, ("gone' does not exist",)
    if case == "latest in an empty folder":
        (tmp / "out").mkdir()
        return cli_flags(model=tiny_bert, train_file=data, validation_file=data, resume="latest") + common, (
            "no complete checkpoint in",
        )
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "another task and model",
        "another model",
        "other labels",
        "a model folder",
        "a missing checkpoint",
        "latest in an empty folder",
    ],
)
def test_resume_from_a_checkpoint_that_does_not_fit(run_with_checkpoint, tiny_bert, tiny_gpt2, tmp_path, capsys, case):
    run, data = run_with_checkpoint
    args, needles = resume_case(case, run, data, tmp_path, tiny_bert, tiny_gpt2)
    capsys.readouterr()
    roots = (tmp_path / "out", run) if case == "other labels" else (tmp_path, run)  # labels: known once data is read
    refused(capsys, roots, "train", *args, needles=needles)
