"""`tuneforge env`: what a bug report needs (like `accelerate env`).

Versions, devices, the launcher or cluster this process runs under, and which backends this
machine can run (each backend's `usable()` says "usable" or "unusable: why").
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

# distribution names, read from package metadata (importing deepspeed just for its version is slow and noisy)
PACKAGES = (
    "tuneforge",
    "torch",
    "transformers",
    "datasets",
    "tokenizers",
    "safetensors",
    "deepspeed",
    "peft",
    "accelerate",
)
# the optional extras a bug report about QLoRA, the harness, sweeps, trackers or embeddings needs (a missing one
# reads "not installed")
EXTRAS = ("bitsandbytes", "lm_eval", "optuna", "mlflow", "wandb", "trackio", "sentence-transformers", "trl")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def backend_status() -> dict[str, str]:
    """Which backends this machine can run, and why not."""
    from tuneforge.backends import available_backends, backend_class

    out = {}
    for name in available_backends():
        try:
            out[name] = backend_class(name).usable()
        except Exception as err:  # an engine that fails to import is reported, not fatal
            out[name] = f"unusable: {type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
    return out


def cpu_class() -> str:
    """'AMD EPYC (AVX512, native bf16)': the CPU's name, its widest vector ISA torch uses, and whether
    it does bf16 natively (what `--precision auto` decides on) — the class a speed figure belongs to."""
    import torch

    from tuneforge.backends.base import cpu_has_native_bf16

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            name = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    bf16 = "native bf16" if cpu_has_native_bf16() else "no native bf16"
    return f"{name} ({torch.backends.cpu.get_cpu_capability()}, {bf16})"


def device_info() -> dict:
    import torch

    from tuneforge.backends.base import resolve_precision

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices: dict = {
        "cpu": cpu_class(),
        "cpu_cores": os.cpu_count(),
        "cuda": cuda,
        "mps": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()),
    }
    if cuda:
        devices["cuda_names"] = [torch.cuda.get_device_name(i) for i in range(cuda)]
        devices["cuda_version"] = torch.version.cuda
    # what `--precision auto` picks on this machine's first device
    first = torch.device("cuda", 0) if cuda else torch.device("cpu")
    devices["auto_precision"] = resolve_precision("auto", first)
    return devices


def collect_env() -> dict:
    import torch.distributed as dist

    from tuneforge.launch import launch_environment

    return {
        "versions": {"python": sys.version.split()[0], **{name: _version(name) for name in PACKAGES + EXTRAS}},
        "platform": platform.platform(),
        "devices": device_info(),
        "process_groups": {
            "available": dist.is_available(),
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
            "mpi": dist.is_available() and dist.is_mpi_available(),
        },
        "launch": launch_environment(),
        "backends": backend_status(),
    }


def format_env(info: dict, indent: str = "") -> str:
    lines = []
    for key, value in info.items():
        if isinstance(value, dict):
            lines.append(f"{indent}{key}:")
            lines.append(format_env(value, indent + "  "))
        else:
            lines.append(f"{indent}{key}: {value}")
    return "\n".join(lines)
