"""What every benchmark here records about where it ran, and the flags of the CPU step benchmarks
(benchmarks/ is on sys.path when a script here runs)."""

from __future__ import annotations

import argparse
import os
import platform
from datetime import date


def machine_meta(**extra) -> dict:
    """Date, machine and CPU class ('AMD EPYC (AVX512, native bf16)': what `auto` precision decides on)."""
    import torch

    from tuneforge.environment import cpu_class

    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    if torch.cuda.is_available():
        machine += f", {torch.cuda.get_device_name()}"
    return {"date": str(date.today()), "machine": machine, "cpu_class": cpu_class(), **extra}


def cpu_step_args(doc: str) -> argparse.Namespace:
    """--threads (set for torch here) and --steps of a script that times single training steps."""
    import torch

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def cpu_step_meta(args: argparse.Namespace, script: str) -> dict:
    """machine_meta of a step benchmark: its threads, torch version and command line."""
    import torch

    command = f"python benchmarks/{script} --threads {args.threads} --steps {args.steps}"
    return machine_meta(threads=args.threads, torch=torch.__version__, command=command)
