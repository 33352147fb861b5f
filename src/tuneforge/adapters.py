"""Adapters: LoRA through `peft`, for every task. What `--adapter lora` adds to a run.

- `add_lora(model, config, base_model)`: peft injects the LoRA layers into the model in place
  (`get_peft_model`), every base weight fixed; the task's head (a classifier's `classifier`, QA's
  `qa_outputs`) trains whole (peft's modules_to_save). The Trainer goes on training the same HF
  model object, so every backend sees the class it knows; the returned `Adapter` keeps the
  `PeftModel` around it for the export.
- The checkpoint of an adapter run (trainable.safetensors, `trainable_state`) is the `adapter` layout of
  backends/layouts.py; the 4-bit loading settings of QLoRA (`check_quantize`, `quantization_kwargs`) are
  precision's (backends/precision.py); both are re-exported here for the callers that train adapters.
- `write_adapter_folder(...)`: OUTPUT_DIR/model as peft writes it (adapter_config.json,
  adapter_model.safetensors) plus config.json, the tokenizer and tuneforge.json, so that
  `peft.PeftModel.from_pretrained(base, folder)` loads it and tuneforge's predict/generate/serve too.
- `load_merged(loader, folder)`: the base model of an adapter folder with the adapter merged in:
  `tuneforge export --merge` (export.py) writes that as a standalone HF folder.
- `load_pretrained_model(loader, path, what)`: a model folder's model, an adapter folder's merged: how the tasks,
  predict, generate and serve load every model (artifacts.from_pretrained loads configs and plain folders).

The base model is recorded (its path or hub id, and a fingerprint of the weights the adapters sit
on), so an adapter is never merged into a model it was not trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tuneforge.artifacts import (
    ADAPTER_CONFIG,
    check_weights_loaded,
    first_error_line,
    from_pretrained,
    is_adapter_folder,
    loads_a_model,
    read_model_info,
    shapes_differ,
    write_model_info,
)
from tuneforge.backends.layouts import TRAINABLE_FILE as TRAINABLE_FILE
from tuneforge.backends.layouts import trainable_state as trainable_state
from tuneforge.backends.precision import check_quantize as check_quantize
from tuneforge.backends.precision import quantization_kwargs as quantization_kwargs
from tuneforge.backends.precision import quiet_bitsandbytes
from tuneforge.errors import ConfigError

PEFT_PREFIX = "base_model.model."  # the PeftModel's name for the model it wraps


@dataclass
class Adapter:
    """A LoRA run's adapter: the PeftModel around the trained model, and the base it sits on."""

    peft_model: Any
    base_model: str  # path or hub id the base weights were loaded from
    fingerprint: str  # sha256 over the base weights that carry adapters

    def settings(self) -> dict:
        """What a checkpoint must match to resume (meta.json): the adapter's shape and its base weights."""
        cfg = self.peft_model.peft_config["default"]
        return {
            "type": "lora",
            "r": cfg.r,
            "alpha": cfg.lora_alpha,
            "targets": sorted(cfg.target_modules),
            "heads": sorted(cfg.modules_to_save or []),
            "base_fingerprint": self.fingerprint,
        }

    def info(self) -> dict:
        """What tuneforge.json records of the adapter: its settings and where the base came from."""
        return {**self.settings(), "base_model": self.base_model}

    def disabled(self):
        """A context in which the model runs as its base alone (DPO's reference): no second copy of the weights."""
        return self.peft_model.disable_adapter()


# ---- which layers get adapters, which train whole ---------------------------------------------
def _is_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"  # GPT-2's linear


def all_transposed(model: torch.nn.Module, targets: list[str]) -> bool:
    """Every layer `targets` names is a Conv1D (GPT-2's linear, its weight stored transposed): peft's fan_in_fan_out,
    which peft's docs ask for GPT-2 (left False, peft sets it itself per layer, with a warning on stderr)."""
    named = [m for name, m in model.named_modules() if name.rpartition(".")[2] in targets]
    return bool(named) and all(type(m).__name__ == "Conv1D" for m in named)


