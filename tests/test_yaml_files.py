"""A user's YAML files (a run's config, a sweep's space): a key given twice, or text that does not parse, is one
line saying where; YAML's merge keys may still be overridden."""

import pytest

from tuneforge.config import load_yaml
from tuneforge.errors import ConfigError
from tuneforge.sweep.space import load_space
from tuneforge.yaml_files import read_yaml


@pytest.mark.parametrize(
    "text, expected",
    [
        ("task: glue/mrpc\noptim:\n  lr: 1.0e-4\n  lr: 2.0e-4\n", "key 'lr' is given twice (lines 3 and 4); keep one"),
        ("seed: 1\nepochs: 2\nseed: 3\n", "key 'seed' is given twice (lines 1 and 3); keep one"),
        (
            "task: [unclosed\n",
            "while parsing a flow sequence: expected ',' or ']', but got '<stream end>' (line 2, column 1)",
        ),
        (
            "task: a\n\tseed: 1\n",
            "while scanning for the next token: found character '\\t' that cannot start any token (line 2, column 1)",
        ),
    ],
)
def test_a_config_file_s_problem_is_one_line_saying_where(tmp_path, text, expected):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_yaml(path)
    assert str(caught.value) == f"config file {str(path)!r} is not valid YAML: {expected}"


def test_a_space_file_with_a_key_twice_is_refused(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("optim.lr: [1.0e-4, 2.0e-4]\nepochs: [1, 2]\noptim.lr: [3.0e-4]\n")
    with pytest.raises(ConfigError, match=r"space file .* key 'optim.lr' is given twice \(lines 1 and 3\)"):
        load_space(str(path))


def test_merge_keys_may_be_overridden_and_non_utf8_is_named(tmp_path):
    path = tmp_path / "merged.yaml"
    path.write_text("base: &base {lr: 1, seed: 2}\nrun:\n  <<: *base\n  lr: 3\n")
    assert read_yaml(path, "config file") == {"base": {"lr": 1, "seed": 2}, "run": {"lr": 3, "seed": 2}}
    path.write_bytes("seed: 1\nname: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 0xe9 at offset 17\); re-save it as UTF-8"):
        read_yaml(path, "config file")
