"""YAML configs: every shipped example validates; key=value overrides and flags layer on top;
unknown keys and bad values are rejected before any work, naming the key and what is allowed."""

import argparse
import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import REPO, cli_main, run_cli, write_sentiment_csv
from tuneforge.backends import available_backends
from tuneforge.config import TrainConfig, apply_overrides, load_yaml
from tuneforge.configure import build_config, config_from_sources, resolve
from tuneforge.errors import ConfigError
from tuneforge.tasks import task_names

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
EXPECTED = {
    "bbc-news",
    "glue-mrpc",
    "glue-sst2",
    "glue-stsb",
    "glue-cola",
    "csv-example",
    "clm-wikitext2",
    "seq2seq-multi30k",
    "conll2003-ner",
    "squad-qa",
    "codah-multiple-choice",
    "lima-sft-lora",
    "ddp",
    "deepspeed",
    "fsdp",
    "gsm8k-grpo-lora",
}


def test_the_examples_are_shipped():
    assert EXPECTED <= {p.stem for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_validates(path):
    values = load_yaml(path)
    config = build_config(values)
    assert isinstance(config, TrainConfig)
    assert config.task in task_names() and config.backend in available_backends()
    # nothing in the file was silently dropped: every key round-trips into the config
    dumped = config.to_dict()
    for key, value in values.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                assert dumped[key][sub] == (list(v) if isinstance(v, tuple) else v), f"{path.name}: {key}.{sub}"
        else:
            assert dumped[key] == value, f"{path.name}: {key}"


def test_yaml_then_overrides_then_flags(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("task: glue/mrpc\nepochs: 2\noptim:\n  lr: 1.0e-4\n  warmup_ratio: 0.1\ndata:\n  max_length: 96\n")
    config = config_from_sources(
        str(cfg),
        ["optim.lr=3e-5", "data.text_columns=[a, b]", "eval_strategy=no"],
        {"epochs": 4, "data.max_length": 64},
    )
    assert config.optim.lr == 3e-5 and config.optim.warmup_ratio == 0.1  # override keeps the section's other keys
    assert config.epochs == 4 and config.data.max_length == 64  # explicit flags win over the file
    assert config.data.text_columns == ["a", "b"] and config.eval_strategy == "no"


def test_override_types_come_from_yaml_syntax():
    values = apply_overrides({}, ["optim.max_grad_norm=null", "overwrite=true", "seed=7", "model=path/to/model"])
    config = build_config(values)
    assert config.optim.max_grad_norm is None and config.overwrite is True and config.seed == 7
    assert config.model == "path/to/model"


def assert_one_line_config_error(values: dict, needles: list[str]) -> None:
    """build_config(values) raises a ConfigError of one line that holds every needle."""
    with pytest.raises(ConfigError) as err:
        build_config(values)
    message = str(err.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


@pytest.mark.parametrize(
    "values,needles",
    [
        ({"learning_rate": 3e-5}, ["unknown config key 'learning_rate'", "allowed:", "optim", "epochs"]),
        ({"optim": {"lrate": 3e-5}}, ["unknown config key 'optim.lrate'", "allowed:", "lr", "warmup_ratio"]),
        ({"data": {"max_len": 64}}, ["unknown config key 'data.max_len'", "max_length"]),
        ({"optim": {"lr": 0}}, ["bad value for 'optim.lr'", "greater than 0", "got 0"]),
        ({"batch_size": -4}, ["bad value for 'batch_size'", "greater than 0", "got -4"]),
        ({"epochs": 0}, ["bad value for 'epochs'", "greater than 0"]),
        (
            {"optim": {"scheduler": "cosine_wave"}},
            ["bad value for 'optim.scheduler'", "'linear'", "'cosine'", "cosine_wave"],
        ),
        ({"precision": "fp8"}, ["bad value for 'precision'", "'bf16'", "fp8"]),
        ({"backend": "horovod"}, ["unknown backend 'horovod'", "ddp", "single"]),
        ({"eval_strategy": "steps"}, ["eval_strategy=steps needs eval_steps"]),
        ({"data": {"max_length": "long"}}, ["bad value for 'data.max_length'", "integer"]),
    ],
)
def test_unknown_keys_and_bad_values_name_the_key_and_what_is_allowed(values, needles):
    assert_one_line_config_error(values, needles)


@pytest.mark.parametrize(
    "override, meant",
    [
        ("lr=1e-5", "optim.lr"),  # the flag is --lr: the key sits in the optim section
        ("max_length=64", "data.max_length"),
        ("data.lr=1e-5", "optim.lr"),
        ("optim.epochs=3", "epochs"),
        ("epoch=3", "epochs"),
        ("max-steps=2", "max_steps"),
        ("optim.warmup_ration=0.1", "optim.warmup_ratio"),
        ("data.max_lenght=64", "data.max_length"),
        ("task=qa", None),
    ],
)
def test_an_unknown_key_names_the_one_meant(override, meant):
    """An unknown key says which key was meant: the section that has it, or the close spelling (it only listed the
    keys of the section it was given in, where `lr` and `max_length` are not)."""
    if meant is None:
        config_from_sources(None, [override], {})
        return
    with pytest.raises(ConfigError) as err:
        config_from_sources(None, [override], {})
    assert f"did you mean {meant}?" in str(err.value), str(err.value)


def test_a_bad_value_is_shown_cut_short(tmp_path):
    """A data file given as the config (SQuAD's JSON: `data` a list of articles) is refused with the start of the
    value, not all of it: the whole 4.8 MB file was the error line."""
    articles = [{"title": f"article {i}", "paragraphs": [{"context": "word " * 500}]} for i in range(20)]
    squad = tmp_path / "dev.json"
    squad.write_text(json.dumps({"version": "1.1", "data": articles}))
    with pytest.raises(ConfigError) as err:
        config_from_sources(str(squad), [], {})
    line = str(err.value)
    assert "bad value for 'data'" in line and "(got [{'" in line and len(line) < 1000, line


def test_a_list_key_takes_one_item_as_its_flag_does():
    """`data.text_columns=review` and `reward=accuracy` (or `text_columns: review` in YAML) are what the flags
    `--text-column review` and `--reward accuracy` give; they were refused as 'not a valid list'."""
    assert config_from_sources(None, ["data.text_columns=review"], {}).data.text_columns == ["review"]
    assert config_from_sources(None, [], {"data.text_columns": ["review"]}).data.text_columns == ["review"]
    grpo = config_from_sources(None, ["task=grpo", "reward=accuracy"], {})
    assert grpo.task_options.reward == ["accuracy"]


def test_a_text_key_given_a_number_takes_it_as_text(tmp_path):
    """`run_name=2024` (YAML reads a number) names the runs 2024, as `--run-name 2024` does; it was 'not a valid
    string'. The saved config.yaml quotes it, and reads back the same."""
    config = config_from_sources(None, ["run_name=2024", "output_dir=2024", "data.label_column=3"], {})
    assert (config.run_name, config.output_dir, config.data.label_column) == ("2024", "2024", "3")
    config.save(tmp_path / "config.yaml")
    assert config_from_sources(str(tmp_path / "config.yaml"), [], {}) == config


def test_a_leading_tilde_in_a_path_key_is_the_home_folder(tmp_path, monkeypatch):
    """A YAML `output_dir: ~/runs/a` (or `--output-dir=~/runs/a`, which no shell expands) was checked as the home
    folder's and written in a folder named '~' under the current one; `train_file: ~/t.csv` 'did not exist'."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = tmp_path / "run.yaml"
    cfg.write_text("task: seq2seq\noutput_dir: ~/runs/a\ndata: {cache_dir: ~/cache, validation_file: ~/v.csv}\n")
    config = config_from_sources(str(cfg), ["task_options.source_file=~/s.en"], {"data.train_file": "~/t.csv"})
    assert (config.output_dir, config.data.cache_dir) == (f"{tmp_path}/runs/a", f"{tmp_path}/cache")
    assert (config.data.train_file, config.data.validation_file) == (f"{tmp_path}/t.csv", f"{tmp_path}/v.csv")
    assert config.task_options.source_file == f"{tmp_path}/s.en"
    assert config_from_sources(None, ["run_name=~x", "data.label_column=~y"], {}).run_name == "~x"  # not a path


def test_yaml_file_problems(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="is a folder, not a YAML file"):  # it said "does not exist"
        load_yaml(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(bad)
    bad.write_text("- a list\n- not a mapping\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_yaml(bad)
    with pytest.raises(ConfigError, match="not key=value"):
        apply_overrides({}, ["optim.lr"])


@pytest.mark.parametrize("override", ["optim.lr.=3e-5", "optim..lr=3e-5", ".lr=3e-5", "=3e-5", "optim.=3e-5"])
def test_an_override_key_with_an_empty_part_is_named_as_such(override):
    """A trailing or doubled dot is a typo in the key: said so (`optim.lr.=3e-5` was a bad value for optim.lr,
    'a valid number' though the value was one)."""
    with pytest.raises(ConfigError, match="has an empty part"):
        config_from_sources(None, [override], {})


def test_a_section_left_empty_is_one_to_fill(tmp_path):
    """A section whose keys are all commented out is null in YAML, and a run's saved config.yaml holds
    `harness_after_train: null`: an override or a flag into it fills it (an override was 'not a section' where the
    flag worked), and alone it is the section's defaults (it was 'not a valid dictionary')."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("task: clm\noptim:\n#  lr: 1.0e-4\ndata:\ntask_options:\nbackend_options:\nharness_after_train:\n")
    assert config_from_sources(str(cfg), [], {}) == build_config({"task": "clm"})
    assert config_from_sources(str(cfg), ["optim.lr=3e-5"], {}).optim.lr == 3e-5
    assert config_from_sources(str(cfg), [], {"optim.lr": 3e-5}).optim.lr == 3e-5
    assert config_from_sources(str(cfg), ["task_options.block_size=32"], {}).task_options.block_size == 32
    harness = ["harness_after_train.tasks=piqa", "harness_after_train.limit=2"]
    assert config_from_sources(str(cfg), harness, {}).harness_after_train.limit == 2


@pytest.mark.parametrize("flags", [{"optim.lr": 1e-4}, {}])
def test_a_section_given_as_a_word_is_refused_with_a_flag_into_it_too(tmp_path, flags):
    """YAML `optim: adamw` is refused; with `--lr 1e-4` it was silently replaced by the flag's section."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("optim: adamw\n")
    with pytest.raises(ConfigError, match="optim"):
        config_from_sources(str(cfg), [], flags)


def test_cli_train_with_yaml_and_override(tmp_path, tiny_bert, cache_dir):
    """`tuneforge train config.yaml optim.lr=3e-5`: the run's resolved config shows both layers."""
    train = write_sentiment_csv(tmp_path / "train.csv", 24, seed=1)
    val = write_sentiment_csv(tmp_path / "val.csv", 8, seed=2)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "task": "classification",
                "model": tiny_bert,
                "output_dir": str(tmp_path / "run"),
                "max_steps": 1,
                "batch_size": 8,
                "quiet": True,
                "optim": {"lr": 1e-4, "warmup_steps": 0},
                "data": {
                    "train_file": str(train),
                    "validation_file": str(val),
                    "cache_dir": cache_dir,
                    "max_length": 32,
                },
            }
        )
    )
    proc = run_cli("train", str(cfg), "optim.lr=3e-5", "data.max_length=48", "--seed", "5")
    assert proc.returncode == 0, proc.stderr
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["optim"]["lr"] == 3e-5 and saved["data"]["max_length"] == 48 and saved["seed"] == 5
    assert saved["batch_size"] == 8 and saved["data"]["train_file"] == str(train)
    assert Path(saved["output_dir"]) == tmp_path / "run"


