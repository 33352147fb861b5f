"""Reward functions (tuneforge.rewards, for `--task grpo`): the built-ins on GSM8K-like answers in both of TRL's
forms, user functions loaded from real files, the scoring table and its one-line errors, every bad spec, a
property test of the answer matching, and the real GSM8K solutions scored against themselves."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tuneforge.errors import ConfigError, DataError
from tuneforge.rewards import (
    BUILTIN,
    DEFAULT_FORMAT,
    RewardFunction,
    RewardSettings,
    check_reward_spec,
    load_rewards,
    score,
)

SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72 clips.\n#### 72"


def reward(spec: str, **changes) -> RewardFunction:
    (function,) = load_rewards([spec], RewardSettings(**changes))
    return function


def chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and message.strip() == message and message, message
    return message


def write(tmp_path, name: str, source: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


# --- accuracy -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("So she sold \\boxed{72} clips.", SOLUTION, 1.0),
        ("24 in May, 72 in all.\n#### 72", SOLUTION, 1.0),
        ("<think>48 + 24</think>\n<answer>72</answer>", SOLUTION, 1.0),
        ("The total is 1,234.", "#### 1234", 1.0),
        ("\\boxed{1,234}", "1,234", 1.0),
        ("<answer>$18</answer>", "#### 18", 1.0),
        ("She earned 18 dollars.", "#### 18", 1.0),
        ("\\boxed{18.00}", "18", 1.0),
        ("\\boxed{\\$1{,}234}", "#### 1,234", 1.0),
        ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("<answer>45%</answer>", "45", 1.0),
        ("It lost -$5 on the deal.", "-5", 1.0),
        ("first \\boxed{3}, on second thought \\boxed{72}", "72", 1.0),  # the last box
        ("\\boxed{72} because 8 x 9 = 72 and 3", "72", 1.0),  # a box beats the last number
        ("#### 72\nchecked in 3 steps", "72", 1.0),  # `#### N` beats the last number
        ("<answer>The answer is 72.</answer>", "72", 1.0),
        ("We had 10-2 left", "2", 1.0),  # a subtraction, not -2
        ("<answer>Paris</answer>", " paris. ", 1.0),  # not numbers: compared as normalised text
        ("So she sold \\boxed{71} clips.", SOLUTION, 0.0),
        ("24 in May, 73 in all.\n#### 73", SOLUTION, 0.0),
        ("<answer>7.2</answer>", "72", 0.0),
        ("\\boxed{1000001}", "#### 1,000,000", 0.0),  # whole numbers compare exactly, not within 1e-6
        ("I do not know.", SOLUTION, 0.0),
        ("<answer>Lyon</answer>", "Paris", 0.0),
        ("", SOLUTION, 0.0),
        ("\\boxed{72}", 72, 1.0),  # a numeric column
        ("\\boxed{72}", "", None),  # no reference: not applicable
        ("\\boxed{72}", "   ", None),
        ("\\boxed{72}", None, None),
    ],
)
def test_accuracy(completion, answer, expected):
    accuracy = reward("accuracy")
    assert accuracy.columns == ("answer",)
    assert accuracy.fn(prompts=["q"], completions=[completion], answer=[answer]) == [expected]
    # conversational: the last assistant message is read
    messages = [{"role": "user", "content": "\\boxed{1}"}] + chat("no") + chat(completion)
    prompt = [{"role": "user", "content": "How many clips?"}]
    assert accuracy.fn(prompts=[prompt], completions=[messages], answer=[answer]) == [expected]


def test_accuracy_reads_the_column_the_settings_name():
    accuracy = reward("accuracy", answer_column="solution")
    assert accuracy.columns == ("solution",)
    scores = accuracy.fn(prompts=["a", "b"], completions=["#### 72", "#### 5"], solution=[SOLUTION, "#### 6"])
    assert scores == [1.0, 0.0]


# integers written as a GSM8K `#### N` line in any of the ways a solution or a model writes them
def written(number: int, style: int) -> str:
    sign, digits = ("-" if number < 0 else ""), abs(number)
    return [
        f"{number}",
        f"{number:,}",
        f"{sign}${digits:,}",
        f"{number:,} dollars",
        f"{number}.00",
        f"{number:,}.",
        f"\\boxed{{{number}}}",
    ][style]


@settings(max_examples=200, deadline=None)
@given(st.integers(-(10**12), 10**12), st.integers(0, 5), st.integers(0, 6))
def test_accuracy_any_integer_matches_its_reference(number, reference_style, completion_style):
    accuracy = reward("accuracy")
    reference = f"Some working: 3 + 4 = 7.\n#### {written(number, reference_style)}"
    right = written(number, completion_style)
    wrong = written(number + 1, completion_style)
    completions = [f"I think so.\n#### {right}" if "boxed" not in right else right, f"Hence\n#### {wrong}"]
    assert accuracy.fn(prompts=["q", "q"], completions=completions, answer=[reference, reference]) == [1.0, 0.0]


def test_accuracy_on_gsm8k_solutions(shared_data):
    path = shared_data / "gsm8k" / "train.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not found")
    with path.open() as lines:
        rows = [json.loads(next(lines)) for _ in range(20)]
    answers = [row["answer"] for row in rows]
    changed = []
    for answer in answers:
        body, final = answer.rsplit("#### ", 1)
        changed.append(f"{body}#### {int(final.replace(',', '')) + 1}")
    accuracy = reward("accuracy").fn
    prompts = [row["question"] for row in rows]
    assert accuracy(prompts=prompts, completions=answers, answer=answers) == [1.0] * 20
    assert accuracy(prompts=prompts, completions=changed, answer=answers) == [0.0] * 20


# --- format and length ----------------------------------------------------------------------------------------


def test_format_default_pattern():
    assert DEFAULT_FORMAT == r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    completions = [
        "<think>48/2 = 24</think><answer>72</answer>",
        "\n <think>line one\nline two</think>\n\n<answer>\n72\n</answer>  \n",  # multi-line, stripped
        "<think>24</think>",  # no answer
        "<answer>72</answer>",  # no thinking
        "<think>a</think><answer>72</answer> and more",  # text after the answer
        "So <think>a</think><answer>72</answer>",  # text before
    ]
    expected = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    fmt = reward("format").fn
    assert fmt(prompts=["p"] * 6, completions=completions) == expected
    assert fmt(prompts=[[{"role": "user", "content": "p"}]] * 6, completions=[chat(c) for c in completions]) == expected


def test_format_pattern_is_settable():
    fmt = reward("format", format_pattern=r"Answer: \d+").fn
    assert fmt(prompts=["p"] * 3, completions=["Answer: 72", " Answer: 72\n", "Answer: seventy"]) == [1.0, 1.0, 0.0]


def test_length():
    length = reward("length", target_length=4).fn
    ids = [[1] * n for n in (4, 2, 6, 8, 12, 0, 3)]
    assert length(prompts=["p"] * 7, completions=["c"] * 7, completion_ids=ids) == [1.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.75]
    assert reward("length").fn(prompts=["p"], completions=["c"], completion_ids=[[0] * 256]) == [1.0]


# --- user functions and the scoring table ---------------------------------------------------------------------

USER_REWARDS = """
    import math

    from helper import BONUS  # a module beside the file


    def right_answer(prompts, completions, answer, completion_ids, **kwargs):
        return [1.0 + BONUS if c == a else (None if a == "skip" else 0.0) for c, a in zip(completions, answer)]


    def fails_on_bad(prompts, completions, **kwargs):
        return [float(c == "good") if c != "bad" else 1 / 0 for c in completions]


    def fails_on_batches(prompts, completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("batch too\\nbig")
        return [0.0]


    def three(prompts, completions, **kwargs):
        return [0.0, 0.0, 0.0]


    def text(prompts, completions, **kwargs):
        return "abc"


    def strings(prompts, completions, **kwargs):
        return [0.0, "abc", 0.0, 0.0]


    def infinite(prompts, completions, **kwargs):
        return [0.0, 0.0, math.inf, 0.0]


    def not_a_number(prompts, completions, **kwargs):
        return [0.0, math.nan, 0.0, 0.0]


    def as_tuple(prompts, completions, **kwargs):
        return tuple(True for _ in completions)


    def numpy_values(prompts, completions, **kwargs):
        import numpy as np

        return [np.bool_(True), np.array(0.5), np.float32(0.25), np.int64(2)]


    def as_array(prompts, completions, **kwargs):
        import numpy as np

        return np.array([0.5] * len(completions))


    def as_tensor(prompts, completions, **kwargs):
        import torch

        return torch.arange(len(completions)) / 2


    def lazily(prompts, completions, **kwargs):
        return (float(c == "good") for c in completions)


    def mapped(prompts, completions, **kwargs):
        return map(len, completions)


    def matrix(prompts, completions, **kwargs):
        import numpy as np

        return np.zeros((len(completions), 2))


    async def judged(prompts, completions, **kwargs):
        import asyncio

        async def judge(completion):
            await asyncio.sleep(0)  # an API call, in TRL's async reward functions
            return 1 / 0 if completion == "bad" else float(completion == "good")

        return await asyncio.gather(*(judge(c) for c in completions))


    async def limited(prompts, completions, **kwargs):
        import asyncio

        global LIMIT
        LIMIT = LIMIT or asyncio.Semaphore(2)  # at most 2 judge calls at once, for the whole run

        async def judge(completion):
            async with LIMIT:
                await asyncio.sleep(0.01)
                return float(completion == "good")

        return await asyncio.gather(*(judge(c) for c in completions))


    LIMIT = None
    THRESHOLD = 0.5
"""


@pytest.fixture
def user_file(tmp_path):
    write(tmp_path, "helper.py", "BONUS = 0.5\n")
    return write(tmp_path, "my_rewards.py", USER_REWARDS)


def batch(rows: int = 4) -> tuple[list, list, dict]:
    prompts = [f"Question {i}: how many clips did Natalia sell altogether in April and in May?" for i in range(rows)]
    completions = ["72", "5", "bad", "good"][:rows]
    columns = {"answer": ["72", "6", "skip", "x"][:rows], "completion_ids": [[1, 2]] * rows}
    return prompts, completions, columns


def test_score_table(user_file):
    functions = load_rewards(
        ["accuracy", f"{user_file}:right_answer", "length", f"{user_file}:as_tuple"], RewardSettings(target_length=2)
    )
    assert [f.name for f in functions] == ["accuracy", f"{user_file}:right_answer", "length", f"{user_file}:as_tuple"]
    assert [f.columns for f in functions] == [("answer",), ("answer",), (), ()]  # right_answer names `answer`
    prompts, completions, columns = batch()
    table = score(functions, prompts, completions, columns)
    assert table.dtype == torch.float64 and table.shape == (4, 4)
    expected = torch.tensor(
        [[1.0, 1.5, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0], [0.0, math.nan, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(table, expected, equal_nan=True)


def test_numpy_values_count_as_numbers(user_file):
    """As TRL reads them (torch.tensor of the list): numpy's bools, scalars and 0-d arrays, like Python's."""
    prompts, completions, columns = batch()
    table = score([reward(f"{user_file}:numpy_values")], prompts, completions, columns)
    assert table[:, 0].tolist() == [1.0, 0.5, 0.25, 2.0]


def test_a_numpy_array_or_tensor_of_values_is_taken_as_trl_takes_it(user_file):
    """TRL reads a function's result value by value, so a 1-d numpy array or tensor works there; here it was 'returned
    a ndarray, not a list'."""
    prompts, completions, columns = batch()
    table = score([reward(f"{user_file}:as_array"), reward(f"{user_file}:as_tensor")], prompts, completions, columns)
    assert table.tolist() == [[0.5, 0.0], [0.5, 0.5], [0.5, 1.0], [0.5, 1.5]]
    with pytest.raises(DataError, match="matrix' returned a ndarray of shape \\(4, 2\\), not a list of 4 values"):
        score([reward(f"{user_file}:matrix")], prompts, completions, columns)


def test_a_generator_or_map_of_values_is_taken_as_trl_takes_it(user_file):
    """TRL reads a function's result value by value: `return (score(c) for c in completions)` or `map(...)` works
    there; here it was 'returned a generator, not a list'."""
    prompts, completions, columns = batch()
    table = score([reward(f"{user_file}:lazily"), reward(f"{user_file}:mapped")], prompts, completions, columns)
    assert table.tolist() == [[0.0, 2.0], [0.0, 1.0], [0.0, 3.0], [1.0, 4.0]]


def test_an_async_function_is_awaited(user_file):
    """TRL 1.x takes `async def` reward functions (awaited together): one returned an unawaited coroutine here."""
    prompts, completions, columns = batch()
    function = reward(f"{user_file}:judged")
    table = score([function], [prompts[i] for i in (0, 1, 3)], ["72", "5", "good"], {})
    assert table[:, 0].tolist() == [0.0, 0.0, 1.0]
    with pytest.raises(DataError) as error:
        score([function], prompts, completions, columns)
    assert "raised ZeroDivisionError: division by zero on row 2" in one_line(error)


def test_async_functions_run_on_one_event_loop_for_the_run(user_file):
    """TRL awaits async reward functions on one event loop kept for the run: what a function keeps between calls
    (an API client, a semaphore bounding its calls) stays bound to that loop. Each call here had a loop of its own,
    so the second step failed: 'Semaphore ... is bound to a different event loop'; and scoring called inside a
    running loop (a notebook's) failed: 'asyncio.run() cannot be called from a running event loop'."""
    import asyncio

    function = reward(f"{user_file}:limited")
    prompts, completions, columns = batch()
    for _ in range(2):
        assert score([function], prompts, completions, columns)[:, 0].tolist() == [0.0, 0.0, 0.0, 1.0]

    async def in_a_notebook():
        return score([function], prompts, completions, columns)[:, 0].tolist()

    assert asyncio.run(in_a_notebook()) == [0.0, 0.0, 0.0, 1.0]


def test_relative_path_from_the_current_folder(user_file, monkeypatch):
    monkeypatch.chdir(user_file.parent)
    function = reward("my_rewards.py:right_answer")
    assert function.name == "my_rewards.py:right_answer"
    prompts, completions, columns = batch(2)
    assert score([function], prompts, completions, columns).tolist() == [[1.5], [0.0]]


@pytest.mark.parametrize(
    ("name", "needles"),
    [
        ("fails_on_bad", ["ZeroDivisionError: division by zero", "row 2", "'Question 2: how many"]),
        ("fails_on_batches", ["RuntimeError: batch too big", "batch of 4 completions", "first prompt", "'Question 0"]),
        ("three", ["returned 3 values for 4 completions"]),
        ("text", ["returned a str, not a list of 4 values"]),
        ("strings", ["returned 'abc' for row 1", "finite number, or None"]),
        ("infinite", ["returned inf for row 2"]),
        ("not_a_number", ["returned nan for row 1"]),
    ],
)
def test_score_refuses_a_bad_function_in_one_line(user_file, name, needles):
    function = reward(f"{user_file}:{name}")
    with pytest.raises(DataError) as error:
        score([reward("length"), function], *batch())
    message = one_line(error)
    assert f"reward '{user_file}:{name}'" in message
    for needle in needles:
        assert needle in message
    if "prompt" in message:  # quoted, shortened to 60 characters
        assert "...'" in message and len(message.split("prompt", 1)[1]) < 90


def test_score_names_the_row_of_a_builtin_on_bad_data():
    with pytest.raises(DataError) as error:
        score([reward("accuracy")], ["p", "q"], ["#### 1", ["not", "messages"]], {"answer": ["1", "2"]})
    assert "reward 'accuracy' raised TypeError" in one_line(error) and "row 1" in one_line(error)


# --- bad specs and settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "needles"),
    [
        (
            "acuracy",
            ["'acuracy'", "no such reward", "did you mean 'accuracy'", *BUILTIN, "file.py:function", "model:DIR"],
        ),
        ("rouge", ["no such reward", "accuracy, format, length", "path/to/file.py:function", "model:DIR"]),
        ("", ["empty"]),
        ("model:", ["names no folder", "model:DIR"]),
        (":fn", ["no file before ':'"]),
        ("rewards.py:", ["no function after ':'"]),
        ("rewards.py", ["names a file but no function", "rewards.py:function"]),
        ("missing.py:fn", ["'missing.py'", "not found", "current folder"]),
        ("notes.txt:fn", ["'notes.txt' is not a .py file"]),
        ("rewards.py:my-fn", ["'my-fn' is not a Python function name"]),
    ],
)
def test_bad_spec(tmp_path, monkeypatch, spec, needles):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "notes.txt", "")
    write(tmp_path, "rewards.py", "")
    for call in (lambda: check_reward_spec(spec), lambda: load_rewards([spec], RewardSettings())):
        with pytest.raises(ConfigError) as error:
            call()
        message = one_line(error)
        for needle in needles:
            assert needle in message, message


