"""Export: a standalone HF model folder (config, model.safetensors, tokenizer, tuneforge.json).

Online, from a live model (`export_live`): the Trainer's OUTPUT_DIR/model; the backend gathers
the full weights (a collective on sharded backends). Offline, from any checkpoint folder
(`export_checkpoint`, `tuneforge export CHECKPOINT OUT_DIR`): no process group, any machine; the
backend named in the checkpoint's meta.json names its checkpoint layout, which reads the weights
(backends/layouts.py: model.safetensors for single/ddp, DCP shards for fsdp/tp, ZeRO shards for deepspeed), and the
model is rebuilt from the checkpoint's config.json, so the export needs no original model.

`tuneforge export --format gguf SOURCE OUT.gguf` (`export_gguf`) writes one GGUF file for llama.cpp and Ollama
instead: SOURCE (an HF model folder, an adapter folder, merged first, or a checkpoint) is made a plain HF folder
here, and tuneforge.gguf_export writes the file.

tuneforge.json beside the weights tells `predict`/`generate`/`serve` what the model was trained for
(task, text columns, max_length, source prefix); it is read and written through `tuneforge.artifacts`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tuneforge import adapters, checkpoint, gguf_export
from tuneforge.artifacts import (
    ADAPTER_CONFIG,
    MODEL_INFO,
    first_error_line,
    is_adapter_folder,
    read_model_info,
    save_pretrained,
    write_model_info,
)
from tuneforge.backends import available_backends, backend_class, layouts
from tuneforge.errors import CheckpointError, ConfigError
from tuneforge.files import TMP_PREFIX, replacing
from tuneforge.flags import POSITIONAL, add_model_flags, parse_options
from tuneforge.options import PATH
from tuneforge.paths import check_output_dir
from tuneforge.weights import share_tied


def write_hf_folder(
    out_dir: str | os.PathLike,
    model,
    state_dict=None,
    tokenizer=None,
    info: dict | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """`model.save_pretrained` (with `state_dict` if given), the tokenizer, tuneforge.json and the task's own
    `files` (a path inside the folder -> its text: `Task.model_files`), written to a temporary folder that then
    replaces `out_dir` in one rename."""
    out = Path(out_dir)
    with replacing(out, what="the model folder") as tmp:
        save_pretrained(model, tmp, state_dict=state_dict)
        if state_dict is not None:
            name_weights_dtype(tmp, state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if info is not None:
            write_model_info(tmp, info)
        for name, text in (files or {}).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_text(text, encoding="utf-8")
    return out


def name_weights_dtype(folder: Path, state_dict: dict) -> None:
    """config.json's `dtype` (the dtype from_pretrained loads in) names the weights written: save_pretrained names
    the live module's, and a DeepSpeed bf16 module is bf16 where its weights handed in are the fp32 master copy."""
    dtypes = {str(v.dtype).removeprefix("torch.") for v in state_dict.values() if v.is_floating_point()}
    path = folder / "config.json"
    saved = json.loads(path.read_text())
    if len(dtypes) == 1 and saved.get("dtype") not in dtypes:
        saved["dtype"] = dtypes.pop()
        path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")  # as transformers writes it


