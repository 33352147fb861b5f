"""Precision: what a run computes in, beside the Backend that holds it (as Fabric's precision plugins).

Owns: resolving `--precision auto` for a device, refusing a precision a backend or device cannot run
(fp16 on CPU, fp16 on a sharded backend), the autocast context, fp16's grad scaler (scaling the loss,
unscaling, stepping or closing a skipped step, its `scaler.pt` in a checkpoint), the attention kernel
`attn_implementation: auto` picks for this precision and device, and the 4-bit (QLoRA) loading settings.

A Backend makes one in `__init__` (`backend.precision_plugin`, of its class's `precision_type`) and sets
it up with its device; `backend.precision` (the name) and `backend.autocast()` read it. Subclasses:
`ShardedPrecision` (fsdp, tp: no fp16, "auto" falls back to fp32 on a GPU without bf16),
`NoAutocastPrecision` (the engine casts: FSDP's MixedPrecisionPolicy) and `EnginePrecision`
(DeepSpeed: the engine keeps the model in that dtype and scales fp16 losses itself).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from tuneforge.errors import ConfigError
from tuneforge.files import torch_save

SCALER_FILE = "scaler.pt"


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


def emulated_bf16_note(requested: str, device: torch.device) -> str | None:
    """A note where bf16 was asked for by name on a CPU without native bf16: it runs there (as torch runs it),
    slower than fp32, which `auto` would have picked. Training, predict and serve say it alike."""
    if requested != "bf16" or device.type != "cpu" or cpu_has_native_bf16():
        return None
    return (
        "note: this CPU has no native bf16 (AVX512-BF16 or AMX), so bf16 runs slower here than fp32, which "
        "--precision auto picks on it"
    )


class Precision:
    """Autocast and fp16 loss scaling with torch's own tools (single, ddp)."""

    supported = ("fp32", "bf16", "fp16")

    def __init__(self, requested: str, backend_name: str, supported: tuple[str, ...] | None = None) -> None:
        self.requested = requested  # the config's precision, "auto" included
        self.backend_name = backend_name
        self.supported = supported or type(self).supported
        self.name = "fp32"
        self.device = torch.device("cpu")
        self.scaler: torch.amp.GradScaler | None = None

    # ---- choice and refusals ------------------------------------------------------------------
    def check_requested(self) -> None:
        """Config-time: a precision this backend never runs (before any device is known)."""

    def setup(self, device: torch.device) -> None:
        self.device = device
        self.name = self.resolve(device)
        self.check()
        if self.name == "fp16" and device.type == "cuda":
            self.scaler = self.make_scaler()

    def resolve(self, device: torch.device) -> str:
        return resolve_precision(self.requested, device)

    def make_scaler(self) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler("cuda")

    def check(self) -> None:
        if self.name not in self.supported:
            raise ConfigError(
                f"backend {self.backend_name!r} does not support precision {self.name!r}; "
                f"use one of: {', '.join(self.supported)}"
            )
        if self.name == "fp16" and self.device.type == "cpu":
            raise ConfigError("precision fp16 needs a CUDA GPU; on CPU use --precision bf16 or fp32")

    def emulated_note(self) -> str | None:
        return emulated_bf16_note(self.requested, self.device)

    # ---- compute ------------------------------------------------------------------------------
    # frozen linear layers may keep their weights in the autocast dtype (`frozen_weight_dtype`)
    stores_frozen_weights = True

    def frozen_weight_dtype(self) -> torch.dtype | None:
        """The dtype a frozen linear layer's weights can be kept in for this run: autocast's (it casts them to it
        at every call; kept so, a forward computes the same numbers without the cast, in half the memory). None:
        as loaded (fp32, or a backend whose engine or sharding handles the dtypes)."""
        if not self.stores_frozen_weights:
            return None
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

    @contextlib.contextmanager
    def weights_for_generation(self, model: torch.nn.Module):
        """For a whole generation call on the live model: every linear layer's float32 weight and bias cast once
        to the autocast dtype, the originals given back after. Autocast casts them to that dtype anyway, but at
        every call (it caches only weights that require gradients): once per generated token, where the tied
        output layer of a small model alone costs ~50 ms on a CPU. The same numbers; the copies live for the call."""
        dtype = self.frozen_weight_dtype()
        swapped = []
        if dtype is not None:
            for module in model.modules():
                if type(module) is not torch.nn.Linear:
                    continue
                for name in ("weight", "bias"):
                    param = getattr(module, name)
                    if param is not None and param.dtype == torch.float32:
                        swapped.append((module, name, param))
                        setattr(module, name, torch.nn.Parameter(param.detach().to(dtype), requires_grad=False))
        try:
            yield
        finally:
            for module, name, param in swapped:
                setattr(module, name, param)

    @staticmethod
    def autocast_for(name: str, device: torch.device):
        """The autocast context of precision `name` on `device` (none for fp32)."""
        if name in ("bf16", "fp16"):
            return torch.autocast(device.type, dtype=torch.bfloat16 if name == "bf16" else torch.float16)
        return contextlib.nullcontext()

    def autocast(self):
        return self.autocast_for(self.name, self.device)

    def default_attention(self, padded: bool = True) -> str | None:
        """The attention kernel `attn_implementation: auto` trains with (None: the model's own default).

        Under bf16 autocast on CPU with padded batches, eager attention: torch's CPU SDPA kernel with a
        padding mask is slower there, forward + backward (benchmarks/cpu_step_kernels.py). Unpadded
        (packed causal LM) batches need no mask and SDPA's causal kernel is the faster one
        (benchmarks/README.md, causal LM). In fp32 SDPA is not slower, and on GPUs it is the fast one."""
        return "eager" if self.device.type == "cpu" and self.name == "bf16" and padded else None

    # ---- fp16 loss scaling ----------------------------------------------------------------------
    @property
    def skips_overflow(self) -> bool:
        """An overflowing gradient is the scaler's to skip (it lowers the scale), not a failed step."""
        return self.scaler is not None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def close_skipped_step(self) -> None:
        """A step refused after `unscale`: the scaler must still close it."""
        if self.scaler:
            self.scaler.update()

    # ---- checkpoint ---------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        if self.scaler:
            torch_save(self.scaler.state_dict(), Path(path) / SCALER_FILE)

    def load(self, path: Path) -> None:
        if self.scaler and (Path(path) / SCALER_FILE).exists():
            self.scaler.load_state_dict(torch.load(Path(path) / SCALER_FILE, weights_only=True))


