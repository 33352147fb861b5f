"""Tensor-parallel styles for GPT-2's Conv1D (used by tp.py; a module of its own because
`torch.distributed.tensor` takes seconds to import, which only a tp run should pay)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


# ---- styles for GPT-2's Conv1D (a Linear whose weight is stored transposed: (in, out)) --------
def _shard_conv1d(module: nn.Module, mesh, weight: Placement, bias: Placement) -> None:
    for name, placement in (("weight", weight), ("bias", bias)):
        param = getattr(module, name)  # a frozen weight (--freeze-layers) stays frozen
        sharded = nn.Parameter(distribute_tensor(param, mesh, [placement]), requires_grad=param.requires_grad)
        module.register_parameter(name, sharded)


class Conv1DColwise(ColwiseParallel):
    def _apply(self, module, mesh):
        return distribute_module(
            module,
            mesh,
            lambda name, mod, mesh: _shard_conv1d(mod, mesh, Shard(1), Shard(0)),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Conv1DRowwise(RowwiseParallel):
    def _apply(self, module, mesh):
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            mesh,
            lambda name, mod, mesh: _shard_conv1d(mod, mesh, Shard(0), Replicate()),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class FusedQKVColwise(Conv1DColwise):
    """GPT-2's c_attn computes [q | k | v] in one matmul. A plain column shard would give rank 0
    all of q and part of k, so the output is all-gathered and each rank keeps its heads of q, k
    and v. The weight keeps its HF layout: checkpoints and the export need no conversion and
    reshard freely (the cost: one activation all-gather per layer)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, mesh):
        # backward: each rank's gradient covers only its own heads; Partial sums them (reduce-scatter)
        full = outputs.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
        rank, size = mesh.get_local_rank(), mesh.size()
        return torch.cat([part.chunk(size, dim=-1)[rank] for part in full.chunk(3, dim=-1)], dim=-1)
