"""Launching: self-launch from a plain script, multi-node agents, external launchers (Slurm by
hand, DeepSpeed hostfile; torchrun itself: tests/backends/test_backend_ddp.py), worker crashes,
and launch errors.

Every run trains the same tiny model on the same data with a global batch of 16 and is compared
with one in-process single-process baseline: matching losses and weights show the processes
really trained together (a rank training alone on its half-batches would drift far apart).
Length grouping is off here: its batch order depends on the per-micro-step global batch, so
with it 2 x 4 x grad_accum 2 would see other examples per step than one batch of 16.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import REPO, cli_command, cli_flags, last_json, read_jsonl, run_cli, sentiment_split, train_command
from tuneforge import cli, launch

STEPS = 6
DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
    "TUNEFORGE_LAUNCHED",
    "TUNEFORGE_RESULT_FILE",
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return sentiment_split(tmp_path_factory.mktemp("launch-data"), 16 * STEPS, 33)


def train_args(tiny_bert, data, cache_dir, out, **flags) -> list[str]:
    """`train` arguments of the STEPS-step run every test here makes, into `out`, with `flags` (conftest.cli_flags)."""
    run = cli_flags(max_steps=STEPS, precision="fp32", logging_steps=1, lr="1e-2", eval_strategy="no")
    where = cli_flags(no_group_by_length=True, cache_dir=cache_dir, output_dir=out, json=True, quiet=True)
    return train_command(data, tiny_bert, **flags) + run + where


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_bert, data, cache_dir) -> Path:
    """One process, batch 16, in this process (the reference every launch is compared with)."""
    out = tmp_path_factory.mktemp("launch-runs") / "single"
    assert cli.main(train_args(tiny_bert, data, cache_dir, out, batch_size=16)) == 0
    return out


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS and not k.startswith("SLURM_")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def assert_matches_baseline(run_dir: Path, baseline: Path) -> None:
    losses = [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "train"]
    reference = [r["loss"] for r in read_jsonl(baseline / "metrics.jsonl") if r["split"] == "train"]
    assert len(losses) == len(reference) == STEPS  # written once, by the main rank only
    assert max(abs(a - b) for a, b in zip(losses, reference)) < 1e-4
    a, b = load_file(run_dir / "model" / "model.safetensors"), load_file(baseline / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4


def start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    """A process (own session: killable with its workers) whose output goes to files, so two of
    them at once never block on a full pipe."""
    with open(log.with_suffix(".out"), "w") as stdout, open(log.with_suffix(".err"), "w") as stderr:
        return subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, cwd=REPO, text=True, start_new_session=True)


def finish(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 300) -> list[tuple[int, str, str]]:
    """Wait for all; past the timeout (a hang) kill them with their workers and fail."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return [
        (p.returncode, log.with_suffix(".out").read_text(), log.with_suffix(".err").read_text())
        for p, log in zip(procs, logs)
    ]


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


# ---- self-launch (FlagAI style) --------------------------------------------------------------
SELF_LAUNCH = '''
"""Plain `python train.py`: Trainer(TrainConfig(backend="ddp", nproc=2)).fit() runs as 2 workers."""
import json, os, sys
from pathlib import Path

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from tuneforge.config import TrainConfig
from tuneforge.trainer import Callback, Trainer

train, val, model, cache, out = sys.argv[1:6]


class CountGradientSyncs(Callback):
    """Counts DDP all-reduce rounds: with no_sync on accumulation micro-steps, one per optimizer step."""

    rounds = 0

    def on_train_begin(self, trainer):
        def hook(group, bucket):
            self.rounds += bucket.is_last()
            return allreduce_hook(group, bucket)
        trainer.model.register_comm_hook(None, hook)

    def on_train_end(self, trainer, result):
        Path(out, f"syncs-rank{trainer.backend.rank}.json").write_text(json.dumps({"rounds": self.rounds}))


config = TrainConfig(task="classification", model=model, output_dir=out, backend="ddp", nproc=2, batch_size=4,
                     grad_accum=2, gradient_checkpointing=True, max_steps=STEPS, precision="fp32", logging_steps=1,
                     eval_strategy="no", quiet=True, optim={"lr": 1e-2},
                     data={"train_file": train, "validation_file": val, "cache_dir": cache, "group_by_length": False})
result = Trainer(config, callbacks=[CountGradientSyncs()]).fit()
print("RESULT", "worker" if "RANK" in os.environ else "parent", json.dumps(result), flush=True)
'''

