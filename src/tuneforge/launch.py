"""Starting workers, and knowing whether we are one.

- Under torchrun or any launcher that sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT,
  or inside Slurm (SLURM_PROCID, ...), tuneforge uses that environment and launches nothing.
- Otherwise, with nproc > 1 or nnodes > 1, the parent runs torch's elastic agent (torchrun's, with
  the launch config torchrun would make of the same flags) in its own process. The agent starts the
  workers, restarts them (--max-restarts) and stops them all when one fails; the parent waits,
  returns the main rank's result, and fails if a worker failed. A worker's user error (a bad input
  only a worker finds: a column, a checkpoint) is handed back, not printed: the parent says it in
  one line, once for all ranks, and exits 2 as a one-process run would. `tuneforge train`/`eval` fork their
  workers from the parent, which has loaded the code already (a second start-up of Python, torch
  and transformers in each worker costs more than a small run); a script (`python train.py`,
  unless it asks `Trainer(..., fork_workers=True)`) is re-run in each worker, as torchrun would,
  and so is any command once CUDA was set up in the parent (a forked child cannot use it). A fork
  copies only the thread that forks: the launching CLI starts no threads of its own before it, and
  the children never collect what they inherit (a process group's destructor would wait on threads
  that are not there).
- With a DeepSpeed-style hostfile, DeepSpeed's launcher fans the command out over the hosts
  (one host: a local launch; several: pdsh over ssh, which must be installed).
- Multi-node (`--nnodes N --node-rank R --master-addr A --master-port P` on every node): the
  main rank, on node 0, writes the run folder (config, metrics, model, result); other nodes
  write nothing there and their parents return {}. Checkpoints are the exception: every rank
  adds its own state file, so saving checkpoints needs an output dir that all nodes share. A worker's
  user error, or the stop of one node's launcher, reaches the other nodes' launchers through the
  world's store (`pass_failure_across_ranks`): each says the one line, naming that node (under
  torchrun or Slurm, a rank's user error reaches the other ranks so).

This module and config.py are the only places that read the environment: `dist_env()` hands a
process's place in the world (`DistEnv`) to the backends, which never read it themselves.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from tuneforge.errors import ConfigError, UserError
from tuneforge.files import write_text
from tuneforge.processes import usable_cores

LAUNCHED_FLAG = "TUNEFORGE_LAUNCHED"
RESULT_FILE_VAR = "TUNEFORGE_RESULT_FILE"  # where the main worker hands its result back
USER_ERROR_FILE_VAR = "TUNEFORGE_USER_ERROR_FILE"  # where a worker hands its user error back (the first rank's)
PEER_ERROR_KEY = "tuneforge/user-error"  # the world's store's: a worker's user error, for the other nodes' workers


class WorkerFailure(UserError):
    """A worker process failed; its error was shown above."""

    exit_code = 1


class Stopped(UserError):
    """The launcher was stopped by a signal (kill's SIGTERM, SIGHUP, ...) and stopped its workers; it exits as a
    process killed by that signal would (128 + its number). Ctrl-C's SIGINT is a KeyboardInterrupt instead."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}; its workers were stopped too")
        self.exit_code = 128 + signum


def _adopt_slurm_env() -> None:
    """Map Slurm's variables onto the torchrun ones (srun starts one task per process)."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env or _env_int("SLURM_NTASKS", 1) <= 1:
        return
    env["RANK"] = str(_env_int("SLURM_PROCID", 0))
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = str(_env_int("SLURM_LOCALID", 0))
    if "MASTER_ADDR" not in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        env["MASTER_ADDR"] = _first_slurm_host(nodelist)
    env.setdefault("MASTER_PORT", str(29500 + _env_int("SLURM_JOB_ID", 0) % 1000))


def _env_int(name: str, default: int) -> int:
    """A launcher's whole-number variable (RANK, SLURM_NTASKS, ...), or `default` where it is unset."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"{name}={value!r} is not a whole number; it comes from the launcher (torchrun, Slurm) or this shell: "
            f"fix it, or unset {name} to run without a launcher"
        ) from None


def _first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: 'node[03-05,07],gpu1' -> 'node03', 'node[1-2]-ib' -> 'node1-ib',
    'rack[1-2]-n[01-04]' -> 'rack1-n01' (each bracket's first number)."""
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist.strip())
    if first is None:
        return nodelist
    return re.sub(r"\[([^\]]*)\]", lambda group: group[1].split(",")[0].split("-")[0], first[0])


