"""Gradient accumulation equals the large batch, with the default length-grouped order."""

from conftest import cli_flags, read_jsonl, run_cli, train_command, write_sentiment_csv


def _losses(tmp_path, tiny_bert, cache_dir, name, **batch):
    train = write_sentiment_csv(tmp_path / "train.csv", 80, seed=3)
    val = write_sentiment_csv(tmp_path / "val.csv", 8, seed=4)
    out = tmp_path / name
    run = cli_flags(max_steps=6, logging_steps=1, precision="fp32", lr="1e-2", eval_strategy="no", **batch)
    args = train_command((train, val), tiny_bert, output_dir=out, cache_dir=cache_dir, quiet=True)
    proc = run_cli(*args, *run)  # forked: one thread, as conftest sets OMP_NUM_THREADS
    assert proc.returncode == 0, proc.stderr
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train"]


def test_accumulation_equals_large_batch(tmp_path, tiny_bert, cache_dir):
    large = _losses(tmp_path, tiny_bert, cache_dir, "large", batch_size=16)
    accumulated = _losses(tmp_path, tiny_bert, cache_dir, "accum", batch_size=4, grad_accum=4)
    assert len(large) == len(accumulated) == 6
    assert max(abs(a - b) for a, b in zip(large, accumulated)) < 1e-5, (large, accumulated)
    assert len(set(round(x, 6) for x in large)) > 1  # the loss really moves: the check can fail