CRASHING = '''
"""A user Trainer whose forward_step fails on rank 1 at step 3."""
import sys

from tuneforge.config import TrainConfig
from tuneforge.trainer import Trainer


class Crashing(Trainer):
    def forward_step(self, model, batch):
        if self.backend.rank == 1 and self.state.step == 2:
            raise RuntimeError("boom on rank 1 at step 3")
        return super().forward_step(model, batch)


train, val, model, cache, out = sys.argv[1:6]
config = TrainConfig(task="classification", model=model, output_dir=out, backend="ddp", nproc=2, batch_size=8,
                     max_steps=STEPS, precision="fp32", eval_strategy="no", quiet=True,
                     data={"train_file": train, "validation_file": val, "cache_dir": cache})
print("RESULT", Crashing(config).fit())
'''


def run_script(tmp_path, source: str, tiny_bert, data, cache_dir, timeout: float = 300):
    """`python train.py ...` -> (CompletedProcess-like result, run dir)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source).replace("STEPS", str(STEPS)))
    out = tmp_path / "run"
    proc = start(
        [sys.executable, str(script), *map(str, data), tiny_bert, cache_dir, str(out)], tmp_path / "log", clean_env()
    )
    [(rc, stdout, stderr)] = finish([proc], [tmp_path / "log"], timeout)
    return subprocess.CompletedProcess(proc.args, rc, stdout, stderr), out


def test_plain_python_script_self_launches_two_workers(tmp_path, tiny_bert, data, cache_dir, baseline):
    proc, out = run_script(tmp_path, SELF_LAUNCH, tiny_bert, data, cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split(" ", 2) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted(who for _, who, _ in lines) == ["parent", "worker", "worker"]
    parent = json.loads(next(body for _, who, body in lines if who == "parent"))
    assert parent["steps"] == STEPS and parent["num_examples"] == 33 and 0.0 <= parent["accuracy"] <= 1.0
    # 2 x 4 x grad_accum 2 (with gradient checkpointing) == one batch of 16, and gradients were
    # all-reduced once per optimizer step: no sync on the accumulation micro-steps
    assert_matches_baseline(out, baseline)
    for rank in (0, 1):
        assert json.loads((out / f"syncs-rank{rank}.json").read_text()) == {"rounds": STEPS}


def test_worker_crash_fails_the_run_with_its_error_and_never_hangs(tmp_path, tiny_bert, data, cache_dir):
    t0 = time.monotonic()
    proc, out = run_script(tmp_path, CRASHING, tiny_bert, data, cache_dir, timeout=240)
    assert proc.returncode != 0
    assert "RuntimeError: boom on rank 1 at step 3" in proc.stderr  # the worker's own error, shown
    assert "training workers failed" in proc.stderr
    assert "RESULT" not in proc.stdout
    assert time.monotonic() - t0 < 200
    assert not (out / "model").exists()


# ---- forked workers (what `tuneforge train` and `eval` do) -----------------------------------------
FORKING = """
import json, signal, sys

from tuneforge.config import TrainConfig
from tuneforge.trainer import Trainer

train, val, model, cache, out, crash = sys.argv[1:7]
handlers = [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)]


class MaybeCrashing(Trainer):
    def forward_step(self, model, batch):
        if not getattr(self.task, "set_up_by_the_user", False):  # a forked worker runs the parent's task
            raise RuntimeError("the task set up before fit was replaced")
        if crash == "crash" and self.backend.rank == 1 and self.state.step == 2:
            raise RuntimeError("boom on rank 1 at step 3")
        return super().forward_step(model, batch)