class ShardedPrecision(Precision):
    """fsdp, tp: fp16 would need a sharded grad scaler, so it is refused (use bf16)."""

    supported = ("fp32", "bf16")
    stores_frozen_weights = False  # the weights are DTensors, cast by the sharding's own policy

    def check_requested(self) -> None:
        if self.requested == "fp16":
            raise ConfigError(self._no_fp16())

    def resolve(self, device: torch.device) -> str:
        name = super().resolve(device)
        if name == "fp16" and self.requested == "auto":
            return "fp32"  # a GPU without bf16: "auto" takes the best this backend runs
        return name

    def check(self) -> None:
        if self.name == "fp16":
            raise ConfigError(self._no_fp16())
        super().check()

    def _no_fp16(self) -> str:
        return f"backend {self.backend_name!r} does not support precision fp16; use --precision bf16 (or fp32)"


class NoAutocastPrecision(ShardedPrecision):
    """FSDP: its MixedPrecisionPolicy casts parameters and inputs, so no autocast."""

    @staticmethod
    def autocast_for(name: str, device: torch.device):
        return contextlib.nullcontext()

    def mixed_precision_policy(self):
        """bf16 compute and all-gather, fp32 gradient reduction and fp32 master weights; fp32: none."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.name == "bf16":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()


class EnginePrecision(Precision):
    """DeepSpeed: the engine keeps the model in bf16/fp16 (fp32 master weights) and scales fp16 losses itself."""

    stores_frozen_weights = False  # the engine casts the model itself

    @staticmethod
    def autocast_for(name: str, device: torch.device):
        return contextlib.nullcontext()

    def make_scaler(self) -> None:
        return None

    @property
    def skips_overflow(self) -> bool:
        return self.name == "fp16"  # DeepSpeed's own loss scaler skips an overflowing fp16 step


# ---- 4-bit loading (QLoRA) ----------------------------------------------------------------------
def quiet_bitsandbytes() -> None:
    """peft imports bitsandbytes where it is installed, and on a CPU its import warns that it cannot fetch a
    kernel from the hub; it then runs its own CPU code, so the line asks nothing of the user."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def check_quantize(config) -> None:
    """--quantize where bitsandbytes cannot be imported (not installed, or no build for this machine): one line,
    before any data is read."""
    if config.quantize == "none":
        return
    quiet_bitsandbytes()
    try:
        import bitsandbytes  # noqa: F401
    except (ImportError, RuntimeError, OSError) as err:  # a build without this machine's native library
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"--quantize {config.quantize} needs bitsandbytes, which cannot run here ({reason}); pip install "
            "'tuneforge[quantize]' on a machine it supports, or drop --quantize (LoRA on the full-precision base)"
        ) from None


def quantized_compute_dtype(precision: str) -> torch.dtype:
    """The dtype 4-bit layers compute in: fp16 or bf16 as asked; "auto" takes bf16 on a CUDA GPU that has it."""
    cuda = torch.cuda.is_available()
    bf16 = precision == "bf16" or (precision == "auto" and cuda and torch.cuda.is_bf16_supported())
    return torch.float16 if precision == "fp16" else torch.bfloat16 if bf16 else torch.float32


def quantization_kwargs(config) -> dict:
    """`from_pretrained` arguments that load the base in 4-bit NF4 (--quantize 4bit), else none. bitsandbytes
    runs on CUDA GPUs and, in its recent releases, on CPUs; where it cannot run, one line says so."""
    if config.quantize == "none":
        return {}
    check_quantize(config)
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=quantized_compute_dtype(config.precision),
    )
    # each rank quantizes onto its own device (set by the backend before any model loads)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return {"quantization_config": quantization, "device_map": {"": device}}
