"""The search space file (tuneforge/sweep/space.py): its shape and ranges checked once, each problem one line naming
the key; then each key put into a real config as a trial would get it. No training."""

from pathlib import Path

import pytest

from conftest import REPO
from tuneforge.config import load_yaml, merge_sources
from tuneforge.configure import build_config
from tuneforge.errors import ConfigError
from tuneforge.sweep.space import FloatRange, check_against_config, distributions, load_space, value_at

BASE = {"task": "classification", "model": "some-model", "data": {"train_file": "train.csv"}}


def space_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return str(path)


def refusal(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_space(space_file(tmp_path, text))
    line = str(err.value)
    assert "\n" not in line
    return line


def test_every_kind_of_distribution_and_the_shorthands(tmp_path):
    text = """
optim.lr: {type: float, low: 1e-5, high: 1.0e-3, log: true}   # 1e-5: YAML text, read as the number it spells
optim.warmup_ratio: {type: float, low: 0.0, high: 0.2, step: 0.05}
lora_r: {type: int, low: 4, high: 32, step: 4}
epochs: {type: int, low: 1, high: 8, log: true}
batch_size: [8, 16]
optim.scheduler: {choices: [linear, cosine]}
optim.max_grad_norm: [null, 1.0]
"""
    space = load_space(space_file(tmp_path, text))
    assert list(space.params) == [
        "optim.lr",
        "optim.warmup_ratio",
        "lora_r",
        "epochs",
        "batch_size",
        "optim.scheduler",
        "optim.max_grad_norm",
    ]
    assert space.params["optim.lr"] == FloatRange(type="float", low=1e-5, high=1e-3, log=True)
    made = distributions(space)
    assert made["optim.lr"].log and made["optim.lr"].low == 1e-5
    assert made["lora_r"].step == 4 and made["epochs"].log
    assert made["batch_size"].choices == (8, 16) and made["optim.max_grad_norm"].choices == (None, 1.0)
    assert made["optim.warmup_ratio"].step == 0.05


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "optim.lr: {type: float, low: 1.0e-3, high: 1.0e-5}",
            "key 'optim.lr': low (0.001) must be below high (1e-05)",
        ),
        ("epochs: {type: int, low: 3, high: 3}", "key 'epochs': low (3) must be below high (3)"),
        ("optim.lr: {type: float, low: 0, high: 0.1, log: true}", "a log range needs low above 0 (got 0)"),
        ("optim.lr: {type: float, low: -1, high: 0.1, log: true}", "a log range needs low above 0 (got -1)"),
        ("optim.lr: {type: float, low: 0, high: .inf}", "key 'optim.lr': high: Input should be a finite number"),
        ("optim.lr: {type: float, low: .nan, high: 1}", "key 'optim.lr': low: Input should be a finite number"),
        ("optim.lr: {type: float, low: 1e400, high: 1}", "finite number"),
        ("optim.lr: {type: float, low: true, high: 1}", "needs a number, not true/false"),
        ("optim.lr: {type: float, low: abc, high: 1}", "low: Input should be a valid number"),
        ("epochs: {type: int, low: 1.5, high: 3}", "key 'epochs': low: Input should be a valid integer (got 1.5)"),
        ("epochs: {type: int, low: 1, high: 4, step: 2}", "high - low (3) must be a multiple of step (2)"),
        ("epochs: {type: int, low: 1, high: 4, step: 0}", "step: Input should be greater than or equal to 1"),
        ("optim.lr: {type: float, low: 0.1, high: 1, log: true, step: 0.1}", "log and step do not combine"),
        ("batch_size: []", "key 'batch_size': choices: List should have at least 1 item"),
        ("batch_size: {type: categorical, choices: []}", "at least 1 item"),
        ("batch_size: [8, 8]", "key 'batch_size': 8 is listed more than once"),
        ("optim.lr: [1, 1.0]", "key 'optim.lr': 1.0 is the same choice as 1"),  # Optuna keeps the first of equals
        ("gradient_checkpointing: [true, 1]", "1 is the same choice as True"),
        ("optim.lr: [0.1, .nan]", "choices must be finite numbers (no inf or nan)"),
        ("optim.lr: [{a: 1}]", "each choice is a number, text, true/false or null"),
        ("optim.lr: {low: 1, high: 2}", "needs a type: float, int or categorical"),
        ("optim.lr: {type: normal, low: 1, high: 2}", "needs a type: float, int or categorical"),
        ("optim.lr: {type: float, low: 1, high: 2, lg: true}", "key 'optim.lr': lg: unknown field"),
        ("optim.lr: 0.1", "needs a distribution"),
        ("'optim..lr': [1]", "'optim..lr' is not a config key"),
        ("output_dir: [a, b]", "'output_dir' is set by the sweep for each trial"),
        ("resume: [latest]", "'resume' is set by the sweep"),
        ("- optim.lr", "must map config keys to distributions"),
        ("", "must map config keys to distributions"),
        ("optim.lr: [1, 2", "is not valid YAML"),
    ],
)
def test_a_bad_space_is_one_line_naming_the_key(tmp_path, text, expected):
    line = refusal(tmp_path, text)
    assert line.startswith("space file ") and expected in line, line


