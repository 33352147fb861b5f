"""`tuneforge env`: versions, devices, the detected launcher/cluster and usable backends."""

from __future__ import annotations

import importlib.metadata
import json
import os

import torch

from conftest import run_cli
from tuneforge.environment import collect_env, format_env

DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def plain_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS and not k.startswith("SLURM_")}
    return {**env, **extra}


def test_env_json_reports_versions_devices_launcher_and_backends():
    proc = run_cli("env", "--json", env=plain_env())
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["versions"]["torch"] == torch.__version__
    assert info["versions"]["tuneforge"] and info["versions"]["transformers"] != "not installed"
    # a LoRA, harness, sweep or tracker bug report needs those versions too; the dev install has each of them
    for extra in ("peft", "accelerate", "bitsandbytes", "lm_eval", "optuna", "mlflow", "sentence-transformers", "trl"):
        assert info["versions"][extra] == importlib.metadata.version(extra), extra
    assert info["devices"]["cpu_cores"] == os.cpu_count()
    assert info["devices"]["cuda"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert info["devices"]["auto_precision"] in ("fp32", "bf16", "fp16")
    # the CPU class a speed figure belongs to, and the precision `auto` picks from it
    cpu = info["devices"]["cpu"]
    assert torch.backends.cpu.get_cpu_capability() in cpu and ("native bf16" in cpu or "no native bf16" in cpu)
    if not torch.cuda.is_available():
        assert (info["devices"]["auto_precision"] == "bf16") == cpu.endswith(", native bf16)")
    assert info["process_groups"]["gloo"] is True
    assert info["launch"] == {"launcher": "none"}
    assert info["backends"]["single"] == "usable" and info["backends"]["ddp"] == "usable"
    assert all(v == "usable" or v.startswith("unusable: ") for v in info["backends"].values())


def test_env_text_lists_every_backend_with_its_verdict(capsys):
    from tuneforge import cli

    assert cli.main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("backends:")
    assert "  ddp: usable" in lines[start:] and "  single: usable" in lines[start:]
    assert any(line.startswith("  torch: ") for line in lines)


def test_env_detects_slurm(monkeypatch):
    for key in DIST_VARS:
        monkeypatch.delenv(key, raising=False)
    for key, value in {
        "SLURM_JOB_ID": "77",
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "node[01-02]",
    }.items():
        monkeypatch.setenv(key, value)
    launch = collect_env()["launch"]
    assert launch["launcher"] == "slurm"
    assert launch["slurm"] == {
        "job_id": "77",
        "procid": "1",
        "ntasks": "4",
        "localid": "1",
        "job_nodelist": "node[01-02]",
    }
    assert "rank" not in launch  # describing the environment changes nothing in it
    assert "RANK" not in os.environ


def test_env_detects_torchrun(monkeypatch):
    for key, value in {
        "TORCHELASTIC_RUN_ID": "abc",
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29400",
    }.items():
        monkeypatch.setenv(key, value)
    info = collect_env()
    assert info["launch"] == {
        "launcher": "torchrun",
        "rank": "3",
        "world_size": "4",
        "local_rank": "1",
        "master_addr": "127.0.0.1",
        "master_port": "29400",
    }
    assert "launcher: torchrun" in format_env(info)
