"""fsdp backend (FSDP2): gradient accumulation with activation checkpointing, bf16, fp16 refused.

Parity, sharded checkpoints, resume, resharding and export are in test_backend_conformance.py;
the runs compared here are the shared ones of the `backend_runs` fixture (setup "clip").
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from conftest import cli_main, max_weight_diff, train_losses


def test_fsdp_gradient_accumulation_and_checkpointing_keep_parity(backend_runs):
    """2 processes x 2 micro-batches of 4, activations recomputed: still the one-process run."""
    flags = "--backend fsdp --nproc 2 --batch-size 4 --grad-accum 2 --gradient-checkpointing".split()
    out = backend_runs.train("clip", "fsdp-accum", *flags)
    single, accum = train_losses(backend_runs["single"]), train_losses(out)
    assert max(abs(single[s] - accum[s]) for s in single) < 1e-4
    assert max_weight_diff(backend_runs["single"] / "model", out / "model") < 1e-4


def test_fsdp_bf16_mixed_precision_trains_near_fp32(backend_runs):
    out = backend_runs.train("clip", "fsdp-bf16", "--backend", "fsdp", "--batch-size", "16", precision="bf16")
    single, bf16 = train_losses(backend_runs["single"]), train_losses(out)
    gaps = [abs(single[s] - bf16[s]) for s in single]
    assert max(gaps) < 2e-2  # bf16 compute, fp32 master weights and gradient reduction
    assert max(gaps) > 1e-6  # ... and it did compute in bf16
    assert {t.dtype for t in load_file(out / "model" / "model.safetensors").values()} == {torch.float32}


def test_fsdp_fp16_is_refused_before_launch(tmp_path, backend_runs, capfd):
    """In this process (no launch happens): capfd holds what a launched worker would print too."""
    args = backend_runs.args("clip", tmp_path / "run", "--backend", "fsdp", "--nproc", "2", precision="fp16")
    code, _, err = cli_main(capfd, *args)
    assert code == 2
    assert err.strip() == "error: backend 'fsdp' does not support precision fp16; use --precision bf16 (or fp32)"
