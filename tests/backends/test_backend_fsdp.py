"""fsdp backend (FSDP2): parity with one process, HF export, sharded checkpoints and resume.

The runs that several tests compare are made once per module: one process (batch 16) and
2 FSDP processes (2 x 8), both saving a checkpoint at step 10 of 20.
"""
from __future__ import annotations

import pytest
import torch
from conftest import last_json, read_jsonl, run_cli, write_sentiment_csv
from safetensors.torch import load_file

STEPS = 20


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """320 training rows (20 global batches of 16) and 33 evaluation rows."""
    d = tmp_path_factory.mktemp("fsdp-data")
    return write_sentiment_csv(d / "train.csv", 320, seed=1), write_sentiment_csv(d / "validation.csv", 33, seed=2)


def train_args(tiny_bert, data, cache_dir, out, *extra) -> list[str]:
    train, val = data
    # clipping at 0.01 is active (the gradient norm starts near 0.02): the sharded norm counts too
    return ["train", "--train-file", str(train), "--validation-file", str(val), "--model", tiny_bert,
            "--max-steps", str(STEPS), "--precision", "fp32", "--logging-steps", "1", "--lr", "1e-2",
            "--max-grad-norm", "0.01", "--eval-strategy", "no", "--cache-dir", cache_dir, "--output-dir", str(out),
            "--json", "--quiet", *extra]


def train(*args) -> dict:
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return last_json(proc.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_bert, data, cache_dir):
    root = tmp_path_factory.mktemp("fsdp-runs")
    save = ("--save-strategy", "steps", "--save-steps", "10")
    train(*train_args(tiny_bert, data, cache_dir, root / "single", "--batch-size", "16", *save))
    train(*train_args(tiny_bert, data, cache_dir, root / "fsdp", "--backend", "fsdp", "--nproc", "2", "--batch-size", "8", *save))
    return root


def train_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "train"}


def max_weight_diff(dir_a, dir_b) -> float:
    a, b = load_file(dir_a / "model.safetensors"), load_file(dir_b / "model.safetensors")
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_fsdp_per_step_losses_match_one_process(runs):
    single, fsdp = train_losses(runs / "single"), train_losses(runs / "fsdp")
    assert sorted(single) == sorted(fsdp) == list(range(1, STEPS + 1))
    assert max(single.values()) - min(single.values()) > 0.01  # the model learns: the comparison means something
    assert max(abs(single[s] - fsdp[s]) for s in single) < 1e-4


def test_fsdp_final_weights_match_one_process(runs, tiny_bert):
    assert max_weight_diff(runs / "single" / "model", runs / "fsdp" / "model") < 1e-4
    start = load_file(f"{tiny_bert}/model.safetensors")["encoder.layer.0.attention.self.query.weight"]
    trained = load_file(runs / "fsdp" / "model" / "model.safetensors")["bert.encoder.layer.0.attention.self.query.weight"]
    assert (trained - start).abs().max() > 1e-3  # the sharded weights were trained and gathered


def test_fsdp_model_folder_predicts_like_one_process(runs):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(runs / "single" / "model")
    batch = tok(["a wonderful, moving film", "a dull and tedious mess so very"], return_tensors="pt", padding=True)
    logits = {}
    for name in ("single", "fsdp"):
        model = AutoModelForSequenceClassification.from_pretrained(runs / name / "model").eval()
        assert model.config.architectures == ["BertForSequenceClassification"]
        with torch.no_grad():
            logits[name] = model(**batch).logits
    assert torch.allclose(logits["single"], logits["fsdp"], atol=1e-4)


