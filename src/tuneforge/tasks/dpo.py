"""Direct preference optimisation (`--task dpo`): a causal LM taught to prefer the chosen completion of
each pair over the rejected one, measured against a fixed reference (Rafailov et al., 2023).

Data: json / jsonl(.gz) pairs, read, tokenized and fitted to `--block-size` by data/preference.py
(prompt/chosen/rejected rows, or hh-rlhf dialogues).

The reference is the model as training found it:
- with `--adapter lora`, the same model with its adapters switched off (peft's `disable_adapter`):
  no second copy of the weights;
- without, a frozen copy made before the backend wraps the model (on a sharded backend it is whole
  on every rank: use LoRA there for large models).
Its log-probabilities come from a forward without gradients in the same step, so a resumed run needs
nothing beyond its checkpoint. The export's tuneforge.json records the model training started from
(`reference_model`), so evaluating the export (`tuneforge eval`) compares it with that model, as the run's own
evaluations did (loaded beside it; a model that records none is its own reference: rewards of 0).

Loss, per pair: -log sigmoid(beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log
ref(rejected)))), where log pi(y) sums the completion's token log-probabilities. The Trainer
normalises the summed loss by the global number of pairs, so accumulation and data parallelism equal
one large batch. Evaluation reports that loss, the reward accuracy (chosen reward above the
rejected), the mean reward margin and the mean chosen and rejected rewards (reward = beta x the log
ratio to the reference), each over every pair across ranks.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pydantic import Field

from tuneforge.adapters import load_pretrained_model
from tuneforge.artifacts import from_pretrained, read_model_info
from tuneforge.config import EVAL, INPUT
from tuneforge.data import chat, preference
from tuneforge.data.tokenize import cut_phrase
from tuneforge.errors import DataError, UserError
from tuneforge.tasks.base import MetricStream, no_cache
from tuneforge.tasks.clm import BlockOptions, CausalLMTask, attending_one_way

if TYPE_CHECKING:
    import datasets

IGNORE = -100


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row: the sum of log-probabilities of the labelled tokens (logits at t score token t+1)."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    token_losses = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="none"
    ).view_as(targets)
    return -token_losses.sum(-1)


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor, row_mask=None) -> torch.Tensor:
    """The summed Bradley-Terry loss -log sigmoid(chosen - rejected) of pairs (DPO's rewards, a reward model's
    scores); rows where `row_mask` is False (evaluation padding) add nothing."""
    losses = -F.logsigmoid(chosen - rejected)
    if row_mask is not None:
        losses = losses * row_mask.to(losses.dtype)
    return losses.sum()


@dataclass
class PairOutputs:
    """The policy's and the reference's log-probabilities of each row's completion: chosen rows first."""

    logps: torch.Tensor
    ref_logps: torch.Tensor

    def rewards(self, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen rewards, rejected rewards): beta x log(pi / ref), one per pair."""
        ratio = beta * (self.logps - self.ref_logps)
        half = ratio.shape[0] // 2
        return ratio[:half], ratio[half:]


class PreferenceStream(MetricStream):
    """Sums over pairs (loss, correct, margin, chosen and rejected rewards), totalled across ranks."""

    NAMES = ("loss", "reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward")

    def __init__(self, task: DPOTask) -> None:
        self.task = task
        self.sums = torch.zeros(len(self.NAMES) + 1, dtype=torch.float64)

    def update(self, outputs, batch, valid) -> None:
        chosen, rejected = outputs.rewards(self.task.options.dpo_beta)
        keep = valid.bool().to(chosen.device)
        c, r = chosen[keep].double(), rejected[keep].double()
        losses = -F.logsigmoid(c - r)
        row = torch.stack([losses.sum(), (c > r).double().sum(), (c - r).sum(), c.sum(), r.sum()])
        self.sums = self.sums.to(row.device) + torch.cat([row, keep.sum().double()[None]])

    def compute(self, backend) -> dict[str, float]:
        totals = backend.reduce_sum(self.sums.to(backend.device))
        n = float(totals[-1])
        out = {name: float(totals[i]) / n if n else float("nan") for i, name in enumerate(self.NAMES)}
        return {**out, "num_pairs": int(n)}


class DPOOptions(BlockOptions):
    dpo_beta: float = Field(
        0.1,
        gt=0,
        le=1e3,
        description="how far the model may move from the reference (the rewards' scale)",
        json_schema_extra=EVAL,
    )
    drop_identical_pairs: bool = Field(
        False, description="drop (and count) pairs whose chosen and rejected are identical instead of refusing"
    )
    chat_template: str | None = Field(
        None,
        description="a Jinja chat template file for conversational pairs, for a tokenizer that has none (or to "
        "replace its own)",
        json_schema_extra={**EVAL, **INPUT},
    )
    nonfinite_suspects = ("--dpo-beta",)


class DPOTask(CausalLMTask):
    name = "dpo"
    Options = DPOOptions
    model_kind = "a causal language model"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.adapter = None  # the LoRA adapter whose switching off gives the reference
        self.reference_model = None  # without an adapter: the frozen copy
        self.looked_up_reference = False  # evaluation outside training: the export's recorded reference read

    @property
    def pads_batches(self) -> bool:
        return True

    def load_tokenizer(self):
        tokenizer = super().load_tokenizer()
        if self.options.chat_template:  # for conversational pairs of a model without a template
            chat.set_chat_template(tokenizer, self.options.chat_template, self.model_path())
        return tokenizer

    # ---- raw data --------------------------------------------------------------------------
    def load_raw(self) -> datasets.DatasetDict:
        import datasets

        splits = self.read_given_files(
            "preference pairs: pass --train-file pairs.jsonl (rows with prompt/chosen/rejected, or hh-rlhf "
            "chosen/rejected dialogues) and --validation-file",
            lambda path, _split: preference.pairs_dataset(
                preference.read_pairs(path, self.options.drop_identical_pairs, self.log)
            ),
        )
        return datasets.DatasetDict(self.hold_out_if_needed(splits, "pair"))

    def prepare_raw(self, splits: dict) -> datasets.DatasetDict:
        import datasets

        pairs = preference.given_splits(splits, self.options.drop_identical_pairs, self.log, replies=True)
        return datasets.DatasetDict(pairs)

    # ---- features --------------------------------------------------------------------------
    def _encoder(self, tokenizer, ds, split: str):
        """The batched map function of one split; a chat template that raises for a row names that row."""
        where = repr(self.files[split]) if self.files.get(split) else f"the {split} data"

        def fn(batch):
            out = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
            for p, c, r in zip(batch["prompt"], batch["chosen"], batch["rejected"]):
                pair = {"prompt": json.loads(p), "chosen": json.loads(c), "rejected": json.loads(r)}
                try:
                    ids = preference.encode_pair(tokenizer, pair)
                except UserError:  # the encoder's own refusals name their fix already
                    raise
                except Exception as err:  # the template's raise_exception, or an error in its own code (1 / 0)
                    row = preference.row_of(ds, p, c, r)
                    raise chat.template_error(err, chat.template_name(self.config), row, where) from None
                for key, value in zip(out, ids):
                    out[key].append(value)
            return out

        return fn

    def tokenize(self, raw, tokenizer, log=print):
        import datasets

        max_length = self.resolve_block_size()

        settings = {"task": "dpo", "template": getattr(tokenizer, "chat_template", None)}
        out = {}
        for split, ds in raw.items():
            fn = self._encoder(tokenizer, ds, split)
            feats = self.tokenize_split(split, ds, ["prompt", "chosen", "rejected"], fn, tokenizer, settings, log)
            out[split] = self._fit(split, feats, max_length, log)
        return datasets.DatasetDict(out)

    def _fit(self, split: str, feats, max_length: int, log) -> datasets.Dataset:
        import datasets

        rows = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "length": []}
        dropped = cut = 0
        for p, c, r in zip(feats["prompt_ids"], feats["chosen_ids"], feats["rejected_ids"]):
            fitted = preference.fit(p, c, r, max_length)
            if fitted is None:
                dropped += 1
                continue
            p, c, r, was_cut = fitted
            cut += was_cut
            for key, value in zip(rows, (p, c, r, len(p) + max(len(c), len(r)))):
                rows[key].append(value)
        total, said = len(feats), []
        if dropped:
            said.append(
                f"{dropped} of {total} pairs dropped (their prompt alone holds block_size {max_length} tokens or more)"
            )
        if cut:
            said.append(f"{cut_phrase(cut, total, 'pairs', 'block_size', max_length)} (their completions truncated)")
        if said:
            log(f"{split}: {', '.join(said)} (raise --block-size to keep them whole)")
        if not rows["length"]:
            raise DataError(
                f"every {split} pair's prompt holds block_size {max_length} tokens or more; raise --block-size"
            )
        log(f"{split}: {len(rows['length'])} pairs")
        return datasets.Dataset.from_dict(rows)

    def collate(self, rows, tokenizer):
        """2n rows, right-padded: prompt + chosen for each pair, then prompt + rejected; labels only on the
        completions."""
        seqs, labels = [], []
        for side in ("chosen_ids", "rejected_ids"):
            for p, c in zip(rows["prompt_ids"], rows[side]):
                seqs.append(p + c)
                labels.append([IGNORE] * len(p) + c)
        width = max(len(s) for s in seqs)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        target = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
        attention = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (s, y) in enumerate(zip(seqs, labels)):
            input_ids[i, : len(s)] = torch.tensor(s)
            target[i, : len(y)] = torch.tensor(y)
            attention[i, : len(s)] = 1
        return {"input_ids": input_ids, "attention_mask": attention, "labels": target}

    # ---- the reference and the loss --------------------------------------------------------
    def set_up_reference(self, model, adapter) -> None:
        if adapter is not None:
            self.adapter = adapter
        else:
            self.reference_model = copy.deepcopy(model).requires_grad_(False).eval()

    def _reference_logps(self, model, inputs, labels) -> torch.Tensor:
        if self.adapter is not None:
            with self.adapter.disabled():
                return sequence_logps(model(**inputs).logits, labels)
        if not self.looked_up_reference and self.reference_model is None:  # evaluation outside training
            self.reference_model = self._recorded_reference(model)
            self.looked_up_reference = True
        if self.reference_model is None:  # none recorded: the model is its own reference
            return sequence_logps(model(**inputs).logits, labels)
        device = inputs["input_ids"].device
        if next(self.reference_model.parameters()).device != device:
            self.reference_model.to(device)
        return sequence_logps(self.reference_model(**inputs).logits, labels)

    def _recorded_reference(self, model):
        """The frozen model that the evaluated export trained from (its tuneforge.json's `reference_model`, loaded
        in the model's dtype, attending one way as training loaded it), or None where it records none."""
        from transformers import AutoConfig, AutoModelForCausalLM

        reference = (read_model_info(self.model_path()) or {}).get("reference_model")
        if reference is None:
            return None
        config = attending_one_way(from_pretrained(AutoConfig, reference, "the DPO reference model's config"))
        loaded = load_pretrained_model(AutoModelForCausalLM, reference, "the DPO reference model", config=config)
        vocabulary = model.get_input_embeddings().num_embeddings  # grown for the tokenizer's pad token, as in training
        if loaded.get_input_embeddings().num_embeddings < vocabulary:
            loaded.resize_token_embeddings(vocabulary)
        return loaded.to(next(model.parameters()).dtype).requires_grad_(False).eval()

    def forward(self, model, batch):
        inputs = self.model_inputs(batch) | no_cache(model)
        with torch.no_grad():
            ref_logps = self._reference_logps(model, inputs, batch["labels"])
        logps = sequence_logps(model(**inputs).logits, batch["labels"])
        return PairOutputs(logps=logps, ref_logps=ref_logps)

    def compute_loss(self, outputs, batch, row_mask=None):
        """(sum of the pairs' DPO losses, number of pairs)."""
        return pairwise_loss(*outputs.rewards(self.options.dpo_beta), row_mask), self.count(batch)

    def count(self, batch) -> torch.Tensor:
        return torch.tensor(float(batch["input_ids"].shape[0] // 2))

    def metric_stream(self):
        return PreferenceStream(self)

    def export_info(self) -> dict:
        return {
            "task": self.config.task,
            "block_size": self.block_size,
            "dpo_beta": self.options.dpo_beta,
            # a folder by its whole path: evaluation may run elsewhere (a hub id as it is)
            "reference_model": str(Path(path).resolve()) if Path(path := self.model_path()).exists() else path,
            **self.capabilities(),
        }
