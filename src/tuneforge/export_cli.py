"""`tuneforge export CHECKPOINT OUT_DIR`: a training checkpoint -> a standalone HF model folder.

The weights are consolidated offline (no process group, any machine), by the layout the backend
named in meta.json wrote:
    model.safetensors            single, ddp: the full weights as they are
    sharded/.metadata            fsdp, tp (torch.distributed.checkpoint): the model entries of all
                                 ranks' shards, read with DCP's offline loader (as dcp_to_torch_save)
    */mp_rank_00_model_states.pt deepspeed: zero_to_fp32's get_fp32_state_dict_from_zero_checkpoint
A backend class may define `offline_state_dict(path) -> dict` to export its own layout; it wins.
The model is rebuilt from the checkpoint's config.json, so the export needs no original model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from tuneforge.errors import CheckpointError


def _dcp_model_state(folder: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    # only the "model" entries: the optimizer shards (2x the weights for Adam) stay on disk
    _load_state_dict(
        state,
        storage_reader=FileSystemReader(str(folder)),
        planner=_EmptyStateDictLoadPlanner(keys={"model"}),
        no_dist=True,
    )
    return state["model"]


def _deepspeed_state(path: Path) -> dict[str, torch.Tensor] | None:
    found = sorted(path.rglob("mp_rank_00_model_states.pt"))
    if not found:
        return None
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag_dir = found[0].parent
    return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)


def consolidated_state_dict(path: Path, meta: dict) -> dict[str, torch.Tensor]:
    """Full model weights (CPU) of a checkpoint folder, whatever backend wrote it."""
    import importlib

    path = Path(path)
    backend = meta.get("backend")
    try:
        cls = importlib.import_module(f"tuneforge.backends.{backend}").BACKEND
    except (ImportError, AttributeError, TypeError):
        cls = None
    if cls is not None and hasattr(cls, "offline_state_dict"):
        return cls.offline_state_dict(path)
    if (path / "model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(str(path / "model.safetensors"))
    dcp = [p.parent for p in path.rglob(".metadata")]
    if dcp:
        return _dcp_model_state(dcp[0])
    state = _deepspeed_state(path)
    if state is not None:
        return state
    raise CheckpointError(
        f"checkpoint {str(path)!r} (backend {backend!r}) holds no weights tuneforge can read: "
        "no model.safetensors, DCP shards or DeepSpeed model states"
    )


def _load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # tied parameters (lm_head = embeddings) are stored once: a missing alias of a loaded tensor is fine
    loaded = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in weights}
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n in missing if not (n in params and id(params[n]) in loaded)]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit its own config.json: missing {missing[:3]}, unexpected "
            f"{list(unexpected)[:3]}"
        )


def export_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write `out_dir` as an HF folder (config, safetensors weights, tokenizer, tuneforge.json)."""
    import transformers

    from tuneforge import checkpoint as ckpt

    path, out = Path(checkpoint), Path(out_dir)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; pass a OUTPUT_DIR/checkpoint-STEP folder")
    if not (path / ckpt.MANIFEST).exists():
        raise CheckpointError(
            f"{str(path)!r} is not a complete tuneforge checkpoint (no {ckpt.MANIFEST}); pass a checkpoint-STEP folder"
        )
    problem = ckpt.verify(path)
    if problem:
        raise CheckpointError(problem)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"export folder {str(out)!r} is not empty; pass --overwrite or choose another folder")
    meta = ckpt.read_meta(path)
    config = transformers.AutoConfig.from_pretrained(path)
    # meta.json names the class that trained (config.json may still name the base model's)
    arch = meta.get("architecture") or (getattr(config, "architectures", None) or [None])[0]
    model_cls = getattr(transformers, arch, None)
    if model_cls is None:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is of architecture {arch!r}, which this transformers version lacks"
        )
    model = model_cls(config)
    _load_weights(model, consolidated_state_dict(path, meta), path)
    tmp = out.with_name(f"{ckpt.TMP_PREFIX}{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if (path / "tokenizer_config.json").exists():
        transformers.AutoTokenizer.from_pretrained(path).save_pretrained(tmp)
    if (path / "tuneforge.json").exists():
        shutil.copyfile(path / "tuneforge.json", tmp / "tuneforge.json")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def cmd_export(ns) -> int:
    out = export_checkpoint(ns.checkpoint, ns.out_dir, overwrite=ns.overwrite)
    print(f"exported {ns.checkpoint} to {out}", flush=True)
    return 0


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a checkpoint as a standalone HF model folder")
    p.add_argument("checkpoint", help="an OUTPUT_DIR/checkpoint-STEP folder (any backend)")
    p.add_argument("out_dir", help="the HF folder to write (config, model.safetensors, tokenizer)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    p.set_defaults(func=cmd_export)