def test_a_folder_is_not_a_reward_file(tmp_path):
    (tmp_path / "pkg.py").mkdir()
    with pytest.raises(ConfigError) as error:
        check_reward_spec(f"{tmp_path / 'pkg.py'}:fn")
    assert "is a folder" in one_line(error)


@pytest.mark.parametrize(
    ("source", "name", "needles"),
    [
        (USER_REWARDS, "missing", ["my_rewards.py has no 'missing'; it defines right_answer, fails_on_bad,"]),
        ("".join(f"def f{i}(**kw): pass\n" for i in range(12)), "fn", ["it defines f0, f1,", "f9 and 2 more"]),
        ("from math import sqrt\n", "fn", ["has no 'fn'", "it defines no functions"]),  # imported, not defined
        (USER_REWARDS, "THRESHOLD", ["'THRESHOLD' in my_rewards.py is of type float, not a function"]),
        (
            "def fn(prompts, completions:\n    return []\n",
            "fn",
            ["my_rewards.py failed to import: SyntaxError", "line 1"],
        ),
        ("import no_such_module_here\n", "fn", ["failed to import: ModuleNotFoundError", "no_such_module_here"]),
        ("x = 1\nraise RuntimeError('no\\nGPU')\n", "fn", ["failed to import: RuntimeError: no GPU (line 2)"]),
        ("import sys\nsys.exit(3)\n", "fn", ["failed to import: SystemExit: 3"]),
        ("def fn(prompts, completions):\n    return []\n", "fn", ["signature is (prompts, completions)", "**kwargs"]),
    ],
)
def test_bad_user_function(tmp_path, source, name, needles):
    write(tmp_path, "helper.py", "BONUS = 0.5\n")
    path = write(tmp_path, "my_rewards.py", source)
    check_reward_spec(f"{path}:{name}")  # cheap: the file exists, nothing imported yet
    modules = set(sys.modules)
    with pytest.raises(ConfigError) as error:
        load_rewards([f"{path}:{name}"], RewardSettings())
    message = one_line(error)
    for needle in needles:
        assert needle in message, message
    if "failed to import" in message:
        assert not {m for m in set(sys.modules) - modules if m.startswith("tuneforge_user_rewards")}
    assert str(tmp_path) not in sys.path


