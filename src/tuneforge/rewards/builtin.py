"""The built-in reward functions (`--reward accuracy | format | length`), TRL/open-r1 style, and the reading of
a prompt's or completion's text in either of TRL's forms.

Each built-in is made by a factory from its settings and has TRL's signature
`fn(prompts, completions, **columns) -> list[float | None]`. Completions are plain strings or conversational
(`[{"role": "assistant", "content": text}]`); the built-ins read the text of the last assistant message.

- accuracy: 1.0 when the completion's final answer equals the row's reference answer, else 0.0; None (not
  applicable) for a row whose reference is empty.
  The reference is the row's answer column: GSM8K's worked solution ending in a line `#### N` gives N, any other
  value is taken whole. The candidate is, from the completion: the last `\\boxed{...}` (nested braces kept), else
  the last `#### N`, else the content of the last `<answer>...</answer>`, else the last number in the text, else
  the whole text.
  They compare as numbers when both read as one: commas between thousands, a leading `$`/`€`/`£`/`¥`, a trailing
  `%`, unit or words ("18 dollars") and a trailing period are dropped, `a/b` is divided, LaTeX's `\\$`, `\\%`,
  `{,}`, `\\,`, `\\frac{a}{b}` and `\\text{...}` are read as text; the numbers must be equal when either is whole
  ("18.00" == "18"; 1,000,001 is not 1,000,000), else within a relative 1e-6. When the reference is a number but
  the extracted span is not ("The answer is 72."), the span's last number is taken. Otherwise they compare as
  strings, case and whitespace normalised and a trailing period dropped.
- format: 1.0 when the stripped completion matches the regex (`re.fullmatch`, re.DOTALL) else 0.0; the default
  asks for `<think>...</think>` then `<answer>...</answer>`.
- length: from the completion's token count n (the `completion_ids` column) and the target t,
  max(0, 1 - |n - t| / t): 1.0 at the target, falling linearly to 0.0 at 0 and at 2t tokens.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?"
# a whole value that is one number: sign, currency, number (or a/b), then only non-digits (%, units, words, ".")
_QUANTITY = re.compile(
    rf"\s*(?P<sign>[-+]?)\s*[$€£¥]?\s*(?P<sign2>[-+]?)(?P<number>(?:{_NUMBER}))"
    rf"(?:\s*/\s*(?P<denominator>{_NUMBER}))?(?P<rest>[^\d]*)"
)
# a number inside text: a minus only where it cannot be a subtraction ("10-2" gives 2)
_NUMBER_IN_TEXT = re.compile(rf"(?:(?<![\w.)\]}}])-\s*[$€£¥]?)?(?<![\w.])(?:{_NUMBER})")
_HASHES = re.compile(r"####[ \t]*([^\n]*\S)")
_ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_LATEX_FRACTION = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\s*\{([^{}]*)\}")
_LATEX_PLAIN = (("\\$", "$"), ("\\%", "%"), ("{,}", ","), ("\\,", ""), ("\\!", ""), ("\\ ", " "), ("−", "-"))


def text_of(item, role: str | None = "assistant") -> str:
    """The text of a prompt or completion: a string itself, or from a list of {"role", "content"} messages the
    content of the last one with `role` (any role when None). Content given as parts keeps their text parts."""
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        item = [item]
    if not isinstance(item, (list, tuple)):
        raise TypeError(f"expected text or a list of messages, got {type(item).__name__}")
    for message in reversed(item):
        if not isinstance(message, dict):
            raise TypeError(f"expected messages as dicts with 'role' and 'content', got {type(message).__name__}")
        if role is None or message.get("role") == role:
            return _content_text(message.get("content"))
    raise ValueError(f"no {role} message among the {len(item)} messages")


def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise TypeError(f"message content is {type(content).__name__}, not text")


def reference_answer(value) -> str | None:
    """The answer a row expects: after the last `#### ` line when there is one (GSM8K), else the whole value;
    None when it is empty or missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(f"the reference answer is {type(value).__name__}, not text or a number")
    text = str(value).strip()
    found = _HASHES.findall(text)
    text = found[-1].strip() if found else text
    return text or None


