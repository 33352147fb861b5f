"""Tensor parallel: each transformer block's matmuls are split across the ranks of a tp group.

Megatron layout with `torch.distributed.tensor.parallel.parallelize_module`: q/k/v and MLP
up-projections column-wise (each rank computes its own attention heads and its slice of the
MLP), attention-output and MLP down-projections row-wise (partial sums, all-reduced). The
attention modules are told their per-rank head counts. Embeddings, norms and heads stay
replicated. Plans exist for BERT-family, GPT-2 and Llama-family models.

With world size > tp size the ranks form a 2-D mesh ("dp", "tp"): ranks of one tp group see
the same batches; gradients are averaged over the "dp" axis once per optimizer step, at the end
of the last micro-batch (`micro_step`, the sync seam every backend has), and metrics are reduced
over "dp" only. Checkpoints are per-rank DCP shards (the `dcp` layout, backends/layouts.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn

from tuneforge.backends._sharded import ShardedBackend, local_tensor, transformer_blocks
from tuneforge.backends.base import MakeOptimizer
from tuneforge.errors import ConfigError
from tuneforge.options import BackendOptions


# ---- plans (module names inside one transformer block) ------------------------------------------
@dataclass(frozen=True)
class Plan:
    family: str
    attention: str  # the attention module: its head counts become per-rank counts
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    fused_qkv: tuple[str, ...] = ()
    conv1d: bool = False  # transformers' Conv1D (GPT-2) instead of nn.Linear

    def styles(self) -> dict:
        """{module name: ParallelStyle}. torch.distributed.tensor is imported here, when tp runs: it takes seconds."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from tuneforge.backends._tp_styles import Conv1DColwise, Conv1DRowwise, FusedQKVColwise

        colwise, rowwise = (Conv1DColwise, Conv1DRowwise) if self.conv1d else (ColwiseParallel, RowwiseParallel)
        return {
            **{name: FusedQKVColwise() for name in self.fused_qkv},
            **{name: colwise() for name in self.colwise},
            **{name: rowwise() for name in self.rowwise},
        }


BERT = Plan(
    "BERT-family",
    "attention.self",
    colwise=("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"),
    rowwise=("attention.output.dense", "output.dense"),
)
GPT2 = Plan(
    "GPT-2",
    "attn",
    colwise=("mlp.c_fc",),
    rowwise=("attn.c_proj", "mlp.c_proj"),
    fused_qkv=("attn.c_attn",),
    conv1d=True,
)
LLAMA = Plan(
    "Llama-family",
    "self_attn",
    colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    rowwise=("self_attn.o_proj", "mlp.down_proj"),
)
PLANS = {
    "bert": BERT,
    "roberta": BERT,
    "xlm-roberta": BERT,
    "camembert": BERT,
    "electra": BERT,
    "gpt2": GPT2,
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
}
# attributes of HF attention modules that hold head counts (or sizes derived from them)
HEAD_ATTRS = ("num_attention_heads", "num_heads", "num_key_value_heads", "all_head_size", "split_size")


def plan_for(model_config) -> Plan:
    model_type = getattr(model_config, "model_type", None)
    if model_type not in PLANS:
        families = {p.family: sorted(t for t, q in PLANS.items() if q is p) for p in PLANS.values()}
        supported = "; ".join(f"{fam} ({', '.join(types)})" for fam, types in families.items())
        raise ConfigError(
            f"backend 'tp' has no tensor-parallel plan for model type {model_type!r} (plans: {supported}); "
            "use --backend fsdp or ddp for this model"
        )
    return PLANS[model_type]


def mlp_width(model_config) -> int | None:
    """The MLP's inner size, which the column-wise up-projections split (GPT-2: n_inner, None meaning 4 x n_embd)."""
    if getattr(model_config, "model_type", None) == "gpt2":
        return model_config.n_inner or 4 * model_config.n_embd
    return getattr(model_config, "intermediate_size", None)


def check_split_sizes(model_config, tp_size: int) -> None:
    """Every split size must divide evenly: a row-wise layer takes its input as equal shards."""
    heads = getattr(model_config, "num_attention_heads", None)
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    width = mlp_width(model_config)
    sizes = ((heads, "attention heads"), (kv_heads, "key/value heads"), (width, "MLP units (intermediate size)"))
    for count, what in sizes:
        if count and count % tp_size:
            fits = [d for d in range(1, count + 1) if all(c % d == 0 for c, _ in sizes if c)]
            raise ConfigError(
                f"--tp-size {tp_size} does not divide the model's {count} {what}; use a tp size among {fits}"
            )


def check_world(tp_size: int, world_size: int) -> None:
    if world_size % tp_size:
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(
            f"--tp-size {tp_size} does not divide the world size {world_size} (all processes); "
            f"use a tp size among {fits}"
        )