@pytest.mark.parametrize("what, default", [("save", "no"), ("eval", "epoch")])
def test_steps_alone_mean_every_n_steps(what, default):
    """`--save-steps 50` or `--eval-steps 50` alone acts every 50 steps: an epoch strategy would ignore it."""
    from tuneforge.configure import build_config

    steps, strategy = f"{what}_steps", f"{what}_strategy"
    assert getattr(build_config({steps: 50}), strategy) == "steps"
    assert getattr(build_config({steps: 50, strategy: "no"}), strategy) == "no"  # explicit wins
    assert getattr(build_config({}), strategy) == default


# ---- backend options: owned by each backend, reachable flat and as backend_options.* -------------
def test_backend_options_flat_nested_and_layered(tmp_path):
    flat = build_config({"backend": "deepspeed", "zero_stage": 3, "offload": "both"})
    nested = build_config({"backend": "deepspeed", "backend_options": {"zero_stage": 3, "offload": "both"}})
    assert flat == nested and flat.backend_options.zero_stage == 3 and flat.backend_options.offload == "both"
    assert resolve(TrainConfig(backend="tp", tp_size=2)).backend_options.tp_size == 2  # the Python API, flat
    assert build_config({"backend": "deepspeed"}).backend_options.zero_stage == 2  # the backend's default
    assert build_config({}).backend_options.model_dump() == {}  # single has no options
    # YAML < key=value < flags, whichever spelling each layer uses
    cfg = tmp_path / "ds.yaml"
    cfg.write_text("backend: deepspeed\nzero_stage: 1\nbackend_options:\n  offload: optimizer\n")
    assert config_from_sources(str(cfg), [], {}).backend_options.zero_stage == 1
    assert config_from_sources(str(cfg), ["zero_stage=3"], {}).backend_options.zero_stage == 3
    assert config_from_sources(str(cfg), ["backend_options.zero_stage=3"], {}).backend_options.zero_stage == 3
    layered = config_from_sources(str(cfg), ["zero_stage=3"], {"backend_options.zero_stage": 2})
    assert layered.backend_options.zero_stage == 2 and layered.backend_options.offload == "optimizer"


