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

from tuneforge.adapters import TRAINABLE_FILE, trainable_state
from tuneforge.backends.options import BackendOptions
from tuneforge.errors import CheckpointError, ConfigError

MakeOptimizer = Callable[[torch.nn.Module], torch.optim.Optimizer]


class NonFiniteStep(Exception):
    """An optimizer step whose loss or gradients were nan/inf on some rank (every rank raises it together).

    `what`: "loss" or "gradients". `applied`: the engine updated the weights anyway (they cannot be trusted);
    otherwise nothing was updated and the gradients are zeroed, so the run may go on."""

    def __init__(self, what: str, applied: bool = False) -> None:
        super().__init__(f"non-finite {what}")
        self.what, self.applied = what, applied


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto' → bf16 where the hardware does it natively, fp16 on older CUDA, else fp32."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if device.type == "cpu":
        return "bf16" if cpu_has_native_bf16() else "fp32"  # bf16 autocast without it is slower than fp32
    return "fp32"


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls in hardware. (torch has no public query for these two.)"""
    return (
        getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
        or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    )


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
    checkpoint_layout = "full"  # model.safetensors + optimizer.pt, written by the main rank
    supports_adapters = True  # --adapter lora: the adapters train, every base weight is fixed
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
        self.precision = "fp32"
        self.scaler: torch.amp.GradScaler | None = None

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

    def setup(self) -> None:
        if self.distributed:
            self._init_process_group()
        self.device = detect_device(self.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.precision = resolve_precision(self.config.precision, self.device)
        self.check_precision()
        if self.precision == "fp16" and self.device.type == "cuda":
            self.scaler = torch.amp.GradScaler("cuda")

    def check_precision(self) -> None:
        if self.precision not in self.supported_precisions:
            raise ConfigError(
                f"backend {self.name!r} does not support precision {self.precision!r}; "
                f"use one of: {', '.join(self.supported_precisions)}"
            )
        if self.precision == "fp16" and self.device.type == "cpu":
            raise ConfigError("precision fp16 needs a CUDA GPU; on CPU use --precision bf16 or fp32")

    def _init_process_group(self) -> None:
        if not dist.is_initialized():
            pg = "nccl" if torch.cuda.is_available() else "gloo"
            if not self.env.launched:
                # no launcher (nproc 1): a world of one, no port needed; a sharded checkpoint still loads
                dist.init_process_group(backend=pg, store=dist.HashStore(), rank=0, world_size=1)
            elif self.env.missing:
                raise ConfigError(
                    f"backend {self.name!r} needs a distributed launch ({', '.join(self.env.missing)} unset); "
                    "run with --nproc N, or under torchrun/Slurm"
                )
            else:
                dist.init_process_group(backend=pg)  # the launcher's rendezvous (env://)
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
        """The attention kernel `attn_implementation: auto` trains with (None: the model's own default).

        Under bf16 autocast on CPU with padded batches, eager attention: torch's CPU SDPA kernel with a
        padding mask is slower there, forward + backward (benchmarks/cpu_step_kernels.py). Unpadded
        (packed causal LM) batches need no mask and SDPA's causal kernel is the faster one
        (benchmarks/README.md, causal LM). In fp32 SDPA is not slower, and on GPUs it is the fast one."""
        return "eager" if self.device.type == "cpu" and self.precision == "bf16" and padded else None

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return getattr(model, "module", model)

    def autocast(self):
        if self.precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
            return torch.autocast(self.device.type, dtype=dtype)
        return contextlib.nullcontext()

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
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def step(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Clip, step and zero the gradients. Returns the pre-clip grad norm (a tensor).

        Raises NonFiniteStep, with nothing updated and the gradients zeroed, when `loss` (this rank's) or the
        gradients are nan/inf on any rank. Under fp16's GradScaler an overflowing gradient is the scaler's to
        skip (it lowers the scale and goes on), not a failure: there only the loss is checked."""
        max_norm = self.config.optim.max_grad_norm
        if self.scaler:
            self.scaler.unscale_(optimizer)
        norm = self.clip_grad_norm(model, max_norm) if max_norm else None
        grads = None if self.scaler else norm if norm is not None else self.largest_grad(model)
        bad = self.nonfinite(loss, grads)
        if bad:
            optimizer.zero_grad(set_to_none=True)
            if self.scaler:
                self.scaler.update()  # unscale_ was called: the scaler must close this step
            raise NonFiniteStep(bad)
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
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
        return {k: v.detach().to("cpu", copy=True) for k, v in self.unwrap(model).state_dict().items()}

    @property
    def trains_adapter(self) -> bool:
        """An adapter run: checkpoints hold the weights that train, the base comes from its model folder."""
        return self.config.adapter != "none"

    def save(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Write model + optimizer (+ scaler) state into the checkpoint folder `path`."""
        from safetensors.torch import save_file, save_model

        if self.is_main:
            if self.trains_adapter:
                save_file(trainable_state(self.unwrap(model)), str(path / TRAINABLE_FILE))
            else:
                save_model(self.unwrap(model), str(path / "model.safetensors"))
            torch.save(optimizer.state_dict(), path / "optimizer.pt")
            if self.scaler:
                torch.save(self.scaler.state_dict(), path / "scaler.pt")

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        from safetensors.torch import load_model

        if self.trains_adapter:
            load_trainable(self.unwrap(model), path, self.device)
        else:
            load_model(self.unwrap(model), str(path / "model.safetensors"), device=str(self.device))
        if optimizer is not None:
            optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=self.device, weights_only=True))
        if self.scaler and (path / "scaler.pt").exists():
            self.scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=True))

    @classmethod
    def read_weights(cls, path: Path) -> dict[str, torch.Tensor]:
        """The full model weights (CPU) of a checkpoint folder this backend wrote, read without a
        process group (`tuneforge export`). Here: model.safetensors (single, ddp)."""
        from safetensors.torch import load_file

        weights = Path(path) / "model.safetensors"
        if not weights.is_file():
            raise CheckpointError(
                f"checkpoint {str(path)!r} (backend {cls.name!r}) holds no weights tuneforge can read: "
                "no model.safetensors"
            )
        return load_file(str(weights))


def load_trainable(model: torch.nn.Module, path: Path, device: torch.device) -> None:
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