def test_fsdp_checkpoint_holds_one_shard_per_rank(runs):
    ckpt = runs / "fsdp" / "checkpoint-10"
    shards = sorted(p.name for p in (ckpt / "sharded").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    assert (ckpt / "sharded" / ".metadata").exists()
    assert not (ckpt / "model.safetensors").exists()  # no full copy gathered at save time


def test_fsdp_resume_continues_with_identical_losses(runs, tiny_bert, data, cache_dir):
    out = runs / "fsdp-resumed"
    train(*train_args(tiny_bert, data, cache_dir, out, "--backend", "fsdp", "--nproc", "2", "--batch-size", "8",
                      "--resume", str(runs / "fsdp" / "checkpoint-10")))
    whole, resumed = train_losses(runs / "fsdp"), train_losses(out)
    assert sorted(resumed) == list(range(11, STEPS + 1))
    assert all(resumed[s] == whole[s] for s in resumed)
    assert max_weight_diff(runs / "fsdp" / "model", out / "model") == 0.0


def test_fsdp_checkpoint_reshards_onto_one_process(runs, tiny_bert, data, cache_dir):
    """2 ranks' shards into a world of one (DCP reshards), with 2 accumulated micro-batches of 8."""
    out = runs / "fsdp-on-one"
    train(*train_args(tiny_bert, data, cache_dir, out, "--backend", "fsdp", "--batch-size", "8", "--grad-accum", "2",
                      "--resume", str(runs / "fsdp" / "checkpoint-10")))
    whole, resumed = train_losses(runs / "fsdp"), train_losses(out)
    assert sorted(resumed) == list(range(11, STEPS + 1))
    assert max(abs(resumed[s] - whole[s]) for s in resumed) < 1e-4
    assert max_weight_diff(runs / "fsdp" / "model", out / "model") < 1e-4


def test_fsdp_resumes_from_a_single_process_checkpoint(runs, tiny_bert, data, cache_dir):
    """model.safetensors + optimizer.pt (single/ddp layout) load into sharded parameters."""
    out = runs / "single-to-fsdp"
    train(*train_args(tiny_bert, data, cache_dir, out, "--backend", "fsdp", "--batch-size", "16",
                      "--resume", str(runs / "single" / "checkpoint-10")))
    whole, resumed = train_losses(runs / "single"), train_losses(out)
    assert sorted(resumed) == list(range(11, STEPS + 1))
    assert max(abs(resumed[s] - whole[s]) for s in resumed) < 1e-4
    assert max_weight_diff(runs / "single" / "model", out / "model") < 1e-4


def test_fsdp_gradient_accumulation_and_checkpointing_keep_parity(runs, tiny_bert, data, cache_dir):
    """2 processes x 2 micro-batches of 4, activations recomputed: still the one-process run."""
    out = runs / "fsdp-accum"
    train(*train_args(tiny_bert, data, cache_dir, out, "--backend", "fsdp", "--nproc", "2", "--batch-size", "4",
                      "--grad-accum", "2", "--gradient-checkpointing"))
    single, accum = train_losses(runs / "single"), train_losses(out)
    assert max(abs(single[s] - accum[s]) for s in single) < 1e-4
    assert max_weight_diff(runs / "single" / "model", out / "model") < 1e-4


def test_fsdp_bf16_mixed_precision_trains_near_fp32(runs, tiny_bert, data, cache_dir):
    out = runs / "fsdp-bf16"
    args = train_args(tiny_bert, data, cache_dir, out, "--backend", "fsdp", "--batch-size", "16")
    args[args.index("--precision") + 1] = "bf16"
    train(*args)
    single, bf16 = train_losses(runs / "single"), train_losses(out)
    gaps = [abs(single[s] - bf16[s]) for s in single]
    assert max(gaps) < 2e-2  # bf16 compute, fp32 master weights and gradient reduction
    assert max(gaps) > 1e-6  # ... and it did compute in bf16
    assert {t.dtype for t in load_file(out / "model" / "model.safetensors").values()} == {torch.float32}


def test_fsdp_fp16_is_refused_before_launch(tmp_path, tiny_bert, data, cache_dir):
    args = train_args(tiny_bert, data, cache_dir, tmp_path / "run", "--backend", "fsdp", "--nproc", "2")
    args[args.index("--precision") + 1] = "fp16"
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: backend 'fsdp' does not support precision fp16; use --precision bf16 (or fp32)"


def test_fsdp_reports_usable():
    from tuneforge.backends.fsdp import BACKEND

    assert BACKEND.usable() == "usable"
    assert BACKEND.distributed and BACKEND.sharded