# ---- online: a live (possibly sharded) model ---------------------------------------------------
def export_live(
    model,
    backend,
    out_dir,
    *,
    tokenizer=None,
    info: dict | None = None,
    state_dict=None,
    gather: bool = True,
    adapter: adapters.Adapter | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """Save the HF folder of a live model (a collective: every rank calls it), with the task's own `files`
    (write_hf_folder); with `adapter`, the adapter folder of an adapter run (adapters.write_adapter_folder).

    `gather=False`: use `state_dict` as given (the main rank's copy of the best weights); every rank
    must pass the same `gather`, since gathering is a collective on sharded backends.
    """
    if gather and state_dict is None:
        state_dict = backend.full_state_dict(model)  # collective on sharded backends
    if backend.is_main:
        module = backend.unwrap(model)
        if adapter is not None:
            module.config.architectures = [type(module).__name__.removeprefix("FSDP")]  # as save_pretrained sets it
            if files:  # another library reads the folder (the task's files): the adapter merged into its base
                write_merged_adapter(adapter, module.config, out_dir, state_dict, tokenizer, info, files)
            else:
                adapters.write_adapter_folder(adapter, out_dir, state_dict, module.config, tokenizer, info or {})
        else:
            write_hf_folder(out_dir, module, state_dict, tokenizer, info, files)
    backend.barrier()
    return Path(out_dir)


def write_merged_adapter(adapter, model_config, out_dir, state_dict, tokenizer, info, files) -> Path:
    """A full model folder for an adapter run: the adapter folder written to a staging folder beside `out_dir`
    (tuneforge's own, removed after), merged into its base, then written with the task's `files` (write_hf_folder)."""
    import transformers

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=TMP_PREFIX + "adapter-", dir=out.parent))
    try:
        adapters.write_adapter_folder(adapter, staging / "adapter", state_dict, model_config, tokenizer, info or {})
        merged = adapters.load_merged(getattr(transformers, model_config.architectures[0]), staging / "adapter")
        return write_hf_folder(out, merged, None, tokenizer, info, files)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def export_merged(
    adapter_dir: str | os.PathLike, out_dir: str | os.PathLike, base: str | None = None, overwrite: bool = False
) -> Path:
    """`tuneforge export --merge ADAPTER_DIR OUT_DIR`: the adapter merged into its base, a standalone HF
    folder that `from_pretrained` loads (weights, config, tokenizer, tuneforge.json)."""
    import transformers

    folder = Path(adapter_dir)
    if not is_adapter_folder(folder):
        raise ConfigError(
            f"{str(folder)!r} is not an adapter folder (no {ADAPTER_CONFIG}); --merge takes the "
            "OUTPUT_DIR/model of an --adapter lora run"
        )
    inputs = {"the adapter folder": str(folder), "the base model": base or adapters.base_of(folder)}
    check_export_folder(Path(out_dir), overwrite, inputs)
    config = read_config(folder)
    arch = (getattr(config, "architectures", None) or [None])[0]
    loader = getattr(transformers, arch, None) if arch else None
    if loader is None:
        raise ConfigError(f"adapter folder {str(folder)!r}: its config.json names no known architecture ({arch!r})")
    model = adapters.load_merged(loader, folder, base=base)
    has_tokenizer = (folder / "tokenizer_config.json").exists()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder) if has_tokenizer else None
    info = read_model_info(folder)
    info.pop("adapter", None)
    return write_hf_folder(out_dir, model, tokenizer=tokenizer, info={**info, "merged_from": str(folder)})


# ---- offline: a checkpoint folder of any backend -----------------------------------------------
def read_weights(path: str | os.PathLike, meta: dict) -> dict:
    """Full model weights (CPU) of a checkpoint folder, read the way its backend (meta.json's) wrote them."""
    name = meta.get("backend")
    try:
        writer = backend_class(name)
    except ConfigError:
        raise CheckpointError(
            f"the checkpoint was written by backend {name!r}, which this tuneforge lacks (it has: "
            f"{', '.join(available_backends())})"
        ) from None
    return layouts.read_weights(writer.checkpoint_layout, Path(path), writer.name)


def _load_weights(model, weights: dict, path: Path) -> None:
    # tied parameters (lm_head = embeddings) are stored once: fill in the other names first
    missing, unexpected = model.load_state_dict(share_tied(weights, model), strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit its own config.json: missing {list(missing)[:3]}, unexpected "
            f"{list(unexpected)[:3]}"
        )


