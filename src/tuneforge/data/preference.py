"""Preference pairs for DPO: rows read from json / jsonl (gzip'd too), each made into a prompt, a chosen
and a rejected completion, then tokenized and fitted to the maximum length.

Row forms, told apart by their keys:
- `prompt`, `chosen`, `rejected`: strings, or a conversation: `prompt` a list of messages
  (`{"role", "content"}`) and `chosen` / `rejected` lists of assistant messages (a string is one).
- `chosen` and `rejected` alone (Anthropic hh-rlhf): each a whole dialogue
  (`\\n\\nHuman: ... \\n\\nAssistant: ...`). The prompt is their shared text through the last
  `\\n\\nAssistant:` they have in common; the completions are the rest, each a whole reply. (TRL splits
  at the first differing character instead, which can put the replies' shared first word in the
  prompt.) Message lists in this form share their leading messages.
A reward model's rows may add `margin` (TRL RewardTrainer's column): a number the chosen side's score should
exceed the rejected side's by; a file gives it on every row or on none.
For DPO a message completion must start with the assistant's turn (it is scored after the prompt's generation
prompt): one that starts with another role is refused in one line naming the row.

Tokens (TRL DPOTrainer's recipe, so both see the same tokens): a text pair is the prompt and
prompt + completion + the eos token, tokenized whole; a conversation is the chat template of the
prompt (with the generation prompt) and of prompt + completion. The completion starts where the two
token lists part.

Length rule (`fit`): a pair whose prompt alone holds `max_length` tokens or more is dropped (nothing
of its completions would be left); a longer pair keeps its first `max_length` tokens, so its
completions are cut. Both counts are logged per split.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tuneforge.data import chat
from tuneforge.errors import ConfigError, DataError

ASSISTANT_TURN = "\n\nAssistant:"  # hh-rlhf's marker of an assistant turn


def is_conversation(value) -> bool:
    return isinstance(value, list)


def _messages(value, role_default: str, where: str) -> list[dict]:
    """A completion's messages: a string is one message of `role_default`."""
    if isinstance(value, str):
        return [{"role": role_default, "content": value}]
    return chat.to_conversation({"messages": value}, "messages", where, need_assistant=False)


def split_dialogues(chosen, rejected, where: str) -> tuple:
    """(prompt, chosen, rejected) of an hh-rlhf row: the shared beginning through the last assistant turn."""
    if is_conversation(chosen) and is_conversation(rejected):  # the shared leading messages
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        return chosen[:shared], chosen[shared:], rejected[shared:]
    if not (isinstance(chosen, str) and isinstance(rejected, str)):
        raise DataError(f"{where}: `chosen` and `rejected` must both be text or both be lists of messages")
    common = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        common += 1
    cut = chosen.rfind(ASSISTANT_TURN, 0, common)  # the marker lies wholly within the shared text
    if cut < 0:
        raise DataError(
            f"{where} has no `prompt`, and its `chosen` and `rejected` share no dialogue up to an assistant turn "
            f"({ASSISTANT_TURN.strip()!r}); give `prompt`, `chosen` and `rejected` fields"
        )
    end = cut + len(ASSISTANT_TURN)
    return chosen[:end], chosen[end:], rejected[end:]


def _check_replies(chosen: list[dict], rejected: list[dict], prompted: bool, where: str) -> None:
    """DataError unless both message completions start with the assistant's turn (`prompted`: the row gave its
    prompt, else it came from the dialogues' shared messages)."""
    for key, completion in (("chosen", chosen), ("rejected", rejected)):
        if completion[0]["role"] != "assistant":
            fix = "start it with the assistant's reply to `prompt`"
            if not prompted:
                fix = "give `prompt`, `chosen` and `rejected` fields (the dialogues part before an assistant turn)"
            raise DataError(
                f"{where}: `{key}` starts with a {completion[0]['role']} message, not the assistant's reply to the "
                f"prompt; {fix}"
            )


