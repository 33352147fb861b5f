"""End-to-end: a tiny run through the CLI writes a run folder that transformers loads."""

from conftest import cli_flags, last_json, read_jsonl, run_cli, train_command


def test_train_tiny_csv_end_to_end(tmp_path, tiny_bert, sentiment_files, cache_dir):
    out = tmp_path / "run"
    run = cli_flags(epochs=2, batch_size=16, lr="1e-3", output_dir=out, cache_dir=cache_dir, json=True, quiet=True)
    proc = run_cli(*train_command(sentiment_files, tiny_bert), *run, env={"DS_ACCELERATOR": None})  # as a user runs
    assert proc.returncode == 0, proc.stderr
    # --json --quiet: stdout is the result line alone (DeepSpeed, installed here, logs to stdout when
    # save_pretrained imports it: its "Setting accelerator to CPU" notice is hidden unless it is the backend)
    assert len(proc.stdout.strip().splitlines()) == 1, proc.stdout
    assert "Setting accelerator" not in proc.stderr
    result = last_json(proc.stdout)
    assert result["num_examples"] == 33
    assert 0.0 <= result["accuracy"] <= 1.0 and result["train_loss"] > 0
    assert (out / "config.yaml").exists() and (out / "model" / "model.safetensors").exists()
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["split"] == "eval"] == [6, 12]

    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert model.config.id2label == {0: "neg", 1: "pos"}