# what an HF model folder (an export, an adapter folder) holds: --overwrite replaces such a folder whole, and
# refuses one holding anything else (the user's files would go with it)
MODEL_FOLDER_FILE = re.compile(
    r"(config|generation_config|tuneforge|adapter_config|tokenizer|tokenizer_config|special_tokens_map|"
    r"added_tokens|vocab|preprocessor_config|chat_template|model\.safetensors\.index)\.json|"
    r"(model(-\d+-of-\d+)?|adapter_model|trainable)\.safetensors|pytorch_model(-\d+-of-\d+)?\.bin|"
    r"vocab\.txt|merges\.txt|spiece\.model|tokenizer\.model|sentencepiece\.bpe\.model|chat_template\.jinja"
)


def _overlaps(a: Path, b: Path) -> bool:
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


def check_export_folder(out: Path, overwrite: bool, inputs: dict[str, str | None] | None = None) -> None:
    """The folder an export writes: not a file, one that can be made (not under a file), not one of the export's
    inputs (`inputs`: what -> path) nor inside or around one, empty unless `overwrite`, and with `overwrite`
    holding only model files (the folder is replaced whole). Checked before any model is loaded."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"export folder {str(out)!r} is a file; choose another folder")
    check_output_dir(str(out), "OUT_DIR", "export folder")  # under a file, or where no folder can be made
    for what, given in (inputs or {}).items():
        if given and Path(given).exists() and _overlaps(out, Path(given)):
            where = "is" if out.resolve() == Path(given).resolve() else "overlaps"
            raise CheckpointError(
                f"export folder {str(out)!r} {where} {what} {given!r}, which the export reads; choose a folder "
                "outside it"
            )
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        raise CheckpointError(f"export folder {str(out)!r} is not empty; pass --overwrite or choose another folder")
    foreign = [name for name in held if not (MODEL_FOLDER_FILE.fullmatch(name) and (out / name).is_file())]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise CheckpointError(
            f"export folder {str(out)!r} holds files an export does not write ({shown}); --overwrite replaces "
            "the whole folder, so move them out or choose another folder"
        )
    if held and MODEL_INFO not in held:  # every export writes it: a model folder without it is someone else's
        raise CheckpointError(
            f"export folder {str(out)!r} holds a model tuneforge did not write (no {MODEL_INFO}: a downloaded or "
            "saved model of yours); --overwrite replaces only an earlier export, so choose another folder"
        )


def export_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write `out_dir` as an HF folder (config, safetensors weights, tokenizer, tuneforge.json, the task's files for
    other libraries: a sentence encoder's sentence-transformers modules)."""
    import transformers

    path, out = Path(checkpoint_dir), Path(out_dir)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; pass a OUTPUT_DIR/checkpoint-STEP folder")
    if not (path / checkpoint.MANIFEST).exists():
        raise CheckpointError(
            f"{str(path)!r} is not a complete tuneforge checkpoint (no {checkpoint.MANIFEST}); pass a "
            "checkpoint-STEP folder"
        )
    check_export_folder(out, overwrite, {"the checkpoint": str(path)})
    problem = checkpoint.verify(path)
    if problem:
        raise CheckpointError(problem)
    meta = checkpoint.read_meta(path)
    if meta.get("adapter"):
        raise CheckpointError(
            f"checkpoint {str(path)!r} is of an adapter run (--adapter lora): it holds the adapters and the head "
            "only. Its run's OUTPUT_DIR/model is the adapter folder; `tuneforge export --merge OUTPUT_DIR/model OUT` "
            "writes a standalone model, or resume the run with --resume"
        )
    config = transformers.AutoConfig.from_pretrained(path)
    # meta.json names the class that trained (config.json may still name the base model's)
    arch = meta.get("architecture") or (getattr(config, "architectures", None) or [None])[0]
    model_cls = getattr(transformers, arch, None) if arch else None
    if model_cls is None:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is of architecture {arch!r}, which this transformers version lacks"
        )
    model = model_cls(config)
    _load_weights(model, read_weights(path, meta), path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
    info = read_model_info(path) if (path / MODEL_INFO).exists() else None
    return write_hf_folder(out, model, tokenizer=tokenizer, info=info, files=checkpoint.read_model_files(path))


# ---- GGUF: one file for llama.cpp and Ollama ---------------------------------------------------
def _gguf_source(path: Path, merge: bool) -> str:
    """What SOURCE of `export --format gguf` is: "checkpoint", "adapter" (merged first) or "model"."""
    if not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} does not exist or is not a folder; pass a model folder, an adapter folder or a "
            "checkpoint-STEP folder"
        )
    if (path / checkpoint.MANIFEST).exists():
        kind = "checkpoint"
    elif is_adapter_folder(path):
        kind = "adapter"
    elif (path / "config.json").exists():
        kind = "model"
    else:
        raise ConfigError(f"{str(path)!r} is not a model folder (no config.json); pass a model or checkpoint folder")
    if merge and kind != "adapter":
        raise ConfigError(
            f"{str(path)!r} is not an adapter folder (no {ADAPTER_CONFIG}); --merge takes the OUTPUT_DIR/model of an "
            "--adapter lora run (--format gguf merges an adapter folder without it)"
        )
    return kind