config = TrainConfig(task="classification", model=model, output_dir=out, backend="ddp", nproc=2, batch_size=8,
                     max_steps=STEPS, precision="fp32", logging_steps=1, eval_strategy="no", quiet=True,
                     optim={"lr": 1e-2},
                     data={"train_file": train, "validation_file": val, "cache_dir": cache, "group_by_length": False})
trainer = MaybeCrashing(config, fork_workers=True)
trainer.task.set_up_by_the_user = True
result = trainer.fit()
print("RESULT", json.dumps(result), handlers == [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)])
"""


def run_forking(tmp_path, tiny_bert, data, cache_dir, crash: str):
    """`python -c CODE`: no script a worker could re-run, so only forked workers can train it."""
    out = tmp_path / "run"
    code = FORKING.replace("STEPS", str(STEPS))
    cmd = [sys.executable, "-c", code, *map(str, data), tiny_bert, cache_dir, str(out), crash]
    [(rc, stdout, stderr)] = finish([start(cmd, tmp_path / "log", clean_env())], [tmp_path / "log"], 240)
    return rc, stdout, stderr, out


def test_forked_workers_train_together_from_code_that_cannot_be_re_run(tmp_path, tiny_bert, data, cache_dir, baseline):
    rc, stdout, stderr, out = run_forking(tmp_path, tiny_bert, data, cache_dir, "no")
    assert rc == 0, stderr[-3000:]
    # the code after fit() runs once, in the parent: the workers ran fit() only; the signal handlers are the
    # script's again, not the agent's
    [line] = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert json.loads(line.split(" ", 1)[1].rsplit(" ", 1)[0])["steps"] == STEPS and line.endswith(" True")
    assert_matches_baseline(out, baseline)


def test_a_forked_worker_crash_fails_the_run_with_its_error_and_never_hangs(tmp_path, tiny_bert, data, cache_dir):
    t0 = time.monotonic()
    rc, stdout, stderr, out = run_forking(tmp_path, tiny_bert, data, cache_dir, "crash")
    assert rc == 1, stderr[-3000:]  # the parent's WorkerFailure
    assert "RuntimeError: boom on rank 1 at step 3" in stderr  # the worker's own error, shown once
    assert stderr.count("RuntimeError: boom on rank 1 at step 3") == 1
    assert "training workers failed (exit code 1)" in stderr and "RESULT" not in stdout
    assert time.monotonic() - t0 < 200
    assert not (out / "model").exists()


def test_code_that_cannot_be_re_run_asks_for_a_script_or_forked_workers(tmp_path, tiny_bert, data, cache_dir):
    code = FORKING.replace("STEPS", str(STEPS)).replace(", fork_workers=True", "")
    cmd = [sys.executable, "-c", code, *map(str, data), tiny_bert, cache_dir, str(tmp_path / "run"), "no"]
    [(rc, _, stderr)] = finish([start(cmd, tmp_path / "log", clean_env())], [tmp_path / "log"], 120)
    assert rc != 0 and "nproc > 1 needs a script to re-run in each worker" in stderr


KERNEL = """
import sys, types

