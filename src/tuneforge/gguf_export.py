"""GGUF export: one .gguf file that llama.cpp and Ollama load, written with the `gguf` package (pure Python).

It owns the GGUF side of `tuneforge export --format gguf`: which models it writes (`check_model`: causal LMs of the
Llama family, written as llama.cpp's `llama` architecture), where the file may go (`check_destination`), and the
file itself (`write_gguf`). The input here is always a plain HF model folder: export.py turns a checkpoint, or an
adapter folder (merged into its base), into one first.

The file is what llama.cpp's convert_hf_to_gguf.py writes for a Llama: the hyper-parameters under `llama.*`, the
tensors under llama.cpp's names (gguf's TensorNameMap) with attn_q/attn_k permuted as llama.cpp lays out rotary
heads, and the tokenizer as `tokenizer.ggml.model` gpt2 (byte-level BPE): every token with its type, the merges,
the bos/eos/unk/pad ids, whether bos/eos are added (as the HF tokenizer does), the pre-tokenizer's llama.cpp name and
the chat template. Types (`QUANTS`): f16 writes every matrix F16, q8_0 Q8_0, q4_0 Q4_0 except the output matrix
(the token embedding where they are tied), which stays Q8_0 (llama-quantize keeps it at Q6_K, which gguf cannot write
in Python); 1-D tensors, norms and biases are F32, and a matrix whose rows do not split into whole blocks F16, as
convert_hf_to_gguf.py does.

OUT is the path of the .gguf file, not a folder: llama.cpp (`llama-cli -m FILE`), Ollama (`FROM ./FILE` in a
Modelfile) and convert_hf_to_gguf.py (`--outfile FILE`) all name one file, and quantizations of one model sit side
by side (model-f16.gguf, model-q4_0.gguf). The file records that tuneforge wrote it (`tuneforge.exported_by`):
--overwrite replaces such a file only, never another.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

from tuneforge.artifacts import context_length, from_pretrained
from tuneforge.errors import CheckpointError, ConfigError
from tuneforge.files import replacing
from tuneforge.paths import check_output_dir

# model_type -> the causal-LM class llama.cpp's llama architecture holds (convert_hf_to_gguf.py's LlamaModel)
SUPPORTED = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
QUANT_NAMES = ("f16", "q8_0", "q4_0")
MARKER = "tuneforge.exported_by"  # the key that says tuneforge wrote a file
ROPE_TYPES = ("default", "linear", "llama3")

# llama.cpp's names of the pre-tokenizers of Llama-family vocabularies, by the sha256 of the token ids of its check
# text (convert_hf_to_gguf.py's get_vocab_base_pre); a tokenizer not among them is named by its structure
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) "
    "✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
KNOWN_PRE = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",  # Smaug-Llama-3
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM, SmolLM2
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral Nemo
    "0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3": "pixtral",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
}


@dataclass(frozen=True)
class Quant:
    """One --quant: the type of the matrices, the output matrix's, and general.file_type."""

    matrix: str  # gguf.GGMLQuantizationType name
    output: str
    file_type: str  # gguf.LlamaFileType name


QUANTS = {
    "f16": Quant("F16", "F16", "MOSTLY_F16"),
    "q8_0": Quant("Q8_0", "Q8_0", "MOSTLY_Q8_0"),
    "q4_0": Quant("Q4_0", "Q8_0", "MOSTLY_Q4_0"),
}


@dataclass(frozen=True)
class Vocab:
    """The tokenizer as GGUF holds it."""

    tokens: list[str]
    types: list[int]  # gguf.TokenType
    pre: str  # tokenizer.ggml.pre
    add_bos: bool
    add_eos: bool


