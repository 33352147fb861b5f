"""load_best_model_at_end on a sharded backend: every rank takes the same export path (no hang)."""

import json

from safetensors.torch import load_file

from conftest import last_json, run_cli, write_sentiment_csv


def test_deepspeed_zero3_load_best_model_at_end_finishes(tmp_path, tiny_bert, cache_dir):
    train = write_sentiment_csv(tmp_path / "train.csv", 64, seed=5)
    val = write_sentiment_csv(tmp_path / "val.csv", 16, seed=6)
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        "--train-file",
        str(train),
        "--validation-file",
        str(val),
        "--model",
        tiny_bert,
        "--backend",
        "deepspeed",
        "--zero-stage",
        "3",
        "--nproc",
        "2",
        "--batch-size",
        "8",
        "--epochs",
        "3",
        "--lr",
        "5e-3",
        "--precision",
        "fp32",
        "--load-best-model-at-end",
        "--metric-for-best",
        "loss",
        "--output-dir",
        str(out),
        "--cache-dir",
        cache_dir,
        "--quiet",
        "--json",
        env={"OMP_NUM_THREADS": "1"},
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    best = min(evals, key=lambda r: r["loss"])
    assert result["best_step"] == best["step"] and abs(result["loss"] - best["loss"]) < 1e-9
    weights = load_file(str(out / "model" / "model.safetensors"))
    assert weights and all(t.numel() > 0 for t in weights.values())  # gathered, never empty ZeRO-3 placeholders