def to_pair(row: dict, where: str, replies: bool = False, margins: bool = False) -> dict:
    """{"prompt", "chosen", "rejected"} of one row, checked: both completions given, text or messages; `replies`
    (DPO, which scores each completion after the prompt's generation prompt): message completions start with the
    assistant's; `margins` (a reward model): with the row's `margin`, where it has one."""
    missing = [k for k in ("chosen", "rejected") if row.get(k) is None]
    if missing:
        raise DataError(
            f"{where} has no `{'` or `'.join(missing)}` (it has: {', '.join(map(str, row)) or 'no fields'}); each row "
            "needs `chosen` and `rejected` (with `prompt`, or hh-rlhf dialogues that share their prompt)"
        )
    chosen, rejected = row["chosen"], row["rejected"]
    given_prompt = row.get("prompt")  # None: hh-rlhf dialogues (a dataset mixing both forms fills null)
    checked = (("chosen", chosen), ("rejected", rejected), ("prompt", "" if given_prompt is None else given_prompt))
    for key, value in checked:
        if not isinstance(value, (str, list)):
            raise DataError(f"{where}: `{key}` is a {type(value).__name__}; give text or a list of messages")
    if given_prompt is None:
        prompt, chosen, rejected = split_dialogues(chosen, rejected, where)
    else:
        prompt = given_prompt
    if is_conversation(prompt) or is_conversation(chosen) or is_conversation(rejected):
        prompt = _messages(prompt, "user", f"{where}, `prompt`")
        chosen = _messages(chosen, "assistant", f"{where}, `chosen`")
        rejected = _messages(rejected, "assistant", f"{where}, `rejected`")
        if replies:
            _check_replies(chosen, rejected, given_prompt is not None, where)
    pair = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    if margins and row.get("margin") is not None:
        pair["margin"] = _margin(row["margin"], where)
    return pair


