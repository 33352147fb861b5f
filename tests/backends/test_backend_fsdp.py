"""fsdp backend (FSDP2): parity with one process, HF export, sharded checkpoints and resume.

The runs that several tests compare are made once per module: one process (batch 16) and
2 FSDP processes (2 x 8), both saving a checkpoint at step 10 of 20.
"""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    backend_train_args,
    classify_reviews,
    first_query_weights,
    max_weight_diff,
    parity_loss_gap,
    resume_at_step_10,
    run_cli,
    sentiment_split,
    train_losses,
    train_ok,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """320 training rows (20 global batches of 16) and 33 evaluation rows."""
    return sentiment_split(tmp_path_factory.mktemp("fsdp-data"), 320, 33)


@pytest.fixture(scope="module")
def train_args(tiny_bert, data, cache_dir):
    """(out, *flags, precision=...) -> the CLI arguments of a 20-step run of tiny_bert."""
    # clipping at 0.01 is active (the gradient norm starts near 0.02): the sharded norm counts too
    return functools.partial(backend_train_args, tiny_bert, data, cache_dir, max_grad_norm="0.01")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, train_args):
    root = tmp_path_factory.mktemp("fsdp-runs")
    save = ("--save-strategy", "steps", "--save-steps", "10")
    train_ok(*train_args(root / "single", "--batch-size", "16", *save))
    train_ok(*train_args(root / "fsdp", "--backend", "fsdp", "--nproc", "2", "--batch-size", "8", *save))
    return root


def test_fsdp_per_step_losses_match_one_process(runs):
    assert parity_loss_gap(runs / "single", runs / "fsdp") < 1e-4


def test_fsdp_final_weights_match_one_process(runs, tiny_bert):
    assert max_weight_diff(runs / "single" / "model", runs / "fsdp" / "model") < 1e-4
    start, trained = first_query_weights(tiny_bert, runs / "fsdp" / "model")
    assert (trained - start).abs().max() > 1e-3  # the sharded weights were trained and gathered


def test_fsdp_model_folder_predicts_like_one_process(runs):
    (single_model, single), (fsdp_model, fsdp) = classify_reviews(runs / "single" / "model", runs / "fsdp" / "model")
    for model in (single_model, fsdp_model):
        assert model.config.architectures == ["BertForSequenceClassification"]
    assert torch.allclose(single, fsdp, atol=1e-4)


def test_fsdp_checkpoint_holds_one_shard_per_rank(runs):
    ckpt = runs / "fsdp" / "checkpoint-10"
    shards = sorted(p.name for p in (ckpt / "sharded").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    assert (ckpt / "sharded" / ".metadata").exists()
    assert not (ckpt / "model.safetensors").exists()  # no full copy gathered at save time


def test_fsdp_resume_continues_with_identical_losses(runs, train_args):
    whole, resumed, out = resume_at_step_10(
        train_args, runs, "fsdp", "fsdp-resumed", "--backend", "fsdp", "--nproc", "2", "--batch-size", "8"
    )
    assert all(resumed[s] == whole[s] for s in resumed)
    assert max_weight_diff(runs / "fsdp" / "model", out / "model") == 0.0


def test_fsdp_checkpoint_reshards_onto_one_process(runs, train_args):
    """2 ranks' shards into a world of one (DCP reshards), with 2 accumulated micro-batches of 8."""
    whole, resumed, out = resume_at_step_10(
        train_args, runs, "fsdp", "fsdp-on-one", "--backend", "fsdp", "--batch-size", "8", "--grad-accum", "2"
    )
    assert max(abs(resumed[s] - whole[s]) for s in resumed) < 1e-4
    assert max_weight_diff(runs / "fsdp" / "model", out / "model") < 1e-4


def test_fsdp_resumes_from_a_single_process_checkpoint(runs, train_args):
    """model.safetensors + optimizer.pt (single/ddp layout) load into sharded parameters."""
    whole, resumed, out = resume_at_step_10(
        train_args, runs, "single", "single-to-fsdp", "--backend", "fsdp", "--batch-size", "16"
    )
    assert max(abs(resumed[s] - whole[s]) for s in resumed) < 1e-4
    assert max_weight_diff(runs / "single" / "model", out / "model") < 1e-4


def test_fsdp_gradient_accumulation_and_checkpointing_keep_parity(runs, train_args):
    """2 processes x 2 micro-batches of 4, activations recomputed: still the one-process run."""
    out = runs / "fsdp-accum"
    train_ok(
        *train_args(
            out,
            "--backend",
            "fsdp",
            "--nproc",
            "2",
            "--batch-size",
            "4",
            "--grad-accum",
            "2",
            "--gradient-checkpointing",
        )
    )
    single, accum = train_losses(runs / "single"), train_losses(out)
    assert max(abs(single[s] - accum[s]) for s in single) < 1e-4
    assert max_weight_diff(runs / "single" / "model", out / "model") < 1e-4


def test_fsdp_bf16_mixed_precision_trains_near_fp32(runs, train_args):
    out = runs / "fsdp-bf16"
    train_ok(*train_args(out, "--backend", "fsdp", "--batch-size", "16", precision="bf16"))
    single, bf16 = train_losses(runs / "single"), train_losses(out)
    gaps = [abs(single[s] - bf16[s]) for s in single]
    assert max(gaps) < 2e-2  # bf16 compute, fp32 master weights and gradient reduction
    assert max(gaps) > 1e-6  # ... and it did compute in bf16
    assert {t.dtype for t in load_file(out / "model" / "model.safetensors").values()} == {torch.float32}


def test_fsdp_fp16_is_refused_before_launch(tmp_path, train_args):
    proc = run_cli(*train_args(tmp_path / "run", "--backend", "fsdp", "--nproc", "2", precision="fp16"))
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == "error: backend 'fsdp' does not support precision fp16; use --precision bf16 (or fp32)"
    )


def test_fsdp_reports_usable():
    from tuneforge.backends.fsdp import BACKEND

    assert BACKEND.usable() == "usable"
    assert BACKEND.distributed and BACKEND.sharded