def in_distributed_env() -> bool:
    _adopt_slurm_env()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass(frozen=True)
class DistEnv:
    """This process's place in a launched world (torchrun, Slurm, DeepSpeed's launcher, ...).

    `launched=False`: no launcher; a distributed backend then makes a world of one (rank 0 of 1).
    `missing`: rendezvous variables a launched process lacks (the backend refuses to start).
    """

    launched: bool = False
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    missing: tuple[str, ...] = ()


def dist_env() -> DistEnv:
    """Where this process stands, read from the launcher's variables (Slurm's mapped onto torchrun's)."""
    env = os.environ
    if not in_distributed_env():
        return DistEnv()  # RANK alone (a stale variable of the shell) is no world: this process is all of it
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        # torch would wait for a rank 0 that never comes (or a world that cannot be)
        raise ConfigError(
            f"the launcher's environment puts this process at RANK={rank} (LOCAL_RANK={local_rank}) of "
            f"WORLD_SIZE={world_size} (under Slurm: SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS); a rank must be 0 to "
            "WORLD_SIZE-1: fix the launcher's variables, or unset them to run without a launcher"
        )
    if "MASTER_PORT" in env and not 0 < _env_int("MASTER_PORT", 0) < 65536:
        raise ConfigError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port (1 to 65535); fix or unset it")
    return DistEnv(
        launched=True,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        missing=tuple(key for key in ("MASTER_ADDR", "MASTER_PORT") if key not in env),
    )


def detected_launcher() -> str:
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "SLURM_PROCID" in env and _env_int("SLURM_NTASKS", 1) > 1:
        return "slurm"
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        return "mpi"
    if "RANK" in env and "WORLD_SIZE" in env:
        return "external (torchrun environment)"
    return "none"


def launch_environment() -> dict:
    """The launcher and cluster this process runs under (for `tuneforge env`); changes nothing."""
    env = os.environ
    info: dict = {"launcher": detected_launcher()}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if key in env:
            info[key.lower()] = env[key]
    if "SLURM_JOB_ID" in env or "SLURM_PROCID" in env:
        info["slurm"] = {
            key.removeprefix("SLURM_").lower(): env[key]
            for key in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST")
            if key in env
        }
    return info


def env_flag(name: str) -> str | None:
    """A TUNEFORGE_* setting from the environment (the cache folder, the crash-test hooks).

    launch.py is the one module that reads the environment, so every other module asks here.
    """
    return os.environ.get(name)


def process_rank() -> int:
    """This process's rank: 0 unless a launcher's world (RANK and WORLD_SIZE, or Slurm's) says otherwise."""
    return dist_env().rank


def launched_by_us() -> bool:
    return os.environ.get(LAUNCHED_FLAG) == "1"


def prints_result() -> bool:
    """Whether this process shows a run's result: the launching parent, or rank 0 under another launcher."""
    return not launched_by_us() and process_rank() == 0


def restart_count() -> int:
    return _env_int("TORCHELASTIC_RESTART_COUNT", 0)


def needs_launch(config) -> bool:
    wants_many = config.nproc > 1 or config.nnodes > 1 or bool(config.hostfile)
    return wants_many and not in_distributed_env()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script_argv() -> list[str]:
    """The Python arguments that re-run this process's command in a worker: `-m NAME` for `python -m pkg.mod`,
    else the script's path; then its arguments."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":  # python -m pkg.mod
        return ["-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    script = sys.argv[0] if sys.argv else ""
    # an interactive session's code has no file: a Jupyter kernel's or IPython's argv[0] is its own launcher
    interactive = not getattr(main, "__file__", None)
    if interactive or not script or script == "-c" or not Path(script).is_file():
        raise ConfigError(
            "nproc > 1 needs a script to re-run in each worker; run your code as `python train.py`, or from a "
            "notebook or other interactive session pass Trainer(..., fork_workers=True) to fork the workers from it"
        )
    return [script, *sys.argv[1:]]


def agent_flags(config) -> list[str]:
    """torchrun's flags for this run's workers, nodes and rendezvous (its own parser reads them)."""
    flags = [f"--nproc-per-node={config.nproc}", f"--max-restarts={config.max_restarts}"]
    if config.rdzv_endpoint:
        _check_resolves(_rdzv_host(config.rdzv_endpoint), "--rdzv-endpoint's host")
        return flags + [
            f"--nnodes={config.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={config.rdzv_endpoint}",
            f"--rdzv-id={Path(config.output_dir).name or 'tuneforge'}",
        ]
    if config.nnodes > 1:
        if config.master_port is None:
            raise ConfigError(
                "multi-node runs need --master-port (the same on every node), or --rdzv-endpoint HOST:PORT"
            )
        _check_resolves(config.master_addr, "--master-addr")
        return flags + [
            f"--nnodes={config.nnodes}",
            f"--node-rank={config.node_rank}",
            f"--master-addr={config.master_addr}",
            f"--master-port={config.master_port}",
        ]
    if config.max_restarts:
        # restarts need the c10d rendezvous (a fresh store per round; see launch_workers' env), else
        # restarted workers read the dead workers' gloo addresses from the static rendezvous store
        return flags + [
            "--nnodes=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{config.master_port or free_port()}",
            "--rdzv-id=tuneforge",
        ]
    return flags + ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={config.master_port or free_port()}"]


def _rdzv_host(endpoint: str) -> str:
    """The host of an --rdzv-endpoint HOST[:PORT], as torch's rendezvous reads it; a bad one is one line."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        return parse_rendezvous_endpoint(endpoint, default_port=29400)[0]
    except ValueError as err:  # a port that is no port (0 to 65535), a host that is no name
        raise ConfigError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT: {str(err).rstrip('.')}") from None