# the heads peft's task types save (SEQ_CLS, TOKEN_CLS: classifier or score; QUESTION_ANS: qa_outputs)
PEFT_TASK_HEADS = ("classifier", "score", "qa_outputs")


def head_modules(model: torch.nn.Module) -> list[str]:
    """The task head that trains whole: a model that predicts no tokens (classifier, tagger, QA, multiple
    choice) has its base model (`base_model_prefix`) and a head beside it; a generating model's head is
    its output embeddings (usually tied to the input ones), which stay fixed. A model that holds its base's
    parts itself (`model.base_model is model`: a bare encoder, T5's QA model) has only the heads peft's task
    types save."""
    has_lm_head = hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None
    if has_lm_head:
        return []
    if getattr(model, "base_model", None) is model:
        return [name for name, _ in model.named_children() if name in PEFT_TASK_HEADS]
    base = getattr(model, "base_model_prefix", "")
    return [
        name
        for name, child in model.named_children()
        if name != base and any(True for _ in child.parameters())  # dropout has none
    ]


def linear_layer_names(model: torch.nn.Module, skip: list[str] = ()) -> list[str]:
    """The distinct names (last part) of the model's linear layers outside `skip` and the output layer."""
    out_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = set()
    for name, module in model.named_modules():
        if _is_linear(module) and module is not out_layer and not any(name.split(".")[0] == s for s in skip):
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def choose_targets(model: torch.nn.Module, targets: str, heads: list[str]) -> list[str]:
    """`--lora-targets` resolved to layer names: auto (peft's table for the architecture, else every
    linear layer), all-linear, or the names given; a name that matches no layer is one line."""
    quiet_bitsandbytes()
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    linear = linear_layer_names(model, skip=heads)
    if not linear:
        raise ConfigError(
            f"{type(model).__name__} has no linear layers outside its head for LoRA to adapt; train it without "
            "--adapter"
        )
    if targets == "auto":
        chosen = PEFT_DEFAULTS.get(getattr(model.config, "model_type", None))
        return sorted(chosen) if chosen else linear
    if targets == "all-linear":
        return linear
    wanted = [t.strip() for t in targets.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in linear]
    if unknown:
        raise ConfigError(
            f"--lora-targets {','.join(unknown)} matches no linear layer of {type(model).__name__}; its linear layers "
            f"are: {', '.join(linear)} (or pass auto, all-linear)"
        )
    return wanted


def check_targets(model_config, targets: str) -> None:
    """`--lora-targets` checked on the bare model built on the meta device (no weights, no memory), before any
    data is read; a config that cannot be built is left to the real load, which reports it."""
    from transformers import AutoModel

    if model_config is None or targets in ("auto", "all-linear"):
        return
    try:
        with torch.device("meta"):
            bare = AutoModel.from_config(model_config)
    except (ValueError, KeyError, ImportError, TypeError):
        return
    choose_targets(bare, targets, heads=[])


def check_base_is_standalone(model_path: str) -> None:
    """A new adapter's base must be a standalone model folder: on an adapter folder (a LoRA run's OUTPUT_DIR/model,
    merged on load) peft's adapter_config.json would name that folder's own base, without its adapter, and the new
    folder's base would be an adapter folder that no loader merges. One line before any data is read."""
    if is_adapter_folder(model_path):
        raise ConfigError(
            f"--model {model_path!r} is an adapter folder (a LoRA run's model), which a new adapter cannot sit on: "
            f"its folder would name the first base, without this adapter; merge it first (tuneforge export --merge "
            f"{model_path} MERGED) and train on MERGED"
        )


def fingerprint(
    model: torch.nn.Module, targets: list[str], heads: list[str], weights: Callable[[str], torch.Tensor] | None = None
) -> str:
    """sha256 over the base weights the adapters sit on (names and values, in the model's order). Names are
    those inside the base model (`model.base_model`), so a classifier and its bare base agree. `weights(name)`
    reads a layer's full-precision weight elsewhere (a 4-bit model's own weights are packed)."""
    h = hashlib.sha256()
    body = getattr(model, "base_model", model)
    for name, module in body.named_modules():
        if body is model and name.split(".")[0] in heads:
            continue
        if _is_linear(module) and name.rsplit(".", 1)[-1] in targets:
            weight = (weights(name) if weights else module.weight.detach()).float().cpu().contiguous()
            h.update(name.encode())
            h.update(weight.numpy().tobytes())
    return h.hexdigest()