# ---- what may be exported, and where ------------------------------------------------------------
def check_model(config, architecture: str | None, where: str) -> None:
    """A model llama.cpp's llama architecture runs as transformers does: a Llama-family causal LM with plain,
    linear or Llama 3 rotary scaling and no sliding window. Checked on the config alone, before weights load."""
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        family = f"of the {kind} family" if kind else "of no family transformers names"
        raise ConfigError(
            f"{where} is {family}; --format gguf writes Llama-family causal LMs "
            f"({', '.join(SUPPORTED)}; e.g. SmolLM2, Llama 3), not this one (a checkpoint of it exports as an HF "
            "folder without --format)"
        )
    if architecture and architecture != SUPPORTED[kind]:
        raise ConfigError(
            f"{where} is a {architecture}; --format gguf writes causal LMs ({SUPPORTED[kind]}), which llama.cpp runs"
        )
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        raise ConfigError(
            f"{where} uses {rope['rope_type']!r} rotary scaling, which this GGUF export does not write (it writes "
            f"{', '.join(ROPE_TYPES)})"
        )
    if getattr(config, "sliding_window", None):
        raise ConfigError(
            f"{where} attends within a sliding window of {config.sliding_window} tokens, which llama.cpp's llama "
            "architecture lacks; the GGUF would answer differently past it"
        )


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def written_by_tuneforge(path: Path) -> bool:
    """A GGUF file holding tuneforge's marker key (what --overwrite may replace)."""
    from gguf import GGUFReader

    try:
        return MARKER in GGUFReader(path).fields
    except Exception:  # not a GGUF file at all: gguf raises ValueError, struct errors, OSError...
        return False


def check_destination(out: Path, overwrite: bool, inputs: dict[str, str | None]) -> None:
    """The .gguf file an export writes: named *.gguf, in a folder that is or can be made (not under a file), not
    inside any of the export's inputs (`inputs`: what -> path), and absent unless `overwrite`, which replaces only a
    GGUF file tuneforge wrote. Checked before any model is loaded."""
    out = Path(out)
    if out.suffix != ".gguf":
        raise ConfigError(
            f"{str(out)!r}: with --format gguf OUT is the .gguf file to write (llama.cpp and Ollama load one file), "
            "e.g. out/model-q8_0.gguf"
        )
    if out.is_symlink() or (out.exists() and not out.is_file()):
        raise CheckpointError(f"{str(out)!r} is not a plain file; choose another path for the .gguf file")
    if out.parent.exists() and not out.parent.is_dir():
        raise CheckpointError(f"{str(out.parent)!r} is a file, not a folder; choose another path")
    check_output_dir(str(out.parent), "OUT", "the .gguf file's folder")  # under a file, or where none can be made
    for what, given in inputs.items():
        if given and Path(given).exists() and _inside(out, Path(given)):
            raise CheckpointError(
                f"{str(out)!r} is inside {what} {given!r}, which the export reads; write the .gguf file outside it"
            )
    if out.exists() and not overwrite:
        raise CheckpointError(f"{str(out)!r} exists; pass --overwrite to replace it, or choose another path")
    if out.exists() and not written_by_tuneforge(out):
        raise CheckpointError(
            f"{str(out)!r} was not written by tuneforge, which never replaces files it did not write; move it away "
            "or choose another path"
        )


def tuneforge_version() -> str:
    """The installed tuneforge's version, from its package metadata (the package itself sits above this module)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("tuneforge")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---- the model's numbers --------------------------------------------------------------------------
def rope_parameters(config) -> dict:
    """The rotary settings: transformers 5's `rope_parameters`, else the older `rope_theta` / `rope_scaling`."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def add_hyperparameters(writer, config, quant: str, name: str) -> None:
    """llama.* and general.* as convert_hf_to_gguf.py writes them for a Llama."""
    import gguf

    rope = rope_parameters(config)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_string(MARKER, f"tuneforge {tuneforge_version()}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(context_length(config))
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    writer.add_file_type(gguf.LlamaFileType[QUANTS[quant].file_type])
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim(config))
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def llama3_rope_factors(config):
    """llama.cpp's rope_freqs tensor of Llama 3 scaling: each rotary frequency's divisor, the plain frequencies over
    transformers' own Llama 3 ones."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dim, base = head_dim(config), float(rope_parameters(config)["rope_theta"])
    plain = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return (plain / scaled).float().numpy()


# ---- tensors ----------------------------------------------------------------------------------------
def permute(weights, n_head: int, n_head_kv: int | None):
    """llama.cpp's layout of a q/k projection (convert_hf_to_gguf.py's LlamaModel.permute): HF keeps each head's
    rotary halves apart, llama.cpp interleaves them."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    shape = weights.shape
    return weights.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def tensor_type(kind, gguf_name: str, ndim: int, quant: str, has_output: bool):
    """The GGML type of one tensor at `quant` (see the module's docstring)."""
    import gguf

    types = gguf.GGMLQuantizationType
    if ndim <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return types.F32
    output = kind == gguf.MODEL_TENSOR.OUTPUT or (kind == gguf.MODEL_TENSOR.TOKEN_EMBD and not has_output)
    return types[QUANTS[quant].output if output else QUANTS[quant].matrix]


