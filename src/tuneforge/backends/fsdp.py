"""FSDP2: parameters, gradients and optimizer state sharded across ranks (`fully_shard`).

Each transformer block is its own FSDP unit (its weights are all-gathered just before it runs
and freed after), then the root takes the rest (embeddings, head). Gradients are
reduce-scattered and averaged over ranks; the Trainer scales each rank's summed loss by
dp_size / global item count, so that average is the gradient of the global mean loss.

- bf16: a MixedPrecisionPolicy (bf16 compute and all-gather, fp32 gradient reduction and fp32
  master weights), from its precision (`NoAutocastPrecision`: no autocast); fp16 is refused (it
  would need a sharded grad scaler): use bf16.
- Gradient accumulation: gradient sync (reduce-scatter) only on the last micro-batch.
- Checkpoints: per-rank DCP shards (the `dcp` layout, backends/layouts.py), reshardable to another world size;
  the HF export gathers full weights to rank 0 on CPU.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tuneforge.backends._sharded import ShardedBackend, transformer_blocks
from tuneforge.backends.base import MakeOptimizer
from tuneforge.backends.precision import NoAutocastPrecision
from tuneforge.errors import ConfigError


class FSDPBackend(ShardedBackend):
    name = "fsdp"
    precision_type = NoAutocastPrecision  # the MixedPrecisionPolicy casts parameters and inputs

    @classmethod
    def usable(cls) -> str:
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            return (
                f"unusable: torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.fully_shard); use "
                "torch 2.6 or newer"
            )
        return super().usable()

    def wrap(self, model: nn.Module, make_optimizer: MakeOptimizer | None = None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        blocks = transformer_blocks(model)
        if not blocks:
            raise ConfigError(
                f"backend 'fsdp' found no transformer blocks in {type(model).__name__}; use --backend ddp"
            )
        model.to(self.device)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        policy = self.precision_plugin.mixed_precision_policy()
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        # the optimizer holds the sharded parameters: each rank steps its own shard
        return model, make_optimizer(model) if make_optimizer else None

    def micro_step(self, model: nn.Module, sync: bool):
        model.set_requires_gradient_sync(sync)  # no reduce-scatter on accumulation micro-batches
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        # the gradients are DTensors on one mesh: torch computes the norm over all shards
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm


BACKEND = FSDPBackend