# as a Jupyter kernel runs a cell: argv[0] is the kernel's launcher, __main__ is IPython's namespace (no file)
sys.argv = sys.argv[1:]  # (the cell reads its settings after it)
namespace = types.ModuleType("__main__")
sys.modules["__main__"] = namespace
exec(compile(CELL, "<cell>", "exec"), namespace.__dict__)
"""


def test_a_notebook_kernel_is_never_re_run_as_the_workers_script(tmp_path, tiny_bert, data, cache_dir):
    """In a Jupyter kernel argv[0] is ipykernel_launcher.py, a file: each worker started it again (a second kernel
    on the notebook's ports: ZMQ's 'Address already in use', then 'training workers failed'). An interactive session
    has no script of its own: one line before any worker, pointing at fork_workers=True."""
    launcher = tmp_path / "kernel_launcher.py"
    launcher.write_text("import sys\nprint('kernel started again', file=sys.stderr)\nsys.exit(1)\n")
    cell = FORKING.replace("STEPS", str(STEPS)).replace(", fork_workers=True", "")
    code = KERNEL.replace("CELL", repr(cell))
    settings = [*map(str, data), tiny_bert, cache_dir, str(tmp_path / "run"), "no"]
    cmd = [sys.executable, "-c", code, str(launcher), *settings]
    [(rc, _, stderr)] = finish([start(cmd, tmp_path / "log", clean_env())], [tmp_path / "log"], 120)
    assert rc != 0 and "kernel started again" not in stderr
    assert "fork_workers=True" in stderr.strip().splitlines()[-1]


# ---- several agents, external launchers ---------------------------------------------------------
def test_two_nodes_on_one_machine_train_together(tmp_path, tiny_bert, data, cache_dir, baseline):
    """Two agents (nproc 1 each) meet at 127.0.0.1:P. Node 0 holds the main rank and writes the
    run folder; node 1 writes nothing and returns no result. Its output dir is not even checked
    (on a shared filesystem it is node 0's, which may already hold this run): an old run there
    neither stops node 1 nor is touched."""
    old_run = tmp_path / "node1" / "metrics.jsonl"
    old_run.parent.mkdir()
    old_run.write_text('{"old": true}\n')
    port = str(launch.free_port())
    procs = []
    for node in (0, 1):
        ddp = dict(backend="ddp", batch_size=8, nnodes=2, node_rank=node, master_addr="127.0.0.1", master_port=port)
        cmd = cli_command(*train_args(tiny_bert, data, cache_dir, tmp_path / f"node{node}", **ddp))
        # two "machines" on 2 cores: one thread per worker, as on real nodes with their own cores
        procs.append(start(cmd, tmp_path / f"node{node}-log", clean_env(OMP_NUM_THREADS="1")))
    (rc0, out0, err0), (rc1, out1, err1) = finish(procs, [tmp_path / f"node{n}-log" for n in (0, 1)])
    assert rc0 == 0 and rc1 == 0, (err0[-2000:], err1[-2000:])
    assert json_lines(out0)[-1]["steps"] == STEPS and json_lines(out1) == []
    assert [p.name for p in (tmp_path / "node1").iterdir()] == [
        "metrics.jsonl"
    ] and old_run.read_text() == '{"old": true}\n'
    # DDP keeps replicas identical; node 0's weights equal one process trained on the global batch
    assert_matches_baseline(tmp_path / "node0", baseline)


@pytest.mark.parametrize("launcher", ["nodes", "slurm"])
def test_a_user_error_on_one_node_is_every_nodes_one_line(tmp_path, tiny_bert, data, cache_dir, launcher):
    """Node 1's copy of the training file lacks the text column (a file that differs between nodes): its worker finds
    it, and node 0's worker only lost its peer: gloo's 'Connection closed by peer' traceback, then 'training workers
    failed', exit 1 (under Slurm, rank 0 said 'internal error (a bug in tuneforge ...)'). Node 0 says node 1's line
    too, naming it, and both exit 2."""
    train, val = data
    node1_train = tmp_path / "train.csv"
    node1_train.write_text(train.read_text().replace("text,label", "txt,label", 1))
    node_data = {0: data, 1: (node1_train, val)}
    port, procs = str(launch.free_port()), []
    for node in (0, 1):
        if launcher == "nodes":
            flags = dict(nnodes=2, node_rank=node, master_addr="127.0.0.1", master_port=port)
            env = clean_env(OMP_NUM_THREADS="1")
        else:  # one task per node, started by hand as srun would
            flags = {}
            env = clean_env(OMP_NUM_THREADS="1", SLURM_PROCID=str(node), SLURM_NTASKS="2", MASTER_PORT=port)
        args = train_args(tiny_bert, node_data[node], cache_dir, tmp_path / f"node{node}", backend="ddp", **flags)
        procs.append(start(cli_command(*args, "--batch-size", "8"), tmp_path / f"node{node}-log", env))
    results = finish(procs, [tmp_path / f"node{n}-log" for n in (0, 1)], timeout=120)
    line = "no text column found; columns are: txt, label"
    for node, (rc, _, stderr) in enumerate(results):
        assert rc == 2 and stderr.count("\n") == 1, stderr[-3000:]
        said_by_node_0 = f"error: {'node' if launcher == 'nodes' else 'rank'} 1 ("
        assert stderr.startswith(said_by_node_0 if node == 0 else "error: no text") and line in stderr


def test_slurm_tasks_started_by_hand_train_together(tmp_path, tiny_bert, data, cache_dir, baseline):
    port = str(launch.free_port())
    procs = []
    for rank in (0, 1):
        env = clean_env(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(rank),
            SLURM_JOB_ID="4242",
            SLURM_JOB_NODELIST="localhost",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
        )  # srun binds cores
        cmd = cli_command(*train_args(tiny_bert, data, cache_dir, tmp_path / "run", backend="ddp", batch_size=8))
        procs.append(start(cmd, tmp_path / f"task{rank}-log", env))
    (rc0, out0, err0), (rc1, out1, err1) = finish(procs, [tmp_path / f"task{n}-log" for n in (0, 1)])
    assert rc0 == 0 and rc1 == 0, (err0[-2000:], err1[-2000:])
    assert len(json_lines(out0)) == 1 and json_lines(out1) == []  # rank 0 reports
    assert_matches_baseline(tmp_path / "run", baseline)


def test_deepspeed_hostfile_fans_out_on_this_machine(tmp_path, tiny_bert, data, cache_dir, baseline):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    out = tmp_path / "run"
    args = train_args(tiny_bert, data, cache_dir, out, backend="ddp", batch_size=8, hostfile=hostfile)
    proc = run_cli(*args, env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_json(proc.stdout)["steps"] == STEPS
    assert_matches_baseline(out, baseline)


def test_multi_host_hostfile_without_pdsh_is_one_clear_error(tmp_path, capsys, monkeypatch, data):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no pdsh on this PATH, whatever the machine has
    rc = cli.main(train_command(data, backend="ddp", hostfile=hostfile, output_dir=tmp_path / "run"))
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (DeepSpeed may log its accelerator first)
    assert rc == 2
    assert (
        err.startswith("error: hostfile") and "2 hosts" in err and "pdsh" in err and "--nnodes N --node-rank R" in err
    )


# ---- bad input: one line, exit 2, nothing launched ------------------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "nosuch"], "unknown backend 'nosuch'; choose one of:"),
        (["--backend", "single", "--nproc", "2"], "backend 'single' runs one process"),
        (["--backend", "ddp", "--nnodes", "2"], "multi-node runs need --master-port"),
        (
            ["--backend", "ddp", "--nnodes", "2", "--node-rank", "2", "--master-port", "29999"],
            "node_rank 2 must be below nnodes 2",
        ),
        (["--backend", "ddp", "--hostfile", "no-such-hostfile"], "hostfile 'no-such-hostfile' does not exist"),
        # torch retried the name for its rendezvous timeout (900 s), a warning every few seconds
        (
            ["--backend", "ddp", "--nnodes", "2", "--node-rank", "1", "--master-port", "29999"]
            + ["--master-addr", "node0.invalid"],
            "--master-addr 'node0.invalid' does not resolve",
        ),
        (
            ["--backend", "ddp", "--nnodes", "2", "--rdzv-endpoint", "node0.invalid:29999"],
            "--rdzv-endpoint's host 'node0.invalid' does not resolve",
        ),
        # internal errors: torch's ValueError
        (["--backend", "ddp", "--nnodes", "2", "--rdzv-endpoint", "node0:http"], "port number of the rendezvous"),
        (["--backend", "ddp", "--nnodes", "2", "--rdzv-endpoint", ":29999"], "is not HOST:PORT: The hostname"),
    ],
)
def test_bad_launch_input_is_one_clear_line(tmp_path, capsys, data, args, message):
    rc = cli.main([*train_command(data, output_dir=tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "hosts, message",
    [
        ("localhost slots=0\n", "gives localhost slots=0"),  # no worker anywhere (it was a ZeroDivisionError)
        ("node-a slots=2\nnode-b slots=0\n", "gives node-b slots=0"),
        ("# only a comment\n\n", "is malformed"),
        ("localhost slots=1\nlocalhost slots=1\n", "multiple entries for localhost"),
        # DeepSpeed reads the leading digits: 1 and 2 workers, silently
        ("# hosts\nlocalhost slots=1.5\n", "line 2 ('localhost slots=1.5'): slots=1.5 is not a whole number"),
        ("node-a slots=2\n\nnode-b slots=2x\n", "line 3 ('node-b slots=2x'): slots=2x is not a whole number"),
    ],
)
def test_bad_hostfile_is_one_clear_error(tmp_path, capsys, data, hosts, message):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(hosts)
    rc = cli.main(train_command(data, backend="ddp", hostfile=hostfile, output_dir=tmp_path / "run"))
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (DeepSpeed logs the bad text first)
    assert rc == 2 and err.startswith(f"error: hostfile {str(hostfile)!r}") and message in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags", [{"nproc": 4}, {"nnodes": 2}])
def test_hostfile_with_nproc_or_nnodes_is_refused_not_ignored(tmp_path, capsys, data, flags):
    """DeepSpeed's launcher starts what the hostfile's slots say: --nproc 4 beside it ran 2 workers, silently."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    rc = cli.main(train_command(data, backend="ddp", hostfile=hostfile, output_dir=tmp_path / "run", **flags))
    (key, value), err = next(iter(flags.items())), capsys.readouterr().err.strip()
    assert rc == 2 and f"--hostfile decides the workers (its hosts and their slots), so --{key} {value} would" in err
    assert not (tmp_path / "run").exists()


def test_slurm_first_host_of_a_nodelist():
    assert launch._first_slurm_host("node[03-05,07],gpu1") == "node03"
    assert launch._first_slurm_host("gpu1,node[1-2]") == "gpu1"
    assert launch._first_slurm_host("localhost") == "localhost"
    # text after a bracket (it was dropped: 'node1'), and a name with two ranges
    assert launch._first_slurm_host("node[1-2]-ib,gpu1") == "node1-ib"
    assert launch._first_slurm_host("rack[1-2]-n[01-04]") == "rack1-n01"


def launcher_variables(monkeypatch, **values: str) -> None:
    """This process's launcher variables: `values` only (each one, and any Slurm mapped onto RANK..., undone after)."""
    for key in (*DIST_VARS, *[k for k in os.environ if k.startswith("SLURM_")], *values):
        monkeypatch.setenv(key, "")  # recorded, so that what the test (or the Slurm mapping) sets is undone
        monkeypatch.delenv(key)
    for key, value in values.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "two"}, "SLURM_NTASKS='two' is not a whole number"),
        ({"SLURM_PROCID": "first", "SLURM_NTASKS": "2"}, "SLURM_PROCID='first' is not a whole number"),
        ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc' is not a whole number"),
        # rank 3 of 2 would wait for a rank 0 that never comes
        ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29123"}, "RANK=3"),
        ({"SLURM_PROCID": "2", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost"}, "a rank must be 0 to"),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}, "is not a port"),
    ],
)
def test_bad_launcher_variables_are_one_clear_line(tmp_path, capsys, monkeypatch, data, variables, message):
    launcher_variables(monkeypatch, **variables)
    rc = cli.main([*train_command(data, backend="ddp", output_dir=tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err
    assert not (tmp_path / "run").exists()


def test_rank_without_a_world_is_a_run_of_one_that_guards_its_output_dir(tmp_path, capsys, monkeypatch, data):
    """RANK left in the shell, no WORLD_SIZE: no launched world (as dist_env says), so this process is the main one:
    it refuses to overwrite an old run (it used to write over it as a 'rank 1' and show no result)."""
    old = tmp_path / "run"
    old.mkdir()
    (old / "metrics.jsonl").write_text('{"old": true}\n')
    launcher_variables(monkeypatch, RANK="1")
    rc = cli.main(train_command(data, backend="single", output_dir=old))
    assert rc == 2 and "already holds a run" in capsys.readouterr().err
    assert (old / "metrics.jsonl").read_text() == '{"old": true}\n'


@pytest.mark.parametrize("launcher", ["tuneforge", "external"])
def test_master_port_in_use_is_one_clear_line(tmp_path, capsys, monkeypatch, data, launcher):
    """Taken where tuneforge's agent starts the rendezvous (--nproc 2 --master-port P), or where rank 0 of another
    launcher's world does (MASTER_PORT=P; Slurm by hand derives it from the job id)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        if launcher == "tuneforge":
            launcher_variables(monkeypatch)
            flags = dict(nproc=2, master_port=port)
        else:
            launcher_variables(monkeypatch, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            flags = {}
        rc = cli.main(train_command(data, backend="ddp", output_dir=tmp_path / "run", **flags))
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert err.startswith("error: ") and err.count("\n") == 1
    assert f"port {port}" in err and "address already in use" in err and "--master-port" in err


def session_members(session: int) -> list[int]:
    """The processes of a session (a launcher started with start_new_session, and whatever it started)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command's name: state ppid pgrp session
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


@pytest.mark.parametrize(
    "stop, code, line, how",
    [
        (signal.SIGTERM, 143, "stopped by SIGTERM", "nproc"),
        (signal.SIGINT, 130, None, "nproc"),
        (signal.SIGTERM, 143, "stopped by SIGTERM", "hostfile"),  # DeepSpeed's launcher's workers stop too
    ],
)
def test_stopping_the_launcher_stops_its_workers_quietly(tmp_path, tiny_bert, data, cache_dir, stop, code, line, how):
    """kill (SIGTERM) or Ctrl-C (SIGINT) of `tuneforge train --nproc 2` (or `--hostfile`): the workers stop with it,
    and the command says so in one line (as one process would), not with a traceback per worker nor as a worker's
    failure (nor after torch's warnings 'Received 15 death signal, shutting down workers' and 'Closing process N via
    signal SIGTERM' per worker), and leaves no worker training alone."""
    out = tmp_path / "run"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    launch_flags = dict(nproc=2) if how == "nproc" else dict(hostfile=hostfile)
    args = train_args(tiny_bert, data, cache_dir, out, backend="ddp", batch_size=8, **launch_flags)
    proc = start(cli_command(*args, "--max-steps", "100000"), tmp_path / "log", clean_env(OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)  # training has begun: the workers are up
    proc.send_signal(stop)  # the launcher alone (a terminal's Ctrl-C would reach the workers too)
    try:
        [(rc, _, stderr)] = finish([proc], [tmp_path / "log"], timeout=60)
        time.sleep(1)  # a worker that outlived its launcher would still be there
        assert session_members(proc.pid) == []
    finally:
        for pid in session_members(proc.pid):
            os.kill(pid, signal.SIGKILL)
    assert rc == code, stderr[-3000:]
    assert "Traceback" not in stderr and "training workers failed" not in stderr
    assert "death signal" not in stderr and "Closing process" not in stderr  # torch's lines of what the last says
    expected = f"error: {line}; its workers were stopped too" if line else "interrupted"
    assert stderr.strip().splitlines()[-1] == expected


def test_rank_and_world_size_without_a_rendezvous_say_why_nproc_launches_nothing(tmp_path, capsys, monkeypatch, data):
    """RANK and WORLD_SIZE left in the shell, no MASTER_ADDR/PORT: the line said to 'run with --nproc N', which the
    command had done (the variables make it a launched rank, which starts no workers)."""
    launcher_variables(monkeypatch, RANK="0", WORLD_SIZE="2")
    rc = cli.main(train_command(data, backend="ddp", nproc=2, output_dir=tmp_path / "run"))
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: RANK=0 and WORLD_SIZE=2 are set") and err.count("\n") == 1, err
    assert "MASTER_ADDR and MASTER_PORT not" in err and "unset RANK and WORLD_SIZE" in err


def test_nodes_that_never_join_are_one_line_on_node_0(tmp_path):
    """`--nnodes 2` started on node 0 only: after the rendezvous' wait (900 s; 0.3 s here, on the same store torch's
    agent makes) node 0 ended in 'internal error (a bug in tuneforge ...): DistStoreError: Timed out ...'."""
    from datetime import timedelta

    from torch.distributed import DistStoreError, TCPStore

    from tuneforge.config import TrainConfig

    port = launch.free_port()
    config = TrainConfig(output_dir=str(tmp_path / "run"), backend="ddp", nnodes=3, master_port=port)
    with pytest.raises(DistStoreError) as waited:
        TCPStore("127.0.0.1", port, 3, True, timedelta(seconds=0.3), multi_tenant=True)  # as the agent on node 0
    err = launch.nodes_did_not_meet(waited.value, config)
    assert isinstance(err, launch.ConfigError) and re.search(rf"node 0 waited \d+ s at 127.0.0.1:{port} ", str(err))
    assert "1 of 3 joined (itself included): start the others with --nnodes 3, --node-rank 1 to 2" in str(err)


def test_stopping_one_nodes_launcher_stops_every_node_with_one_line(tmp_path, tiny_bert, data, cache_dir):
    """kill (SIGTERM) of node 1's launcher mid-run: node 0's worker lost its peer, and node 0 said so with gloo's
    'Connection closed by peer' traceback and 'training workers failed (exit code 1); the worker's error is shown
    above'. It says node 1 was stopped, in one line (exit 1); node 1 says it was stopped (143); neither hangs."""
    port, procs = str(launch.free_port()), []
    for node in (0, 1):
        ddp = dict(backend="ddp", batch_size=8, nnodes=2, node_rank=node, master_addr="127.0.0.1", master_port=port)
        args = train_args(tiny_bert, data, cache_dir, tmp_path / f"node{node}", **ddp)
        env = clean_env(OMP_NUM_THREADS="1")
        procs.append(start(cli_command(*args, "--max-steps", "100000"), tmp_path / f"node{node}-log", env))
    deadline = time.monotonic() + 240
    while not (tmp_path / "node0" / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.5)  # training has begun on both nodes
    procs[1].send_signal(signal.SIGTERM)
    (rc0, _, err0), (rc1, _, err1) = finish(procs, [tmp_path / f"node{n}-log" for n in (0, 1)], timeout=60)
    assert (rc0, rc1) == (1, 143), (err0[-2000:], err1[-2000:])
    assert err0.startswith("error: node 1 (") and err0.count("\n") == 1, err0[-3000:]
    assert "was stopped by SIGTERM, and this node's workers with it" in err0
    assert err1.strip().splitlines()[-1] == "error: stopped by SIGTERM; its workers were stopped too"


@pytest.mark.parametrize("given, threads", [("3", 3), ("2,1", 2), ("", None), ("abc", None), ("0", None), (None, None)])
def test_worker_threads_read_omp_num_threads_as_openmp_does(monkeypatch, given, threads):
    """OMP_NUM_THREADS empty, not a number, or an OpenMP list (2,1: 2 threads, then 1 in nested regions) was an
    internal error under --nproc 2 (ValueError: invalid literal for int()); a number is taken (a list's first),
    else the cores this process may use (its affinity) shared by the node's workers."""
    from tuneforge.configure import build_config

    if given is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", given)
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    assert launch.worker_threads(build_config(backend="ddp", nproc=2)) == (threads or share)
