"""Checkpoint layouts: how the model and optimizer state lie inside a `checkpoint-STEP/` folder.

The one place that knows these files (the Checkpointer in checkpoint.py writes everything else of a
checkpoint; `tuneforge export` reads weights through here):

    full        model.safetensors + optimizer.pt, written by the main rank (single, ddp)
    adapter     trainable.safetensors + optimizer.pt: an adapter run (--adapter lora) holds the weights
                that train, the frozen base comes from its model folder (single, ddp)
    dcp         sharded/: torch.distributed.checkpoint, one `__R_0.distcp` per rank plus `.metadata`,
                keys are parameter names (fsdp, tp; an adapter run saves the weights that train). DCP
                stores each tensor's global shape and each shard's offsets, so `load` reshards (N ranks
                to M, fsdp to tp) and a full checkpoint loads too. Every rank writes: a multi-node run
                needs the output dir on a shared filesystem.
    deepspeed   deepspeed/: DeepSpeed's own ZeRO shards (each rank writes its own); resumed with the same
                number of processes, read offline with zero_to_fp32

Each layout has `save(backend, path, model, optimizer)`, `load(backend, path, model, optimizer)` (a
collective where the backend's state is), `refusal(backend, path, written_by, adapter=)`: why `backend` cannot
resume a checkpoint (of an adapter run or not; one line, or None; asked before any worker starts, as `load` asks
it) and
`read_weights(path, backend_name)`: the full weights (CPU) without a process group. `layout_for(kind,
adapter)` picks one; the backend names its kind (`Backend.checkpoint_layout`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from tuneforge.errors import CheckpointError
from tuneforge.files import torch_save
from tuneforge.weights import share_tied

FULL_WEIGHTS = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
TRAINABLE_FILE = "trainable.safetensors"  # an adapter run's checkpoint: the weights that train, no others
SHARDED_DIR = "sharded"
DEEPSPEED_DIR = "deepspeed"  # DeepSpeed's checkpoint tag: checkpoint-STEP/deepspeed/


# ---- what a folder holds ---------------------------------------------------------------------------
def has_full_weights(path: Path) -> bool:
    """Whether a checkpoint holds the full weights in one file (single/ddp), readable by any backend."""
    return (Path(path) / FULL_WEIGHTS).exists()


def full_weights(path: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights of a single/ddp checkpoint (CPU), with every alias of a tied weight filled in."""
    from safetensors.torch import load_file

    # safetensors stores tied weights once: give every alias of a stored tensor its value
    return share_tied(load_file(str(Path(path) / FULL_WEIGHTS)), model)


def holds_unsharded_weights(path: Path) -> bool:
    """A full or adapter checkpoint: what a backend that does not shard can read."""
    return has_full_weights(path) or (Path(path) / TRAINABLE_FILE).exists()


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights that train (adapters and head), by the model's own names, on CPU."""
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.requires_grad}


def _load_optimizer(path: Path, optimizer, device) -> None:
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(Path(path) / OPTIMIZER_FILE, map_location=device, weights_only=True))


def new_run_hint(adapter: bool) -> str:
    """The way to a new run from a checkpoint the backend cannot resume, after a refusal's 'resume with ...'.
    `adapter`: the checkpoint is of an adapter run, which `tuneforge export` refuses (the adapters and head only)."""
    if adapter:
        return (
            " (an adapter run's checkpoint holds the adapters and the head only, which `tuneforge export` does not "
            "take); once its run has finished, `tuneforge export --merge OUTPUT_DIR/model OUT` makes a model to "
            "start a new run from"
        )
    return ", or `tuneforge export` it and start a new run from the exported model"


