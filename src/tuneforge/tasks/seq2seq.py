"""Sequence-to-sequence (translation, summarisation): T5, BART, Marian, or a MiniLM encoder-decoder.

Data: parallel text files (one sentence per line) or a table with source/target columns, an
optional source prefix ("translate English to German: " for T5), dynamic padding with the label
padding set to -100. Evaluation: the loss (summed over target tokens, exact across ranks) and
sacreBLEU corpus BLEU of `generate` outputs (beam size `num_beams`, up to
`generation_max_length` new tokens, so outputs are not cut at the HF default of 20), gathered
from every rank. References are the decoded labels, and `gen_len` the mean count of an output's tokens but padding
(its start and end tokens too), as in the transformers translation recipe.
Sources and targets longer than `max_length` / `max_target_length` are cut there (their end token kept), counted
in one log line per split; `max_target_length` and `generation_max_length` past the decoder's positions are refused
in one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pydantic import Field
from torch.nn.utils.rnn import pad_sequence

from tuneforge.adapters import load_pretrained_model
from tuneforge.artifacts import FAMILY_SEQ2SEQ, bundled_minilm, check_model_path, context_length, from_pretrained
from tuneforge.config import EVAL, INPUT, MAX_TOKENS
from tuneforge.data.sources import read_table, require_columns, to_dataset
from tuneforge.data.text import read_parallel
from tuneforge.data.tokenize import Cut, encode_within, report_cuts
from tuneforge.errors import ConfigError, DataError
from tuneforge.options import TaskOptions
from tuneforge.tasks.base import MetricStream, Task, empty_check, hold_out_validation, set_dropout
from tuneforge.tasks.clm import text_generator

if TYPE_CHECKING:
    import datasets

NOT_SEQ2SEQ_HEADS = (
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForCausalLM",
    "LMHeadModel",
)


def corpus_bleu(predictions: list[str], references: list[str]) -> float:
    import sacrebleu

    if not predictions:
        return 0.0
    return float(sacrebleu.corpus_bleu(predictions, [references]).score)


def generated_lengths(generated: torch.Tensor, pad_id: int) -> list[int]:
    """Each row's tokens of `generate`'s output but padding, the decoder's start and end tokens counted: gen_len as
    the transformers translation and summarization recipes count it (np.count_nonzero(pred != pad_token_id))."""
    return (generated != pad_id).sum(dim=1).tolist()


class GenerationStream(MetricStream):
    """Token loss sums (reduced) and decoded predictions/references (gathered) for corpus BLEU."""

    def __init__(self, task: Seq2SeqTask) -> None:
        self.task = task
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.tokens = torch.zeros((), dtype=torch.float64)
        self.predictions: list[str] = []
        self.references: list[str] = []
        self.generated_tokens = 0

    def update(self, outputs, batch, valid, predictions=None, references=None, generated_lengths=None) -> None:
        loss, n = self.task.compute_loss(outputs, batch, row_mask=valid)
        self.loss_sum = self.loss_sum.to(loss.device) + loss.detach().double()
        self.tokens = self.tokens.to(n.device) + n.double()
        keep = valid.tolist()
        if predictions is not None:
            self.predictions += [p for p, k in zip(predictions, keep) if k]
            self.references += [r for r, k in zip(references, keep) if k]
            self.generated_tokens += sum(g for g, k in zip(generated_lengths, keep) if k)

    def compute(self, backend) -> dict[str, float]:
        totals = backend.reduce_sum(torch.stack([self.loss_sum, self.tokens]).to(backend.device))
        gathered = backend.gather_objects((self.predictions, self.references, self.generated_tokens))
        predictions = [p for g in gathered for p in g[0]]
        references = [r for g in gathered for r in g[1]]
        generated = sum(g[2] for g in gathered)
        tokens = int(totals[1])
        return {
            "loss": float(totals[0]) / tokens if tokens else float("nan"),
            "bleu": corpus_bleu(predictions, references),
            "gen_len": generated / len(predictions) if predictions else 0.0,
            "num_examples": len(predictions),
        }


class Seq2SeqOptions(TaskOptions):
    source_file: str | None = Field(
        None, description="source lines (one example per line)", json_schema_extra={**EVAL, **INPUT}
    )
    target_file: str | None = Field(
        None, description="target lines, parallel to --source-file", json_schema_extra={**EVAL, **INPUT}
    )
    validation_source_file: str | None = Field(
        None, description="validation source lines", json_schema_extra={**EVAL, **INPUT}
    )
    validation_target_file: str | None = Field(
        None, description="validation target lines", json_schema_extra={**EVAL, **INPUT}
    )
    source_column: str | None = Field(
        None, description="the source column of csv/jsonl rows (default: source)", json_schema_extra=EVAL
    )
    target_column: str | None = Field(
        None, description="the target column of csv/jsonl rows (default: target)", json_schema_extra=EVAL
    )
    source_prefix: str = Field(
        "", description="text put before every source (e.g. 'translate German to English: ')", json_schema_extra=EVAL
    )
    max_target_length: int = Field(128, gt=0, le=MAX_TOKENS, description="tokens per target", json_schema_extra=EVAL)
    num_beams: int = Field(1, gt=0, le=1000, description="evaluation: beam search width", json_schema_extra=EVAL)
    generation_max_length: int = Field(
        128, gt=0, le=MAX_TOKENS, description="evaluation: tokens generated at most", json_schema_extra=EVAL
    )


class Seq2SeqTask(Task):
    name = "seq2seq"
    Options = Seq2SeqOptions
    training_data_flags = "--source-file and --target-file (or a --train-file of source and target columns)"
    model_kind = "a sequence-to-sequence model"
    model_classes = "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"
    generates = True
    family = FAMILY_SEQ2SEQ
    best_metric = "bleu"
    greater_is_better = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.source_column = self.options.source_column or "source"
        self.target_column = self.options.target_column or "target"
        if self.source_column == self.target_column:  # the model would learn to copy its input
            raise ConfigError(
                f"--source-column and --target-column both name {self.source_column!r}; pass the column holding "
                "the inputs and the one holding the outputs"
            )
        self._check_one_source_per_split()

    def _check_one_source_per_split(self) -> None:
        """A table beside the parallel files of its split would not be read (`_read_split` takes the files)."""
        data, opts = self.config.data, self.options
        splits = (
            ("train", data.train_file, opts.source_file or opts.target_file, "--source-file/--target-file"),
            (
                "validation",
                data.validation_file,
                opts.validation_source_file or opts.validation_target_file,
                "--validation-source-file/--validation-target-file",
            ),
        )
        for split, table, files, flags in splits:
            if table and files:
                raise ConfigError(
                    f"--{split}-file and {flags} both give the {split} pairs (the table would not be read); keep one"
                )

    # ---- raw data --------------------------------------------------------------------------
    def load_raw(self) -> datasets.DatasetDict:
        import datasets

        data, opts = self.config.data, self.options
        splits = {}
        train = self._read_split(
            "train", opts.source_file, opts.target_file, data.train_file, ("--source-file", "--target-file")
        )
        if train is not None:
            splits["train"] = train
        validation = self._read_split(
            "validation",
            opts.validation_source_file,
            opts.validation_target_file,
            data.validation_file,
            ("--validation-source-file", "--validation-target-file"),
        )
        if validation is not None:
            splits["validation"] = validation
        elif "train" in splits:  # hold out 10% of train, fixed by split_seed
            self.log("no validation data: holding out 10% of the training pairs for validation")
            splits = hold_out_validation(
                splits["train"],
                data.split_seed,
                "sentence pair",
                "add pairs or pass --validation-source-file and --validation-target-file",
            )
        if not splits:
            raise ConfigError(
                "task 'seq2seq' needs data: pass --source-file/--target-file (parallel text, one sentence per "
                "line) or --train-file with source/target columns, and their validation counterparts"
            )
        for split, ds in splits.items():
            empty_check(ds, split)
        return datasets.DatasetDict(splits)

    def _read_split(self, split, source_file, target_file, table_file, flags) -> datasets.Dataset | None:
        if source_file or target_file:
            if not (source_file and target_file):
                given, missing = (flags[0], flags[1]) if source_file else (flags[1], flags[0])
                raise ConfigError(
                    f"{given} needs {missing} as well: parallel files, one sentence per line on each side"
                )
            return read_parallel(source_file, target_file, split)
        if table_file:
            return self._select_columns(to_dataset(read_table(table_file)), f"the {split} data ({table_file})")
        return None

    def _select_columns(self, ds: datasets.Dataset, where: str) -> datasets.Dataset:
        import datasets

        require_columns(ds.column_names, [self.source_column], where, "--source-column")
        require_columns(ds.column_names, [self.target_column], where, "--target-column")
        ds = ds.select_columns([self.source_column, self.target_column])
        sources, targets = ds[self.source_column], ds[self.target_column]
        for side, column, values in (("source", self.source_column, sources), ("target", self.target_column, targets)):
            row = next((i for i, v in enumerate(values, start=1) if v is None), None)
            if row is not None:  # str() would train it as the text "None"
                raise DataError(
                    f"{where}, row {row}: the {side} is null (column {column!r}); give it its text, or drop the row"
                )
        return datasets.Dataset.from_dict({"source": [str(s) for s in sources], "target": [str(t) for t in targets]})

    def prepare_raw(self, splits: dict) -> datasets.DatasetDict:
        import datasets

        raw = {}
        for split, ds in splits.items():
            if ds is not None:
                empty_check(ds, split)
                raw[split] = self._select_columns(ds, f"the {split} dataset")
        return datasets.DatasetDict(raw)

    # ---- features --------------------------------------------------------------------------
    def _decoder_start_token_id(self, tokenizer) -> int | None:
        if self.config.model is None:  # the MiniLM encoder-decoder built in load_model
            return tokenizer.cls_token_id
        from transformers import AutoConfig

        return getattr(
            from_pretrained(AutoConfig, self.model_path(), "the model config"), "decoder_start_token_id", None
        )

    def tokenize(self, raw, tokenizer, log=print):
        import datasets

        data, opts = self.config.data, self.options
        prefix = opts.source_prefix
        # BERT-style tokenizers start the target with [CLS], which for an encoder-decoder is the
        # decoder start token itself: the decoder must learn what follows it, not to repeat it
        start_id = self._decoder_start_token_id(tokenizer)

        def fn(batch):
            enc, source_cut = encode_within(
                tokenizer,
                {"text": [prefix + s for s in batch["source"]], "return_token_type_ids": False},
                data.max_length,
            )
            targets, target_cut = encode_within(tokenizer, {"text_target": batch["target"]}, opts.max_target_length)
            labels = targets["input_ids"]
            if start_id is not None:
                labels = [ids[1:] if ids and ids[0] == start_id else ids for ids in labels]
            return {
                "input_ids": enc["input_ids"],
                "attention_mask": enc["attention_mask"],
                "labels": labels,
                "length": [len(x) for x in enc["input_ids"]],
                "source_cut": source_cut,  # counted in the log line, then dropped
                "target_cut": target_cut,
            }

        settings = {
            "task": "seq2seq",
            "prefix": prefix,
            "max_length": data.max_length,
            "max_target_length": opts.max_target_length,
            "strip_start": start_id,
            "cut_flags": True,
        }
        # the model sees, and learns to end, the cut text; evaluation's references are the cut targets
        cuts = [
            Cut("source_cut", "sources", "max_length", data.max_length or tokenizer.model_max_length, "--max-length"),
            Cut("target_cut", "targets", "max_target_length", opts.max_target_length, "--max-target-length"),
        ]
        out = {}
        for split, ds in raw.items():
            feats = self.tokenize_split(split, ds, ["source", "target"], fn, tokenizer, settings, log)
            if len(feats) == 0:
                raise DataError(f"the {split} split has no sentence pairs; give files with at least one line")
            out[split] = report_cuts(split, feats, cuts, log)
        return datasets.DatasetDict(out)

    def collate(self, rows, tokenizer):
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        source = [torch.tensor(x, dtype=torch.long) for x in rows["input_ids"]]
        batch = {
            "input_ids": pad_sequence(source, batch_first=True, padding_value=pad_id),
            "attention_mask": pad_sequence(
                [torch.tensor(x, dtype=torch.long) for x in rows["attention_mask"]], batch_first=True, padding_value=0
            ),
        }
        if "labels" in rows:  # label padding is -100: never a target
            batch["labels"] = pad_sequence(
                [torch.tensor(x, dtype=torch.long) for x in rows["labels"]], batch_first=True, padding_value=-100
            )
        return batch

    def model_inputs(self, batch):
        # labels go in so the model builds its own decoder inputs (shift right, start token);
        # the loss it returns (a mean) is not used: compute_loss sums from the logits
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": batch["labels"]}

    # ---- model -----------------------------------------------------------------------------
    def load_model(self, tokenizer):
        from transformers import AutoConfig, AutoModelForSeq2SeqLM

        if self.config.model is None:
            return self._minilm_encoder_decoder(tokenizer)
        path = self.config.model
        check_model_path(path)
        model_config = from_pretrained(AutoConfig, path, "the model config")
        archs = getattr(model_config, "architectures", None) or []
        if any(a.endswith(NOT_SEQ2SEQ_HEADS) for a in archs) or not getattr(model_config, "is_encoder_decoder", False):
            kind = archs[0] if archs else model_config.model_type
            raise ConfigError(
                f"model {path!r} is a {kind}, not a sequence-to-sequence model; --task seq2seq needs one "
                "such as T5, BART or Marian (or no --model for the MiniLM encoder-decoder)"
            )
        self.check_max_length(tokenizer, getattr(model_config, "encoder", model_config))
        self.check_decoder_room(model_config)
        return load_pretrained_model(
            AutoModelForSeq2SeqLM,
            path,
            "a sequence-to-sequence model",
            config=set_dropout(model_config, self.config.dropout),
            **self.pretrained_kwargs(),
        )

    def check_decoder_room(self, model_config) -> None:
        """Targets and generated outputs within the decoder's positions (past them the position embedding fails
        with an IndexError mid-run); a decoder without a fixed limit (T5's relative positions) takes any length."""
        decoder = getattr(model_config, "decoder", model_config)
        limit = getattr(decoder, "max_decoder_position_embeddings", None) or context_length(decoder)
        if not limit:
            return
        opts = self.options
        if opts.max_target_length > limit:
            raise ConfigError(
                f"max_target_length {opts.max_target_length} is above the model's decoder limit of {limit} positions; "
                f"use --max-target-length {limit} or less"
            )
        room = limit - 1  # the decoder's start token takes a position (as `tuneforge generate` counts)
        if opts.generation_max_length > room:
            raise ConfigError(
                f"generation_max_length {opts.generation_max_length} is above the {room} new tokens the model's "
                f"decoder has room for ({limit} positions, one for its start token); use --generation-max-length "
                f"{room} or less"
            )

    def _minilm_encoder_decoder(self, tokenizer):
        """BERT-style encoder and decoder both warm-started from the bundled MiniLM."""
        from transformers import AutoConfig, EncoderDecoderModel

        minilm = bundled_minilm()
        encoder_config, decoder_config = (
            set_dropout(AutoConfig.from_pretrained(minilm), self.config.dropout) for _ in "ed"
        )
        model = EncoderDecoderModel.from_encoder_decoder_pretrained(
            minilm, minilm, encoder_config=encoder_config, decoder_config=decoder_config
        )
        self.check_max_length(tokenizer, model.config.encoder)
        self.check_decoder_room(model.config)
        ids = {
            "decoder_start_token_id": tokenizer.cls_token_id,
            "bos_token_id": tokenizer.cls_token_id,
            "eos_token_id": tokenizer.sep_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
        for key, value in ids.items():
            setattr(model.config, key, value)
            setattr(model.generation_config, key, value)
        model.config.vocab_size = model.config.decoder.vocab_size
        return model

    # ---- loss, generation and metrics ------------------------------------------------------
    def compute_loss(self, outputs, batch, row_mask=None):
        """(sum of target-token losses, number of target tokens); logits already align with labels."""
        logits, labels = outputs.logits, batch["labels"]
        if row_mask is not None:
            labels = labels.masked_fill(~row_mask.bool()[:, None], -100)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100, reduction="sum"
        )
        return loss, (labels != -100).sum()

    def count(self, batch) -> torch.Tensor:
        return (batch["labels"] != -100).sum()

    def generation_kwargs(self) -> dict:
        # max_new_tokens overrides the model's generation_config max_length (20 by default)
        return {
            "num_beams": self.options.num_beams,
            "max_new_tokens": self.options.generation_max_length,
            "do_sample": False,
        }

    def eval_step(self, batch, valid, stream, tools) -> None:
        outputs = tools.forward(batch)
        generated = tools.generate(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **self.generation_kwargs()
        )
        tokenizer = tools.tokenizer
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        predictions = [t.strip() for t in tokenizer.batch_decode(generated, skip_special_tokens=True)]
        labels = batch["labels"].masked_fill(batch["labels"] == -100, pad_id)
        references = [t.strip() for t in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        stream.update(outputs, batch, valid, predictions, references, generated_lengths(generated, pad_id))

    def metric_stream(self):
        return GenerationStream(self)

    make_generator = staticmethod(text_generator)  # serve's OpenAI routes run the exported model

    def export_info(self) -> dict:
        data, opts = self.config.data, self.options
        return {
            "task": self.config.task,
            "max_length": data.max_length,
            "max_target_length": opts.max_target_length,
            "source_prefix": opts.source_prefix,
            "num_beams": self.options.num_beams,
            "generation_max_length": self.options.generation_max_length,
            **self.capabilities(),
        }