# ---- QLoRA: a 4-bit base ------------------------------------------------------------------------
def quantized_config(model_config) -> bool:
    return getattr(model_config, "quantization_config", None) is not None


def is_quantized(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False))


def file_weights(base_model: str, model: torch.nn.Module) -> Callable[[str], torch.Tensor] | None:
    """A reader of the full-precision weights in a local base folder's safetensors files, by the names inside
    `model.base_model` (for a 4-bit model's fingerprint); None for a hub id or other weight files."""
    from safetensors import safe_open

    files = sorted(Path(base_model).glob("*.safetensors")) if Path(base_model).is_dir() else []
    if not files:
        return None
    where = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            where.update({key: f for key in st.keys()})  # noqa: SIM118  (safe_open has no __iter__)
    prefix = getattr(model, "base_model_prefix", "")

    def read(name: str) -> torch.Tensor:
        key = next((k for k in (f"{prefix}.{name}.weight", f"{name}.weight") if k in where), None)
        if key is None:
            raise ConfigError(f"the base model {base_model!r} has no weight for layer {name!r} in its files")
        with safe_open(str(where[key]), framework="pt") as st:
            return st.get_tensor(key)

    return read


# ---- training ----------------------------------------------------------------------------------
def add_lora(model: torch.nn.Module, config, base_model: str, log: Callable[[str], None] = print) -> Adapter:
    """Inject LoRA into `model` in place (it keeps its class); returns the Adapter around it."""
    quiet_bitsandbytes()
    from peft import LoraConfig, get_peft_model

    heads = head_modules(model)
    targets = choose_targets(model, config.lora_targets, heads)
    quantized = is_quantized(model)
    weights = file_weights(base_model, model) if quantized else None
    fp = fingerprint(model, targets, heads, weights) if weights or not quantized else ""
    if quantized:  # QLoRA: norms and embeddings in fp32, inputs that carry gradients for checkpointing
        from peft import prepare_model_for_kbit_training

        prepare_model_for_kbit_training(model, use_gradient_checkpointing=config.gradient_checkpointing)
        for module in model.modules():
            # on AVX512-BF16 CPUs bitsandbytes repacks a 4-bit weight in place at its first no-grad forward in
            # eval mode (bf16 scales, and it fails on layers narrower than its block of 64): evaluation would
            # change the weights training goes on with. Off, evaluation runs the training path.
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        modules_to_save=heads or None,
        fan_in_fan_out=all_transposed(model, targets),
    )
    with warnings.catch_warnings():  # peft asks transformers a deprecated question about checkpointing
        warnings.filterwarnings("ignore", category=FutureWarning)
        peft_model = get_peft_model(model, lora)
    # modules_to_save keeps the original head beside its trained copy: count the head once
    originals = {id(p) for n, p in model.named_parameters() if ".original_module." in n}
    # a 4-bit weight packs two values a byte
    total = sum(p.numel() * (2 if p.dtype == torch.uint8 else 1) for p in model.parameters() if id(p) not in originals)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    head = f"; the head ({', '.join(heads)}) trains whole" if heads else ""
    base = " on the 4-bit NF4 base (QLoRA)" if quantized else ""
    log(
        f"training {trained / 1e6:.2f}M of {total / 1e6:.1f}M parameters ({100 * trained / total:.2f}%): LoRA r="
        f"{config.lora_r} alpha={config.lora_alpha:g} on {', '.join(targets)}{head}{base}"
    )
    return Adapter(peft_model=peft_model, base_model=str(base_model), fingerprint=fp)