# ---- full and adapter: one file of weights, written by the main rank --------------------------------
class FullLayout:
    name = "full"

    def save(self, backend, path: Path, model: nn.Module, optimizer) -> None:
        from safetensors.torch import save_model

        if backend.is_main:
            save_model(backend.unwrap(model), str(Path(path) / FULL_WEIGHTS))
            torch_save(optimizer.state_dict(), Path(path) / OPTIMIZER_FILE)

    def refusal(self, backend, path: Path, written_by: str | None, *, adapter: bool = False) -> str | None:
        if holds_unsharded_weights(path):
            return None
        return (
            f"checkpoint {str(path)!r} holds sharded weights written by backend {written_by!r}, which backend "
            f"{backend.name!r} cannot read; resume with --backend {written_by}{new_run_hint(adapter)}"
        )

    def load(self, backend, path: Path, model: nn.Module, optimizer) -> None:
        from safetensors.torch import load_model

        load_model(backend.unwrap(model), str(Path(path) / FULL_WEIGHTS), device=str(backend.device))
        _load_optimizer(path, optimizer, backend.device)

    @staticmethod
    def read_weights(path: Path, backend_name: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        weights = Path(path) / FULL_WEIGHTS
        if not weights.is_file():
            raise CheckpointError(
                f"checkpoint {str(path)!r} (backend {backend_name!r}) holds no weights tuneforge can read: "
                f"no {FULL_WEIGHTS}"
            )
        return load_file(str(weights))


class AdapterLayout(FullLayout):
    name = "adapter"

    def save(self, backend, path: Path, model: nn.Module, optimizer) -> None:
        from safetensors.torch import save_file

        if backend.is_main:
            save_file(trainable_state(backend.unwrap(model)), str(Path(path) / TRAINABLE_FILE))
            torch_save(optimizer.state_dict(), Path(path) / OPTIMIZER_FILE)

    def load(self, backend, path: Path, model: nn.Module, optimizer) -> None:
        load_trainable(backend.unwrap(model), path, backend.device)
        _load_optimizer(path, optimizer, backend.device)


def load_trainable(model: nn.Module, path: Path, device: torch.device) -> None:
    """An adapter run's checkpoint weights (trainable.safetensors) into `model`, whose frozen base
    weights are already those it was trained on; every trained weight must be there."""
    from safetensors.torch import load_file

    weights = load_file(str(Path(path) / TRAINABLE_FILE), device=str(device))
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(weights) != trained:
        differ = sorted(set(weights) ^ trained)
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds other trained weights than this run's adapter ({differ[:2]}...); "
            "resume with the --adapter and --lora-* flags of its config.yaml"
        )
    model.load_state_dict(weights, strict=False)


