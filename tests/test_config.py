"""YAML configs: every shipped example validates; key=value overrides and flags layer on top;
unknown keys and bad values are rejected before any work, naming the key and what is allowed."""

from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_cli, write_sentiment_csv
from tuneforge.backends import available_backends
from tuneforge.config import TrainConfig, apply_overrides, build_config, config_from_sources, load_yaml
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
    "ddp",
    "deepspeed",
    "fsdp",
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
    with pytest.raises(ConfigError) as err:
        build_config(values)
    message = str(err.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_yaml_file_problems(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(bad)
    bad.write_text("- a list\n- not a mapping\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_yaml(bad)
    with pytest.raises(ConfigError, match="not key=value"):
        apply_overrides({}, ["optim.lr"])


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


def test_save_steps_alone_means_saving_every_n_steps():
    from tuneforge.config import build_config

    assert build_config({"save_steps": 50}).save_strategy == "steps"
    assert build_config({"save_steps": 50, "save_strategy": "no"}).save_strategy == "no"  # explicit wins
    assert build_config({}).save_strategy == "no"
