"""The classification task: metrics by name, GLUE regression and MCC runs, label ids saved with the
model, and evaluating a fine-tuned model on a validation file alone."""

import json

import numpy as np
import pytest

from conftest import cli_flags, last_json, run_cli, tokenized_fresh_then_cached, train_command
from tuneforge.config import TrainConfig
from tuneforge.tasks.classification import classification_metrics
from tuneforge.trainer import Trainer


def test_metrics_by_name():
    preds, labels = np.array([1, 0, 1, 1, 0, 0]), np.array([1, 0, 0, 1, 0, 1])
    m = classification_metrics(preds, labels, ("accuracy", "f1", "mcc"), num_labels=2)
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert m["f1"] == pytest.approx(2 / 3)  # precision 2/3, recall 2/3
    assert m["mcc"] == pytest.approx(1 / 3)  # (tp*tn - fp*fn) / sqrt(...) = (4 - 1) / 9
    scores, gold = np.array([0.1, 0.4, 0.35, 0.8]), np.array([0.0, 1.0, 2.0, 3.0])
    r = classification_metrics(scores, gold, ("pearson", "spearman"), num_labels=1)
    assert r["spearman"] == pytest.approx(0.8)  # one swapped pair of ranks
    assert r["pearson"] == pytest.approx(np.corrcoef(scores, gold)[0, 1])
    multi = classification_metrics(np.array([0, 1, 2, 2]), np.array([0, 1, 2, 1]), ("accuracy", "f1"), num_labels=3)
    assert multi["f1"] == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)  # macro over 3 classes


