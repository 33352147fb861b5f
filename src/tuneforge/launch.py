"""Starting workers, and knowing whether we are one.

- Under torchrun or any launcher that sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT,
  or inside Slurm (SLURM_PROCID, ...), tuneforge uses that environment and launches nothing.
- Otherwise, with nproc > 1 or nnodes > 1, the current command (`tuneforge train ...` or
  `python train.py`) is re-run as workers through `torch.distributed.run` (the elastic agent);
  the parent waits, returns the main rank's result, and fails if a worker failed.
- With a DeepSpeed-style hostfile, DeepSpeed's launcher fans the command out over the hosts.

This module and config.py are the only places that read the environment.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tuneforge.errors import ConfigError, UserError

LAUNCHED_FLAG = "TUNEFORGE_LAUNCHED"


class WorkerFailure(UserError):
    """A worker process failed; its error was shown above."""

    exit_code = 1


def _adopt_slurm_env() -> None:
    """Map Slurm's variables onto the torchrun ones (srun starts one task per process)."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) <= 1:
        return
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        env["MASTER_ADDR"] = _first_slurm_host(nodelist)
    env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000))


def _first_slurm_host(nodelist: str) -> str:
    """'node[03-05,07],gpu1' -> 'node03' (the subset of Slurm's hostlist syntax we need)."""
    first = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist[: nodelist.index("]") + 1]
    if "[" in first:
        prefix, rng = first.split("[", 1)
        start = rng.rstrip("]").split(",")[0].split("-")[0]
        return prefix + start
    return first


def in_distributed_env() -> bool:
    _adopt_slurm_env()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def detected_launcher() -> str:
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "SLURM_PROCID" in env:
        return "slurm"
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        return "mpi"
    if "RANK" in env and "WORLD_SIZE" in env:
        return "external (torchrun environment)"
    return "none"


def process_rank() -> int:
    _adopt_slurm_env()
    return int(os.environ.get("RANK", "0"))


def launched_by_us() -> bool:
    return os.environ.get(LAUNCHED_FLAG) == "1"


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def needs_launch(config) -> bool:
    wants_many = config.nproc > 1 or config.nnodes > 1 or bool(config.hostfile)
    return wants_many and not in_distributed_env()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script_argv() -> list[str]:
    """The command to re-run in each worker: this same script with the same arguments."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":  # python -m pkg.mod
        return ["-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    script = sys.argv[0] if sys.argv else ""
    if not script or script == "-c" or not Path(script).exists():
        raise ConfigError("nproc > 1 needs a script to re-run in each worker; run your code as `python train.py`, not interactively")
    return [script, *sys.argv[1:]]


def torchrun_command(config) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={config.nproc}",
           f"--max-restarts={config.max_restarts}"]
    if config.rdzv_endpoint:
        cmd += [f"--nnodes={config.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={config.rdzv_endpoint}",
                f"--rdzv-id={Path(config.output_dir).name or 'tuneforge'}"]
    elif config.nnodes > 1:
        if config.master_port is None:
            raise ConfigError("multi-node runs need --master-port (the same on every node), or --rdzv-endpoint HOST:PORT")
        cmd += [f"--nnodes={config.nnodes}", f"--node-rank={config.node_rank}",
                f"--master-addr={config.master_addr}", f"--master-port={config.master_port}"]
    else:
        cmd += ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={config.master_port or free_port()}"]
    return cmd + _script_argv()


def hostfile_command(config) -> list[str]:
    hosts = Path(config.hostfile)
    if not hosts.is_file():
        raise ConfigError(f"hostfile {config.hostfile!r} does not exist; write lines like 'node1 slots=2'")
    from deepspeed.launcher.runner import fetch_hostfile

    if not fetch_hostfile(str(hosts)):
        raise ConfigError(f"hostfile {config.hostfile!r} lists no hosts; write lines like 'node1 slots=2'")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hosts),
           "--master_addr", config.master_addr, "--master_port", str(config.master_port or 29500)]
    argv = _script_argv()
    if argv[0] == "-m":
        cmd += ["--module"] + argv[1:]
    else:
        cmd += argv
    return cmd


def launch_workers(config) -> dict:
    """Run the workers to completion; return the main rank's result (node 0) or {}."""
    cmd = hostfile_command(config) if config.hostfile else torchrun_command(config)
    env = {**os.environ, LAUNCHED_FLAG: "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // config.nproc)))}
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise WorkerFailure(f"training workers failed (exit code {proc.returncode}); the worker's error is shown above")
    result_file = Path(config.output_dir) / "result.json"
    if config.node_rank == 0 and result_file.exists():
        return json.loads(result_file.read_text())
    return {}