def _check_resolves(host: str, what: str) -> None:
    """One line for a host name that no resolver knows: torch would retry it for the rendezvous' 900 s, a warning
    every few seconds. A resolver that fails for now (EAI_AGAIN) is left to torch's retries."""
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as err:
        if err.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            raise ConfigError(
                f"{what} {host!r} does not resolve ({err.strerror}); give node 0's address as every node reaches it "
                "(its IP, or a name this node's resolver knows)"
            ) from None


def read_hostfile(path: str) -> dict[str, int]:
    """{host: slots} of a DeepSpeed-style hostfile ('node1 slots=2' per line), as DeepSpeed reads it."""
    hosts = Path(path)
    if not hosts.is_file():
        raise ConfigError(f"hostfile {path!r} does not exist; write lines like 'node1 slots=2'")
    from deepspeed.launcher.runner import fetch_hostfile

    try:
        pool = fetch_hostfile(str(hosts))
    except ValueError as err:
        raise ConfigError(f"hostfile {path!r} is malformed ({err}); write lines like 'node1 slots=2'") from None
    if not pool:
        raise ConfigError(f"hostfile {path!r} lists no hosts; write lines like 'node1 slots=2'")
    _check_slots_are_numbers(path, hosts.read_text(encoding="utf-8", errors="replace"))
    idle = [host for host, slots in pool.items() if slots < 1]
    if idle:  # DeepSpeed would start no worker there (or none at all): a world it cannot build
        raise ConfigError(
            f"hostfile {path!r} gives {idle[0]} slots=0; every host listed runs at least one worker: give it "
            "slots=1 or more, or remove its line"
        )
    return dict(pool)


def _check_slots_are_numbers(path: str, text: str) -> None:
    """DeepSpeed reads a slots count's leading digits only ('slots=1.5' as 1, 'slots=2x' as 2): one line instead."""
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if len(fields) < 2 or fields[0].startswith("#") or re.fullmatch(r"slots=[0-9]+", fields[1]):
            continue
        raise ConfigError(
            f"hostfile {path!r} line {number} ({line.strip()!r}): {fields[1]} is not a whole number of slots; "
            "write lines like 'node1 slots=2'"
        )


def hostfile_command(config) -> list[str]:
    """DeepSpeed's launcher over the hostfile's hosts (one host: a local launch, no ssh)."""
    import shutil

    pool = read_hostfile(config.hostfile)
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        str(config.hostfile),
        "--master_port",
        str(config.master_port or free_port()),
        "--no_local_rank",
        "--log_level=warning",
    ]
    if len(pool) == 1:
        # DeepSpeed runs a one-host hostfile on this machine; its ssh check would only fail here
        cmd += ["--no_ssh_check", "--master_addr", config.master_addr]
    else:
        if not shutil.which("pdsh"):
            raise ConfigError(
                f"hostfile {config.hostfile!r} lists {len(pool)} hosts; DeepSpeed's launcher reaches them with pdsh "
                "over ssh, "
                "which is not installed here; install pdsh (with passwordless ssh), or start "
                "`tuneforge train --nnodes N --node-rank R --master-addr HOST --master-port P` on each host"
            )
        if config.master_addr not in ("127.0.0.1", "localhost"):  # else DeepSpeed asks the first host
            cmd += ["--master_addr", config.master_addr]
    argv = _script_argv()
    return cmd + (["--module", *argv[1:]] if argv[0] == "-m" else argv)


