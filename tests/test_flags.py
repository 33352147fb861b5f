"""Every command's flags come from one options model (tuneforge.flags): its --help lists each field, and every
numeric field refuses a value out of its bounds (or inf/nan) through the real `tuneforge` entry point with one
`error:` line naming the flag and exit 2, before any model is looked at."""

from __future__ import annotations

import math

import pytest

from conftest import cli_main
from tuneforge.chat import ChatOptions
from tuneforge.download import DownloadOptions
from tuneforge.errors import ConfigError
from tuneforge.export import ExportOptions
from tuneforge.flags import field_bounds, field_flag, parse_options
from tuneforge.generate import GenerateOptions, Sampling
from tuneforge.predict import PredictOptions, predict_file
from tuneforge.serve.options import ServeOptions

COMMAND_OPTIONS = {
    "export": ExportOptions,
    "generate": GenerateOptions,
    "chat": ChatOptions,
    "download": DownloadOptions,
    "predict": PredictOptions,
    "serve": ServeOptions,
}


def required_args(command: str, tmp_path) -> list[str]:
    """The least a command takes to reach its options' check: a model folder that does not exist (a check that
    ran after the model's would name the folder, not the flag), and the required flags."""
    missing = str(tmp_path / "no-model")
    return {
        "export": [missing, str(tmp_path / "out")],
        "generate": [missing, "--prompt", "hello"],
        "chat": [missing],
        "download": ["prajjwal1/bert-tiny"],
        "predict": [missing, "--input", str(tmp_path / "in.csv"), "--output", str(tmp_path / "p.jsonl")],
        "serve": [missing],
    }[command]


def flags_of(model) -> dict[str, tuple[str, dict]]:
    """field name -> (flag, argparse kwargs), for the fields that have a flag."""
    made = {name: field_flag(name, field, name) for name, field in model.model_fields.items()}
    return {name: (m[0], m[1][1]) for name, m in made.items() if m}


def out_of_bounds(field, kind: type) -> list[str]:
    """Values just outside the field's bounds, and for a float inf and nan."""
    bounds = field_bounds(field)
    step = 1 if kind is int else 0.5
    values = []
    if "ge" in bounds:
        values.append(bounds["ge"] - step)
    if "gt" in bounds:
        values.append(bounds["gt"])
    if "le" in bounds:
        values.append(bounds["le"] + step)
    if "lt" in bounds:
        values.append(bounds["lt"])
    shown = [str(kind(v)) for v in values]
    return shown + (["nan", "inf", "-inf"] if kind is float else [])


NUMERIC_CASES = [
    (command, flag, value)
    for command, model in COMMAND_OPTIONS.items()
    for name, (flag, kwargs) in flags_of(model).items()
    if kwargs.get("type") in (int, float)
    for value in out_of_bounds(model.model_fields[name], kwargs["type"])
]


def test_every_bounded_numeric_field_is_walked():
    walked = {(command, flag) for command, flag, _ in NUMERIC_CASES}
    assert ("serve", "--request-timeout") in walked and ("predict", "--batch-size") in walked
    assert ("generate", "--temperature") in walked and ("chat", "--max-new-tokens") in walked
    for command, model in COMMAND_OPTIONS.items():
        for name, (flag, kwargs) in flags_of(model).items():
            if kwargs.get("type") in (int, float):
                assert field_bounds(model.model_fields[name]), f"{command} {flag} states no bounds"


@pytest.mark.parametrize("command", list(COMMAND_OPTIONS))
def test_help_lists_every_field_of_the_options_model(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag: the help compared as written
    from tuneforge.cli import main

    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())
    model = COMMAND_OPTIONS[command]
    for name, (flag, _) in flags_of(model).items():
        assert flag in text, f"{command} --help does not list {flag}"
        description = model.model_fields[name].description
        assert description and " ".join(description.split()) in text, f"{command} {flag} has no help"


def test_a_default_made_by_a_factory_is_not_shown_as_pydantics_placeholder(capsys, monkeypatch):
    """train --help said '--reward ... (default: PydanticUndefined)': a list field's default_factory was read as
    its default."""
    monkeypatch.setenv("COLUMNS", "1000")
    from tuneforge.cli import main

    assert main(["train", "--help"]) == 0
    assert "PydanticUndefined" not in capsys.readouterr().out


