"""The one small interface between the Trainer and a parallelism engine.

The Trainer names no backend. It calls, in order:

    backend = get_backend(config, launch.dist_env())  # the class named by config.backend
    backend.check(model_config)                       # config-time checks (also in the launching parent)
    backend.setup()                                   # process group, device
    model, optimizer = backend.wrap(model, make_optimizer)  # make_optimizer None: evaluation only
    with backend.micro_step(model, sync=is_last_micro):  # the one place gradient sync is decided
        with backend.autocast(): outputs = ...        # per micro-batch
        backend.backward(loss, model)
    grad_norm = backend.step(model, optimizer, loss)  # clip, step, zero_grad; NonFiniteStep: nan/inf, no update
    backend.reduce_sum(t) / backend.gather_objects(x) # exact metrics across data-parallel ranks
    backend.save(dir, model, optimizer) / backend.load(dir, model, optimizer)
    backend.full_state_dict(model)                    # consolidated weights for the HF export
    Backend.read_weights(checkpoint_dir)              # classmethod: offline, for `tuneforge export`
    backend.teardown()

The Backend owns the process group, the device, wrapping (and sharding) the model, the gradient sync
seam and the step, and the collectives. Beside it, as Fabric's Strategy has its plugins, it holds two
parts it delegates to: `backend.precision_plugin` (backends/precision.py: autocast, fp16's grad scaler,
the precisions it refuses, the attention kernel for `auto`; `backend.precision` is its name) and
`backend.layout` (backends/layouts.py: the files its checkpoints hold, an adapter run's included, and
reading their weights offline). A backend class names their kinds: `precision_type`, `checkpoint_layout`.

A backend lives in `tuneforge/backends/<name>.py` and exposes a subclass named `BACKEND`. Its own
settings are its `Options` (a pydantic model): they become `config.backend_options`, flat config
keys (`zero_stage: 3`) and CLI flags (`--zero-stage`) without naming the backend anywhere else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tuneforge.backends import layouts
from tuneforge.backends.precision import Precision, cpu_has_native_bf16, resolve_precision
from tuneforge.errors import ConfigError
from tuneforge.options import BackendOptions
from tuneforge.weights import share_tied

__all__ = ["Backend", "MakeOptimizer", "NonFiniteStep", "cpu_has_native_bf16", "detect_device", "resolve_precision"]

MakeOptimizer = Callable[[torch.nn.Module], torch.optim.Optimizer]


class NonFiniteStep(Exception):
    """An optimizer step whose loss or gradients were nan/inf on some rank (every rank raises it together).

    `what`: "loss" or "gradients". `applied`: the engine updated the weights anyway (they cannot be trusted);
    otherwise nothing was updated and the gradients are zeroed, so the run may go on."""

    def __init__(self, what: str, applied: bool = False) -> None:
        super().__init__(f"non-finite {what}")
        self.what, self.applied = what, applied


def detect_device(local_rank: int = 0) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


class Backend:
    """Single-process defaults; distributed backends override what differs.

    `env` is the process's place in a launched world (`launch.DistEnv`: launched, rank,
    world_size, local_rank); a backend never reads the environment itself.
    """

    name = "base"
    distributed = False
    sharded = False  # weights/optimizer saved per rank (fsdp, deepspeed zero-3, tp)
    supports_gradient_checkpointing = True
    supported_precisions = ("fp32", "bf16", "fp16")
    precision_type: type[Precision] = Precision  # autocast, grad scaler, refusals (backends/precision.py)
    checkpoint_layout = "full"  # model.safetensors + optimizer.pt, written by the main rank (backends/layouts.py)
    supports_adapters = True  # --adapter lora: the adapters train, every base weight is fixed
    supports_quantized_base = True  # --quantize 4bit: each rank holds the whole packed 4-bit model
    Options: type[BackendOptions] = BackendOptions

    def __init__(self, config, env) -> None:
        self.config = config
        self.env = env
        # the config validated them for its backend; a config made for another backend gives the defaults
        options = config.backend_options
        self.options = options if isinstance(options, self.Options) else self.Options()
        self.rank = 0
        self.world_size = 1
        self.local_rank = 0
        self.device = torch.device("cpu")
        self.precision_plugin = self.precision_type(config.precision, self.name, self.supported_precisions)
        # an adapter run's checkpoints hold the weights that train; the base comes from its model folder
        self.layout = layouts.layout_for(self.checkpoint_layout, adapter=config.adapter != "none")

    @property
    def precision(self) -> str:
        """The precision this run computes in ("auto" resolved in setup)."""
        return self.precision_plugin.name

    @classmethod
    def usable(cls) -> str:
        """'usable', or 'unusable: why' (shown by `tuneforge env`)."""
        if not cls.distributed:
            return "usable"
        if not dist.is_available():
            return "unusable: this torch build has no torch.distributed"
        if torch.cuda.is_available() and not dist.is_nccl_available():
            return "unusable: CUDA is present but this torch build has no NCCL"
        if not torch.cuda.is_available() and not dist.is_gloo_available():
            return "unusable: this torch build has no gloo backend for CPU"
        return "usable"

    # ---- lifecycle ------------------------------------------------------------------------
    def check(self, model_config=None) -> None:
        """Config-time checks, before any work (also run once by the launching parent, before any
        worker starts). `model_config`: the model's HF config where it is cheaply known, else None."""
        self.precision_plugin.check_requested()

    def setup(self) -> None:
        if self.distributed:
            self._init_process_group()
        self.device = detect_device(self.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.precision_plugin.setup(self.device)

    def _init_process_group(self) -> None:
        if not dist.is_initialized():
            pg = "nccl" if torch.cuda.is_available() else "gloo"
            if not self.env.launched:
                # no launcher (nproc 1): a world of one, no port needed; a sharded checkpoint still loads
                dist.init_process_group(backend=pg, store=dist.HashStore(), rank=0, world_size=1)
            elif self.env.missing:
                # RANK and WORLD_SIZE say a launcher started this process, so it launches nothing (--nproc neither)
                raise ConfigError(
                    f"RANK={self.env.rank} and WORLD_SIZE={self.env.world_size} are set, as a launcher sets them, but "
                    f"{' and '.join(self.env.missing)} not, so backend {self.name!r} cannot meet the other ranks and "
                    "tuneforge starts no workers of its own (whatever --nproc says): unset RANK and WORLD_SIZE (left "
                    "in this shell?) to run alone or with --nproc N, or start it under torchrun/Slurm"
                )
            else:
                try:
                    dist.init_process_group(backend=pg)  # the launcher's rendezvous (env://)
                except dist.DistNetworkError as err:  # MASTER_PORT taken, MASTER_ADDR unreachable
                    from tuneforge.launch import rendezvous_failed

                    raise rendezvous_failed(err) from None
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = self.env.local_rank if self.env.launched else 0

    def teardown(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    # ---- data-parallel geometry (tp overrides: ranks of one tp group share data) -----------
    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def dp_size(self) -> int:
        return self.world_size

    # ---- model ----------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module, make_optimizer: MakeOptimizer | None = None):
        """Place (and wrap, shard) the model; returns (model, optimizer), the optimizer None without make_optimizer."""
        model.to(self.device)
        return model, make_optimizer(model) if make_optimizer else None

    def default_attention(self, padded: bool = True) -> str | None:
        """The attention kernel `attn_implementation: auto` trains with: the precision's choice."""
        return self.precision_plugin.default_attention(padded)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return getattr(model, "module", model)

    def holds_whole_model(self) -> bool:
        """Whether every rank holds all of the model's weights, so a forward pass needs no other rank: what a task
        that generates while it trains (GRPO) needs of a backend. Sharded backends split the weights."""
        return not self.sharded

    def refuses_repeated_gradients(self) -> str | None:
        """Why a weight's gradient may not arrive more than once in one backward (a task that runs the model again
        inside its backward: `Task.reruns_in_backward`), or None where gradients accumulate, as here."""
        return None

    def autocast(self):
        """The autocast context of this run's precision on its device (none where the engine casts)."""
        return self.precision_type.autocast_for(self.precision, self.device)

    def generate(self, model: torch.nn.Module, **kwargs: Any) -> torch.Tensor:
        """`generate` on the unwrapped model under this run's autocast. Sharded weights (FSDP, ZeRO-3, tp)
        are gathered inside each forward, so on more than one rank all ranks take the same number of
        decoding steps (`synced_gpus`: the ones that finish early keep stepping)."""
        with self.autocast():
            return self.unwrap(model).generate(synced_gpus=self.sharded and self.world_size > 1, **kwargs)

    def micro_step(self, model: torch.nn.Module, sync: bool):
        """Entered once per micro-batch around forward, loss and backward: the one place that
        decides whether this micro-batch's gradients are synchronised across ranks (`sync`: the
        last micro-batch of an optimizer step). One process: nothing to decide."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, model: torch.nn.Module) -> None:
        self.precision_plugin.scale(loss).backward()

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def step(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Clip, step and zero the gradients. Returns the pre-clip grad norm (a tensor).

        Raises NonFiniteStep, with nothing updated and the gradients zeroed, when `loss` (this rank's) or the
        gradients are nan/inf on any rank. Under fp16's GradScaler an overflowing gradient is the scaler's to
        skip (it lowers the scale and goes on), not a failure: there only the loss is checked."""
        max_norm, precision = self.config.optim.max_grad_norm, self.precision_plugin
        precision.unscale(optimizer)
        norm = self.clip_grad_norm(model, max_norm) if max_norm else None
        grads = None if precision.skips_overflow else norm if norm is not None else self.largest_grad(model)
        bad = self.nonfinite(loss, grads)
        if bad:
            optimizer.zero_grad(set_to_none=True)
            precision.close_skipped_step()
            raise NonFiniteStep(bad)
        precision.optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return norm

    def largest_grad(self, model: torch.nn.Module) -> torch.Tensor | None:
        """The largest |gradient| of this rank's (local shard of the) gradients: nan/inf when any is (no clip
        norm to read it from)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # a DTensor's shard: no collective
        grads = [g for g in grads if g.numel()]  # a rank's shard of a small tensor may be empty
        return torch.nn.utils.get_total_norm(grads, norm_type=float("inf")) if grads else None

    def nonfinite(self, loss: torch.Tensor | None, grads: torch.Tensor | None) -> str | None:
        """'loss' or 'gradients' when that tensor is nan/inf on any rank, else None: every rank gets the same
        answer from one all-reduce of two flags (sharded and tensor-parallel ranks hold different parts)."""
        zero = torch.zeros((), device=self.device)
        flags = torch.stack(
            [(~torch.isfinite(t.detach().float())).any().float() if t is not None else zero for t in (loss, grads)]
        )
        if self.distributed and self.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        loss_bad, grads_bad = flags.tolist()
        return "loss" if loss_bad else "gradients" if grads_bad else None

    # ---- collectives over data-parallel replicas -------------------------------------------
    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed and self.dp_size > 1:
            tensor = tensor.clone()
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.dp_group)
        return tensor

    @property
    def dp_group(self):
        return None  # the default (world) group

    def gather_objects(self, obj: Any) -> list[Any]:
        if not (self.distributed and self.dp_size > 1):
            return [obj]
        out: list[Any] = [None] * self.dp_size
        dist.all_gather_object(out, obj, group=self.dp_group)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.barrier()

    # ---- state ----------------------------------------------------------------------------
    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Consolidated full weights on the main rank (None elsewhere), on CPU."""
        if not self.is_main:
            return None
        # a copy even on CPU (`.cpu()` would alias the live parameters): the best-model snapshot must not move
        module = self.unwrap(model)
        copies = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
        # each name was copied on its own: tied weights (lm_head = embeddings) share one tensor again, so
        # save_pretrained writes them once, as it does for the model itself
        return share_tied(copies, module)

    def save(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Write model + optimizer (+ scaler) state into the checkpoint folder `path` (its layout's files)."""
        self.layout.save(self, path, model, optimizer)
        if self.is_main:
            self.precision_plugin.save(path)

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.layout.load(self, path, model, optimizer)
        self.precision_plugin.load(path)

    @classmethod
    def read_weights(cls, path: Path) -> dict[str, torch.Tensor]:
        """The full model weights (CPU) of a checkpoint folder this backend wrote, read without a
        process group (`tuneforge export`), the way its checkpoint layout lies on disk."""
        return layouts.read_weights(cls.checkpoint_layout, Path(path), cls.name)