def test_saved_config_round_trips(tmp_path):
    for values in ({"backend": "deepspeed", "zero_stage": 3}, {"backend": "tp", "tp_size": 2}, {"backend": "ddp"}):
        config = build_config(values)
        config.save(tmp_path / "config.yaml")
        assert build_config(load_yaml(tmp_path / "config.yaml")) == config


@pytest.mark.parametrize(
    "values,needles",
    [
        ({"backend": "ddp", "tp_size": 2}, ["tp_size (--tp-size) is an option of backend 'tp', not of backend 'ddp'"]),
        ({"zero_stage": 3}, ["option of backend 'deepspeed', not of backend 'single'", "--backend deepspeed"]),
        ({"backend": "deepspeed", "zero_stage": 7}, ["bad value for 'backend_options.zero_stage'", "got 7"]),
        ({"backend": "deepspeed", "offload": "disk"}, ["'backend_options.offload'", "'optimizer'", "disk"]),
        (
            {"backend": "tp", "backend_options": {"tp": 2}},
            ["'backend_options.tp'", "backend 'tp' has options: tp_size"],
        ),
        (
            {"backend": "deepspeed", "zero_stage": 3, "backend_options": {"zero_stage": 1}},
            ["zero_stage is given twice"],
        ),
        ({"zero_stagee": 3}, ["unknown config key 'zero_stagee'", "zero_stage"]),
    ],
)
def test_bad_backend_options_are_one_line(values, needles):
    assert_one_line_config_error(values, needles)


