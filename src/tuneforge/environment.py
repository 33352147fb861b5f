"""`tuneforge env`: what a bug report needs (like `accelerate env`)."""
from __future__ import annotations

import importlib
import os
import platform
import sys


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception:
        return "not installed"


def backend_status() -> dict[str, str]:
    """Which backends this machine can run, and why not."""
    from tuneforge.backends import available_backends

    out = {}
    for name in available_backends():
        try:
            mod = importlib.import_module(f"tuneforge.backends.{name}")
            check = getattr(mod.BACKEND, "usable", None)
            out[name] = check() if check else "usable"
        except Exception as err:  # an engine that fails to import is reported, not fatal
            out[name] = f"unusable: {type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
    return out


def collect_env() -> dict:
    import torch

    from tuneforge import __version__
    from tuneforge.launch import detected_launcher

    devices = {"cpu": os.cpu_count(), "cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0,
               "mps": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())}
    if devices["cuda"]:
        devices["cuda_names"] = [torch.cuda.get_device_name(i) for i in range(devices["cuda"])]
    bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return {
        "tuneforge": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "datasets": _version("datasets"),
        "deepspeed": _version("deepspeed"),
        "devices": devices,
        "cpu_native_bf16": bool(bf16),
        "distributed": {"available": torch.distributed.is_available(), "gloo": torch.distributed.is_gloo_available(),
                        "nccl": torch.distributed.is_nccl_available()},
        "launcher": detected_launcher(),
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