@pytest.mark.parametrize("command, flag, value", NUMERIC_CASES)
def test_an_out_of_bounds_value_is_one_line_naming_the_flag(command, flag, value, tmp_path, capsys):
    code, out, err = cli_main(capsys, command, *required_args(command, tmp_path), f"{flag}={value}")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {flag} ") or lines[0].startswith(f"error: bad value for {flag}:"), lines[0]
    assert not (tmp_path / "no-model").exists() and not (tmp_path / "out").exists()


def test_a_field_without_its_own_wording_names_the_flag_and_the_allowed_range(tmp_path, capsys):
    code, _, err = cli_main(capsys, "predict", *required_args("predict", tmp_path), "--batch-size", "0")
    assert code == 2
    assert err.strip() == (
        "error: bad value for --batch-size: Input should be greater than or equal to 1 (got 0); "
        "allowed: a whole number >= 1"
    )


@pytest.mark.parametrize("command", list(COMMAND_OPTIONS))
def test_flags_left_out_take_the_models_defaults(command, tmp_path):
    from tuneforge.cli import build_parser

    args = required_args(command, tmp_path)
    parsed = parse_options(COMMAND_OPTIONS[command], build_parser(command).parse_args([command, *args]))
    for name, field in COMMAND_OPTIONS[command].model_fields.items():
        if not field.is_required() and name != "served_model_name":  # that one defaults to MODEL_DIR
            assert getattr(parsed, name) == field.default, name


def test_serve_names_the_model_by_its_folder_unless_told():
    assert ServeOptions(model_dir="runs/x/model").served_model_name == "runs/x/model"
    assert ServeOptions(model_dir="runs/x/model", served_model_name="tiny").served_model_name == "tiny"


def test_the_python_api_checks_the_same_bounds():
    """Generator.generate and predict_file take the options' fields: the same bounds, the same line."""
    with pytest.raises(ConfigError, match=r"^--top-p must be in \(0, 1\] \(got 2.0\)$"):
        parse_options(Sampling, {"top_p": 2.0})
    with pytest.raises(ConfigError, match="^--temperature must be a finite number"):
        parse_options(Sampling, {"temperature": math.inf})
    with pytest.raises(ConfigError, match="^bad value for --batch-size"):
        predict_file("no-model", "in.csv", "p.jsonl", batch_size=0)


def test_a_check_across_fields_is_its_own_line(tmp_path, capsys):
    code, _, err = cli_main(capsys, "export", *required_args("export", tmp_path), "--base", "gpt2")
    assert code == 2 and err.strip() == "error: --base goes with --merge (the model an adapter is merged into)"


def test_the_range_text_is_the_configs():
    """flags.allowed_range is config.py's (each key's refusal states its range the same way, flag or config key)."""
    from tuneforge import config, flags
    from tuneforge.backends import backend_classes

    models = [config.TrainConfig, config.OptimConfig, config.DataConfig, *COMMAND_OPTIONS.values()]
    models += [cls.Options for cls in backend_classes().values()]
    for model in models:
        for name, field in model.model_fields.items():
            assert flags.allowed_range(field) == config.allowed_range(field), (model.__name__, name)


def test_an_unknown_key_names_the_allowed_ones():
    with pytest.raises(ConfigError, match="^unknown option 'top_q'; allowed: max_new_tokens, do_sample"):
        parse_options(Sampling, {"top_q": 0.5})


def test_a_refused_value_is_shown_from_its_first_items_only():
    """YAML aliases build a list of 10**9 texts from 9 lines of a config (shared, not copied): the refusal shows its
    first items without writing out the whole (it was repr'd whole, then cut: the run never got to its error)."""
    from tuneforge.flags import shown_value

    class Counted:
        calls = 0

        def __repr__(self) -> str:
            Counted.calls += 1
            return "'x'"

    value: list = [Counted()] * 10
    for _ in range(5):  # 10**6 leaves, each the same object
        value = [value] * 10
    shown = shown_value(value)
    assert shown.startswith("[[[[[") and len(shown) <= 120
    assert Counted.calls < 1000


TILDE_ARGS = {  # each command's paths given with a leading ~ (after `=` or quoted, where no shell expands it)
    "predict": ["~/m", "--input=~/in.csv", "--output=~/p.jsonl"],
    "export": ["~/adapter", "~/out", "--merge", "--base=~/base"],
    "serve": ["~/m"],
    "chat": ["~/m"],
    "generate": ["~/m", "--prompt", "~/not a path: a prompt"],
    "download": ["org/repo", "--local-dir=~/d"],
    "runs": ["~/a", "~/b", "--plot=~/p.png"],
    "sweep": ["~/base.yaml", "epochs=1", "--space=~/space.yaml", "--output-dir=~/sweep"],
    "eval": ["~/m", "--output-dir=~/e"],
    "train": ["~/c.yaml", "epochs=1"],  # (a flag's path is the config's: test_config.py)
    "prepare": ["~/c.yaml", "epochs=1"],
}


