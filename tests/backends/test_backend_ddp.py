"""ddp backend: exact parity with one process, exact evaluation, resume, world size 1.

One training run in one process (batch 16, in this process) and one in 2 DDP processes (2 x 8)
are shared by the tests that compare them (each 2-process run costs ~10 s of start-up). The
resume test also covers "under an external launcher (torchrun), tuneforge launches nothing".
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import PARITY_STEPS as STEPS
from conftest import (
    REPO,
    backend_train_args,
    classify_reviews,
    last_json,
    max_weight_diff,
    parity_loss_gap,
    run_cli,
    sentiment_split,
    train_losses,
)
from tuneforge import cli, launch


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """320 training rows (20 global batches of 16) and a 101-row eval set (odd: uneven rank shares)."""
    return sentiment_split(tmp_path_factory.mktemp("ddp-data"), 320, 101)


@pytest.fixture(scope="module")
def train_args(tiny_bert, data, cache_dir):
    """(out, *flags) -> the CLI arguments of a 20-step run of tiny_bert (no clipping)."""
    return functools.partial(backend_train_args, tiny_bert, data, cache_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, train_args):
    """{'single': run dir, 'ddp': run dir, ...}: the same training, 1 x 16 and 2 x 8."""
    root = tmp_path_factory.mktemp("ddp-runs")
    assert cli.main(train_args(root / "single", "--batch-size", "16")) == 0
    ddp = run_cli(
        *train_args(
            root / "ddp",
            "--backend",
            "ddp",
            "--nproc",
            "2",
            "--batch-size",
            "8",
            "--save-strategy",
            "steps",
            "--save-steps",
            "10",
        )
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    return {
        "single": root / "single",
        "ddp": root / "ddp",
        "root": root,
        "single_result": json.loads((root / "single" / "result.json").read_text()),
        "ddp_result": last_json(ddp.stdout),
        "ddp_stdout": ddp.stdout,
    }


def test_ddp_per_step_losses_match_one_process(runs):
    assert parity_loss_gap(runs["single"], runs["ddp"]) < 1e-4


def test_ddp_final_weights_match_one_process(runs):
    assert max_weight_diff(runs["single"] / "model", runs["ddp"] / "model") < 1e-4
    assert runs["ddp_result"]["steps"] == STEPS
    # the launching parent prints the result once; the workers print nothing
    assert sum(line.startswith("{") for line in runs["ddp_stdout"].splitlines()) == 1


def test_ddp_model_folder_predicts_like_one_process(runs):
    (_, single), (_, ddp) = classify_reviews(runs["single"] / "model", runs["ddp"] / "model")
    assert torch.allclose(single, ddp, atol=1e-4)


def test_ddp_eval_counts_each_example_once_and_equals_one_process(runs, data, cache_dir):
    """Same weights (the single run's model) evaluated by 2 DDP processes and by one."""
    train, val = data
    model = runs["single"] / "model"
    args = [
        "eval",
        str(model),
        "--task",
        "classification",
        "--train-file",
        str(train),
        "--validation-file",
        str(val),
        "--cache-dir",
        cache_dir,
        "--precision",
        "fp32",
        "--eval-batch-size",
        "16",
        "--json",
        "--quiet",
    ]
    ddp = run_cli(*args, "--backend", "ddp", "--nproc", "2", "--output-dir", str(runs["root"] / "eval-ddp"))
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    one = runs["single_result"]  # computed in-process at the end of the single run, same weights
    metrics = last_json(ddp.stdout)
    assert metrics["num_examples"] == one["num_examples"] == 101
    assert 0.5 < one["accuracy"] < 1.0 and 0.0 < one["f1"] < 1.0  # both classes predicted: counting matters
    assert metrics["accuracy"] == one["accuracy"] and metrics["f1"] == one["f1"]
    assert metrics["loss"] == pytest.approx(one["loss"], rel=1e-6)  # summation order differs, nothing else


def test_ddp_resume_under_external_torchrun_continues_exactly(runs, train_args):
    """The main rank wrote checkpoint-10; both ranks load it and finish the run as if never stopped.

    Started by torchrun itself (with nproc=2 in the config): tuneforge uses that environment and
    launches nothing more (a nested launch would make each worker a parent: two results printed,
    two writers of metrics.jsonl).
    """
    ckpt = runs["ddp"] / "checkpoint-10"
    assert (ckpt / "model.safetensors").exists() and (ckpt / "optimizer.pt").exists()
    out = runs["root"] / "ddp-resumed"
    args = train_args(out, "--backend", "ddp", "--batch-size", "8", "--resume", str(ckpt))
    args.insert(1, "nproc=2")  # an override, not --nproc: torchrun's parser would take that for its --nproc-per-node
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(launch.free_port()),
        "-m",
        "tuneforge.cli",
        *args,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TUNEFORGE_LAUNCHED")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum(line.startswith("{") for line in proc.stdout.splitlines()) == 1
    resumed, whole = train_losses(out), train_losses(runs["ddp"])
    assert sorted(resumed) == list(range(11, STEPS + 1))
    assert max(abs(resumed[s] - whole[s]) for s in resumed) < 1e-6
    assert max_weight_diff(runs["ddp"] / "model", out / "model") < 1e-6


def in_process_run(tiny_bert, data, cache_dir, out, **overrides) -> dict:
    from tuneforge.config import build_config
    from tuneforge.trainer import Trainer

    train, val = data
    cfg = build_config(
        {
            "task": "classification",
            "model": tiny_bert,
            "output_dir": str(out),
            "max_steps": 3,
            "batch_size": 8,
            "precision": "fp32",
            "eval_strategy": "no",
            "quiet": True,
            "optim": {"lr": 1e-2},
            "data": {
                "train_file": str(train),
                "validation_file": str(val),
                "cache_dir": cache_dir,
                "max_eval_samples": 16,
            },
            **overrides,
        }
    )
    trainer = Trainer(cfg)
    result = trainer.fit()
    result["world_size"] = trainer.backend.world_size
    return result


def test_ddp_with_one_process_runs_as_world_size_one(tmp_path, tiny_bert, data, cache_dir):
    """`--backend ddp` without a launch: a process group of one, identical to `single`."""
    single = in_process_run(tiny_bert, data, cache_dir, tmp_path / "single")
    ddp = in_process_run(tiny_bert, data, cache_dir, tmp_path / "ddp", backend="ddp")
    assert ddp["world_size"] == 1 and ddp["steps"] == 3
    assert not torch.distributed.is_initialized()  # torn down again
    assert max_weight_diff(tmp_path / "single" / "model", tmp_path / "ddp" / "model") == 0.0
    assert ddp["train_loss"] == single["train_loss"]


def test_ddp_bf16_with_gradient_checkpointing_and_accumulation(tmp_path, tiny_bert, data, cache_dir):
    result = in_process_run(
        tiny_bert,
        data,
        cache_dir,
        tmp_path / "bf16",
        backend="ddp",
        precision="bf16",
        gradient_checkpointing=True,
        grad_accum=2,
        batch_size=4,
    )
    assert result["steps"] == 3 and result["train_loss"] == pytest.approx(0.69, abs=0.1)
    meta = json.loads((tmp_path / "bf16" / "model" / "config.json").read_text())
    assert meta["architectures"] == ["BertForSequenceClassification"]


def test_ddp_reports_itself_usable_here():
    from tuneforge.backends.ddp import BACKEND

    assert BACKEND.distributed and BACKEND.usable() == "usable"