# ---- export and loading -------------------------------------------------------------------------
def store_frozen_linears(model: torch.nn.Module, dtype: torch.dtype | None) -> int:
    """Keep every frozen `nn.Linear`'s weight and bias in `dtype` (the run's autocast dtype, which autocast casts
    them to at every call anyway: the same numbers, no per-call cast, half the memory). A weight shared with the
    input embeddings (tied lm_head) stays as it is: embeddings are not autocast. Returns the bytes saved."""
    if dtype is None or is_quantized(model):
        return 0
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = embeddings.weight if embeddings is not None else None
    saved = 0
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if type(module) is not torch.nn.Linear or any(p.requires_grad for p in params):
            continue
        if tied is not None and module.weight is tied:
            continue
        for p in params:
            if p.dtype != dtype and p.is_floating_point():
                saved += p.numel() * (p.element_size() - torch.finfo(dtype).bits // 8)
                p.data = p.data.to(dtype)
    return saved


def write_adapter_folder(
    adapter: Adapter, out_dir: str | os.PathLike, state_dict: dict | None, model_config, tokenizer, info: dict
) -> Path:
    """OUTPUT_DIR/model of an adapter run, replaced in one rename: peft's adapter files (from
    `state_dict`, the full weights by the trained model's names, where the live weights are sharded),
    config.json (labels), the tokenizer and tuneforge.json (with the adapter's base)."""
    from tuneforge.files import replacing

    out = Path(out_dir)
    peft_state = {PEFT_PREFIX + k: v for k, v in state_dict.items()} if state_dict is not None else None
    with replacing(out, what="the adapter folder") as tmp:
        adapter.peft_model.save_pretrained(tmp, state_dict=peft_state)
        name_unsharded_class(tmp, adapter.peft_model.base_model.model)
        (tmp / "README.md").unlink(missing_ok=True)  # peft's model-card template, with nothing filled in
        model_config.save_pretrained(tmp)  # labels, and the class that trained (the base may be a bare BertModel)
        if quantized_config(model_config):  # QLoRA: the adapter belongs to the full-precision base, as peft's does
            saved = json.loads((tmp / "config.json").read_text())
            saved.pop("quantization_config", None)
            (tmp / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_model_info(tmp, {**info, "adapter": {**adapter.info(), **base_location(adapter.base_model, out)}})
    return out


def base_location(base: str, adapter_dir: Path) -> dict:
    """Where a local base folder lies, for tuneforge.json beside the name as given (peft's adapter_config.json keeps
    that): its absolute path, and its path from the adapter folder. A name typed relative to the training's working
    folder then still finds the base from another folder, and from a copy of the project elsewhere. A hub id: none."""
    if not Path(base).expanduser().is_dir():
        return {}
    where = os.path.abspath(Path(base).expanduser())
    from_adapter = os.path.relpath(where, os.path.abspath(adapter_dir))
    return {"base_model_path": where, "base_model_path_from_adapter": from_adapter}


def name_unsharded_class(folder: Path, model: torch.nn.Module) -> None:
    """peft's adapter_config.json names the class of the model it wraps (`auto_mapping`, which AutoPeftModel
    imports); FSDP2 swaps that class in place for one of its own (FSDPLlamaForCausalLM, made inside torch),
    which no loader can import: the file names the model's own class again."""
    own = next(c for c in type(model).__mro__ if not c.__module__.startswith("torch.distributed."))
    path = folder / ADAPTER_CONFIG
    saved = json.loads(path.read_text())
    if saved.get("auto_mapping") and own is not type(model):
        saved["auto_mapping"] = {"base_model_class": own.__name__, "parent_library": own.__module__}
        path.write_text(json.dumps(saved, indent=2, sort_keys=True))


def _adapter_info(folder: Path) -> dict:
    try:
        info = read_model_info(folder)
    except ConfigError:  # unreadable: fall back on peft's own config, as for a folder peft wrote
        info = {}
    if info.get("adapter"):
        return info["adapter"]
    try:  # an adapter folder peft wrote elsewhere: its config names the base
        peft_cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{str(folder / ADAPTER_CONFIG)!r} is unreadable ({err}); re-export the adapter") from None
    return {"base_model": peft_cfg.get("base_model_name_or_path")}


def base_of(folder: str | os.PathLike) -> str | None:
    """The base model of an adapter folder (its path, found as `find_base` finds it, or hub id), or None."""
    info = _adapter_info(Path(folder))
    try:
        return find_base(Path(folder), info)
    except ConfigError:  # not there: the load says so
        return info.get("base_model")


def find_base(folder: Path, info: dict) -> str | None:
    """The base to load for adapter `folder` (its tuneforge.json `info`): a hub id, or an adapter of peft's or of an
    earlier tuneforge, as named (peft reads a path from the current folder); a local base, the first folder found
    of the one it was trained on, the name as given, and the same place seen from the adapter folder (a copy of the
    project elsewhere). None there: one line saying where it was."""
    given, trained_on = info.get("base_model"), info.get("base_model_path")
    if not trained_on:
        return given
    beside = folder / info.get("base_model_path_from_adapter", trained_on)
    for place in (trained_on, given, beside):
        if place and Path(place).expanduser().is_dir():
            return str(place)
    raise ConfigError(
        f"the base model {given!r} of adapter {str(folder)!r} is not there: it was trained on {trained_on!r}, and "
        f"neither that, {given!r} from the current folder nor {str(beside)!r} is a folder; "
        + BASE_FIX.format(folder=folder)
    )


def _check_base_kind(folder: Path, base: str, config) -> None:
    """A local base of another kind of model than the adapter's (a gpt2 for a bert adapter): one line that
    says so, before its weights are loaded."""
    try:
        base_type = json.loads((Path(base) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # a hub id, or no readable config: loading says what is wrong
    want = getattr(config, "model_type", None)
    if want and base_type and base_type != want:
        raise ConfigError(
            f"adapter {str(folder)!r} was trained on a model of the {want} family, and the base {base!r} is of the "
            f"{base_type} family; pass the base model's folder it was trained on"
        )


# only `tuneforge export` takes --base: the other commands load an adapter folder's base from its adapter_config.json
BASE_FIX = (
    "merge it with its base model's folder into a standalone one: tuneforge export {folder} OUT --merge --base DIR"
)


def load_merged(loader, folder: str | os.PathLike, base: str | None = None, **kwargs):
    """`loader.from_pretrained` of the adapter's base (or `base`) with the adapter of `folder` merged in.

    The folder's config.json (labels, task head) is the model's config. A base whose weights differ
    from the ones the adapter was trained on is refused, in one line.
    """
    quiet_bitsandbytes()
    from peft import PeftModel
    from transformers import AutoConfig

    folder = Path(folder)
    info = _adapter_info(folder)
    base = base or find_base(folder, info)
    if not base:
        raise ConfigError(f"adapter folder {str(folder)!r} names no base model; {BASE_FIX.format(folder=folder)}")
    if (folder / "config.json").exists():
        kwargs.setdefault("config", AutoConfig.from_pretrained(folder))
    _check_base_kind(folder, base, kwargs.get("config"))
    model = _load_base(loader, folder, base, info, kwargs)
    want = info.get("base_fingerprint")
    if want:
        heads = head_modules(model)
        got = fingerprint(model, info.get("targets") or [], heads)
        if got != want:
            raise ConfigError(
                f"adapter {str(folder)!r} was trained on other base weights than those of {base!r} (fingerprints "
                f"differ); merge it into the model it was trained on ({info.get('base_model')!r})"
            )
    with warnings.catch_warnings():  # peft asks transformers a deprecated question about checkpointing
        warnings.filterwarnings("ignore", category=FutureWarning)
        return PeftModel.from_pretrained(model, folder).merge_and_unload()


def _base_vocabulary(base: str, config) -> int | None:
    """The base's own vocabulary size where the adapter's `config` has more (training grew the embeddings for its
    tokenizer's tokens, and peft saved the grown layers with the adapter), else None."""
    from transformers import AutoConfig

    if config is None:
        return None
    try:
        own = AutoConfig.from_pretrained(base).get_text_config().vocab_size
    except (OSError, ValueError, AttributeError):
        return None  # loading the base says what is wrong
    grown = getattr(config.get_text_config(), "vocab_size", None)
    return own if own and grown and own < grown else None


def _load_base(loader, folder: Path, base: str, info: dict, kwargs: dict):
    """The base model of adapter `folder` by `loader`, at the vocabulary size the adapter was trained with: a base
    whose embeddings training grew loads at its own size and grows after, as peft's docs do before loading an
    adapter. A base that cannot be loaded, or of other shapes: one line."""
    import copy

    config = kwargs.get("config")
    own_vocabulary = _base_vocabulary(base, config)
    if own_vocabulary:
        kwargs = {**kwargs, "config": copy.deepcopy(config)}
        kwargs["config"].get_text_config().vocab_size = own_vocabulary
    try:
        model = loader.from_pretrained(base, **kwargs)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"the base model {base!r} of adapter {str(folder)!r} cannot be loaded ({str(err).splitlines()[0][:160]}); "
            + BASE_FIX.format(folder=folder)
        ) from None
    except RuntimeError as err:
        if not shapes_differ(err):
            raise
        raise ConfigError(
            f"the base model {base!r} does not fit adapter {str(folder)!r}: its weights' shapes differ from those of "
            f"the model it was trained on ({info.get('base_model')!r}); merge it into that model"
        ) from None
    if own_vocabulary:
        model.resize_token_embeddings(config.get_text_config().vocab_size)
    return model


def start_new_head(model, mismatched: list, path: str, what: str, log) -> None:
    """Says, through `log`, that the head of `model` starts new where its shapes differ from the folder's
    (`mismatched`: from_pretrained's (name, the folder's shape, the model's shape)); a refusal where a weight outside
    the head differs (a size edited in config.json, another model's weights)."""
    if not mismatched:
        return
    heads = head_modules(model)
    if any(name.split(".")[0] not in heads for name, *_ in mismatched):
        raise ConfigError(
            f"could not load {what} from {path!r}: its weights' shapes differ from those its config.json gives (a "
            "size edited there, or another model's weights)"
        )
    name, theirs, ours = mismatched[0]
    log(
        f"model {path!r}: its head ({', '.join(heads)}) has other shapes than this run's ({name}: {list(theirs)} in "
        f"the folder, {list(ours)} here); it starts from random weights"
    )


def load_pretrained_model(loader, path: str, what: str, new_head=None, **kwargs):
    """The model of a model folder, by `loader` (AutoModelFor..., BertFor...): an adapter folder's base with its
    adapter merged in (`load_merged`), any other folder through `artifacts.from_pretrained`; a folder that cannot be
    loaded is one ConfigError line. `new_head` (a task that trains the model: its log): a task head of other shapes
    than the folder's (a classifier of 2 labels trained on 3, a sentence classifier given to NER) starts new, said
    there, as transformers' ignore_mismatched_sizes does; without it, or elsewhere than in the head, a refusal.

    It lives here, not in artifacts.py with `from_pretrained`: merging needs peft and the base's fingerprint (this
    module's), and artifacts.py sits below every module that reads a model folder, this one included."""
    from safetensors import SafetensorError

    if not (loads_a_model(loader) and is_adapter_folder(path)):
        if new_head is None:
            return from_pretrained(loader, path, what, **kwargs)
        model, loading = from_pretrained(
            loader, path, what, ignore_mismatched_sizes=True, output_loading_info=True, **kwargs
        )
        check_weights_loaded(model, loading, path, what)
        mismatched = sorted(loading.get("mismatched_keys") or (), key=lambda each: each[0])
        start_new_head(model, mismatched, path, what, new_head)
        return model
    try:
        return load_merged(loader, path, **kwargs)  # an adapter run's OUTPUT_DIR/model
    except (OSError, ValueError, SafetensorError) as err:
        raise ConfigError(f"could not load {what} from {path!r}: {first_error_line(err)}") from None
