"""Reward models (`--task reward`): a sequence scorer (a sequence-classification head with one output) taught
to score the chosen completion of each preference pair above the rejected one, and the predictor that scores
text with it (`tuneforge predict`, `tuneforge serve`, and GRPO's `--reward model:DIR`: rewards/model.py).

Data: the DPO pairs (data/preference.py): prompt/chosen/rejected rows, text or conversations, or hh-rlhf
dialogues. Each side is scored on its prompt + completion, tokenized as TRL's RewardTrainer does (so both train
on the same tokens): text is prompt + completion + the eos token (where the tokenizer has one), tokenized whole
with the tokenizer's special tokens; a conversation is the chat template of its messages (`--chat-template`, or
the tokenizer's own). A conversation for a tokenizer without a template is joined into hh-rlhf's text form
("\\n\\nHuman: ...\\n\\nAssistant: ...") and scored as text. A pair whose longer side holds more than
`--max-length` tokens is dropped and counted, as TRL does (cutting it would cut the completions, where the two
sides differ).

Loss, per pair (Bradley-Terry, TRL RewardTrainer's): -log sigmoid(r(chosen) - r(rejected) - margin), the margin
a row's `margin` (TRL's column; none: 0). The Trainer
normalises the summed loss by the global number of pairs, so accumulation and data parallelism equal one large
batch. Evaluation reports that loss, the pairwise accuracy (chosen scored above rejected), the mean margin
r(chosen) - r(rejected) and the mean chosen and rejected scores, each over every pair across ranks.

The exported tuneforge.json records `"scores": true`: the model answers with one score per text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import Field

from tuneforge.adapters import load_pretrained_model
from tuneforge.artifacts import check_model_path, check_tokenizer_files, from_pretrained, read_model_info
from tuneforge.config import EVAL, INPUT
from tuneforge.data import chat, preference
from tuneforge.data.tokenize import CutCount, encode_within
from tuneforge.errors import ConfigError, DataError, UserError
from tuneforge.options import TaskOptions
from tuneforge.tasks.base import Task, score_last_token_of, set_dropout, set_pad_token
from tuneforge.tasks.classification import ClassificationPredictor
from tuneforge.tasks.dpo import PreferenceStream, pairwise_loss
from tuneforge.tasks.length_runs import length_batches

if TYPE_CHECKING:
    import datasets

ROLE_NAMES = {"user": "Human", "assistant": "Assistant"}  # hh-rlhf's names of the turns
SCORER_NEEDED = (
    "a reward model: the model folder of a `tuneforge train --task reward` run (OUTPUT_DIR/model), or a "
    "sequence-classification model with one output"
)


# ---- what a scorer reads -------------------------------------------------------------------------
def as_messages(value, role: str) -> list[dict]:
    """A prompt or completion as messages: text is one message of `role`; a list of messages as it is."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not all(isinstance(m, dict) and "content" in m for m in value):
        what = "prompt" if role == "user" else "completion"
        raise DataError(
            f"a {what} is a {type(value).__name__}, not text or a list of {{role, content}} messages; give one of those"
        )
    return value


def joined(messages: list[dict]) -> str:
    """A conversation as hh-rlhf text: each message as `\\n\\nRole: content` (user: Human, assistant: Assistant)."""
    return "".join(
        f"\n\n{ROLE_NAMES.get(m.get('role'), str(m.get('role')).capitalize())}: {m['content']}" for m in messages
    )


def encode_scored(tokenizer, prompt, completion, max_length: int | None = None) -> list[int]:
    """The token ids a scorer reads for prompt + completion (TRL RewardTrainer's): text + eos tokenized whole, or
    a conversation's chat template (a tokenizer without one: the conversation joined, as text). `max_length`: cut
    to that many tokens from the left (the tokenizer's special tokens kept), so the completion stays whole."""
    return encode_scored_within(tokenizer, prompt, completion, max_length)[0]


def encode_scored_within(tokenizer, prompt, completion, max_length: int | None = None) -> tuple[list[int], bool]:
    """`encode_scored`, and whether max_length cut the row (data/tokenize.py's `encode_within`)."""
    side, tokenizer.truncation_side = tokenizer.truncation_side, "left"
    try:
        if isinstance(prompt, list) or isinstance(completion, list):
            messages = as_messages(prompt, "user") + as_messages(completion, "assistant")
            if getattr(tokenizer, "chat_template", None):
                return chat_ids_within(tokenizer, messages, max_length)
            text = joined(messages)
        else:
            text = prompt + completion
        eos = tokenizer.eos_token
        if eos and not text.endswith(eos):
            text += eos
        if not max_length:
            return list(tokenizer(text)["input_ids"]), False
        enc, cut = encode_within(tokenizer, {"text": [text]}, max_length)
        return list(enc["input_ids"][0]), cut[0]
    finally:
        tokenizer.truncation_side = side