def read_config(path: Path):
    """The config.json of a folder the export reads; one that is missing or cannot be read is one line."""
    import transformers
    from huggingface_hub.errors import StrictDataclassError  # a value of the wrong type

    try:
        return transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, StrictDataclassError) as err:
        raise ConfigError(f"{str(path)!r}: its config.json cannot be read ({first_error_line(err)})") from None


def _gguf_check_source(path: Path, kind: str) -> None:
    """The source's config (a checkpoint's meta.json names the class that trained), checked before weights load."""
    config = read_config(path)
    meta = checkpoint.read_meta(path) if kind == "checkpoint" else {}
    arch = meta.get("architecture") or (getattr(config, "architectures", None) or [None])[0]
    gguf_export.check_source(path, config, arch, repr(str(path)))


def gguf_model_name(path: Path) -> str:
    """general.name: the source folder's name, or its run's where it is a run's model/ or checkpoint-STEP/."""
    path = path.resolve()
    return path.parent.name if path.name == "model" or path.name.startswith("checkpoint-") else path.name


def export_gguf(
    source: str | os.PathLike,
    out_file: str | os.PathLike,
    quant: str = "f16",
    *,
    base: str | None = None,
    merge: bool = False,
    overwrite: bool = False,
) -> Path:
    """`tuneforge export --format gguf SOURCE OUT.gguf`: SOURCE as one GGUF file (tuneforge.gguf_export). An HF
    model folder is read as it is; an adapter folder is merged into its base (or `base`) and a checkpoint rebuilt
    (as `export_merged` and `export_checkpoint` do) into a temporary folder beside OUT first."""
    path, out = Path(source), Path(out_file)
    kind = _gguf_source(path, merge)
    if base and kind != "adapter":
        raise ConfigError(f"--base goes with an adapter folder (the model it is merged into); {str(path)!r} is not one")
    inputs = {"the source": str(path)}
    if kind == "adapter":
        inputs["the base model"] = base or adapters.base_of(path)
    gguf_export.check_destination(out, overwrite, inputs)
    _gguf_check_source(path, kind)
    missing = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # deepest first
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if kind == "model":
            return gguf_export.write_gguf(path, out, quant, gguf_model_name(path))
        with tempfile.TemporaryDirectory(prefix=f"{TMP_PREFIX}gguf-", dir=out.parent) as staging:
            folder = Path(staging) / "model"
            if kind == "adapter":
                export_merged(path, folder, base=base)
            else:
                export_checkpoint(path, folder)
            return gguf_export.write_gguf(folder, out, quant, gguf_model_name(path))
    except BaseException:
        for made in missing:  # the folders made for OUT, where the export failed: gone again if still empty
            if made.exists() and not any(made.iterdir()):
                made.rmdir()
        raise


