"""DistributedDataParallel: every rank holds the whole model; gradients are averaged.

gloo on CPU, NCCL on CUDA. On gradient-accumulation micro-steps forward and backward run
under `no_sync()` (DDP arms its all-reduce in the forward, so wrapping only the backward would
still sync), so gradients are all-reduced once per optimizer step. DDP *averages* gradients
over ranks; the Trainer scales each rank's summed loss by dp_size / global item count, so the
average equals the gradient of the global mean loss (exact parity with one process).

Checkpoints are the single-process layout: the main rank writes model.safetensors and
optimizer.pt (replicas are identical), every rank loads them.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.nn.parallel import DistributedDataParallel

from tuneforge.backends.base import Backend, MakeOptimizer
from tuneforge.errors import ConfigError

# keep the start-up broadcast of buffers, not the one before every forward (DDPBackend.wrap)
NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


class DDPBackend(Backend):
    name = "ddp"
    distributed = True

    def check(self, model_config=None) -> None:
        super().check(model_config)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus and self.config.nproc > gpus and not self.config.hostfile:
            raise ConfigError(
                f"--nproc {self.config.nproc} is more than the {gpus} GPU(s) here; "
                f"NCCL needs one GPU per process: use --nproc {gpus} or less (or CUDA_VISIBLE_DEVICES= to run "
                f"gloo ranks on the CPU)"
            )

    def wrap(self, model: torch.nn.Module, make_optimizer: MakeOptimizer | None = None):
        model.to(self.device)
        # the optimizer sees the plain module: parameter names and optimizer.pt match `single`
        optimizer = make_optimizer(model) if make_optimizer else None
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # buffers are equal on every rank from DDP's start-up broadcast and constant in the transformers models
        # trained here (position and token-type ids, rotary frequencies); broadcasting them again before each
        # forward rewrites them in place, and with torch 2.11 (2.13 keeps their version counters) a step of several
        # forwards before one backward (embedding's split_by_length and GradCache) then fails in backward where the
        # model saved a view of one (BERT's position ids: "modified by an inplace operation", seen on a GPU
        # machine). sentence-transformers' trainer turns it off (ddp_broadcast_buffers=False) for the same error.
        # torch 2.13 names it forward_sync_buffers (broadcast_buffers warns on every run); older torch (a GPU
        # image's) knows only broadcast_buffers
        ddp_model = DistributedDataParallel(model, device_ids=device_ids, **NO_FORWARD_BUFFER_SYNC)
        return ddp_model, optimizer

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def micro_step(self, model: torch.nn.Module, sync: bool):
        # DDP arms its all-reduce in the forward: no_sync spans forward and backward
        return contextlib.nullcontext() if sync else model.no_sync()


BACKEND = DDPBackend