def _encode(data, qtype):
    """`data` (float32) as `qtype`; a matrix whose rows do not split into whole blocks stays F16 (llama.cpp's rule)."""
    import gguf

    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:
        return data.astype("float16"), gguf.GGMLQuantizationType.F16


def gguf_tensors(model, config, quant: str):
    """(gguf name, encoded array, GGML type) of every weight of a Llama causal LM, in the model's order."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    n_head, n_kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    out = []
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # stored once, as token_embd: llama.cpp (and transformers' GGUF loader) tie them back
        found = names.get_type_and_name(hf_name, try_suffixes=(".weight", ".bias"))
        if found is None:
            raise ConfigError(f"weight {hf_name!r} has no llama.cpp tensor name; this model is not a plain Llama")
        kind, gguf_name = found
        data = tensor.detach().float().numpy()
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute(data, n_head, n_head)
        elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute(data, n_head, n_kv)
        qtype = tensor_type(kind, gguf_name, data.ndim, quant, has_output=not tied)
        out.append((gguf_name, *_encode(data, qtype)))
    if rope_parameters(config)["rope_type"] == "llama3":
        rope_freqs = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        out.append((rope_freqs, llama3_rope_factors(config), gguf.GGMLQuantizationType.F32))
    return out


# ---- tokenizer --------------------------------------------------------------------------------------
def _backend_spec(tokenizer, where: str) -> dict:
    """The tokenizers-library description of a byte-level BPE tokenizer; anything else is refused."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    model = (spec.get("model") or {}).get("type")
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if model != "BPE" or not any(p.get("type") == "ByteLevel" for p in parts):
        raise ConfigError(
            f"the tokenizer of {where} is not a byte-level BPE one ({model or type(tokenizer).__name__}); --format "
            "gguf writes GPT-2-style BPE vocabularies (tokenizer.ggml.model gpt2: Llama 3, SmolLM2...) only"
        )
    return spec


def pre_tokenizer_name(tokenizer, spec: dict, where: str) -> str:
    """tokenizer.ggml.pre: llama.cpp's name for how text is split before BPE, by the tokens of llama.cpp's check
    text (its known vocabularies), else GPT-2's own split for a tokenizer whose only pre-tokenizer is GPT-2's."""
    digest = sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    if digest in KNOWN_PRE:
        return KNOWN_PRE[digest]
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return "gpt-2"
    raise ConfigError(
        f"the tokenizer of {where} splits text in a way llama.cpp has no name for here (pre-tokenizer "
        f"{json.dumps(pre)[:120]}); --format gguf writes the GPT-2 split and the Llama 3, SmolLM and Mistral ones"
    )


def _token_text(tokenizer, index: int, token: str) -> str:
    """An added token as llama.cpp expects it: pre-normalized (convert_hf_to_gguf.py's get_vocab_base)."""
    if not tokenizer.added_tokens_decoder[index].normalized:
        return tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
    return token


def _looks_special(token: str) -> bool:
    return (token.startswith("<|") and token.endswith("|>")) or token in ("<pad>", "<mask>")


