"""End-to-end: a tiny run through the CLI writes a run folder that transformers loads."""

from conftest import last_json, read_jsonl, run_cli


def test_train_tiny_csv_end_to_end(tmp_path, tiny_bert, sentiment_files, cache_dir):
    train, val = sentiment_files
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        "--train-file",
        str(train),
        "--validation-file",
        str(val),
        "--model",
        tiny_bert,
        "--epochs",
        "2",
        "--batch-size",
        "16",
        "--lr",
        "1e-3",
        "--output-dir",
        str(out),
        "--cache-dir",
        cache_dir,
        "--json",
        "--quiet",
    )
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert result["num_examples"] == 33
    assert 0.0 <= result["accuracy"] <= 1.0 and result["train_loss"] > 0
    assert (out / "config.yaml").exists() and (out / "model" / "model.safetensors").exists()
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["split"] == "eval"] == [6, 12]

    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert model.config.id2label == {0: "neg", 1: "pos"}
