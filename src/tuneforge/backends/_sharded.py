"""What the DTensor backends (fsdp, tp) share: the process group, the transformer blocks, no fp16
(`ShardedPrecision`), consolidated weights for the HF export, and sharded checkpoints (the `dcp` layout
of backends/layouts.py: written by every rank, resumed with resharding, read offline for `tuneforge
export`; a single/ddp checkpoint loads too)."""

from __future__ import annotations

import torch
from torch import nn

from tuneforge.backends.base import Backend
from tuneforge.backends.precision import ShardedPrecision
from tuneforge.weights import share_tied


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
    precision_type = ShardedPrecision
    supports_quantized_base = False  # sharding would split the packed 4-bit weights
    checkpoint_layout = "dcp"  # sharded/: torch.distributed.checkpoint, every rank writes its shards

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
        # on CPU a replicated (plain) parameter, and any shard of a world of one, comes back as the live tensor
        # itself: copied, so the best-model snapshot does not move with the training
        live = {local_tensor(t).data_ptr() for t in (*model.parameters(), *model.buffers())}
        copies = {k: v.detach().clone() if v.data_ptr() in live else v.detach() for k, v in full.items()}
        # each name was gathered on its own: tied weights (lm_head = embeddings) share one tensor
        # again, so save_pretrained writes them once, as it does for an unsharded model
        return share_tied(copies, model)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's local shard