def candidate_answer(text: str) -> str | None:
    """The completion's final answer: the last \\boxed{...}, else `#### N`, else <answer>...</answer>, else the
    last number, else the whole stripped text (None when empty)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    for pattern in (_HASHES, _ANSWER_TAGS):
        found = pattern.findall(text)
        if found:
            return found[-1]
    numbers = _NUMBER_IN_TEXT.findall(text)
    if numbers:
        return numbers[-1]
    return text.strip() or None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed")
    while start != -1:
        content = _braced(text, start + len("\\boxed"))
        if content is not None:
            return content
        start = text.rfind("\\boxed", 0, start)
    return None


def _braced(text: str, at: int) -> str | None:
    """What the braces opening at `at` (after spaces) hold, or None when none open there or they never close."""
    while at < len(text) and text[at] == " ":
        at += 1
    if at >= len(text) or text[at] != "{":
        return None
    depth = 0
    for end in range(at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[at + 1 : end]
    return None


def _plain(text: str) -> str:
    text = _LATEX_FRACTION.sub(r"\1/\2", _LATEX_TEXT.sub(r" \1", text))
    for latex, plain in _LATEX_PLAIN:
        text = text.replace(latex, plain)
    return text.strip().strip("$").strip()  # $72$ (inline math)


def as_number(text: str) -> float | None:
    """The number `text` is, units and formatting aside ("$1,234.00", "18 dollars", "45%", "3/4"), else None."""
    match = _QUANTITY.fullmatch(_plain(text))
    if match is None or (match["sign"] and match["sign2"]):
        return None
    value = float(match["number"].replace(",", ""))
    if match["denominator"] is not None:
        denominator = float(match["denominator"].replace(",", ""))
        if denominator == 0:
            return None
        value /= denominator
    return -value if "-" in (match["sign"] + match["sign2"]) else value


def _normalised(text: str) -> str:
    return " ".join(_plain(text).lower().split()).rstrip(".").strip()


def answers_match(candidate: str | None, reference: str) -> bool:
    """Whether a completion's extracted answer equals the reference: as numbers where both are numbers (exactly
    when either is whole, else within a relative 1e-6), else as normalised strings."""
    if candidate is None:
        return False
    expected = as_number(reference)
    if expected is not None:
        got = as_number(candidate)
        if got is None:  # "The answer is 72." inside <answer> or \boxed: its last number
            numbers = _NUMBER_IN_TEXT.findall(_plain(candidate))
            got = as_number(numbers[-1]) if numbers else None
        if got is not None:
            if got.is_integer() or expected.is_integer():  # 1,000,001 is not 1,000,000 within 1e-6
                return got == expected
            return math.isclose(got, expected, rel_tol=1e-6)
    return _normalised(candidate) == _normalised(reference)


def accuracy_reward(answer_column: str) -> Callable[..., list]:
    """`accuracy`: reads each row's reference from `answer_column` (see the module docstring)."""

    def accuracy(prompts, completions, **columns) -> list[float | None]:
        if answer_column not in columns:
            raise LookupError(f"no column {answer_column!r} in the data (columns: {', '.join(sorted(columns))})")
        scores = []
        for completion, value in zip(completions, columns[answer_column]):
            reference = reference_answer(value)
            if reference is None:
                scores.append(None)
            else:
                scores.append(1.0 if answers_match(candidate_answer(text_of(completion)), reference) else 0.0)
        return scores

    return accuracy


def format_reward(pattern: re.Pattern) -> Callable[..., list]:
    """`format`: 1.0 where the stripped completion fully matches `pattern` (compiled with re.DOTALL)."""

    def matches_format(prompts, completions, **columns) -> list[float]:
        return [1.0 if pattern.fullmatch(text_of(completion).strip()) else 0.0 for completion in completions]

    return matches_format


def length_reward(target: int) -> Callable[..., list]:
    """`length`: max(0, 1 - |n - target| / target) for a completion of n tokens."""

    def length(prompts, completions, completion_ids=None, **columns) -> list[float]:
        if completion_ids is None:
            raise LookupError("no completion_ids given: the length reward counts the completion's tokens")
        return [max(0.0, 1.0 - abs(len(ids) - target) / target) for ids in completion_ids]

    return length
