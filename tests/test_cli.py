"""The command line's own behaviour: what `tuneforge --help` costs, and each command's parser."""

import re
import subprocess
import sys

import pytest

from conftest import REPO, cli_flags, cli_main, train_command

# a fresh interpreter: what `tuneforge --help` imports (the suite's process has torch loaded already)
PROBE = """
import contextlib, io, sys
from tuneforge.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
    main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "transformers", "datasets", "deepspeed") if m in sys.modules)
print(" ".join(heavy) or "-", "train" in out.getvalue() and "download" in out.getvalue())
"""


def imported_by(*argv: str) -> str:
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_top_level_help_lists_every_command_without_importing_torch():
    # the flag tables import every backend (torch): they are built only for the command that runs
    assert imported_by("--help") == "- True"


def test_python_dash_m_tuneforge_is_the_command():
    """`python -m tuneforge` (where the scripts folder is not on PATH) runs the same command line: its help, and
    its refusals in one line with exit 2."""
    run = lambda *argv: subprocess.run([sys.executable, "-m", "tuneforge", *argv], capture_output=True, text=True)  # noqa: E731
    helped, refused = run("--help"), run("train", "--bogus", "1")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: tuneforge")
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "error: tuneforge train: unrecognized arguments: --bogus (`tuneforge train --help` lists the flags)"
    )


@pytest.mark.parametrize("command", ["export", "generate", "serve", "download", "predict", "env"])
def test_each_command_builds_its_own_arguments(command):
    from tuneforge.cli import build_parser

    sub = build_parser(command)._subparsers._group_actions[0].choices
    own = [a.dest for a in sub[command]._actions if a.dest != "help"]
    assert own, f"{command} has no arguments"
    assert not [a for a in sub["train"]._actions if a.dest != "help"]  # train's flags not built
    assert sub[command].get_default("func") is not None


@pytest.mark.parametrize(
    "argv, needles",
    [
        (
            ["predict", "m", "--input", "i.jsonl", "--output", "o.jsonl", "--precision", "fp64"],
            ("invalid choice: 'fp64'",),
        ),
        (["serve", "m", "--precision", "bf17"], ("tuneforge serve: argument --precision", "'bf17'")),
        (["train", "--bogus", "1"], ("tuneforge train: unrecognized arguments: --bogus", "tuneforge train --help")),
        (["serve", "m", "--port", "1", "extra"], ("tuneforge serve: unrecognized arguments: extra",)),
        (["predict", "m"], ("the following arguments are required: --input, --output",)),
        (["trian"], ("unknown command 'trian'", "did you mean 'train'?", "tuneforge --help` lists the commands")),
        ([], ("the following arguments are required: command",)),
    ],
)
def test_argparse_refusals_are_one_error_line(capfd, tmp_path, argv, needles):
    """A flag argparse itself refuses (a bad choice, an unknown flag, a missing argument, a misspelt command): one
    `error:` line naming it, exit 2, no usage block."""
    from test_bad_input import assert_refused, in_process

    proc = in_process(capfd, *argv)
    assert_refused(proc, tmp_path, *needles)
    assert proc.stderr.startswith("error: tuneforge") and "usage:" not in proc.stderr


@pytest.mark.parametrize(
    "argv, needles",
    [
        # a unique prefix was taken silently (`--out` as --output-dir, `--max-len` as --max-length) while a prefix of
        # two flags was refused: abbreviations are refused alike, naming the flag meant
        # (--batch-size 0: were the abbreviation taken, the run stops there, before any work)
        (["train", "--out", "x", "--batch-size", "0"], ("unrecognized arguments: --out", "mean --output-dir?")),
        (["train", "--max-len=64", "--batch-size", "0"], ("arguments: --max-len=64", "did you mean --max-length?")),
        (["train", "--lable-column", "y"], ("did you mean --label-column?",)),
        (["predict", "m", "--input", "i", "--output", "o", "--batch", "8"], ("--batch 8", "mean --batch-size?")),
        (["train", "--sav", "1"], ("did you mean --save-steps, --save-strategy or --save-total-limit?",)),
        (["tran"], ("unknown command 'tran'", "did you mean 'train'?")),
    ],
)
def test_an_abbreviated_or_misspelt_flag_is_refused_naming_the_flag_meant(capfd, tmp_path, argv, needles):
    from test_bad_input import assert_refused, in_process

    assert_refused(in_process(capfd, *argv), tmp_path, *needles)