def given_values(options) -> set[str]:
    values = options.model_dump().values() if hasattr(options, "model_dump") else vars(options).values()
    return {v for value in values for v in (value if isinstance(value, (list, tuple)) else [value]) if v}


@pytest.mark.parametrize("command", list(TILDE_ARGS))
def test_a_leading_tilde_in_a_commands_path_is_the_home_folder(command, tmp_path, monkeypatch):
    """`predict --input=~/in.csv` 'did not exist', `download --local-dir=~/d` wrote a folder named '~', `eval ~/m`
    read no trained task from the folder: only the training config's path keys took ~ as the home folder."""
    from tuneforge.cli import build_parser
    from tuneforge.runs import RunsOptions
    from tuneforge.sweep.options import SweepOptions

    monkeypatch.setenv("HOME", str(tmp_path))
    models = {**COMMAND_OPTIONS, "runs": RunsOptions, "sweep": SweepOptions}
    ns = build_parser(command).parse_command([command, *TILDE_ARGS[command]])
    options = parse_options(models[command], ns) if command in models else ns
    paths = {arg.partition("=")[2] or arg for arg in TILDE_ARGS[command] if "a prompt" not in arg}
    expanded = {path.replace("~", str(tmp_path), 1) for path in paths if path.startswith("~")}
    assert {v for v in given_values(options) if str(v).startswith(str(tmp_path))} == expanded
    kept = {"~/not a path: a prompt"} if command == "generate" else set()
    assert {v for v in given_values(options) if str(v).startswith("~")} == kept


def every_commands_help() -> dict[tuple[str, str], str]:
    """{(command, flag): its help text} of every command's flags, as `--help` shows them."""
    from tuneforge.cli import build_parser

    parser = build_parser(None)
    return {
        (name, action.option_strings[-1]): action.help or ""
        for name, sub in parser.commands.items()
        for action in sub._actions
        if action.option_strings and action.dest != "help"
    }


def test_every_flag_has_help_and_states_its_default():
    """Each flag says what it does, and its default where it has one: a description with the word 'default' in it
    hid the default (train's --epochs 2 and --lr 8e-05, serve's --generation-config auto), a list's default_factory
    showed as 'PydanticUndefined' (--reward), eval's --output-dir and --json and env's --json had no help, and a
    switch outside a run's config (serve's --pack-weights, sweep's --plots) said its default was 'the task's'."""
    helps = every_commands_help()
    assert not [flag for flag, text in helps.items() if not text.strip()]
    assert not [flag for flag, text in helps.items() if "Undefined" in text]
    shown = {
        ("train", "--epochs"): "(default: 2; ner: 3)",
        ("train", "--lr"): "(default: 8e-05; grpo: 1e-05, ner: 0.00015)",
        ("train", "--attn-implementation"): "(default: auto)",
        ("serve", "--generation-config"): "(default: auto)",
        ("serve", "--no-pack-weights"): "(default: on; --no-pack-weights turns it off)",
        ("sweep", "--no-plots"): "(default: on; --no-plots turns it off)",
        ("train", "--no-packing"): "(default: on, or the task's;",
        ("eval", "--output-dir"): "default: runs/harness",
        ("train", "--save-total-limit"): "plus the best",
    }
    for flag, text in shown.items():
        assert text in helps[flag], f"{flag}: {helps[flag]!r}"


def test_train_help_says_each_tasks_own_default():
    """A task's own defaults (run_defaults: grpo's batch of 2 prompts, ner's 3 epochs) are named in the help of
    their flags: `--batch-size (default: 16)` was all `tuneforge train --help` said, and grpo trains 2."""
    from tuneforge.cli import train_flags
    from tuneforge.tasks import task_classes

    helps = {key: kwargs["help"] for key, kwargs in train_flags().values()}
    for name, cls in task_classes().items():
        for key, value in cls.Options.run_defaults.items():
            shown = ("on" if value else "off") if isinstance(value, bool) else value
            assert f"{name}: {shown}" in helps[key], f"--task {name}'s {key} ({shown}) is not in its help"
    assert "(default: 16; grpo: 2)" in helps["batch_size"]
    assert "(default: on; embedding: off, grpo: off;" in helps["data.group_by_length"]
