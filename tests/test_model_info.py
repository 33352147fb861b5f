"""tuneforge.json has one reader and one writer (tuneforge.artifacts), and they round-trip.

The walk reads src/tuneforge as text and AST: the file's name is spelt only in artifacts.py, every other
module reaches the file through `read_model_info`/`write_model_info`, and no module but artifacts.py opens
a path built from MODEL_INFO itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tuneforge.artifacts import MODEL_INFO, read_model_info, write_model_info
from tuneforge.errors import ConfigError

SRC = Path(__file__).resolve().parents[1] / "src" / "tuneforge"
HOME = SRC / "artifacts.py"
FILE_METHODS = {"write_text", "write_bytes", "read_text", "read_bytes", "open"}


def modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if p != HOME)


def test_the_file_name_is_spelt_only_in_artifacts():
    """Docstrings and comments may name the file; code (a string constant) may not."""
    spelt = []
    for path in modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == MODEL_INFO and id(node) not in docstrings:
                spelt.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert spelt == [], f"{MODEL_INFO!r} written outside artifacts.py (use read_model_info/write_model_info): {spelt}"


def test_no_module_opens_the_file_but_artifacts():
    """`folder / MODEL_INFO` may be tested for existence elsewhere, never read or written there."""
    opened = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in FILE_METHODS
                and "MODEL_INFO" in ast.unparse(node.func.value)
            ):
                opened.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert opened == [], f"tuneforge.json opened outside artifacts.py: {opened}"


def test_the_readers_and_writers_use_the_one_pair():
    """Every module that touches the file goes through artifacts' functions (export re-exports the reader)."""
    users = {
        path.relative_to(SRC).as_posix()
        for path in modules()
        if "read_model_info(" in path.read_text(encoding="utf-8")
        or "write_model_info(" in path.read_text(encoding="utf-8")
    }
    # the three writers of before (export, adapters, checkpoint) and the readers (adapters, tasks, predict)
    assert {"export.py", "adapters.py", "checkpoint.py", "predict.py"} <= users
    for name in users:
        text = (SRC / name).read_text(encoding="utf-8")
        assert "def read_model_info" not in text and "def write_model_info" not in text, name


def test_write_then_read_round_trips(tmp_path):
    info = {"task": "classification", "max_length": 128, "text_columns": ["text"]}
    write_model_info(tmp_path, info)
    assert (tmp_path / MODEL_INFO).exists()
    assert read_model_info(tmp_path) == info
    assert read_model_info(tmp_path / "elsewhere") == {}


@pytest.mark.parametrize(("text", "says"), [("{not json", "is not valid JSON"), ("[1, 2]", "is not a JSON object")])
def test_a_bad_file_is_one_config_error(tmp_path, text, says):
    (tmp_path / MODEL_INFO).write_text(text)
    with pytest.raises(ConfigError, match=says):
        read_model_info(tmp_path)


def test_export_still_offers_the_reader():
    from tuneforge import export

    assert export.read_model_info is read_model_info