def read_vocab(tokenizer, vocab_size: int, where: str) -> Vocab:
    """Every token id below the model's vocab_size with its text and llama.cpp type (ids the tokenizer lacks are
    [PAD<id>] UNUSED, as llama.cpp writes them)."""
    import gguf

    spec = _backend_spec(tokenizer, where)
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ConfigError(
            f"the tokenizer of {where} has token ids up to {max(vocab.values())}, past the model's vocab_size "
            f"{vocab_size}; the model cannot take them"
        )
    by_id, added = {i: t for t, i in vocab.items()}, tokenizer.get_added_vocab()
    tokens, types = [], []
    for index in range(vocab_size):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif token in added:
            text = _token_text(tokenizer, index, token)
            control = tokenizer.added_tokens_decoder[index].special or _looks_special(text)
            tokens.append(text)
            types.append(gguf.TokenType.CONTROL if control else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    plain, full = tokenizer.encode("Hello", add_special_tokens=False), tokenizer.encode("Hello")
    extra = len(full) > len(plain)
    add_bos = extra and tokenizer.bos_token_id is not None and full[0] == tokenizer.bos_token_id
    add_eos = extra and tokenizer.eos_token_id is not None and full[-1] == tokenizer.eos_token_id
    return Vocab(tokens, [int(t) for t in types], pre_tokenizer_name(tokenizer, spec, where), add_bos, add_eos)


def add_tokenizer(writer, folder: Path, tokenizer, vocab: Vocab, where: str) -> None:
    """tokenizer.ggml.* and tokenizer.chat_template; the merges and special ids through gguf's SpecialVocab (as
    convert_hf_to_gguf.py reads them), whether bos/eos are added as the HF tokenizer adds them."""
    import gguf

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(vocab.tokens))
    if not special.merges:
        raise ConfigError(f"the tokenizer of {where} has no BPE merges in its files; re-save it with transformers")
    special.add_special_token = {**special.add_special_token, "bos": vocab.add_bos, "eos": vocab.add_eos}
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: llama.cpp's list form
        template = [{"name": name, "template": text} for name, text in template.items()]
    special.chat_template = template or None
    special.add_to_gguf(writer, quiet=True)


def source_tokenizer(folder: Path, where: str):
    """The tokenizer beside the model or checkpoint (a GGUF file carries it); a folder without one, or one that
    cannot be loaded, is one line."""
    from transformers import AutoTokenizer

    if not (Path(folder) / "tokenizer_config.json").exists():
        raise ConfigError(f"{where} has no tokenizer; a GGUF file carries one: save the tokenizer beside the model")
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ConfigError(f"the tokenizer of {where} cannot be loaded ({str(err).splitlines()[0][:160]})") from None


def check_source(folder: Path, config, architecture: str | None, where: str) -> None:
    """`check_model`, and the tokenizer beside it one GGUF can carry: what the export checks before it loads
    weights, merges or rebuilds anything."""
    check_model(config, architecture, where)
    read_vocab(source_tokenizer(folder, where), config.vocab_size, where)


# ---- the file -------------------------------------------------------------------------------------------
def write_gguf(folder: str | os.PathLike, out: str | os.PathLike, quant: str, name: str) -> Path:
    """The HF model folder `folder` written as the GGUF file `out` at `quant` (f16, q8_0, q4_0), replacing it in
    one rename. `name`: general.name. The caller checked the destination (`check_destination`)."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, out, where = Path(folder), Path(out), repr(name)
    config = AutoConfig.from_pretrained(folder)
    check_model(config, (getattr(config, "architectures", None) or [None])[0], where)
    tokenizer = source_tokenizer(folder, where)
    vocab = read_vocab(tokenizer, config.vocab_size, where)
    model = from_pretrained(AutoModelForCausalLM, str(folder), "the model", dtype="auto")  # missing, corrupt: one line
    with torch.no_grad():
        tensors = gguf_tensors(model, config, quant)
    del model
    with replacing(out, what="the .gguf file", then=" or choose another path") as tmp:
        writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
        add_hyperparameters(writer, config, quant, name)
        add_tokenizer(writer, folder, tokenizer, vocab, where)
        for gguf_name, data, qtype in tensors:
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out