def test_check_reward_spec_imports_nothing(tmp_path):
    path = write(tmp_path, "boom.py", "raise SystemExit('imported')\n")
    code = f"import sys; from tuneforge.rewards import check_reward_spec as c; c('accuracy'); c({f'{path}:fn'!r}); "
    code += "c('model:some/dir'); print(sorted(m for m in ('torch', 'boom') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("specs", "changes", "needles"),
    [
        (["format"], {"format_pattern": "<answer>(.*"}, ["format reward's pattern '<answer>(.*'", "not a valid regex"]),
        (["length"], {"target_length": 0}, ["length reward's target is 0 tokens"]),
        (["accuracy"], {"answer_column": ""}, ["answer column is empty"]),
        (["accuracy", "format", "accuracy"], {}, ["--reward 'accuracy' is given twice", "--reward-weights"]),
        ([], {}, ["no --reward given"]),
    ],
)
def test_bad_settings_and_lists(specs, changes, needles):
    with pytest.raises(ConfigError) as error:
        load_rewards(specs, RewardSettings(**changes))
    for needle in needles:
        assert needle in one_line(error)


def test_the_same_file_function_twice(user_file, monkeypatch):
    monkeypatch.chdir(user_file.parent)
    with pytest.raises(ConfigError) as error:
        load_rewards([f"{user_file}:three", "./my_rewards.py:three"], RewardSettings())
    assert f"--reward './my_rewards.py:three' is given twice (as '{user_file}:three')" in one_line(error)
    # two functions of one file are two rewards
    assert len(load_rewards(["my_rewards.py:three", "my_rewards.py:text"], RewardSettings())) == 2


def test_trainer_state_reaches_every_function_and_no_column_may_take_its_name(user_file):
    """TRL passes `trainer_state=` to every reward function; a data column of that name would have clashed with it
    (a TypeError blamed on the function), as one named `prompts` would."""
    source = "def step(completions, trainer_state, **kwargs):\n    return [trainer_state] * 2\n"
    write(user_file.parent, "state.py", source)
    function = reward(f"{user_file.parent / 'state.py'}:step")
    assert function.columns == ()  # scoring gives it, not the data
    assert score([function], ["p", "q"], ["a", "b"], {}, trainer_state=3).tolist() == [[3.0], [3.0]]
    with pytest.raises(DataError, match="a data column is named 'trainer_state'"):
        score([function], ["p", "q"], ["a", "b"], {"trainer_state": [1, 2]}, trainer_state=3)