def test_a_config_saved_before_backend_options_still_loads():
    # every backend's options were top-level keys, with their defaults where another backend ran
    old = {"backend": "ddp", "zero_stage": 2, "offload": "none", "deepspeed_config": None, "tp_size": None}
    assert build_config(old).backend_options.model_dump() == {}
    assert build_config({**old, "backend": "tp", "tp_size": 2}).backend_options.tp_size == 2
    with pytest.raises(ConfigError, match="option of backend 'deepspeed'"):
        build_config({**old, "zero_stage": 3})  # a value that says something is not dropped


def test_another_backends_flag_is_one_clear_line(capsys):
    from tuneforge import cli

    rc = cli.main(["train", "--backend", "ddp", "--tp-size", "2", "--train-file", "train.csv"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("error: tp_size (--tp-size) is an option of backend 'tp', not of backend 'ddp'")


# ---- the CLI's flags are generated from the config models ------------------------------------------
def test_every_config_field_and_backend_option_has_a_flag():
    from tuneforge.backends import backend_classes
    from tuneforge.cli import eval_flags, eval_keys, train_flags
    from tuneforge.config import DataConfig, OptimConfig
    from tuneforge.tasks import task_classes

    keys = {key for key, _ in train_flags().values()}
    sections = ("optim", "data", "task_options", "backend_options", "pending_options")
    assert {name for name in TrainConfig.model_fields if name not in sections} <= keys
    for name, cls in backend_classes().items():
        assert {f"backend_options.{option}" for option in cls.Options.model_fields} <= keys, name
        assert {f"backend_options.{option}" for option in cls.Options.model_fields} <= set(eval_keys()), name
    for name, cls in task_classes().items():
        assert {f"task_options.{option}" for option in cls.Options.model_fields} <= keys, name
        assert {f"task_options.{option}" for option in cls.Options.model_fields} <= set(eval_keys()), name
    for prefix, model in (("optim.", OptimConfig), ("data.", DataConfig)):
        for name, field in model.model_fields.items():
            no_flag = (field.json_schema_extra or {}).get("flag", "") is None
            assert (prefix + name in keys) != no_flag, prefix + name
    assert {key for key, _ in eval_flags().values()} == set(eval_keys())
    assert {"data.max_length", "data.validation_file", "batch_size", "backend", "task"} <= set(eval_keys())
    assert "optim.lr" not in eval_keys() and "epochs" not in eval_keys()
    # the names and behaviours users know
    assert train_flags()["--lr"][0] == "optim.lr" and train_flags()["--data-dir"][0] == "data.data_dir"
    assert train_flags()["--text-column"] == (
        "data.text_columns",
        {**train_flags()["--text-column"][1], "action": "append"},
    )
    assert train_flags()["--packing"][1]["action"] is argparse.BooleanOptionalAction  # --packing, --no-packing
    assert train_flags()["--overwrite"][1]["const"] is True
    assert train_flags()["--resume"][1]["nargs"] == "?" and train_flags()["--resume"][1]["const"] == "latest"
    assert train_flags()["--precision"][1]["choices"] == ["auto", "fp32", "bf16", "fp16"]
    assert train_flags()["--offload"][1]["choices"] == ["none", "optimizer", "params", "both"]
    assert train_flags()["--report-to"][1]["nargs"] == "+"


def test_train_help_shows_each_fields_description():
    import re

    from tuneforge.backends.deepspeed import DeepSpeedOptions
    from tuneforge.backends.tp import TPOptions
    from tuneforge.cli import build_parser

    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())
    for field in (
        TrainConfig.model_fields["dropout"],
        TrainConfig.model_fields["attn_implementation"],
        TrainConfig.model_fields["batch_size"],
        DeepSpeedOptions.model_fields["zero_stage"],
        TPOptions.model_fields["tp_size"],
    ):
        assert " ".join(field.description.split()) in help_text, field.description
    assert re.search(r"--offload \{none,optimizer,params,both\}", help_text)
    assert "backend deepspeed options" in help_text and "backend tp options" in help_text


def test_flags_reach_the_config():
    from tuneforge.cli import _flags, build_parser, train_flags

    ns = build_parser().parse_args(
        ["train", "--backend", "deepspeed", "--zero-stage", "3", "--offload", "both", "--lr", "1e-4", "--resume"]
        + ["--text-column", "a", "--text-column", "b", "--no-packing", "--report-to", "jsonl", "tensorboard"]
        + ["--task", "clm"]
    )
    config = config_from_sources(None, [], _flags(ns, train_flags()))
    assert config.backend_options.zero_stage == 3 and config.backend_options.offload == "both"
    assert config.optim.lr == 1e-4 and config.resume == "latest" and config.data.text_columns == ["a", "b"]
    assert config.task_options.packing is False and config.report_to == ["jsonl", "tensorboard"]


@pytest.mark.parametrize(
    "flags, grouped",
    [([], False), (["--group-by-length"], True), (["--no-group-by-length"], False)],
)
def test_a_switch_a_task_turns_off_can_be_turned_on_again(flags, grouped):
    """data.group_by_length is on by default, off for embedding (its run_defaults): `--group-by-length` turns it
    back on, from the command line alone."""
    from tuneforge.cli import _flags, build_parser, train_flags

    ns = build_parser().parse_args(["train", "--task", "embedding", *flags])
    assert config_from_sources(None, [], _flags(ns, train_flags())).data.group_by_length is grouped


# ---- the task follows from the data files, in the Python API as on the command line -----------------
@pytest.mark.parametrize(
    "values,task",
    [
        ({"data": {"train_file": "train.txt"}}, "clm"),
        ({"data": {"train_file": "train.csv"}}, "classification"),
        ({"data": {"source_file": "src.txt", "target_file": "tgt.txt"}}, "seq2seq"),
        ({"data": {"source_file": "src.txt", "train_file": "train.txt"}}, "seq2seq"),
        ({"task": "regression", "data": {"train_file": "train.txt"}}, "regression"),  # an explicit task wins
        ({"data": {"validation_file": "val.csv"}}, "classification"),  # eval: the validation file alone
        ({"data": {"validation_file": "valid.txt"}}, "clm"),
        ({}, "bbc-news"),
    ],
)
def test_task_inferred_from_files_in_the_python_api(values, task):
    assert build_config(values).task == task
    assert resolve(TrainConfig(**values)).task == task


def test_task_inferred_from_a_data_section_object():
    from tuneforge.config import DataConfig

    assert resolve(TrainConfig(data=DataConfig(train_file="notes.txt"))).task == "clm"


def test_task_inferred_the_same_from_the_cli():
    from tuneforge.cli import _flags, build_parser, train_flags

    for args, task in (
        (["--train-file", "a.txt"], "clm"),
        (["--train-file", "a.csv"], "classification"),
        (["--source-file", "s.txt", "--target-file", "t.txt"], "seq2seq"),
        (["--train-file", "a.txt", "--task", "classification"], "classification"),
    ):
        ns = build_parser().parse_args(["train", *args])
        assert config_from_sources(None, [], _flags(ns, train_flags())).task == task, args
    assert config_from_sources(None, ["task=clm"], {"data.train_file": "a.csv"}).task == "clm"


def test_trainer_overrides_of_backend_options():
    from tuneforge import Trainer

    config = TrainConfig(backend="deepspeed", offload="optimizer")
    trainer = Trainer(config, zero_stage=3)
    assert trainer.config.backend_options.zero_stage == 3 and trainer.config.backend_options.offload == "optimizer"
    assert Trainer(config, backend="tp", tp_size=2).config.backend_options.model_dump() == {"tp_size": 2}
    with pytest.raises(ConfigError, match="option of backend 'tp'"):
        Trainer(config, tp_size=2)


def _get(config, key):
    section, _, field = key.rpartition(".")
    return getattr(getattr(config, section) if section else config, field)


def test_a_tasks_own_defaults_fill_only_what_the_user_left_unset(tmp_path):
    from tuneforge.config import DataConfig, OptimConfig
    from tuneforge.tasks import task_class

    defaults = task_class("ner").Options.run_defaults
    assert defaults, "ner declares its own schedule (benchmarks/README.md, NER)"
    for key, value in defaults.items():
        assert _get(resolve(TrainConfig(task="ner")), key) == value, key
        assert _get(build_config({"task": "ner"}), key) == value, key
        assert _get(resolve(TrainConfig(task="ner", optim=OptimConfig(), data=DataConfig())), key) == value, key
        assert _get(TrainConfig(), key) == _get(TrainConfig(task="classification"), key), key  # others: the field's
        assert _get(TrainConfig(), key) != value, f"{key}: the test needs a default that differs from the field's"

        # what the user gives wins, however it is given
        mine = value * 2
        section, _, field = key.rpartition(".")
        given = {section: {field: mine}} if section else {field: mine}
        assert _get(build_config({"task": "ner", **given}), key) == mine, key
        if section:
            objects = {"optim": OptimConfig, "data": DataConfig}
            assert _get(resolve(TrainConfig(task="ner", **{section: objects[section](**{field: mine})})), key) == mine
        yaml_file = tmp_path / "ner.yaml"
        yaml_file.write_text(yaml.safe_dump({"task": "ner", **given}))
        assert _get(config_from_sources(str(yaml_file), [], {}), key) == mine, key
        assert _get(config_from_sources(None, [f"{key}={mine}"], {"task": "ner"}), key) == mine, key
        assert _get(config_from_sources(None, [], {"task": "ner", key: mine}), key) == mine, key

    # the saved config records what ran, and reloading it keeps it (now set by the file)
    config = resolve(TrainConfig(task="ner"))
    config.save(tmp_path / "config.yaml")
    reloaded = config_from_sources(str(tmp_path / "config.yaml"), [], {})
    assert all(_get(reloaded, key) == value for key, value in defaults.items())
    # a task without defaults of its own, or an unknown one, leaves the fields' defaults (the latter fails later)
    assert TrainConfig(task="no-such-task").epochs == TrainConfig().epochs


# ---- every number is finite and within stated bounds (issue 23) ------------------------------------
def numeric_keys() -> list[tuple[str, str, dict]]:
    """(dotted key, backend, values template) of every numeric config field and backend option, walked from the
    models so a new field is covered without naming it here."""
    from tuneforge.backends import backend_classes
    from tuneforge.config import DataConfig, OptimConfig, allowed_range
    from tuneforge.tasks import task_classes

    keys = []
    for section, model in (("", TrainConfig), ("optim", OptimConfig), ("data", DataConfig)):
        for name, field in model.model_fields.items():
            if allowed_range(field) or name == "freeze_layers":  # freeze_layers: a number or auto
                keys.append((f"{section}.{name}".lstrip("."), "single"))
    for backend, cls in backend_classes().items():
        keys += [
            (f"backend_options.{name}", backend) for name, f in cls.Options.model_fields.items() if allowed_range(f)
        ]
    seen = set()
    for task, cls in task_classes().items():
        for name, f in cls.Options.model_fields.items():
            if allowed_range(f) and name not in seen:  # a family's shared option once
                seen.add(name)
                keys.append((f"task_options.{name}", task))
    return keys


def values_with(key: str, backend: str, value) -> dict:
    section, _, name = key.rpartition(".")
    value = (0.9, value) if name == "betas" else value
    if section == "backend_options":
        return {"backend": backend, name: value}
    if section == "task_options":
        return {"task": backend, name: value}  # (the task that owns it)
    return {section: {name: value}} if section else {name: value}


NUMERIC_KEYS = numeric_keys()


def test_the_walk_finds_every_numeric_field():
    keys = {key for key, _ in NUMERIC_KEYS}
    assert len(keys) >= 40  # the walk really walks: a broken one would pass the tests below vacuously
    assert {"epochs", "seed", "task_options.dpo_beta", "lora_alpha", "optim.lr", "optim.betas"} <= keys
    assert {"data.max_length", "task_options.doc_stride", "task_options.block_size"} <= keys
    assert {"backend_options.zero_stage", "backend_options.tp_size", "skip_nonfinite"} <= keys


@pytest.mark.parametrize("key,backend", NUMERIC_KEYS, ids=[k for k, _ in NUMERIC_KEYS])
def test_every_numeric_field_refuses_inf_nan_and_huge_values(key, backend):
    """inf, -inf, nan and a number far past any sane value (10**30, also as a float) are one line each that
    names the key; a finite-number refusal states the allowed range."""
    huge = () if key == "freeze_layers" else (10**30, 1e30)  # more layers than there are: all of them, as said
    for bad in (float("inf"), float("-inf"), float("nan"), -(10**30), *huge):
        with pytest.raises(ConfigError) as err:
            build_config(values_with(key, backend, bad))
        message = str(err.value)
        assert "\n" not in message and f"'{key}'" in message, (bad, message)
        if key != "freeze_layers":
            assert "allowed: " in message, message


@pytest.mark.parametrize(
    "overrides,needles",
    [
        (["optim.lr=nan"], ["'optim.lr'", "finite", "allowed: a finite number > 0 and <= 1000"]),
        (["epochs=1e400"], ["'epochs'", "finite", "<= 1000000"]),
        (["epochs=.inf"], ["'epochs'", "finite"]),
        (["dpo_beta=inf", "task=dpo"], ["'task_options.dpo_beta'", "finite"]),
        (["lora_alpha=.nan", "adapter=lora"], ["'lora_alpha'", "finite"]),
        (["seed=4294967296"], ["'seed'", "allowed: a whole number >= 0 and <= 4294967295"]),
        (["data.max_length=1000000000000000000000000000000"], ["'data.max_length'", "<= 16777216"]),
        (["optim.betas=[0.9, 1.0]"], ["'optim.betas'", "each a finite number >= 0 and < 1"]),
        (["optim.max_grad_norm=-1"], ["'optim.max_grad_norm'", ">= 0"]),
        (["freeze_layers=.inf"], ["'freeze_layers'", "0 or more"]),
    ],
)
def test_overrides_refuse_non_finite_and_overflowing_values(overrides, needles):
    with pytest.raises(ConfigError) as err:
        config_from_sources(None, overrides, {})
    message = str(err.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_yaml_inf_and_nan_are_refused(tmp_path):
    cfg = tmp_path / "run.yaml"
    for text, key in (
        ("epochs: .inf\n", "'epochs'"),
        ("optim:\n  lr: .nan\n", "'optim.lr'"),
        ("seed: -.inf\n", "'seed'"),
    ):
        cfg.write_text(text)
        with pytest.raises(ConfigError, match=key):
            config_from_sources(str(cfg), [], {})


def test_trainer_overrides_are_validated_too():
    from tuneforge.trainer import Trainer

    with pytest.raises(ConfigError, match="'epochs'.*finite"):
        Trainer(build_config(task="classification"), epochs=float("inf"))


@pytest.mark.parametrize(
    "args,needle",
    [
        (["train", "--epochs", "inf"], "'epochs'"),
        (["train", "--task", "dpo", "--dpo-beta", "inf"], "'task_options.dpo_beta'"),
        (["train", "--adapter", "lora", "--lora-alpha", "inf"], "'lora_alpha'"),
        (["train", "--lr", "nan"], "'optim.lr'"),
        (["train", "--seed", str(2**40)], "'seed'"),
        (["train", "--max-grad-norm=-inf"], "'optim.max_grad_norm'"),
        (["train", "--batch-size", str(10**30)], "'batch_size'"),
        (["eval", "MODEL", "--max-length", str(10**30)], "'data.max_length'"),
        (
            ["eval", "MODEL", "--task", "qa", "--null-score-diff-threshold", "nan"],
            "'task_options.null_score_diff_threshold'",
        ),
        (["eval", "MODEL", "--seed=-1"], "'seed'"),
    ],
)
def test_cli_refuses_non_finite_flags_in_one_line_before_any_work(capsys, tmp_path, args, needle):
    (tmp_path / "train.csv").write_text("text,label\na,pos\nb,neg\n")
    out = tmp_path / "out"
    args = [str(tmp_path) if a == "MODEL" else a for a in args]
    code, stdout, stderr = cli_main(
        capsys, *args, "--train-file", str(tmp_path / "train.csv"), "--output-dir", str(out)
    )
    assert code == 2 and stderr.count("\n") == 1 and stderr.startswith("error: bad value for ") and needle in stderr
    assert "allowed: " in stderr and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.csv"]  # nothing written


# ---- config.yaml files written before tasks owned their options still load ---------------------------------
SAVED = Path(__file__).parent / "fixtures" / "config-f111d58"  # written by f111d58's `Config.save`, one per family
SAVED_OPTIONS = {  # what each file set that now lives in the task's options
    "classification": {},
    "glue-mrpc": {},
    "clm": {"block_size": 256, "packing": False},
    "sft": {"chat_format": "alpaca", "chat_template": "template.jinja", "block_size": 512},
    "dpo": {"drop_identical_pairs": True, "block_size": 384, "dpo_beta": 0.2},
    "seq2seq": {"source_file": "train.en", "source_prefix": "translate: ", "num_beams": 4, "generation_max_length": 48},
    "ner": {},
    "qa": {"doc_stride": 128, "n_best_size": 10, "max_answer_length": 40, "null_score_diff_threshold": 0.5},
    "multiple-choice": {"data_format": "codah"},
}


@pytest.mark.parametrize("name", sorted(SAVED_OPTIONS))
def test_a_config_saved_before_task_options_still_loads(name, tmp_path):
    old = load_yaml(SAVED / f"{name}.yaml")
    config = build_config(old)
    assert config.task == old["task"] and config.backend == old["backend"]
    assert {k: getattr(config.task_options, k) for k in SAVED_OPTIONS[name]} == SAVED_OPTIONS[name]
    assert config.data.max_length == old["data"]["max_length"] and config.epochs == old["epochs"]
    assert config.backend_options.model_dump() == old["backend_options"]
    config.save(tmp_path / "config.yaml")  # saved again in today's layout, it loads to the same config
    assert build_config(load_yaml(tmp_path / "config.yaml")) == config
    assert (
        "task_options" in load_yaml(tmp_path / "config.yaml")
        and "doc_stride" not in load_yaml(tmp_path / "config.yaml")["data"]
    )


def test_a_saved_config_of_one_task_refuses_another_tasks_option_it_sets():
    old = load_yaml(SAVED / "qa.yaml")  # doc_stride 128: a value, not a default
    with pytest.raises(ConfigError, match=r"doc_stride \(--doc-stride\) is an option of task 'qa', not of task 'clm'"):
        build_config({**old, "task": "clm"})


@pytest.mark.parametrize(
    "args,owner",
    [
        (["--task", "clm", "--doc-stride", "64"], "'qa'"),
        (["--dpo-beta", "0.2"], "'dpo'"),
        (["--task", "qa", "--block-size", "64"], "'clm' or 'sft' or 'dpo'"),
        (["--task", "ner", "--num-beams", "4"], "'seq2seq'"),
        (["--task", "sft", "--data-format", "codah"], "'multiple-choice'"),
        # a value at its owner's default (a config file's is dropped) was accepted and did nothing
        (["--packing"], "'clm' or 'sft'"),
        (["--task", "qa", "--pack-texts"], "'embedding'"),
        (["--task", "clm", "--kl-importance-correction"], "'grpo'"),
        (["task_options.packing=true"], "'clm' or 'sft'"),
        (["packing=true"], "'clm' or 'sft'"),
    ],
)
def test_a_flag_of_another_task_is_one_line_naming_its_task(capsys, tmp_path, args, owner):
    from tuneforge import cli

    out = tmp_path / "out"
    rc = cli.main(["train", *args, "--train-file", str(tmp_path / "train.csv"), "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert f"is an option of task {owner}" in err and not out.exists()


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--num-beams", "1"], "num_beams (--num-beams) is an option of task 'seq2seq', not of task 'classification'"),
        (["--packing"], "packing (--packing) is an option of task 'clm' or 'sft'"),
        (
            ["--zero-stage", "2"],
            "zero_stage (--zero-stage) is an option of backend 'deepspeed', not of backend 'single'",
        ),
    ],
)
def test_eval_refuses_another_owners_option_at_its_default_as_train_does(capsys, tmp_path, tiny_bert, flags, said):
    """eval dropped these without a word (they do nothing to a classifier's evaluation); train refuses them."""
    rc, out, err = cli_main(
        capsys, "eval", tiny_bert, "--task", "classification", *flags, "--output-dir", str(tmp_path)
    )
    assert rc == 2 and err.count("\n") == 1 and err.startswith(f"error: {said}"), err


@pytest.mark.parametrize(
    "given, needle",
    [
        ({"lora_r": 8}, "lora_r=8 sets up LoRA adapters, and this run has none (--adapter none)"),
        ({"adapter": "none", "lora_targets": "query"}, "lora_targets=query sets up LoRA adapters"),
        ({"experiment_name": "mrpc"}, "experiment_name=mrpc is the experiment or project"),
        ({"report_to": "tensorboard", "tracking_uri": "sqlite:///m.db"}, "--report-to tensorboard has none"),
    ],
)
def test_python_keywords_that_would_do_nothing_are_refused_as_the_clis_flags_are(given, needle):
    """TrainConfig(lora_r=8) without adapter="lora" (and a tracker setting no tracker of report_to reads) trained
    as if not given; the Python API's keywords, and Trainer's overrides, are given now as the CLI's flags are."""
    from tuneforge.trainer import Trainer

    with pytest.raises(ConfigError, match=re.escape(needle)):
        TrainConfig(task="classification", **given)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        Trainer(TrainConfig(task="classification"), **given)


def test_python_keywords_a_saved_config_holds_whole_are_let_pass(tmp_path):
    """A saved config.yaml given whole as keywords holds every LoRA key at its default: nothing given that does
    nothing; a LoRA run's, and a config dict (a file's values), keep their keys as `tuneforge train FILE` does."""
    build_config({"task": "classification"}).save(tmp_path / "config.yaml")
    assert TrainConfig(**load_yaml(tmp_path / "config.yaml")).adapter == "none"
    assert TrainConfig(task="classification", adapter="lora", lora_r=8, report_to="mlflow", run_name="a").lora_r == 8
    assert build_config({"task": "classification", "lora_r": 8}).lora_r == 8
