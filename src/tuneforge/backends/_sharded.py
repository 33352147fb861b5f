"""What the DTensor backends (fsdp, tp) share: the process group, the transformer blocks,
consolidated weights for the HF export, and sharded checkpoints (written, resumed, and read
offline by `read_weights` for `tuneforge export`).

Checkpoint layout (inside the `checkpoint-STEP/` folder the Trainer hands to `save`):

    sharded/            torch.distributed.checkpoint (DCP): model + optimizer, one
                        `__R_0.distcp` file per rank plus `.metadata`; keys are parameter names

DCP stores every tensor with its global shape and each shard's offsets, so `load` reshards:
a checkpoint written by fsdp or tp on N processes loads on M processes, and into either
backend. A single/ddp checkpoint (model.safetensors + optimizer.pt) loads too. The files are
written by every rank, so a multi-node run needs the output dir on a shared filesystem.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from tuneforge.backends.base import Backend
from tuneforge.errors import CheckpointError, ConfigError
from tuneforge.weights import share_tied

SHARDED_DIR = "sharded"


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (BertLayer, GPT2Block, LlamaDecoderLayer, ...) of every layer stack.

    A layer stack is a ModuleList of one class; where the model names its `_no_split_modules`
    (the HF marker of a block), only stacks of those classes count (an encoder-decoder has two).
    """
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    stacks = [
        m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(b) for b in m}) == 1
    ]
    marked = [m for m in stacks if type(m[0]).__name__ in no_split]
    if marked:
        return [block for stack in marked for block in stack]
    return list(max(stacks, key=len)) if stacks else []


class ShardedBackend(Backend):
    """Base of the backends whose parameters are DTensors (sharded across ranks)."""

    distributed = True
    sharded = True
    supported_precisions = ("fp32", "bf16")  # fp16 needs a sharded grad scaler: use bf16

    checkpoint_layout = "dcp"  # sharded/: torch.distributed.checkpoint, every rank writes its shards

    def check(self, model_config=None) -> None:
        if self.config.precision == "fp16":
            raise ConfigError(self._no_fp16())

    def check_precision(self) -> None:
        if self.precision == "fp16" and self.config.precision == "auto":
            self.precision = "fp32"  # a GPU without bf16: "auto" takes the best this backend runs
        if self.precision == "fp16":
            raise ConfigError(self._no_fp16())
        super().check_precision()

    def _no_fp16(self) -> str:
        return f"backend {self.name!r} does not support precision fp16; use --precision bf16 (or fp32)"

    # ---- state ----------------------------------------------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Gathers every shard (a collective: all ranks call it); the main rank gets the weights.

        Other ranks get an empty dict, not None: the Trainer's export gathers again when handed
        None (the best weights of load_best_model_at_end), and a gather on some ranks only hangs.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload: gathered tensors go to CPU and only rank 0 keeps them
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return {}
        # each name was gathered on its own: tied weights (lm_head = embeddings) share one tensor
        # again, so save_pretrained writes them once, as it does for an unsharded model
        return share_tied({k: v.detach() for k, v in full.items()}, model)

    def save(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer, options=self._state_options())
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=Path(path) / SHARDED_DIR)

    def _state_options(self):
        """An adapter run saves and loads the weights that train (the frozen base comes from its model folder)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.trains_adapter, strict=not self.trains_adapter)

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        path = Path(path)
        if (path / SHARDED_DIR / ".metadata").exists():
            self._load_sharded(path / SHARDED_DIR, model, optimizer)
        elif (path / "model.safetensors").exists():
            self._load_full(path, model, optimizer)
        else:
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds neither sharded weights ({SHARDED_DIR}/.metadata) nor "
                "model.safetensors; "
                f"backend {self.name!r} resumes from its own sharded checkpoints or a model.safetensors one"
            )

    @classmethod
    def read_weights(cls, path: Path) -> dict[str, torch.Tensor]:
        """The "model" entries of the DCP shards (all ranks'), read offline with DCP's public API; the
        optimizer entries (2x the weights for Adam) stay on disk. A checkpoint holding
        model.safetensors (resumed from single/ddp, never re-saved) is read as such."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        folder = Path(path) / SHARDED_DIR
        if not (folder / ".metadata").exists():
            return super().read_weights(path)
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

    def _load_full(self, path: Path, model: nn.Module, optimizer) -> None:
        """A single/ddp checkpoint: full weights and a torch optimizer state keyed by position."""
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True)
        weights = share_tied(load_file(str(path / "model.safetensors")), model)  # tied weights are stored once
        set_model_state_dict(model, weights, options=full)
        if optimizer is None:
            return
        saved = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        sizes = [len(g["params"]) for g in saved["param_groups"]]
        if sizes != [len(g["params"]) for g in optimizer.param_groups]:
            raise CheckpointError(
                f"optimizer.pt in {str(path)!r} has parameter groups of sizes {sizes}, this run's optimizer "
                f"{[len(g['params']) for g in optimizer.param_groups]}; resume with the same model and optimizer"
            )
        by_name = {
            "state": {order[i]: state for i, state in saved["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]],
        }
        set_optimizer_state_dict(model, optimizer, by_name, options=full)
