"""What a task family provides to the Trainer, the CLI and the predict API.

A task turns raw data into tokenized features, builds the model, computes a summed loss with
its count (so gradient accumulation and data parallelism normalise by the real number of
examples or tokens), and streams metrics exactly across data-parallel ranks.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tuneforge.artifacts import (
    bundled_minilm,
    capability_info,
    check_max_length_fits,
    check_model_path,
    check_vocabulary_fits,
    context_length,
    from_pretrained,
    load_tokenizer,
    read_model_info,
)
from tuneforge.config import lower_is_better
from tuneforge.errors import ConfigError, DataError, UserError
from tuneforge.launch import env_flag
from tuneforge.options import TaskOptions
from tuneforge.paths import check_cache_outside_inputs, check_local, check_output_dir


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


@functools.cache
def _forward_takes_use_cache(model_class: type) -> bool:
    return "use_cache" in inspect.signature(model_class.forward).parameters


def no_cache(model) -> dict:
    """{"use_cache": False} for a model whose forward takes it (decoders), else {} (encoders, the caller's own
    modules). A decoder's config says use_cache=True for generation, and a loss forward would then build a key/value
    cache of every layer that nothing reads (transformers' Trainer turns it off too); the config is left as it is,
    so the exported model generates with its own setting."""
    inner = getattr(model, "module", model)  # a data-parallel wrapper's model
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # peft's passes the keywords on
    return {"use_cache": False} if _forward_takes_use_cache(type(inner)) else {}


@dataclass(frozen=True)
class PredictorFolder:
    """What a predictor reads of its model folder before loading the model: the path, tuneforge.json (`info`, {} for
    a plain HF folder) and the HF config."""

    path: str
    info: dict
    config: Any


def no_checkpointing(model_class: str) -> str:
    """The refusal of --gradient-checkpointing for a model class transformers cannot checkpoint."""
    return (
        f"{model_class} does not support gradient checkpointing in transformers; drop --gradient-checkpointing "
        "(a smaller --batch-size with --grad-accum also saves memory)"
    )


def architecture_ends(model_dir: str, suffix: str) -> bool:
    """Whether `model_dir`'s config.json names an architecture ending in `suffix` (ForTokenClassification, ...): a
    task's `claims_folder` of a plain HF folder (a hub model), read without loading transformers' config."""
    import json
    from pathlib import Path

    try:
        archs = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get("architectures")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(archs, list) and any(str(a).endswith(suffix) for a in archs)


def open_predictor_folder(model_dir, max_length: int | None) -> PredictorFolder:
    """A predictor's first step: --max-length checked (1 or more), the folder checked (one line where it is not a
    model folder), its tuneforge.json and HF config read."""
    from transformers import AutoConfig

    path = str(model_dir)
    if max_length is not None and max_length < 1:
        raise ConfigError(f"--max-length must be at least 1, got {max_length}")
    check_model_path(path)
    return PredictorFolder(path, read_model_info(path), from_pretrained(AutoConfig, path, "the model config"))


def set_pad_token(tokenizer, model_dir: str | None) -> None:
    """A tokenizer without a pad token (GPT-2's, Llama's) pads with its eos token (TRL's rule, for a tokenizer given
    to its trainers too): a classifier's, scorer's, tagger's, reader's or encoder's batches are padded. `model_dir`:
    the folder it was read from (None: given to fit() / validate())."""
    if tokenizer.pad_token is not None:
        return
    if tokenizer.eos_token is None:
        whose = f"the tokenizer of {model_dir!r}" if model_dir else "the tokenizer given"
        raise ConfigError(
            f"{whose} has neither a pad nor an eos token, and its batches are padded; add a pad "
            "token to it (tokenizer.add_special_tokens) or use another model"
        )
    tokenizer.pad_token = tokenizer.eos_token


def score_last_token_of(model, tokenizer) -> None:
    """A decoder's sequence classifier (GPT-2, OPT, Llama) scores the last token that is not config.pad_token_id, so
    that must be the pad token its batches are padded with: a config without one, or naming another (OPT's 1,
    Llama-2's 0, where the tokenizer pads with eos), read a short text's score at a padding position. Set on the model
    trained, evaluated or predicted, it is saved with the export. An encoder keeps its own (its embeddings' padding
    index and RoBERTa's positions are built from it)."""
    from transformers.models.auto import modeling_auto

    model_config = model.config
    family = getattr(model_config, "model_type", None)
    decoder = family in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not (
        family in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES or model_config.is_encoder_decoder
    )
    if model_config.pad_token_id is None or decoder:
        model_config.pad_token_id = tokenizer.pad_token_id


def score_given_classifier_s_last_token(model, tokenizer) -> None:
    """`score_last_token_of` a transformers sequence classifier (or a subclass of one) that the caller gave fit() /
    validate(), as the tasks' `load_model` does of their own; any other model is left as it is."""
    if any(cls.__name__.endswith("ForSequenceClassification") for cls in type(model).__mro__):
        score_last_token_of(model, tokenizer)


def predict_max_length(max_length: int | None, trained: int | None, default: int, model_config=None) -> int:
    """A predictor's max_length: the user's, else the trained one (tuneforge.json), else `default`, within the
    model's position limit: the user's above it is one ConfigError line, the others are cut to it."""
    check_max_length_fits(max_length, model_config)
    chosen = max_length or trained or default
    limit = context_length(model_config)
    return min(chosen, limit) if limit else chosen


class ServingPrecision:
    """The precision a predictor's forwards run in (the predictor's `precision`, which `serve` and `predict` set): as
    loaded until `use` (what `--precision` asks for; auto: bf16 where the hardware does it natively, else fp32) keeps
    the model's linear-layer weights in bf16 or fp16 and runs each forward under autocast in it (`autocast()`: norms,
    softmax and outputs stay float32). MiniLM on an AVX512-BF16 CPU: 1.9x the texts a second at 32 a batch, vectors
    within cosine 0.99998 of float32's (benchmarks/README.md)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.dtype: torch.dtype | None = None

    def use(self, precision: str) -> str:
        """Run the model (inference only: its weights stop requiring grad) in `precision`; the precision resolved."""
        from tuneforge.adapters import store_frozen_linears
        from tuneforge.backends.precision import resolve_precision

        resolved = resolve_precision(precision, self.device)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(resolved)
        # a folder saved in bf16 or fp16 loads so (transformers reads config.json's dtype): float32 first, for fp32's
        # forwards and autocast's float32 norms and softmax
        self.model.float()
        if self.dtype is not None:
            store_frozen_linears(self.model.requires_grad_(False), self.dtype)
        return resolved

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None)


@dataclass(frozen=True)
class EvalTools:
    """What a task's `eval_step` may use; it never sees the Trainer or the backend.

    forward(batch) -> model outputs (under the run's autocast); generate(**kwargs) -> token ids from
    the unwrapped model (`Backend.generate`: autocast, all ranks stepping together when sharded);
    tokenizer: the run's tokenizer."""

    forward: Callable[[dict[str, torch.Tensor]], Any]
    generate: Callable[..., torch.Tensor]
    tokenizer: Any
    # complete(prompts, params) -> engine Completions: the continuous-batching engine on the live model
    # (serve/engine.py `GenerationEngine.generate`), for tasks that generate while they train (StepTools)
    complete: Callable[..., list] | None = None
    # where the run stands (a task may pass it on, as GRPO gives reward functions TRL's trainer_state): the optimizer
    # steps taken, the run's total (0 outside training: `tuneforge evaluate`) and the epochs completed
    step: int = 0
    max_steps: int = 0
    epoch: int = 0


@dataclass(frozen=True)
class StepTools:
    """What a task's `prepare_step` may use to make a step's examples from its data (generating with the model
    being trained): never the Trainer or the optimizer.

    complete(prompts, params): the engine's completions of token-id prompts (a `SamplingParams` each) from the
    live model, in eval mode, under the run's autocast; model: the unwrapped live model (for no-grad forwards);
    autocast(): the run's autocast context; reduce_sum / gather_objects: the backend's collectives over the
    data-parallel ranks; step: the optimizer step about to be taken (1-based); epoch; seed: the run's seed; device:
    where the step's tensors go; max_steps: the run's total optimizer steps."""

    complete: Callable[..., list]
    model: Any
    autocast: Callable[[], Any]
    reduce_sum: Callable[[torch.Tensor], torch.Tensor]
    gather_objects: Callable[[Any], list]
    step: int
    epoch: int
    seed: int
    device: torch.device
    max_steps: int = 0


class MetricStream:
    """Accumulates per-batch results; `compute` gathers across ranks and returns plain floats."""

    def update(self, outputs: Any, batch: dict[str, torch.Tensor], valid: torch.Tensor) -> None:
        raise NotImplementedError

    def compute(self, backend) -> dict[str, float]:
        raise NotImplementedError

    def with_loss(self, backend, metrics: dict, num_examples: int) -> dict:
        """`metrics` followed by the loss (mean over all ranks of a stream's `loss_sum` / `count`) and
        `num_examples`: how the streams that score examples end `compute`."""
        return {**metrics, "loss": mean_over_ranks(backend, self.loss_sum, self.count), "num_examples": num_examples}


class Task:
    name = "task"
    model_kind = "model"  # for messages: 'a classification model'
    # transformers' table of the model classes this task trains (modeling_auto's *_MAPPING_NAMES): a transformers
    # model of another kind given to fit() / validate() is refused by name (None: any model)
    model_classes: ClassVar[str | None] = None
    best_metric = "loss"  # default metric_for_best
    greater_is_better = False
    pads_batches = True  # batches carry padding (an attention mask): picks the CPU attention kernel
    pads_with_tokenizer: ClassVar[bool] = False  # the tokenizer pads the batches (transformers' pad: needs a pad token)
    training_data_flags = "--train-file"  # what a run without training data is told to pass
    label_names: list[str] | None = None  # the adopted label set, in id order (tasks without classes: None)
    # the task's own settings (config keys under task_options, and flags); its run_defaults ("epochs") too
    Options: ClassVar[type[TaskOptions]] = TaskOptions
    # What the task's models produce, recorded in tuneforge.json (`capabilities`): generate, serve and predict
    # choose by these, never by the task's name. `family`: artifacts.FAMILY_CAUSAL or FAMILY_SEQ2SEQ.
    generates: ClassVar[bool] = False
    family: ClassVar[str | None] = None
    # the task generates with the model while it trains (`prepare_step`): a backend must hold the whole model on
    # each rank (not fsdp, ZeRO-3 or tp)
    generates_while_training: ClassVar[bool] = False

    def higher_is_better(self, metric: str) -> bool:
        """How `metric` ranks evaluations (the best model, early stopping, a sweep): the task's own metric as the
        task ranks it, any other higher-is-better but for a loss, perplexity or error."""
        return self.greater_is_better if metric == self.best_metric else not lower_is_better(metric)

    @property
    def reruns_in_backward(self) -> str | None:
        """What of the task's settings runs the model again inside a training step's backward (the embedding
        task's GradCache), so that a weight's gradient arrives several times in one backward; None: nothing."""
        return None

    @property
    def updates_per_batch(self) -> int:
        """Optimizer steps taken on each step's data (GRPO's num_iterations: a generated batch reused); the
        step plan repeats each step's data this many times and its position advances after the last."""
        return 1

    def __init__(self, config) -> None:
        if not isinstance(config.task_options, self.Options):
            raise TypeError(
                f"task {config.task!r} needs its options ({self.Options.__name__}) in the config: build the config "
                "with tuneforge.configure.build_config (Trainer does it)"
            )
        self.config = config
        self.options = config.task_options
        self.log = print
        self.files: dict[str, str] = {}  # split -> the file it was read from (errors name it)
        self.dp_group = None  # the data-parallel ranks' process group (use_data_parallel); None: one process
        for flag, path in config.inputs().items():
            if flag != "--model":  # (check_model_path refuses a model's URL, suggesting a hub id)
                check_local(flag, path)
        for source in config.data.sources:  # named by their keys: each is read as --train-file, which it is not
            for key in ("path", "validation_file"):
                check_local(f"data source {source.name!r}: {key}", getattr(source, key))
        if config.model:  # a typo in --model fails before any tokenizer, data or model work
            check_model_path(config.model)
        if config.data.cache_dir:
            check_output_dir(config.data.cache_dir, "--cache-dir", "cache dir")
        cache = config.data.cache_dir or env_flag("TUNEFORGE_CACHE")  # (the folder the cache writes in)
        if cache:
            flag = "--cache-dir" if config.data.cache_dir else "TUNEFORGE_CACHE"
            check_cache_outside_inputs(cache, flag, config.inputs())

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

    def prepare_given_tokenizer(self, tokenizer) -> None:
        """What `load_tokenizer` does to the task's own tokenizer, done to one given to fit() / validate(): a pad
        token (eos) where the tokenizer pads the batches (a GPT-2 or Llama one failed in transformers' pad)."""
        if self.pads_with_tokenizer:
            set_pad_token(tokenizer, None)

    def check_vocabulary(self, tokenizer) -> None:
        """One line, before any data work, where the tokenizer holds more tokens than the model's embeddings."""
        check_vocabulary_fits(tokenizer, self.peek_model_config(), self.model_path())

    def _known_family(self, wanted: bool) -> tuple[str | None, dict]:
        """(model_type, transformers' auto table of this task's model classes) of --model where `wanted` and
        transformers' own tables know its family; (None, {}) where not read, or for a model with its own code
        (trust_remote_code), which stands outside those tables."""
        from transformers.models.auto import modeling_auto
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        model_config = self.peek_model_config() if wanted and self.config.model else None
        family = getattr(model_config, "model_type", None)
        if family not in CONFIG_MAPPING_NAMES or getattr(model_config, "auto_map", None):
            return None, {}
        return family, getattr(modeling_auto, self.model_classes or "MODEL_MAPPING_NAMES")

    def check_model_family(self) -> None:
        """One line, before any data work, where --model is of a family that transformers has no class of this task's
        kind for (GPT-2 for multiple choice, Gemma for QA, OPT for NER, T5 for a causal LM): loading it failed only
        after the data were tokenized, in transformers' words ('Unrecognized configuration class ...')."""
        family, table = self._known_family(bool(self.model_classes))
        if family is None or family in table:
            return
        usual = ("llama", "qwen2", "gpt2", "t5", "bart") if self.generates else ("bert", "roberta", "deberta-v2")
        *others, last = [name for name in usual if name in table][:3]
        kind = self.model_kind.removeprefix("a ").removeprefix("an ")
        raise ConfigError(
            f"model {self.config.model!r} is of the {family} family, for which transformers has no {kind} (task "
            f"{self.config.task!r} needs one); give a model of a family that has one, such as {', '.join(others)} or "
            f"{last}"
        )

    def check_checkpointing(self) -> None:
        """One line, before any data work, where --gradient-checkpointing meets a model class transformers cannot
        checkpoint (MPNet, ALBERT, XLNet): its refusal came after the data were tokenized, as an internal error."""
        import transformers

        family, table = self._known_family(self.config.gradient_checkpointing)
        name = table.get(family)
        if name is None:
            return
        model_class = getattr(transformers, name if isinstance(name, str) else name[0], None)
        if model_class is not None and not model_class.supports_gradient_checkpointing:
            raise ConfigError(no_checkpointing(model_class.__name__))

    def pretrained_kwargs(self) -> dict:
        """Extra `from_pretrained` arguments of the model to train: float32 weights, whatever dtype its config.json
        names (transformers loads a bf16 or fp16 folder as such: the optimizer would step half-precision weights,
        where the run's precision is autocast's), or the 4-bit base of --quantize (QLoRA), its task head kept in
        full precision (`unquantized_modules`)."""
        import torch

        from tuneforge import adapters

        kwargs = adapters.quantization_kwargs(self.config)
        if not kwargs:
            return {"dtype": torch.float32}
        kwargs["quantization_config"].llm_int8_skip_modules = self.unquantized_modules()
        return kwargs

    def unquantized_modules(self) -> list[str] | None:
        """The modules a 4-bit base keeps in full precision: transformers' own choice (the output layer, tied
        weights, the last parameter's module) and this task's head, which trains whole; None (transformers' choice
        alone) where the model's class is not known here. transformers takes the last *parameter*, so a head that
        ends in a bias (BERT's `classifier.bias`) was quantized, and its 4-bit copy could not train."""
        import torch
        import transformers
        from transformers.models.auto import modeling_auto
        from transformers.quantizers.base import get_keys_to_not_convert

        from tuneforge.adapters import head_modules

        model_config = self.peek_model_config()
        names = getattr(modeling_auto, self.model_classes, {}) if self.model_classes else {}
        name = names.get(getattr(model_config, "model_type", None))
        model_class = getattr(transformers, name if isinstance(name, str) else (name or [""])[0], None)
        if model_class is None:
            return None
        with torch.device("meta"):  # the module tree only: no weights are made
            model = model_class(model_config)
        return sorted(set(get_keys_to_not_convert(model)) | set(head_modules(model)))

    def load_model(self, tokenizer):
        raise NotImplementedError

    # --- data ---------------------------------------------------------------------------
    # The Trainer calls, in order: load_raw (or prepare_raw), label_set -> use_labels, encode_labels,
    # tokenize, select_examples. Only use_labels changes what the task knows about the data.
    def load_raw(self):
        """DatasetDict with train/validation splits of raw (untokenized) examples, labels as written."""
        raise NotImplementedError

    def label_set(self, raw) -> list[str] | None:
        """The classes a model of this task predicts, in id order, decided from `raw` (None: no classes)."""
        return None

    def use_labels(self, names: list[str] | None) -> None:
        """Adopt the label set (from `label_set`): the model head and the label encoding follow it."""

    def encode_labels(self, raw):
        """`raw` with its labels as ids of the adopted label set (tasks without classes: unchanged)."""
        return raw

    def adopt_model_labels(self, model_config=None) -> None:
        """Evaluating a fine-tuned model without training data: take the label set saved with it (`model_config`:
        that of a model given to validate(), else the config's model's)."""

    def check_given_model_kind(self, model) -> None:
        """A transformers model given to fit() / validate() that is not of a class this task trains (AutoModel's bare
        encoder, a causal LM for a classifier): one ConfigError naming both, before any step (it was an error deep
        in a step: no attribute 'logits', a target of the wrong size). The caller's own torch modules pass."""
        from transformers import PreTrainedModel

        if self.model_classes is None or not isinstance(model, PreTrainedModel):
            return
        from transformers.models.auto import modeling_auto

        table = getattr(modeling_auto, self.model_classes)
        known = {name for names in table.values() for name in ([names] if isinstance(names, str) else names)}
        if known.isdisjoint(cls.__name__ for cls in type(model).__mro__):
            mine = table.get(getattr(model.config, "model_type", None))
            hint = f" (e.g. {mine if isinstance(mine, str) else mine[0]})" if mine else ""
            raise ConfigError(
                f"the model given is a {type(model).__name__}, and task {self.config.task!r} trains "
                f"{self.model_kind}{hint}: load it with the matching AutoModelFor... class, or leave model= out and "
                "the task builds one"
            )

    def name_given_model_labels(self, model) -> None:
        """A model the caller gave fit() / validate(): its head must have one output per class of the adopted label
        set, and its config names them (as `load_model` does for the task's own model), so that the exported folder
        predicts the data's labels. Tasks without classes: nothing to check."""
        if self.label_names is None or not hasattr(model.config, "num_labels"):
            return
        names, size = list(self.label_names), model.config.num_labels
        if size != len(names):
            raise ConfigError(
                f"the model given has {size} outputs in its head and the data {len(names)} labels "
                f"({', '.join(map(str, names))}): give a model with num_labels={len(names)}, or leave model= out "
                "and the task builds one"
            )
        model.config.id2label = dict(enumerate(names))
        model.config.label2id = {name: i for i, name in enumerate(names)}

    def select_examples(self, split: str, ds):
        """--max-train-samples / --max-eval-samples: the one rule for both.

        They count the examples the model sees: the first N features of a split (one feature per row
        for classification and seq2seq, one packed block for clm). A task whose rows map one to one onto
        features may apply this to raw rows before tokenizing (the same examples, less work)."""
        data = self.config.data
        limit = {"train": data.max_train_samples, "validation": data.max_eval_samples}.get(split)
        if ds is None or not limit:
            return ds
        return ds.select(range(min(limit, len(ds))))

    def check_local_files(self, check_file, find_in_dir) -> None:
        """Cheap up-front checks of the data flags, before any model work: each --train-file/--validation-file by
        `check_file(path)`; with neither, --data-dir's files by `find_in_dir(folder)`."""
        data = self.config.data
        given = [f for f in (data.train_file, data.validation_file) if f]
        for f in given:
            check_file(f)
        if data.data_dir and not given:
            find_in_dir(data.data_dir)

    def read_given_files(self, needs: str, read) -> dict:
        """{split: read(path, split)} of --train-file/--validation-file, each split's file kept in `self.files`;
        neither given: one ConfigError line saying what the task `needs` (and how to pass it)."""
        data = self.config.data
        if not data.train_file and not data.validation_file:
            raise ConfigError(f"task {self.name!r} needs {needs}")
        splits = {}
        for split, path in (("train", data.train_file), ("validation", data.validation_file)):
            if path:
                self.files[split] = str(path)
                splits[split] = read(path, split)
        return splits

    def read_local_splits(self, find_in_dir, read) -> dict | None:
        """{split: raw Dataset} of train/validation from --train-file/--validation-file, or from --data-dir (its
        files found by `find_in_dir(folder)`), each read by `read(path)`; each split's file is kept in
        `self.files` for error messages. None: no local data given (the task's hub default applies)."""
        data = self.config.data
        self.files = {}
        if data.train_file or data.validation_file:
            files = {"train": data.train_file, "validation": data.validation_file}
        elif data.data_dir:
            files = find_in_dir(data.data_dir)
        else:
            return None
        splits = {}
        for split in ("train", "validation"):
            if files.get(split):
                self.files[split] = str(files[split])
                splits[split] = read(files[split])
        if not splits:
            raise ConfigError(f"--data-dir {data.data_dir!r} holds no train or validation file for {self.config.task}")
        return splits

    def hold_out_if_needed(self, splits: dict, unit: str) -> dict:
        """`splits` with 10% of train held out for validation where no validation file was given (fixed by
        split_seed); `unit` names what a row is (sentence, question, row)."""
        if "validation" in splits:
            return splits
        self.log(f"no validation file: holding out 10% of the training {unit}s for validation")
        splits = hold_out_validation(splits["train"], self.config.data.split_seed, unit, "add a validation file")
        if "train" in self.files:  # (data given as datasets, through the Python API, have no file)
            self.files["validation"] = self.files["train"]
        return splits

    def tokenize(self, raw, tokenizer, log=print):
        """DatasetDict of features, each split with a `length` column."""
        raise NotImplementedError

    def tokenize_split(self, split: str, ds, columns: list[str], fn, tokenizer, settings: dict, log=print):
        """`fn` (batched) over `columns` of one raw split, through the tokenization cache: `settings`
        are what, besides the data and the tokenizer, decides the features."""
        from tuneforge.data.tokenize import cached_map  # datasets loads here, not at every CLI start

        return cached_map(
            ds.select_columns(columns),
            fn,
            tokenizer=tokenizer,
            settings=settings,
            cache_dir=self.config.data.cache_dir,
            desc=f"tokenize {split}",
            log=log,
            num_proc=self.config.data.num_workers,
        )

    def collate(self, rows: dict[str, list], tokenizer) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}

    def forward(self, model, batch: dict[str, torch.Tensor]):
        """The outputs `compute_loss` and the metric stream read, for one batch (the Trainer calls this under
        the run's autocast, with the backend's model)."""
        return model(**self.model_inputs(batch), **no_cache(model))

    def use_data_parallel(self, group) -> None:
        """The process group of the run's data-parallel ranks (None: one process), told before any data or model
        work: a task whose loss spans the ranks (in-batch candidates gathered from all of them) computes over it."""
        self.dp_group = group

    def prepare_step(self, batches: list[dict], tools: StepTools) -> list[dict]:
        """The micro-batches one optimizer step trains on, from the ones collated from the step's data rows
        (`collate`). Most tasks train on their data as it is; a task that makes its examples (GRPO: completions
        generated from the rows' prompts and scored) does it here, once per step, for all its micro-batches."""
        return batches

    def train_logs(self, backend, step: int) -> dict:
        """Extra values for the training log line at `step` (a collective: every rank calls it), measured since
        the last line; the task's own window empties."""
        return {}

    def set_up_reference(self, model, adapter) -> None:
        """Training only: called once the trainable model is built (`adapter`: its LoRA adapter, or None) and
        before a backend wraps it. A task whose loss compares the model with itself as it was (DPO) keeps
        that reference here."""

    # --- loss and metrics ---------------------------------------------------------------
    def compute_loss(self, outputs, batch, row_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of per-item losses, number of items) for one micro-batch.

        `row_mask` (evaluation): a bool tensor, one entry per row; rows where it is False (padding
        duplicates added so every rank gets a full batch) add nothing to the loss sum."""
        raise NotImplementedError

    def count(self, batch) -> torch.Tensor:
        """Items the loss of `batch` is summed over (examples or target tokens)."""
        return torch.tensor(float(batch["input_ids"].shape[0]))

    def metric_stream(self) -> MetricStream:
        raise NotImplementedError

    def eval_step(self, batch, valid, stream: MetricStream, tools: EvalTools) -> None:
        """One evaluation micro-batch (seq2seq overrides this to also `generate`)."""
        stream.update(tools.forward(batch), batch, valid)

    def prepare_raw(self, splits: dict):
        """User-given raw datasets (Python API) -> the same form as `load_raw`."""
        raise NotImplementedError

    def capabilities(self) -> dict:
        """What tuneforge.json records of what this task's models produce (every `export_info` includes it)."""
        return capability_info(self.generates, self.family)

    def export_info(self) -> dict:
        """Written as tuneforge.json beside an exported model: how to feed it at predict time."""
        return {"task": self.config.task, "max_length": self.config.data.max_length, **self.capabilities()}

    def model_files(self, model_config) -> dict[str, str]:
        """Files that other libraries read to load the exported model (a path inside the folder -> its text),
        written into OUTPUT_DIR/model beside the weights; `model_config`: the trained model's config. Most tasks'
        models need none."""
        return {}

    @staticmethod
    def claims_folder(model_dir: str) -> bool:
        """Whether a model folder tuneforge did not write (no task in its tuneforge.json) is this task's kind by its
        layout, so that predict and serve run it as such (a sentence-transformers folder: a sentence encoder)."""
        return False

    @staticmethod
    def make_generator(model_dir: str, max_length: int | None = None):
        """What `serve` runs for a model this task exported when the model generates text (the OpenAI routes):
        a `tuneforge.generate.Generator` (inputs truncated to `max_length` where given); None for a task whose
        models do not generate (`make_predictor`'s)."""
        return None

    @staticmethod
    def make_predictor(model_dir: str, **kwargs):
        """What `tuneforge predict` and `serve` run for a model this task exported: an object with
        `predict(inputs, batch_size)`, `accepts` (the request kinds serve takes: texts, pairs, inputs), `task`,
        `labels` and `regression`."""
        raise ConfigError(
            f"model {model_dir!r} generates text: `tuneforge predict` takes classifiers, scorers, taggers, qa, "
            "multiple-choice models and sentence encoders; use `tuneforge generate` for it, or `tuneforge serve` (its "
            "OpenAI routes)"
        )

    # --- saving -------------------------------------------------------------------------
    def check_max_length(self, tokenizer, model_config) -> None:
        """max_length within the model's positions and above the tokenizer's special tokens (data/tokenize.py's
        `check_room_for_text`); unset (null), texts are cut at the tokenizer's model_max_length (transformers'
        truncation), which must then be within them too (a hub tokenizer's ~1e30 is no limit)."""
        from tuneforge.data.tokenize import check_room_for_text

        max_length = self.config.data.max_length
        if max_length is not None:
            check_room_for_text(max_length, tokenizer)
        limit = context_length(model_config)
        stated = getattr(tokenizer, "model_max_length", None)
        if max_length is None and limit and not (isinstance(stated, int) and stated <= limit):
            cut = f"at its model_max_length {stated}" if isinstance(stated, int) and stated < 1 << 30 else "nowhere"
            raise ConfigError(
                f"max_length is unset (null), so texts are cut where the tokenizer says ({cut}), past the model's "
                f"{limit} positions; give --max-length {limit} or less"
            )
        check_max_length_fits(max_length, model_config)


def mean_over_ranks(backend, loss_sum: torch.Tensor, count: torch.Tensor) -> float:
    """The loss summed on every rank over the items counted on every rank (nan: no items)."""
    totals = backend.reduce_sum(torch.stack([loss_sum, count]).float().to(backend.device))
    return float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")


HELD_OUT = 0.1  # the share of a lone training file held out for validation


def hold_out_validation(train, seed: int, what: str, fix: str) -> dict:
    """{"train", "validation"}: 10% of `train` held out for validation, fixed by `seed`; both parts shuffled
    (held_out_rows: where each part's rows were in `train`)."""
    if len(train) < 2:
        raise DataError(
            f"the training data has only {len(train)} {what}: too few to hold out 10% for validation; {fix}"
        )
    parts = train.train_test_split(test_size=HELD_OUT, seed=seed)
    return {"train": parts["train"], "validation": parts["test"]}


def held_out_rows(size: int, seed: int) -> dict[str, list[int]]:
    """{"train", "validation"}: the rows (1-based) of a table of `size` rows that hold_out_validation(table, seed)
    puts in each part, in the part's order (the same split of row numbers alone): for an error that names a row
    of the file."""
    import datasets

    numbered = datasets.Dataset.from_dict({"row": list(range(1, size + 1))})
    parts = numbered.train_test_split(test_size=HELD_OUT, seed=seed)
    return {"train": parts["train"]["row"], "validation": parts["test"]["row"]}


def empty_check(ds, split: str) -> None:
    if ds is None or len(ds) == 0:
        raise DataError(f"the {split} split has no examples; give a file with at least one row")