# ---- CLI ---------------------------------------------------------------------------------------
def _free_choice(*choices: str) -> dict:
    """json_schema_extra of a Literal flag that argparse takes as any word: pydantic refuses a wrong one in one
    `error:` line naming the choices (argparse's refusal would print its usage first)."""
    return {"flag_kwargs": {"choices": None, "metavar": "{" + ",".join(choices) + "}"}}


class ExportOptions(BaseModel):
    """`tuneforge export`'s arguments, checked before anything is read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str = Field(
        description="an OUTPUT_DIR/checkpoint-STEP folder (any backend); with --merge, an adapter folder; with "
        "--format gguf, also a model folder or an adapter folder (merged first)",
        json_schema_extra={**POSITIONAL, **PATH},
    )
    out_dir: str = Field(
        description="the HF folder to write (config, model.safetensors, tokenizer); with --format gguf, the .gguf "
        "file to write",
        json_schema_extra={**POSITIONAL, **PATH},
    )
    overwrite: bool = Field(
        False,
        description="replace an earlier export in OUT_DIR (a folder of model files only; with --format gguf, a "
        ".gguf file tuneforge wrote)",
    )
    merge: bool = Field(
        False, description="CHECKPOINT is an adapter run's OUTPUT_DIR/model: merge the adapter into its base model"
    )
    base: str | None = Field(
        None,
        description="with --merge (or an adapter folder with --format gguf): the base model (default: the one it "
        "was trained on)",
        json_schema_extra=PATH,
    )
    format: Literal["hf", "gguf"] = Field(
        "hf",
        description="hf: an HF model folder; gguf: one .gguf file for llama.cpp and Ollama (Llama-family causal LMs)",
        json_schema_extra={
            **_free_choice("hf", "gguf"),
            "refusal": "--format {value!r} is not one tuneforge writes; "
            "choose hf (an HF folder) or gguf (a llama.cpp file)",
        },
    )
    quant: Literal["f16", "q8_0", "q4_0"] | None = Field(
        None,
        description="with --format gguf: the weights' type in the file: f16, q8_0 or q4_0 (default: f16)",
        json_schema_extra={
            **_free_choice(*gguf_export.QUANT_NAMES),
            "refusal": "--quant {value!r} is not a GGUF type tuneforge writes; choose f16, q8_0 or q4_0",
        },
    )

    @model_validator(mode="after")
    def _base_needs_merge(self):
        if self.base and not self.merge and self.format != "gguf":
            raise ValueError("--base goes with --merge (the model an adapter is merged into)")
        if self.quant and self.format != "gguf":
            raise ValueError(f"--quant {self.quant} goes with --format gguf (an HF folder keeps the model's dtype)")
        if self.format == "hf" and self.out_dir.lower().endswith(".gguf"):  # a folder named so, then a checkpoint error
            raise ValueError(
                f"{self.out_dir!r} names a .gguf file: add --format gguf (without it export writes a folder)"
            )
        return self


def cmd_export(ns: argparse.Namespace) -> int:
    options = parse_options(ExportOptions, ns)
    if options.format == "gguf":
        out = export_gguf(
            options.checkpoint,
            options.out_dir,
            options.quant or "f16",
            base=options.base,
            merge=options.merge,
            overwrite=options.overwrite,
        )
        size = out.stat().st_size / 1e6
        print(f"exported {options.checkpoint} to {out} (GGUF {options.quant or 'f16'}, {size:.1f} MB)", flush=True)
        return 0
    if options.merge:
        out = export_merged(options.checkpoint, options.out_dir, base=options.base, overwrite=options.overwrite)
    else:
        out = export_checkpoint(options.checkpoint, options.out_dir, overwrite=options.overwrite)
    print(f"exported {options.checkpoint} to {out}", flush=True)
    return 0


def add_arguments(p) -> None:
    """`tuneforge export`'s arguments: ExportOptions' fields (the CLI lists the command and its help)."""
    add_model_flags(p, ExportOptions)
    p.set_defaults(func=cmd_export)