def procs_on_this_node(config) -> int:
    if config.hostfile:
        return max(read_hostfile(config.hostfile).values())
    return config.nproc


def worker_threads(config) -> int:
    """CPU threads of each worker on this node: OMP_NUM_THREADS where it names a number (an OpenMP list's first, as
    4,2), else the cores this process may use (its affinity: taskset, a container's cpuset) shared by the workers."""
    given = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    cores = usable_cores()
    return max(1, cores // procs_on_this_node(config))


def hand_back(result: dict, is_main: bool) -> dict:
    """In a worker we launched: the main rank writes its result for the waiting parent.

    The first result wins: it answers the parent's call that launched the workers (a script
    that goes on to call `validate()` re-runs it as workers from the parent too).
    """
    target = os.environ.get(RESULT_FILE_VAR)
    if target and is_main and not Path(target).exists():
        write_text(target, json.dumps(result), durable=False)
    return result


def report_user_error(err: UserError) -> None:
    """A user error's one `error:` line on stderr; in a worker we launched, handed to the launching process instead
    (the first rank's only), which shows it once for all ranks and exits as the command itself would."""
    if not _hand_to_launcher(_user_error_payload(err)):
        print(f"error: {err}", file=sys.stderr, flush=True)


def _user_error_payload(err: UserError, prefix: str = "") -> str:
    return json.dumps({"kind": type(err).__name__, "message": f"{prefix}{err}", "exit_code": err.exit_code})


def _hand_to_launcher(payload: str) -> bool:
    """In a worker we launched: a user error (`_user_error_payload`) written for the launching process, unless
    another rank's was written first; False where no launcher reads one (or its folder is gone)."""
    target = os.environ.get(USER_ERROR_FILE_VAR)
    if not target:
        return False
    try:
        with open(target, "x", encoding="utf-8") as fh:  # "x": another rank's, written first, stays
            fh.write(payload)
    except FileExistsError:
        pass
    except OSError:
        return False
    return True


def pass_failure_across_ranks(err: Exception) -> UserError | None:
    """As an error stops a rank of a world of several (before its process group is torn down), through the world's
    store (under tuneforge's launcher: node 0's launcher holds it; used across nodes only, a node's ranks share a
    file): a user error goes there, and so does the stop of this node's launcher (kill, Ctrl-C). Another error that
    finds one there (a collective whose peer left) follows from it: that one is returned, to be raised in its place,
    so that every node's launcher (or under torchrun, Slurm: every rank) says its one line, naming where it came
    from, and not gloo's traceback with 'training workers failed' or an internal error. Best effort: a store
    gone with node 0's launcher is skipped."""
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.api import SignalException

    ours = launched_by_us()
    if not dist.is_initialized() or dist.get_world_size() < 2 or (ours and _env_int("GROUP_WORLD_SIZE", 1) < 2):
        return None
    where = f"node {os.environ.get('GROUP_RANK', '?')}" if ours else f"rank {dist.get_rank()}"
    where = f"{where} ({socket.gethostname()})"
    with suppress(Exception):
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=5))
        if isinstance(err, UserError):
            if ours:
                report_user_error(err)  # before the store: this node's other ranks read the file first
            store.compare_set(PEER_ERROR_KEY, "", _user_error_payload(err, f"{where}: "))
        elif isinstance(err, SignalException):  # the agent stopping this node's workers: its launcher was stopped
            how = signal.Signals(err.sigval).name
            stopped = WorkerFailure(f"{where} was stopped by {how}, and this node's workers with it")
            store.compare_set(PEER_ERROR_KEY, "", _user_error_payload(stopped))
        elif not user_error_reported() and store.check([PEER_ERROR_KEY]):
            return _user_error_from(store.get(PEER_ERROR_KEY).decode())
    return None


def user_error_reported() -> bool:
    """Whether, in a worker we launched, a rank has handed back a user error: this worker's own failure that
    follows (a collective whose peer left) is its consequence, and the launcher's one line says it all."""
    target = os.environ.get(USER_ERROR_FILE_VAR)
    return bool(target) and Path(target).exists()


def _workers_user_error(error_file: Path) -> UserError | None:
    """The user error a worker handed back (`report_user_error`), as its own kind (ConfigError, DataError, ...) with
    its exit code; None where none did."""
    try:
        return _user_error_from(error_file.read_text(encoding="utf-8"))
    except OSError:
        return None


