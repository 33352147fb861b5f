"""deepspeed backend: the derived DeepSpeed config and a user JSON merged into it (or refused when it
contradicts tuneforge's config), ZeRO shard files, and load_best_model_at_end under ZeRO-3.

Parity with one process for ZeRO 1/2/3 (with CPU offload), the exact resume of a DeepSpeed-format
checkpoint and its offline export are in test_backend_conformance.py. The runs (setup "zero" of the
`backend_runs` fixture, 2 CPU processes with gloo):
    zero-single   one process, batch 16
    zero1         2 x 8
    zero2         2 x 4 x grad-accum 2, optimizer offload, a checkpoint every 5 steps
    zero3         2 x 8, a user JSON ("auto" batch size; every parameter partitioned), a checkpoint at the end
    zero3-offload 2 x 8, optimizer and parameter offload, the same JSON
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from conftest import cli_main, last_json, run_cli, write_sentiment_csv


def test_derived_config_with_user_json_merged(backend_runs):
    runs = backend_runs
    resolved = json.loads((runs["zero3"] / "deepspeed_config.json").read_text())
    assert resolved["train_micro_batch_size_per_gpu"] == 8  # "auto" took tuneforge's value
    assert resolved["train_batch_size"] == 16 and resolved["gradient_accumulation_steps"] == 1
    assert resolved["gradient_clipping"] == 0.1 and resolved["bf16"] == {"enabled": False}
    zero = resolved["zero_optimization"]
    assert (
        zero["stage"] == 3 and zero["stage3_param_persistence_threshold"] == 0 and zero["reduce_bucket_size"] == 100000
    )
    assert zero["offload_optimizer"] == {"device": "none"} and zero["offload_param"] == {"device": "none"}
    offload = json.loads((runs["zero3-offload"] / "deepspeed_config.json").read_text())["zero_optimization"]
    assert offload["offload_optimizer"] == {"device": "cpu"} and offload["offload_param"] == {"device": "cpu"}
    accum = json.loads((runs["zero2"] / "deepspeed_config.json").read_text())
    assert (
        accum["train_micro_batch_size_per_gpu"],
        accum["gradient_accumulation_steps"],
        accum["train_batch_size"],
    ) == (4, 2, 16)


def test_zero2_checkpoint_holds_each_ranks_optimizer_shard(backend_runs):
    shards = sorted(p.name for p in (backend_runs["zero2"] / "checkpoint-5" / "deepspeed").iterdir())
    assert (
        "zero_pp_rank_0_mp_rank_00_optim_states.pt" in shards and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in shards
    )


@pytest.mark.parametrize(
    "user_json, extra, needles",
    [
        (
            {"train_micro_batch_size_per_gpu": 4},
            (),
            [
                "deepspeed config train_micro_batch_size_per_gpu=4 conflicts with batch_size=8",
                "remove it from the JSON or change --batch-size",
            ],
        ),
        (
            {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}},
            ("--zero-stage", "3"),
            ["deepspeed config bf16.enabled=true conflicts with precision=fp32", "--precision"],
        ),
        ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}, (), ["sets 'optimizer'", "--lr"]),
        ({"gradient_clipping": float("inf")}, (), ["is not valid JSON (Infinity is not a JSON number", "finite"]),
        (None, ("--zero-stage", "2", "--offload", "params"), ["offload=params", "ZeRO stage 3", "--zero-stage 3"]),
    ],
)
def test_bad_deepspeed_settings_are_refused(tmp_path, tiny_bert, backend_runs, capfd, user_json, extra, needles):
    """Refused in this process, the launching one: capfd holds what a launched worker would print too."""
    args = [
        "train",
        "--train-file",
        str(backend_runs.data("zero")["train"]),
        "--model",
        tiny_bert,
        "--backend",
        "deepspeed",
        "--nproc",
        "2",
        "--batch-size",
        "8",
        "--precision",
        "fp32",
        "--output-dir",
        str(tmp_path / "out"),
        *extra,
    ]
    if user_json is not None:
        (tmp_path / "ds.json").write_text(json.dumps(user_json))
        args += ["--deepspeed-config", str(tmp_path / "ds.json")]
    code, _, err = cli_main(capfd, *args)
    assert code == 2, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (tmp_path / "out").exists()  # refused before any worker started


def test_deepspeed_zero3_load_best_model_at_end_finishes(tmp_path, tiny_bert, cache_dir):
    """load_best_model_at_end on a sharded backend: every rank takes the same export path (no hang)."""
    train = write_sentiment_csv(tmp_path / "train.csv", 64, seed=5)
    val = write_sentiment_csv(tmp_path / "val.csv", 16, seed=6)
    out = tmp_path / "run"
    flags = "--backend deepspeed --zero-stage 3 --nproc 2 --batch-size 8 --epochs 3 --lr 5e-3 --precision fp32"
    flags += " --load-best-model-at-end --metric-for-best loss --quiet --json"
    files = ["--train-file", str(train), "--validation-file", str(val), "--model", tiny_bert]
    dirs = ["--output-dir", str(out), "--cache-dir", cache_dir]
    proc = run_cli("train", *files, *flags.split(), *dirs, timeout=400)  # forked (one thread: conftest)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    best = min(evals, key=lambda r: r["loss"])
    assert result["best_step"] == best["step"] and abs(result["loss"] - best["loss"]) < 1e-9
    weights = load_file(str(out / "model" / "model.safetensors"))
    assert weights and all(t.numel() > 0 for t in weights.values())  # gathered, never empty ZeRO-3 placeholders


def test_a_bf16_run_exports_its_fp32_weights_as_fp32(tmp_path, tiny_bert, cache_dir):
    """The model folder holds ZeRO's fp32 master weights, and its config.json says so: from_pretrained loads them in
    fp32, as it loads the offline export of the same checkpoint (the bf16 engine's module once named bf16 there)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from conftest import classify_reviews

    train = write_sentiment_csv(tmp_path / "train.csv", 32, seed=5)
    out = tmp_path / "run"
    flags = "--backend deepspeed --zero-stage 2 --nproc 2 --batch-size 8 --max-steps 2 --precision bf16 --save-steps 2"
    proc = run_cli(
        "train", "--train-file", str(train), "--model", tiny_bert, "--output-dir", str(out), "--cache-dir", cache_dir,
        "--eval-strategy", "no", "--quiet", *flags.split(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("export", str(out / "checkpoint-2"), str(tmp_path / "exported"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for folder in (out / "model", tmp_path / "exported"):
        assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
        assert AutoModelForSequenceClassification.from_pretrained(folder).dtype == torch.float32
    (_, live), (_, offline) = classify_reviews(out / "model", tmp_path / "exported")
    assert torch.equal(live, offline)