def test_help_still_shows_the_usage(capfd):
    from test_bad_input import in_process

    proc = in_process(capfd, "predict", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: tuneforge predict") and "--precision" in proc.stdout


def test_train_ends_with_its_time_and_machine(tmp_path, capsys, tiny_bert, sentiment_files, cache_dir):
    from tuneforge.cli import machine

    flags = cli_flags(max_steps=1, output_dir=tmp_path / "run", cache_dir=cache_dir, quiet=True)
    code, out, err = cli_main(capsys, *train_command(sentiment_files, tiny_bert), *flags)
    assert code == 0, err
    last = out.strip().splitlines()[-1]
    pattern = rf"took \d+ s on {re.escape(machine())} \(\d+\.\d s of it waiting for data\)"
    assert re.fullmatch(pattern, last), last


@pytest.mark.parametrize(
    "info, taken",
    [
        # what the folder's task has as options, and data settings; not how predict reads rows (text_columns)
        (
            {"task": "qa", "max_length": 64, "doc_stride": 16, "text_columns": ["question", "context"]},
            {"data.max_length": 64, "task_options.doc_stride": 16},
        ),
        (
            {"task": "seq2seq", "source_prefix": "translate: ", "num_beams": 2, "generation_max_length": None},
            {"task_options.source_prefix": "translate: ", "task_options.num_beams": 2},
        ),
        ({"task": "grpo", "block_size": 64, "generates": True}, {}),  # derived there, not an option: left out
    ],
)
def test_eval_takes_the_settings_a_folder_was_trained_with(tmp_path, capsys, info, taken):
    import json

    from tuneforge.cli import _trained_settings

    (tmp_path / "tuneforge.json").write_text(json.dumps(info))
    assert _trained_settings(str(tmp_path), {}) == taken
    given = {key: "flag" for key in taken}  # a flag wins
    assert _trained_settings(str(tmp_path), given) == {}
    out = capsys.readouterr().out
    assert ("'translate: '" in out) == (info["task"] == "seq2seq")


@pytest.mark.parametrize(
    "argv, positionals",
    [
        (["train", "run.yaml", "--max-steps", "2", "epochs=3"], ["run.yaml", "epochs=3"]),
        (["train", "--lr", "1", "a.yaml", "--seed", "1", "lora_r=4", "epochs=3"], ["a.yaml", "lora_r=4", "epochs=3"]),
        (["prepare", "run.yaml", "--num-workers", "2", "task=clm"], ["run.yaml", "task=clm"]),
        (["sweep", "run.yaml", "--space", "s.yaml", "backend=ddp", "seed=1"], ["run.yaml", "backend=ddp", "seed=1"]),
        # --report-to takes several words: an override or the config after it was refused as a tracker's name
        (["train", "run.yaml", "--report-to", "tensorboard", "epochs=2"], ["run.yaml", "epochs=2"]),
        (["train", "--report-to", "mlflow", "run.yaml"], ["run.yaml"]),
        (
            ["train", "a.yaml", "--seed", "1", "epochs=3", "--report-to", "mlflow", "epochs=2"],
            ["a.yaml", "epochs=3", "epochs=2"],
        ),
    ],
)
def test_overrides_may_follow_flags(argv, positionals):
    """`tuneforge train CONFIG --max-steps 2 epochs=3`: a key=value after a flag is an override as before one (it
    was refused as an unrecognized argument); the overrides keep their order."""
    from tuneforge.cli import build_parser

    ns = build_parser(argv[0]).parse_command(argv)
    assert list(ns.config) == positionals
    assert getattr(ns, "report_to", None) in (None, ["tensorboard"], ["mlflow"])


def test_an_unknown_flag_among_overrides_is_still_refused(capfd, tmp_path):
    from test_bad_input import assert_refused, in_process

    assert_refused(in_process(capfd, "train", "run.yaml", "--bogus", "epochs=3"), tmp_path, "unrecognized arguments")