def _user_error_from(payload: str) -> UserError | None:
    """The user error of a `_user_error_payload`; None where it cannot be read."""
    from tuneforge import errors

    try:
        reported = json.loads(payload)
    except ValueError:
        return None
    kind = getattr(errors, str(reported.get("kind")), None)
    known = isinstance(kind, type) and issubclass(kind, UserError)  # a worker's own class (WorkerFailure): UserError
    err = (kind if known else UserError)(str(reported.get("message", "")))
    err.exit_code = int(reported.get("exit_code", UserError.exit_code))
    return err


# the loggers that report a failed worker group: its failure, the workers stopped, a restart
ELASTIC_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.launcher.api",
    "torch.multiprocessing.spawn",
)


@contextmanager
def _quiet_elastic(error_file: Path):
    """torch elastic's report of a failed worker (its ProcessExitedException traceback, the other workers stopped)
    dropped once a worker has handed back a user error, and its report of a stop by a signal ('Received 15 death
    signal, shutting down workers', 'Closing process N via signal SIGTERM' per worker) always: the launcher's one
    line of it says it all."""
    stopping: list[bool] = []

    def quiet(record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Received %s death signal"):
            stopping.append(True)
        return not (stopping or error_file.exists())

    loggers = [logging.getLogger(name) for name in ELASTIC_LOGGERS]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def launch_workers(config, forked_work=None) -> dict:
    """Run the workers to completion; return the main rank's result (on node 0) or {}.

    `forked_work`: the worker's job, run in workers forked from this process, which has loaded the code
    already (no second start-up of Python and the libraries in each worker); None, or CUDA already set up
    here (a forked child cannot use it), re-runs this process's command in each worker. The caller checks
    the config first (`backends.check_launchable`): a bad one is one line, not a line per worker.
    """
    threads = str(worker_threads(config))
    with tempfile.TemporaryDirectory(prefix="tuneforge-launch-") as tmp:
        result_file, error_file = Path(tmp) / "result.json", Path(tmp) / "user-error.json"
        env = {
            LAUNCHED_FLAG: "1",
            RESULT_FILE_VAR: str(result_file),
            USER_ERROR_FILE_VAR: str(error_file),
            "OMP_NUM_THREADS": threads,
        }
        if config.max_restarts:  # a shared rendezvous store keeps stale keys across restarts (pytorch#135712)
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        if config.hostfile:
            code = _run_stopping_with_us(hostfile_command(config), {**os.environ, **env})
        else:
            # the agent hands this process's environment to the workers it starts
            with _environment(env), _quiet_elastic(error_file):
                code = _run_agent(config, forked_work if forked_work and forks_workers(config) else None)
        if code != 0:
            failure = WorkerFailure(f"training workers failed (exit code {code}); the worker's error is shown above")
            raise _workers_user_error(error_file) or failure
        # the main rank runs on node 0: other nodes' parents have nothing to return
        if result_file.exists():
            return json.loads(result_file.read_text())
    run_result = Path(config.output_dir) / "result.json"  # a launcher that did not pass our environment on
    return json.loads(run_result.read_text()) if config.node_rank == 0 and run_result.exists() else {}


def _run_stopping_with_us(cmd: list[str], env: dict) -> int:
    """`cmd` (DeepSpeed's launcher) to its end, in a process group of its own that a signal to this process
    (kill's SIGTERM, SIGHUP, Ctrl-C's SIGINT) is passed to whole: DeepSpeed's one-host runner does not pass one
    on, and would leave its workers training alone. Returns its exit code; stopped, raises as `_run_agent` does."""
    child = subprocess.Popen(cmd, env=env, process_group=0)
    stopped: list[int] = []

    def pass_on(signum, _frame) -> None:
        stopped.append(signum)
        with suppress(ProcessLookupError):
            os.killpg(child.pid, signum)

    handlers = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        code = child.wait()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        with suppress(ProcessLookupError):  # a worker the launcher did not stop in time
            os.killpg(child.pid, signal.SIGKILL)
    if stopped:
        if stopped[0] == signal.SIGINT:
            raise KeyboardInterrupt
        raise Stopped(stopped[0])
    return code


def _run_agent(config, forked_work) -> int:
    """torch's elastic agent, in this process, with the launch config torchrun would make of `agent_flags`:
    it starts the workers (forked to run `forked_work`, or running this command again), restarts them up to
    max_restarts times, and stops them all when one fails. Returns the exit code of the first failure, or 0."""
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    script = ["-u", *_script_argv()] if forked_work is None else []
    launch_config, _, _ = config_from_args(get_args_parser().parse_args([*agent_flags(config), "tuneforge"]))
    if forked_work is not None:
        launch_config.start_method = "fork"
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    try:
        if forked_work is None:
            elastic_launch(launch_config, sys.executable)(*script)
        else:
            # forked workers never collect what they inherit (a destructor of this process's objects, such as a
            # process group's, may wait there on threads that were not forked with it)
            frozen_already = gc.get_freeze_count() > 0  # the caller's own freeze stays
            gc.freeze()
            try:
                elastic_launch(launch_config, _forked_worker)(forked_work, int(os.environ["OMP_NUM_THREADS"]))
            finally:
                if not frozen_already:
                    gc.unfreeze()
        return 0
    except ChildFailedError as failed:
        return next(iter(failed.failures.values())).exitcode
    except (DistNetworkError, DistStoreError) as err:  # before any worker starts: the agent's rendezvous store
        raise nodes_did_not_meet(err, config) or rendezvous_failed(err) from None
    except SignalException as stopped:  # the agent stopped the workers; stop as the signal asks
        if stopped.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise Stopped(stopped.sigval) from None
    finally:
        for sig, handler in handlers.items():  # the agent's handlers raise its own exception
            signal.signal(sig, handler)


def nodes_did_not_meet(err: Exception, config) -> ConfigError | None:
    """A multi-node run's rendezvous that timed out (torch's 900 s, as torchrun's) as one line: on node 0, the
    store's wait for the other nodes ('... 1/2 clients joined', an internal error before); on another node, its
    connection to node 0. None for another failure."""
    if config.nnodes < 2 or config.rdzv_endpoint:
        return None
    text, where = str(err), f"{config.master_addr}:{config.master_port}"
    waited = re.search(r"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined", text)
    if waited:
        seconds, joined, nodes = waited.groups()
        return ConfigError(
            f"node 0 waited {seconds} s at {where} for the other nodes and {joined} of {nodes} joined (itself "
            f"included): start the others with --nnodes {nodes}, --node-rank 1 to {int(nodes) - 1} and the same "
            "--master-addr and --master-port, or lower --nnodes"
        )
    if config.node_rank > 0 and "timed out" in text:
        return ConfigError(
            f"node {config.node_rank} could not reach node 0 at {where} ({text.strip().splitlines()[0]}): start "
            "node 0 (--node-rank 0) with that --master-port, and check that --master-addr is node 0's address as "
            "this node reaches it (no firewall between them)"
        )
    return None


def rendezvous_failed(err: Exception) -> ConfigError:
    """torch's rendezvous error ('... port: 29500, ..., message: address already in use') as one line."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    port = re.search(r"port: (\d+)", text)
    reason = text.rsplit("message: ", 1)[-1].rstrip(".") if "message: " in text else text
    where = f"on port {port.group(1)} " if port else ""
    return ConfigError(
        f"the workers' rendezvous {where}failed ({reason}); on one machine leave --master-port out (a free port is "
        "picked) or choose a free one; across nodes give each node node 0's --master-addr and a --master-port free "
        "there (under a launcher: its MASTER_ADDR/MASTER_PORT)"
    )


def _forked_worker(work, threads: int) -> None:
    """A forked worker: the job, with this process's own threads; an error is shown here, as the command's
    own worker would show it, and ends the worker with its exit code."""
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException

    torch.set_num_threads(threads)
    try:
        work()
    except SignalException as stopped:  # the agent's handler, forked with it: it is stopping the workers
        raise SystemExit(128 + stopped.sigval) from None
    except UserError as err:
        report_user_error(err)
        raise SystemExit(err.exit_code) from None
    except Exception:
        if not user_error_reported():
            traceback.print_exc()
            sys.stderr.flush()
        raise SystemExit(1) from None


def forks_workers(config) -> bool:
    """Whether `launch_workers` forks its workers from this process (so that what it imports first, they have):
    not through a hostfile (DeepSpeed's launcher starts new processes) nor once CUDA is set up here."""
    return not config.hostfile and not _cuda_set_up()


def _cuda_set_up() -> bool:
    """Whether this process has set up CUDA: a child forked from it fails at its first CUDA call."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


@contextmanager
def _environment(changes: dict):
    """`changes` set in this process's environment for the block, then undone."""
    before = {key: os.environ.get(key) for key in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