def test_an_undefined_metric_is_nan_or_sklearns_zero_without_a_library_warning():
    """A correlation of constant predictions (or labels) is undefined: nan (written as null), with no scipy
    ConstantInputWarning on stderr, which --quiet promises to keep to errors; MCC of one label only is sklearn's
    0.0, with no sklearn warning either."""
    import warnings

    constant, gold = np.array([0.5, 0.5, 0.5]), np.array([0.0, 1.0, 2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for preds, labels in ((constant, gold), (gold, constant), (constant, constant)):
            r = classification_metrics(preds, labels, ("pearson", "spearman"), num_labels=1)
            assert np.isnan(r["pearson"]) and np.isnan(r["spearman"])
        overflowed = classification_metrics(np.array([np.inf, 1.0, 2.0]), gold, ("pearson",), num_labels=1)
        assert np.isnan(overflowed["pearson"])  # an fp16 forward's score past its range
        one_label = classification_metrics(np.zeros(4, int), np.zeros(4, int), ("accuracy", "mcc"), num_labels=2)
    assert one_label == {"accuracy": 1.0, "mcc": 0.0}


def glue_config(tmp_path, name, folder, tiny_bert, cache_dir, **extra):
    return TrainConfig(
        task=f"glue/{name}",
        model=tiny_bert,
        output_dir=str(tmp_path / name),
        max_steps=3,
        batch_size=16,
        quiet=True,
        data={"data_dir": str(folder), "max_train_samples": 64, "max_eval_samples": 96, "cache_dir": cache_dir},
        **extra,
    )


def test_glue_stsb_trains_as_regression(tmp_path, shared_data, tiny_bert, cache_dir):
    result = Trainer(glue_config(tmp_path, "stsb", shared_data / "glue" / "STS-B", tiny_bert, cache_dir)).fit()
    assert set(result) >= {"pearson", "spearman", "loss", "train_loss"} and "accuracy" not in result
    assert result["num_examples"] == 96
    assert -1 <= result["pearson"] <= 1 and -1 <= result["spearman"] <= 1
    from transformers import AutoConfig

    saved = AutoConfig.from_pretrained(result["model_dir"])
    assert saved.num_labels == 1 and saved.problem_type == "regression"


def test_glue_cola_reports_mcc(tmp_path, shared_data, tiny_bert, cache_dir):
    result = Trainer(glue_config(tmp_path, "cola", shared_data / "glue" / "CoLA", tiny_bert, cache_dir)).fit()
    assert {"mcc", "accuracy"} <= set(result) and "f1" not in result
    assert -1 <= result["mcc"] <= 1 and result["num_examples"] == 96
    info = json.loads((tmp_path / "cola" / "model" / "tuneforge.json").read_text())
    assert info["task"] == "glue/cola" and info["text_columns"] == ["sentence"]


def test_eval_of_an_exported_folder_takes_its_task_and_refuses_another_kind(
    tmp_path, shared_data, tiny_bert, cache_dir, capsys
):
    """`tuneforge eval FOLDER` evaluates the task FOLDER was trained for (it once needed --task glue/cola again, and
    without it fell to the bundled BBC News task); a --task of another kind of model (a tagger for a classifier)
    would score a new, untrained head, and is refused in one line."""
    from conftest import cli_main

    run = tmp_path / "cola"
    Trainer(glue_config(tmp_path, "cola", shared_data / "glue" / "CoLA", tiny_bert, cache_dir)).fit()
    data = cli_flags(data_dir=shared_data / "glue" / "CoLA", max_eval_samples=96, output_dir=tmp_path / "eval")
    code, out, err = cli_main(capsys, "eval", str(run / "model"), *data, "--json", "--quiet")
    assert code == 0, err
    assert {"mcc", "accuracy"} <= set(json.loads(out.strip().splitlines()[-1]))
    code, _, err = cli_main(capsys, "eval", str(run / "model"), "--task", "ner", *data)
    assert code == 2 and err.strip() == (
        f"error: model {str(run / 'model')!r} was trained as glue/cola (a sequence-classification model); --task ner "
        "evaluates a token-classification model, which would score a new, untrained head on it: drop --task or "
        "train for ner"
    )


def test_integer_labels_and_pairs_are_saved_with_the_model(tmp_path, tiny_bert, cache_dir):
    """jsonl with two text columns and integer labels: ids and names land in the saved config."""
    rows = [
        {"premise": f"the film was {w}", "hypothesis": f"it was {v}", "label": int(w == v) * 3 + 4}
        for w in ("good", "bad", "long", "short")
        for v in ("good", "bad", "long", "short")
    ]
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows * 3))
    val = tmp_path / "val.jsonl"
    val.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "run"
    columns = cli_flags(text_column=["premise", "hypothesis"])
    run = cli_flags(max_steps=2, batch_size=16, output_dir=out, cache_dir=cache_dir, json=True, quiet=True)
    proc = run_cli(*train_command((train, val), tiny_bert), *columns, *run)
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert result["num_examples"] == 16 and {"accuracy", "f1", "train_loss", "wall_s"} <= set(result)
    saved = json.loads((out / "model" / "config.json").read_text())
    assert saved["id2label"] == {"0": "4", "1": "7"} and saved["label2id"] == {"4": 0, "7": 1}
    info = json.loads((out / "model" / "tuneforge.json").read_text())
    assert info["text_columns"] == ["premise", "hypothesis"] and info["regression"] is False

    # evaluating the fine-tuned model needs only a validation file: its labels come from the model
    evaluation = cli_flags(
        validation_file=val, output_dir=tmp_path / "eval", cache_dir=cache_dir, json=True, quiet=True
    )
    proc = run_cli("eval", str(out / "model"), "--task", "classification", *columns, *evaluation)
    assert proc.returncode == 0, proc.stderr
    metrics = last_json(proc.stdout)
    assert metrics["num_examples"] == 16
    assert metrics["accuracy"] == pytest.approx(result["accuracy"]) and metrics["loss"] == pytest.approx(
        result["loss"], rel=1e-3
    )
    # no --task: the validation file says classification; --task bbc-news (as glue/...) reads the file given too, not
    # its own data (both once evaluated BBC News's bundled validation split, or refused its labels)
    for task in ([], ["--task", "bbc-news"]):
        proc = run_cli("eval", str(out / "model"), *task, *columns, *evaluation)
        assert proc.returncode == 0, proc.stderr
        assert last_json(proc.stdout)["accuracy"] == pytest.approx(metrics["accuracy"])
        assert last_json(proc.stdout)["num_examples"] == 16