def chat_ids_within(tokenizer, messages: list[dict], max_length: int | None) -> tuple[list[int], bool]:
    """A conversation's chat-template token ids, cut to `max_length` on the tokenizer's truncation side, and whether
    they were (a fast tokenizer's encoding keeps what the cut left over; a slow one's is tokenized to a token more
    first, as `encode_within` does)."""

    def encode(limit: int | None):
        cut = {"truncation": True, "max_length": limit} if limit else {}
        return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **cut)

    if not max_length:
        return list(encode(None)["input_ids"]), False
    if tokenizer.is_fast:
        enc = encode(max_length)
        return list(enc["input_ids"]), bool(enc.encodings[0].overflowing)
    longer = list(encode(max_length + 1)["input_ids"])
    return (list(encode(max_length)["input_ids"]), True) if len(longer) > max_length else (longer, False)


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of token-id rows, right-padded with `pad_id` (TRL's collator)."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        attention[i, : len(r)] = 1
    return input_ids, attention


def pair_scores(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen scores, rejected scores) of a batch's scorer outputs: the chosen rows come first."""
    return torch.chunk(logits.float().squeeze(-1), 2)


def margined_scores(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen scores less the pair's margin, rejected scores): the loss's terms, -log sigmoid(r(chosen) -
    r(rejected) - margin) as TRL's RewardTrainer takes a `margin` column (none: 0)."""
    chosen, rejected = pair_scores(logits)
    margin = batch.get("margin")
    return (chosen, rejected) if margin is None else (chosen - margin.to(chosen.device), rejected)


class ScoreStream(PreferenceStream):
    """Sums over pairs (loss, correct, margin, chosen and rejected scores), totalled across ranks."""

    NAMES = ("loss", "accuracy", "margin", "chosen_score", "rejected_score")

    def update(self, outputs, batch, valid) -> None:
        chosen, rejected = pair_scores(outputs.logits)
        keep = valid.bool().to(chosen.device)
        c, r = chosen[keep].double(), rejected[keep].double()
        loss = pairwise_loss(*(side[keep].double() for side in margined_scores(outputs.logits, batch)))
        row = torch.stack([loss, (c > r).double().sum(), (c - r).sum(), c.sum(), r.sum()])
        self.sums = self.sums.to(row.device) + torch.cat([row, keep.sum().double()[None]])


# ---- the task ------------------------------------------------------------------------------------
class RewardOptions(TaskOptions):
    drop_identical_pairs: bool = Field(
        False, description="drop (and count) pairs whose chosen and rejected are identical instead of refusing"
    )
    chat_template: str | None = Field(
        None,
        description="a Jinja chat template file for conversational pairs, for a tokenizer that has none (or to "
        "replace its own)",
        json_schema_extra={**EVAL, **INPUT},
    )


class RewardModelTask(Task):
    name = "reward"
    Options = RewardOptions
    model_kind = "a sequence scorer"
    pads_with_tokenizer = True
    model_classes = "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"
    best_metric = "accuracy"
    greater_is_better = True

    # ---- model -------------------------------------------------------------------------------
    def load_tokenizer(self):
        """The tokenizer, with a pad token; also rejects a max_length above the model's limit before any data work."""
        model_config = self._model_config()
        tokenizer = super().load_tokenizer()
        if self.options.chat_template:
            chat.set_chat_template(tokenizer, self.options.chat_template, self.model_path())
        set_pad_token(tokenizer, self.model_path())
        self.check_max_length(tokenizer, model_config)
        return tokenizer

    def _model_config(self, **changes):
        """The model's config (with `changes`); a classifier of several labels is refused: its head cannot score."""
        from transformers import AutoConfig

        path = self.model_path()
        model_config = from_pretrained(AutoConfig, path, "the model config")
        archs = getattr(model_config, "architectures", None) or []
        if any(a.endswith("ForSequenceClassification") for a in archs) and model_config.num_labels != 1:
            raise ConfigError(
                f"model {path!r} is a classifier with {model_config.num_labels} labels; a reward model starts from a "
                "base model (an encoder or a causal LM) or a scorer with one output: pass that as --model"
            )
        return from_pretrained(AutoConfig, path, "the model config", **changes) if changes else model_config

    def load_model(self, tokenizer):
        from transformers import AutoModelForSequenceClassification

        path = self.model_path()
        model_config = set_dropout(self._model_config(num_labels=1), self.config.dropout)
        self.check_max_length(tokenizer, model_config)
        model = load_pretrained_model(
            AutoModelForSequenceClassification,
            path,
            "a sequence scorer",
            config=model_config,
            new_head=self.log,
            **self.pretrained_kwargs(),
        )
        score_last_token_of(model, tokenizer)
        return model

    # ---- raw data ----------------------------------------------------------------------------
    def load_raw(self) -> datasets.DatasetDict:
        import datasets

        splits = self.read_given_files(
            "preference pairs: pass --train-file pairs.jsonl (rows with prompt/chosen/rejected, or hh-rlhf "
            "chosen/rejected dialogues) and --validation-file",
            lambda path, _split: preference.pairs_dataset(self._read_pairs(path)),
        )
        return datasets.DatasetDict(self.hold_out_if_needed(splits, "pair"))

    def _read_pairs(self, path) -> list[dict]:
        return preference.read_pairs(path, self.options.drop_identical_pairs, self.log, reader="--task reward")

    def prepare_raw(self, splits: dict) -> datasets.DatasetDict:
        import datasets

        pairs = preference.given_splits(splits, self.options.drop_identical_pairs, self.log, margins=True)
        return datasets.DatasetDict(pairs)

    # ---- features ----------------------------------------------------------------------------
    def _encoder(self, tokenizer, ds, split: str):
        """The batched map function of one split; a chat template that raises for a row names that row."""
        where = repr(self.files[split]) if self.files.get(split) else f"the {split} data"

        def fn(batch):
            out = {"chosen_ids": [], "rejected_ids": []}
            for p, c, r in zip(batch["prompt"], batch["chosen"], batch["rejected"]):
                prompt = json.loads(p)
                try:
                    out["chosen_ids"].append(encode_scored(tokenizer, prompt, json.loads(c)))
                    out["rejected_ids"].append(encode_scored(tokenizer, prompt, json.loads(r)))
                except UserError:  # the encoder's own refusals name their fix already
                    raise
                except Exception as err:  # the template's raise_exception, or an error in its own code (1 / 0)
                    row = preference.row_of(ds, p, c, r)
                    raise chat.template_error(err, chat.template_name(self.config), row, where) from None
            if "margin" in batch:
                out["margin"] = batch["margin"]
            return out

        return fn

    def tokenize(self, raw, tokenizer, log=print):
        import datasets

        settings = {"task": "reward", "template": getattr(tokenizer, "chat_template", None), "eos": tokenizer.eos_token}
        out = {}
        for split, ds in raw.items():
            fn = self._encoder(tokenizer, ds, split)
            columns = ["prompt", "chosen", "rejected"] + (["margin"] if "margin" in ds.column_names else [])
            feats = self.tokenize_split(split, ds, columns, fn, tokenizer, settings, log)
            out[split] = self._fit(split, feats, self.config.data.max_length, log)
        return datasets.DatasetDict(out)

    @staticmethod
    def _fit(split: str, feats, max_length: int | None, log) -> datasets.Dataset:
        """The pairs whose both sides fit `max_length` tokens (TRL's filter), the dropped ones counted."""
        keep = [
            i
            for i, (c, r) in enumerate(zip(feats["chosen_ids"], feats["rejected_ids"]))
            if not max_length or max(len(c), len(r)) <= max_length
        ]
        if len(keep) < len(feats):
            log(
                f"{split}: {len(feats) - len(keep)} of {len(feats)} pairs dropped: a side holds more than max_length "
                f"{max_length} tokens (raise --max-length to keep them)"
            )
        if not keep:
            raise DataError(
                f"every {split} pair holds more than max_length {max_length} tokens on a side; raise --max-length "
                "(up to the model's limit)"
            )
        fitted = feats.select(keep)
        log(f"{split}: {len(fitted)} pairs")
        return fitted.add_column(
            "length", [max(len(c), len(r)) for c, r in zip(fitted["chosen_ids"], fitted["rejected_ids"])]
        )

    def collate(self, rows, tokenizer):
        """2n rows, right-padded: each pair's chosen side, then each pair's rejected side (TRL's layout)."""
        input_ids, attention = pad_rows(list(rows["chosen_ids"]) + list(rows["rejected_ids"]), tokenizer.pad_token_id)
        batch = {"input_ids": input_ids, "attention_mask": attention}
        if "margin" in rows:  # one a pair
            batch["margin"] = torch.tensor(list(rows["margin"]), dtype=torch.float32)
        return batch

    # ---- loss and metrics --------------------------------------------------------------------
    def compute_loss(self, outputs, batch, row_mask=None):
        """(sum of the pairs' Bradley-Terry losses, number of pairs)."""
        return pairwise_loss(*margined_scores(outputs.logits, batch), row_mask), self.count(batch)

    def count(self, batch) -> torch.Tensor:
        return torch.tensor(float(batch["input_ids"].shape[0] // 2))

    def metric_stream(self):
        return ScoreStream(self)

    def capabilities(self) -> dict:
        return {**super().capabilities(), "scores": True}

    @staticmethod
    def make_predictor(model_dir: str, **kwargs):
        return RewardPredictor(model_dir, **kwargs)


# ---- scoring -------------------------------------------------------------------------------------
def check_scorer(model_dir: str) -> None:
    """One ConfigError line unless `model_dir` is a folder holding a sequence scorer: a reward run's export
    (tuneforge.json says it scores), or a plain sequence-classification folder with one output; with tokenizer files."""
    if not Path(model_dir).is_dir():
        raise ConfigError(f"reward model {model_dir!r} does not exist; need {SCORER_NEEDED}")
    check_model_path(model_dir)
    info = read_model_info(model_dir)
    if info and not info.get("scores"):
        raise ConfigError(
            f"model {model_dir!r} was trained by --task {info.get('task')}, not --task reward; need {SCORER_NEEDED}"
        )
    from transformers import AutoConfig

    config = from_pretrained(AutoConfig, model_dir, "the model config")
    archs = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        kind = f"a {archs[0]}" if archs else "a model without a head"
        raise ConfigError(f"model {model_dir!r} is {kind}, not a sequence scorer; need {SCORER_NEEDED}")
    if config.num_labels != 1:
        raise ConfigError(
            f"model {model_dir!r} is a classifier with {config.num_labels} labels, not a scorer with one output; "
            f"need {SCORER_NEEDED}"
        )
    check_tokenizer_files(model_dir)  # the tokenizer loads at the first call: GRPO's, after generating


class RewardPredictor(ClassificationPredictor):
    """What `tuneforge predict` and `serve` run for a reward model: {"score": float} per text, or per (prompt,
    completion) pair; `scores(prompts, completions)` takes text or conversations (GRPO's rewards). Inputs are
    read as the model trained on them (`encode_scored`), cut from the left to max_length."""

    accepts = ("texts", "pairs")

    def __init__(self, model_dir: str | Path, device: str | None = None, max_length: int | None = None) -> None:
        check_scorer(str(model_dir))
        super().__init__(model_dir, device=device, max_length=max_length)  # (its pad token set as a classifier's)

    @torch.inference_mode()
    def score_ids(self, rows: list[list[int]], batch_size: int = 64) -> list[float]:
        """The score of each token-id row, in order; rows of similar length share a forward (`length_batches`)."""
        scores = [0.0] * len(rows)
        for idx in length_batches([len(r) for r in rows], batch_size, on_cpu=self.device.type == "cpu"):
            input_ids, attention = pad_rows([rows[i] for i in idx], self.tokenizer.pad_token_id)
            with self.precision.autocast():
                out = self.model(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device))
            for i, value in zip(idx, out.logits.float()[:, 0].tolist()):
                scores[i] = value
        return scores

    def scores(self, prompts: Sequence, completions: Sequence, batch_size: int = 64) -> list[float]:
        """The score of each prompt + completion: text, or conversations (a prompt's messages and the completion's
        assistant messages)."""
        if len(prompts) != len(completions):
            raise DataError(f"{len(prompts)} prompts but {len(completions)} completions; give one completion each")
        rows = self._encode(prompts, completions, "prompt and completion pairs")
        return self.score_ids(rows, batch_size) if rows else []

    def _encode(self, prompts: Sequence, completions: Sequence, rows: str) -> list[list[int]]:
        """The token ids of each prompt + completion (`encode_scored`); how many were cut is kept (`last_cut`)."""
        encoded = [encode_scored_within(self.tokenizer, p, c, self.max_length) for p, c in zip(prompts, completions)]
        self.last_cut = CutCount(sum(cut for _, cut in encoded), len(encoded), rows, self.max_length, kept="last")
        return [ids for ids, _ in encoded]

    def predict(self, inputs: Sequence[str | tuple[str, str]], batch_size: int = 64) -> list[dict]:
        """One {"score": float} per input, in input order: a text, or a (prompt, completion) pair."""
        items = [tuple(x) if isinstance(x, (tuple, list)) else (x, "") for x in inputs]
        if any(len(item) != 2 or not all(isinstance(t, str) for t in item) for item in items):
            raise DataError("inputs must be texts or (prompt, completion) pairs of texts")
        rows = "texts" if all(isinstance(x, str) for x in inputs) else "prompt and completion pairs"
        encoded = self._encode([p for p, _ in items], [c for _, c in items], rows)
        return [{"score": s} for s in (self.score_ids(encoded, batch_size) if encoded else [])]