class TPOptions(BackendOptions):
    tp_size: int | None = Field(
        None, gt=0, le=4096, description="processes per tensor-parallel group (default: all); the rest is data parallel"
    )


class TPBackend(ShardedBackend):
    name = "tp"
    Options = TPOptions
    # peft's LoRA layers replace the linear modules the tensor-parallel plan shards by name
    supports_adapters = False

    def __init__(self, config, env) -> None:
        super().__init__(config, env)
        self.mesh = None  # ("dp", "tp") DeviceMesh, built in setup

    # ---- checks: in the launching process too, so a bad input is one line before any worker --
    def check(self, model_config=None) -> None:
        """`model_config`: where known before the model loads; otherwise the checks wait for wrap()."""
        super().check(model_config)
        world = self.config.nproc * self.config.nnodes
        tp_size = self.options.tp_size or world
        if not self.env.launched and not self.config.hostfile:
            check_world(tp_size, world)
        if model_config is not None:
            plan_for(model_config)
            check_split_sizes(model_config, tp_size)

    def setup(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        super().setup()
        tp_size = self.options.tp_size or self.world_size
        check_world(tp_size, self.world_size)
        self.mesh = init_device_mesh(
            self.device.type, (self.world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp")
        )

    # ---- data-parallel geometry: the "dp" axis of the mesh ------------------------------------
    @property
    def tp_size(self) -> int:
        return self.mesh["tp"].size()

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()

    @property
    def dp_group(self):
        return self.mesh.get_group("dp")

    # ---- model ----------------------------------------------------------------------------------
    def wrap(self, model: nn.Module, make_optimizer: MakeOptimizer | None = None):
        from torch.distributed.tensor.parallel import parallelize_module

        plan = plan_for(model.config)
        check_split_sizes(model.config, self.tp_size)
        model.to(self.device)
        tp_mesh = self.mesh["tp"]
        for block in transformer_blocks(model):
            names = {n for n, _ in block.named_modules()}
            missing = [n for n in (*plan.fused_qkv, *plan.colwise, *plan.rowwise, plan.attention) if n not in names]
            if missing:
                raise ConfigError(
                    f"backend 'tp': {type(block).__name__} has no {missing[0]!r}, which the {plan.family} plan "
                    "splits; use --backend fsdp or ddp for this model"
                )
            parallelize_module(block, tp_mesh, plan.styles())
            attention = block.get_submodule(plan.attention)
            for attr in HEAD_ATTRS:  # each rank runs num_heads / tp of the heads
                if isinstance(getattr(attention, attr, None), int):
                    setattr(attention, attr, getattr(attention, attr) // self.tp_size)
        optimizer = make_optimizer(model) if make_optimizer else None  # None for evaluation only
        if optimizer is not None:
            _step_one_by_one(optimizer)
        return model, optimizer

    def load(self, path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        super().load(path, model, optimizer)
        if optimizer is not None:
            _step_one_by_one(optimizer)  # a loaded state brings back the flags of the run that saved it

    @contextlib.contextmanager
    def micro_step(self, model: nn.Module, sync: bool):
        """Ranks of one tp group compute the same gradients; the "dp" replicas average theirs once their
        last micro-batch's backward is done (`sync`), before `step`."""
        yield
        if sync and self.dp_size > 1:
            self._average_grads_over_dp(model)

    def _average_grads_over_dp(self, model: nn.Module) -> None:
        grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce for all gradients
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.dp_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Sharded gradients' squared norms are summed over the tp group, replicated ones counted once."""
        from torch.distributed.tensor import DTensor

        sharded, replicated = [], []
        for p in model.parameters():
            if p.grad is None:
                continue
            is_shard = isinstance(p.grad, DTensor) and any(pl.is_shard() for pl in p.grad.placements)
            (sharded if is_shard else replicated).append(local_tensor(p.grad))
        zero = torch.zeros((), device=self.device)
        sharded_sq = sum((g.float().pow(2).sum() for g in sharded), zero)
        dist.all_reduce(sharded_sq, group=self.mesh.get_group("tp"))
        total = (sharded_sq + sum((g.float().pow(2).sum() for g in replicated), zero)).sqrt()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in sharded + replicated:
            g.mul_(scale.to(g.dtype))
        return total


def _step_one_by_one(optimizer: torch.optim.Optimizer) -> None:
    """Fused/foreach kernels take one list of same-kind tensors, but here split (DTensor) and
    replicated (plain) parameters share parameter groups: the optimizer steps them one by one."""
    for group in optimizer.param_groups:
        for flag in ("fused", "foreach"):
            if group.get(flag):
                group[flag] = False


BACKEND = TPBackend