@pytest.mark.parametrize("config_pad", [None, 7], ids=["no-config-pad", "config-pad-differs"])
def test_a_causal_lm_without_a_pad_token_trains_and_evaluates_as_a_classifier(
    tmp_path, tiny_llama, cache_dir, capsys, config_pad
):
    """tiny_llama's tokenizer has no pad token (as GPT-2's and Llama's): batches pad with its eos token and the head
    reads the last token before the padding, as the reward task does (it once crashed inside tokenizer.pad). A config
    naming another pad token (Llama-2's 0, OPT's 1) read the score at a padding position: the eval at another batch
    size scored otherwise, and the export kept it."""
    import shutil

    from conftest import cli_main, sentiment_split

    model = shutil.copytree(tiny_llama, tmp_path / "base")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "pad_token_id": config_pad}))
    files = sentiment_split(tmp_path, 24, 8)
    common = cli_flags(max_length=32, cache_dir=cache_dir, json=True, quiet=True)
    out = tmp_path / "run"
    steps = cli_flags(task="classification", max_steps=1, batch_size=8, output_dir=out)
    code, stdout, err = cli_main(capsys, *train_command(files, str(model)), *steps, *common)
    assert code == 0, err
    trained = last_json(stdout)
    assert json.loads((out / "model" / "config.json").read_text())["pad_token_id"] == config["eos_token_id"]
    evaluation = cli_flags(validation_file=files[1], output_dir=tmp_path / "eval", eval_batch_size=4)
    code, stdout, err = cli_main(capsys, "eval", str(out / "model"), *evaluation, *common)
    assert code == 0, err
    assert last_json(stdout)["loss"] == pytest.approx(trained["loss"], rel=1e-4)


def test_eval_of_an_exported_folder_reads_the_data_with_its_training_settings(tmp_path, tiny_bert, cache_dir, capsys):
    """`tuneforge eval FOLDER` takes the settings FOLDER's tuneforge.json records (here --max-length 6), so it scores
    what the training run's last evaluation did (it cut the texts at the default length instead, as for a QA model's
    doc_stride or a T5's source_prefix); a flag still overrides, and the line says what was taken."""
    from conftest import cli_main

    rows = [f"{word} {' '.join([word] * 8)} {i}" for i in range(20) for word in ("good", "bad")]
    data = tmp_path / "rows.csv"
    data.write_text("text,label\n" + "".join(f"{r},{'pos' if r.startswith('good') else 'neg'}\n" for r in rows))
    common = dict(precision="fp32", cache_dir=cache_dir)
    train = train_command((data, data), tiny_bert, output_dir=tmp_path / "run", max_length=6, max_steps=10, **common)
    code, out, err = cli_main(capsys, *train, "--batch-size", "8", "--lr", "5e-3", "--seed", "3", "--json", "--quiet")
    assert code == 0, err
    trained = last_json(out)
    evaluation = cli_flags(validation_file=data, output_dir=tmp_path / "eval", **common)
    code, out, err = cli_main(capsys, "eval", str(tmp_path / "run" / "model"), *evaluation, "--json")
    assert code == 0, err
    assert "settings the model was trained with (its tuneforge.json; a flag overrides): max_length 6" in out
    assert last_json(out)["loss"] == pytest.approx(trained["loss"], abs=1e-6)
    code, out, err = cli_main(capsys, "eval", str(tmp_path / "run" / "model"), *evaluation, "--max-length", "64")
    assert code == 0, err
    assert "settings the model was trained with" not in out


@pytest.mark.parametrize("columns", [["text"], ["premise", "hypothesis"]])
def test_texts_and_pairs_cut_to_max_length_are_counted_and_counted_again_from_the_cache(
    tmp_path, tiny_bert, cache_dir, columns
):
    # a review longer than --max-length trained on its first tokens without a word
    from conftest import quiet_task

    rows = [{c: " ".join(["so"] * (i % 9) + [c]) for c in columns} | {"label": i % 2} for i in range(20)]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    task = quiet_task(
        "classification",
        tiny_bert,
        train_file=str(data),
        validation_file=str(data),
        text_columns=columns,
        max_length=8,
        cache_dir=str(tmp_path / "cache"),
    )
    tokenizer = task.load_tokenizer()
    raw = task.load_raw()
    task.use_labels(task.label_set(raw))
    raw = {"validation": task.encode_labels(raw)["validation"]}
    texts = [[r[c] for r in rows] for c in columns]
    whole = [len(ids) for ids in tokenizer(*texts)["input_ids"]]
    cut = sum(n > 8 for n in whole)
    assert 0 < cut < len(rows)
    what = "texts" if len(columns) == 1 else "text pairs"
    for lines, feats in tokenized_fresh_then_cached(task, raw, tokenizer, "validation"):  # cached: said again
        assert lines[-1] == (
            f"validation: {cut} of 20 {what} longer than max_length 8 tokens cut to their first 8 (raise "
            "--max-length to keep them whole)"
        )
        assert feats["input_ids"] == tokenizer(*texts, truncation=True, max_length=8)["input_ids"]  # as before
        assert "text_cut" not in feats.column_names