# ---- dcp: torch.distributed.checkpoint shards (fsdp, tp) --------------------------------------------
class DCPLayout:
    name = "dcp"

    def __init__(self, adapter: bool = False) -> None:
        self.adapter = adapter  # the weights that train only (the frozen base comes from its model folder)

    def _state_options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.adapter, strict=not self.adapter)

    def save(self, backend, path: Path, model: nn.Module, optimizer) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer, options=self._state_options())
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=Path(path) / SHARDED_DIR)

    def refusal(self, backend, path: Path, written_by: str | None, *, adapter: bool = False) -> str | None:
        if (Path(path) / SHARDED_DIR / ".metadata").exists() or has_full_weights(path):
            return None
        if (Path(path) / DEEPSPEED_DIR).is_dir():
            return (
                f"checkpoint {str(path)!r} holds DeepSpeed's ZeRO shards ({DEEPSPEED_DIR}/), written by backend "
                f"{written_by or 'deepspeed'!r}, which backend {backend.name!r} cannot read; resume with --backend "
                f"{written_by or 'deepspeed'}{new_run_hint(adapter)}"
            )
        return (
            f"checkpoint {str(path)!r} holds neither sharded weights ({SHARDED_DIR}/.metadata) nor {FULL_WEIGHTS}; "
            f"backend {backend.name!r} resumes from its own sharded checkpoints or a {FULL_WEIGHTS} one"
        )

    def load(self, backend, path: Path, model: nn.Module, optimizer) -> None:
        path = Path(path)
        refused = self.refusal(backend, path, None, adapter=self.adapter)
        if refused:
            raise CheckpointError(refused)
        if (path / SHARDED_DIR / ".metadata").exists():
            self._load_sharded(path / SHARDED_DIR, model, optimizer)
        else:
            _load_full_into_sharded(path, model, optimizer)

    def _load_sharded(self, folder: Path, model: nn.Module, optimizer) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import state_dict as dsd

        # this run's own (sharded) state names the pieces each rank needs; DCP reads them in place
        options = self._state_options()
        if optimizer is None:
            state = {"model": dsd.get_model_state_dict(model, options=options)}
            dcp.load(state, checkpoint_id=folder)
            dsd.set_model_state_dict(model, state["model"], options=options)
            return
        model_state, optim_state = dsd.get_state_dict(model, optimizer, options=options)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=folder)
        dsd.set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options
        )

    @staticmethod
    def read_weights(path: Path, backend_name: str) -> dict[str, torch.Tensor]:
        """The "model" entries of the DCP shards (all ranks'), read offline with DCP's public API; the
        optimizer entries (2x the weights for Adam) stay on disk. A checkpoint holding
        model.safetensors (resumed from single/ddp, never re-saved) is read as such."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        folder = Path(path) / SHARDED_DIR
        if not (folder / ".metadata").exists():
            return FullLayout.read_weights(path, backend_name)
        reader = dcp.FileSystemReader(str(folder))
        entries = reader.read_metadata().state_dict_metadata  # every tensor's global shape and dtype
        state = {
            key: torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in entries.items()
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
        }
        with warnings.catch_warnings():  # torch warns that no_dist loads in one process: that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, no_dist=True)
        return {key.removeprefix("model."): value for key, value in state.items()}


def _load_full_into_sharded(path: Path, model: nn.Module, optimizer) -> None:
    """A single/ddp checkpoint into sharded parameters: full weights and a torch optimizer state keyed by
    position."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, full_weights(path, model), options=full)  # tied weights are stored once
    if optimizer is None:
        return
    saved = torch.load(Path(path) / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    sizes = [len(g["params"]) for g in saved["param_groups"]]
    if sizes != [len(g["params"]) for g in optimizer.param_groups]:
        raise CheckpointError(
            f"{OPTIMIZER_FILE} in {str(path)!r} has parameter groups of sizes {sizes}, this run's optimizer "
            f"{[len(g['params']) for g in optimizer.param_groups]}; resume with the same model and optimizer"
        )
    by_name = {
        "state": {order[i]: state for i, state in saved["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=full)


# ---- deepspeed: the engine's own ZeRO shards ----------------------------------------------------------
class DeepSpeedLayout:
    name = "deepspeed"

    def __init__(self, adapter: bool = False) -> None:
        self.adapter = adapter

    def save(self, backend, path: Path, model, optimizer) -> None:
        # every rank writes its ZeRO shard into checkpoint-STEP/deepspeed/; tuneforge keeps its own `latest`
        # an adapter run: the weights that train only (the frozen base comes from its model folder)
        model.save_checkpoint(str(path), tag=DEEPSPEED_DIR, save_latest=False, exclude_frozen_parameters=self.adapter)

    def refusal(self, backend, path: Path, written_by: str | None, *, adapter: bool = False) -> str | None:
        folder = Path(path) / DEEPSPEED_DIR
        if not folder.is_dir():
            return (
                f"checkpoint {str(path)!r} holds no DeepSpeed state ({DEEPSPEED_DIR}/); backend 'deepspeed' resumes "
                f"only its own checkpoints: resume with the backend that wrote it{new_run_hint(adapter)}"
            )
        # ZeRO-3 partitions the weights: each rank writes zero_pp_rank_R_mp_rank_00_model_states.pt, where stages 1
        # and 2 (which load each other's) write one mp_rank_00_model_states.pt
        written_stage3 = any(folder.glob("zero_pp_rank_*_model_states.pt"))
        stage = backend.options.zero_stage
        if written_stage3 == (stage == 3):
            return None
        return (
            f"DeepSpeed checkpoint {str(path)!r} was written with ZeRO stage {3 if written_stage3 else '1 or 2'}, "
            f"this run has stage {stage}, and DeepSpeed loads a stage 3 checkpoint on stage 3 only; resume with "
            f"--zero-stage {3 if written_stage3 else 2}{new_run_hint(adapter)}"
        )

    def load(self, backend, path: Path, model, optimizer) -> None:
        folder = Path(path) / DEEPSPEED_DIR
        refused = self.refusal(backend, path, None, adapter=self.adapter)
        if refused:
            raise CheckpointError(refused)
        shards = len(list(folder.glob("*optim_states.pt")))
        if optimizer is not None and shards and shards != backend.dp_size:
            raise CheckpointError(
                f"DeepSpeed checkpoint {str(path)!r} holds {shards} ZeRO shards, this run has {backend.dp_size} "
                f"process{'es' if backend.dp_size > 1 else ''}; "
                f"resume with --nproc {shards}{new_run_hint(self.adapter)}"
            )
        loaded, _ = model.load_checkpoint(
            str(path),
            tag=DEEPSPEED_DIR,
            load_optimizer_states=optimizer is not None,
            load_lr_scheduler_states=False,
            load_module_strict=not self.adapter,
        )
        if loaded is None:
            raise CheckpointError(
                f"DeepSpeed could not load checkpoint {str(path)!r}; resume from an earlier checkpoint-STEP folder"
            )

    @staticmethod
    def read_weights(path: Path, backend_name: str) -> dict[str, torch.Tensor]:
        """Consolidated fp32 weights of a checkpoint folder, without a process group (`tuneforge export`)."""
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        if not (Path(path) / DEEPSPEED_DIR).is_dir():
            raise CheckpointError(f"checkpoint {str(path)!r} holds no DeepSpeed state ({DEEPSPEED_DIR}/)")
        return get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DEEPSPEED_DIR)


LAYOUTS = {"full": FullLayout, "dcp": DCPLayout, "deepspeed": DeepSpeedLayout}


def layout_for(kind: str, adapter: bool = False):
    """The layout a backend of checkpoint kind `kind` writes; `adapter`: a run that trains adapters only."""
    if kind == "full":
        return AdapterLayout() if adapter else FullLayout()
    return LAYOUTS[kind](adapter=adapter)


def read_weights(kind: str, path: Path, backend_name: str) -> dict[str, torch.Tensor]:
    """The full model weights (CPU) of a checkpoint folder written in layout `kind`, without a process group."""
    return LAYOUTS[kind].read_weights(Path(path), backend_name)