def test_two_problems_are_both_named(tmp_path):
    line = refusal(tmp_path, "optim.lr: {type: float, low: 1, high: 0}\nepochs: {type: int, low: 5, high: 1}")
    assert "key 'optim.lr': low (1) must be below high (0)" in line and "key 'epochs': low (5)" in line


def test_a_missing_space_file(tmp_path):
    with pytest.raises(ConfigError, match="space file '.*nope.yaml' does not exist"):
        load_space(str(tmp_path / "nope.yaml"))


# ---- the space against the run's config ----------------------------------------------------------------------
def build(values: dict):
    """The config a trial with `values` gets (the base here: a classification run)."""
    return lambda params: build_config(merge_sources(None, [f"{k}={v}" for k, v in values.items()], params))


def check(tmp_path, text: str, **base) -> None:
    check_against_config(load_space(space_file(tmp_path, text)), build({**flat(BASE), **base}), "space.yaml")


def flat(values: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in values.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def test_keys_of_the_run_pass(tmp_path):
    check(tmp_path, "optim.lr: {type: float, low: 1.0e-5, high: 1}\nepochs: [1, 2.5]\nfreeze_layers: [0, 2, auto]")
    check(
        tmp_path,
        "dropout: {type: float, low: 0.0, high: 0.5}\nlora_r: [4, 8]\noptim.warmup_ratio: [0.0]",
        adapter="lora",
        freeze_layers="auto",
    )
    check(tmp_path, "zero_stage: [1, 3]", backend="deepspeed")  # a backend's option, given flat
    check(tmp_path, "doc_stride: [32, 64]", task="qa")  # a task's option, given flat


@pytest.mark.parametrize(
    ("text", "base", "expected"),
    [
        ("optim.learning_rate: [0.1]", {}, "key 'optim.learning_rate' = 0.1: unknown config key 'optim.learning_rate'"),
        ("per_device_batch_size: [8]", {}, "unknown config key 'per_device_batch_size'"),
        ("optim.lr: {type: float, low: 0.1, high: 10000}", {}, "key 'optim.lr' = 10000.0: bad value for 'optim.lr'"),
        ("epochs: {type: int, low: 0, high: 3}", {}, "key 'epochs' = 0: bad value for 'epochs'"),
        ("optim.scheduler: [linear, zigzag]", {}, "key 'optim.scheduler' = 'zigzag'"),
        ("zero_stage: [1, 3]", {}, "is an option of backend 'deepspeed'"),  # not this run's backend
        ("doc_stride: [32, 64]", {}, "is an option of task 'qa'"),
        ("optim: [1]", {}, "key 'optim' = 1"),
        ("freeze_layers: [1]", {"adapter": "lora"}, "do not combine with --adapter lora"),
    ],
)
def test_a_key_or_value_the_config_refuses(tmp_path, text, base, expected):
    with pytest.raises(ConfigError) as err:
        check(tmp_path, text, **base)
    assert str(err.value).startswith("space file 'space.yaml': ") and expected in str(err.value), str(err.value)


def test_a_lora_key_of_a_run_without_adapters_would_change_nothing_unless_the_space_varies_the_adapter(tmp_path):
    """Every trial trained without adapters, the LoRA rank the sweep varied ignored (as train refuses --lora-r)."""
    with pytest.raises(ConfigError, match=r"key 'lora_r' = 4: lora_r=4 sets up LoRA adapters, and this run has none"):
        check(tmp_path, "lora_r: [4, 8]")
    check(tmp_path, "adapter: [none, lora]\nlora_r: [4, 8]", freeze_layers="auto")


def test_another_owners_option_at_its_default_would_change_nothing(tmp_path):
    # build_config drops another backend's option left at that backend's default (as 0.x config files list them):
    # the sweep refuses it, since no trial would train with it
    from tuneforge.backends import backend_class

    default = backend_class("deepspeed").Options.model_fields["zero_stage"].default
    with pytest.raises(ConfigError, match="key 'zero_stage' is not an option of this run"):
        check(tmp_path, f"zero_stage: [{default}]")


def test_value_at_finds_sections_fields_and_flat_options():
    config = build_config(merge_sources(None, ["task=qa", "zero_stage=2", "backend=deepspeed", "doc_stride=48"], {}))
    assert value_at(config, "optim.lr") == (True, config.optim.lr)
    assert value_at(config, "doc_stride") == (True, 48) and value_at(config, "data.doc_stride") == (True, 48)
    assert value_at(config, "zero_stage") == (True, 2)
    assert value_at(config, "nonsense") == (False, None)


def test_the_shipped_example_space_fits_its_config():
    space_path = REPO / "configs" / "sweeps" / "glue-mrpc-space.yaml"
    space = load_space(str(space_path))
    base = REPO / "configs" / "glue-mrpc.yaml"
    load_yaml(base)
    check_against_config(space, lambda params: build_config(merge_sources(str(base), [], params)), str(space_path))