def _margin(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(
            f"{where}: `margin` is {value!r}; give a number (how far the chosen side's score should exceed the "
            "rejected side's, as TRL's RewardTrainer reads it)"
        )
    return float(value)


def check_margins(pairs: list[dict], where: str) -> None:
    """DataError unless every pair has a margin or none has: a pair without one would train as margin 0 unseen."""
    given = [p for p in pairs if "margin" in p]
    if given and len(given) < len(pairs):
        lacking = next(p for p in pairs if "margin" not in p)
        raise DataError(
            f"row {lacking['row']} of {where} has no `margin`, and row {given[0]['row']} has one; give every pair a "
            "margin (0 for none) or drop the column"
        )


def distinct(pairs: list[dict], where: str, drop: bool, log=print) -> list[dict]:
    """The pairs whose chosen and rejected differ: an identical pair prefers nothing (and teaches nothing), so it
    is refused in one line, or dropped and counted with --drop-identical-pairs (hh-rlhf has a few)."""
    same = [i for i, p in enumerate(pairs, 1) if p["chosen"] == p["rejected"]]
    if not same:
        return pairs
    if not drop:
        raise DataError(
            f"row {same[0]} of {where}: `chosen` and `rejected` are identical, so the pair prefers nothing "
            f"({len(same)} such row(s) in all); fix or drop them, or pass --drop-identical-pairs"
        )
    log(f"{where}: {len(same)} pair(s) with identical chosen and rejected dropped (--drop-identical-pairs)")
    return [p for p in pairs if p["chosen"] != p["rejected"]]


def read_pairs(path: str | Path, drop_identical: bool = False, log=print, reader: str = "--task dpo") -> list[dict]:
    """The checked pairs of a preference file (`reader`: the task reading it, for messages; DPO's completions are
    replies)."""
    rows = chat.read_rows(path, what="preference data", reader=reader)
    replies, margins = reader == "--task dpo", reader == "--task reward"
    pairs = [{**to_pair(row, f"row {i} of {str(path)!r}", replies, margins), "row": i} for i, row in enumerate(rows, 1)]
    check_margins(pairs, repr(str(path)))
    return distinct(pairs, repr(str(path)), drop_identical, log)


def pairs_dataset(pairs: list[dict]):
    """Pairs as a raw split: prompt, chosen and rejected each as JSON text (text or messages alike), and each
    pair's row in its file (`row`: kept through dropped pairs and a held-out split, for errors)."""
    import datasets

    columns = {k: [dumps(p[k]) for p in pairs] for k in ("prompt", "chosen", "rejected")}
    if pairs and "margin" in pairs[0]:  # (check_margins: every pair has one)
        columns["margin"] = [p["margin"] for p in pairs]
    return datasets.Dataset.from_dict({**columns, "row": [p["row"] for p in pairs]})


def row_of(ds, prompt: str, chosen: str, rejected: str) -> int:
    """The row in its file of the pair of raw split `ds` whose cells are these (the error path only: one scan)."""
    cells = zip(ds["row"], ds["prompt"], ds["chosen"], ds["rejected"])
    return next(n for n, *pair in cells if pair == [prompt, chosen, rejected])


def given_splits(splits: dict, drop_identical: bool, log=print, replies: bool = False, margins: bool = False) -> dict:
    """{split: raw split} of datasets of pair rows given through the Python API, each row checked as a file's
    (`replies`, `margins`: as to_pair's)."""
    raw = {}
    for split, ds in splits.items():
        if ds is None:
            continue
        rows = ds.to_list()
        if not rows:
            raise DataError(f"the {split} split has no pairs; give at least one")
        where = f"the {split} dataset"
        pairs = [{**to_pair(row, f"{where}, row {i}", replies, margins), "row": i} for i, row in enumerate(rows, 1)]
        check_margins(pairs, where)
        raw[split] = pairs_dataset(distinct(pairs, where, drop_identical, log))
    return raw


# ---- tokens ------------------------------------------------------------------------------------
def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def encode_pair(tokenizer, pair: dict) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of one pair, as TRL's DPOTrainer tokenizes it."""
    prompt = pair["prompt"]
    if is_conversation(prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "the preference data holds conversations but the tokenizer has no chat template; pass "
                "--chat-template FILE (a Jinja template, e.g. ChatML) or train from a chat model"
            )

        def encode(messages: list[dict], generation_prompt: bool = False) -> list[int]:
            return list(
                tokenizer.apply_chat_template(
                    messages, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt
                )["input_ids"]
            )

        prompt_ids = encode(prompt, generation_prompt=True)
        with_chosen, with_rejected = encode(prompt + pair["chosen"]), encode(prompt + pair["rejected"])
    else:
        eos = tokenizer.eos_token or ""

        def encode(text: str) -> list[int]:
            return tokenizer(text)["input_ids"]

        def ended(text: str) -> str:
            return text if text.endswith(eos) else text + eos

        prompt_ids = encode(prompt)
        with_chosen, with_rejected = encode(prompt + ended(pair["chosen"])), encode(prompt + ended(pair["rejected"]))
    start = min(_common_prefix(prompt_ids, with_chosen), _common_prefix(prompt_ids, with_rejected))
    return prompt_ids[:start], with_chosen[start:], with_rejected[start:]


def fit(prompt: list[int], chosen: list[int], rejected: list[int], max_length: int):
    """The pair within `max_length` tokens: None when the prompt alone fills it, else (prompt, chosen,
    rejected, cut) with the completions cut to what fits."""
    room = max_length - len(prompt)
    if room <= 0:
        return None
    cut = len(chosen) > room or len(rejected) > room
    return prompt, chosen[:room], rejected[:room], cut


def dumps(value) -> str:
    """A prompt or completion as one dataset cell (text or messages alike)."""
    return json.dumps(value, ensure_ascii=False)
