"""`tuneforge predict`: batched and sorted by length inside, yet the same labels (in the input's
order) as loading the saved folder with plain transformers and taking the argmax."""

import csv
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import cli_flags, cli_main, last_json, read_jsonl, run_cli, save_tiny_bert, save_tiny_classifier
from tuneforge.errors import ConfigError, DataError
from tuneforge.predict import Predictor, predict_file

TEXTS = [
    "short",
    'a much longer review, with commas and "quotes", that goes on and on about the film',
    "ok",
    "the plot was thin but the acting carried it",
    "",
    "great!",
    "terrible pacing; awful script",
    "one two three four five six seven eight nine ten eleven twelve thirteen",
    "meh",
    "wonderful",
] * 3
LABELS = {0: "neg", 1: "neutral", 2: "pos"}


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory, minilm_dir):
    """A tiny 3-class BERT classifier saved as a plain HF folder (no tuneforge.json)."""
    return save_tiny_classifier(tmp_path_factory.mktemp("tiny-classifier"), minilm_dir, LABELS)


def reference(model_dir, firsts, seconds=None, max_length=128):
    """Plain transformers: one example at a time (no padding at all), argmax and softmax."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad():
        for i, text in enumerate(firsts):
            args = (text,) if seconds is None else (text, seconds[i])
            logits = model(**tok(*args, truncation=True, max_length=max_length, return_tensors="pt")).logits[0]
            probs = logits.softmax(-1)
            out.append((model.config.id2label[int(logits.argmax())], probs.tolist(), logits.tolist()))
    return out


def check_against_reference(preds, ref):
    assert [p["index"] for p in preds] == list(range(len(ref)))
    assert [p["label"] for p in preds] == [r[0] for r in ref]
    for p, (_, probs, _) in zip(preds, ref):
        assert list(p["scores"]) == list(LABELS.values())
        assert list(p["scores"].values()) == pytest.approx(probs, abs=1e-4)
        assert p["score"] == pytest.approx(max(probs), abs=1e-4)


def test_cli_predict_csv_matches_transformers_argmax(tmp_path, tiny_classifier):
    inp = tmp_path / "reviews.csv"
    with open(inp, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["id", "text"])
        writer.writerows([(i, t) for i, t in enumerate(TEXTS)])
    out = tmp_path / "preds.jsonl"
    proc = run_cli("predict", tiny_classifier, "--input", str(inp), "--output", str(out), "--batch-size", "4")
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {len(TEXTS)} predictions" in proc.stdout
    preds = read_jsonl(out)
    ref = reference(tiny_classifier, TEXTS)
    check_against_reference(preds, ref)
    assert len({p["label"] for p in preds}) > 1  # a real check: not one constant answer


def write_rows(path: Path, texts: list[str]) -> None:
    """`texts` as a `sentence` column (and another) in the format `path`'s name says, compressed for a .gz."""
    import gzip

    import pandas as pd

    frame = pd.DataFrame({"sentence": texts, "extra": 1})
    fmt = path.name.removesuffix(".gz").rpartition(".")[2]
    if fmt == "parquet":
        frame.to_parquet(path)
        return
    text = {
        "tsv": "sentence\n" + "".join(t + "\n" for t in texts),
        "jsonl": frame.to_json(orient="records", lines=True),
        "json": frame.to_json(orient="records"),
    }[fmt]
    path.write_bytes(gzip.compress(text.encode()) if path.suffix == ".gz" else text.encode())


# train reads a .json, a .parquet and a table compressed whole; predict refused them ("convert it")
@pytest.mark.parametrize("fmt", ["tsv", "jsonl", "jsonl.gz", "json", "parquet", "tsv.gz"])
def test_predict_file_formats(tmp_path, tiny_classifier, fmt):
    inp = tmp_path / f"reviews.{fmt}"
    clean = [t for t in TEXTS if '"' not in t and t]  # standard quoting; a blank TSV line is no row
    write_rows(inp, clean)
    out = tmp_path / "preds.jsonl"
    assert predict_file(tiny_classifier, str(inp), str(out), batch_size=3) == len(clean)
    check_against_reference(read_jsonl(out), reference(tiny_classifier, clean))


def test_a_glue_tsv_compressed_whole_is_read_in_the_tasks_layout(tmp_path, shared_data):
    """MRPC's dev.tsv.gz is read as dev.tsv is (quoting off: its '"' characters are text), not as a plain table."""
    import gzip

    from tuneforge.tasks.glue import read_glue_texts

    dev = shared_data / "glue" / "MRPC" / "dev.tsv"
    packed = tmp_path / "dev.tsv.gz"
    packed.write_bytes(gzip.compress(dev.read_bytes()))
    assert read_glue_texts("mrpc", packed).equals(read_glue_texts("mrpc", dev))


def test_a_text_file_given_to_predict_is_one_line_naming_what_it_reads(tmp_path, tiny_classifier):
    lines = (
        tmp_path / "texts.txt.gz"
    )  # a corpus's lines: no rows of named columns, as train reads none for a classifier
    lines.write_bytes(b"\x1f\x8b")
    with pytest.raises(DataError, match=r"predict reads rows of .csv, .tsv, .json, .jsonl, .parquet files \(or one"):
        predict_file(tiny_classifier, str(lines), str(tmp_path / "p.jsonl"))


@pytest.mark.parametrize(
    "name, content, said",
    [
        ("in.csv", "text;id\na;1\n", "separated by ';'"),
        ("in.tsv", "text,id\na,1\n", "separated by commas.*: name it .csv"),
    ],
)
def test_a_table_of_another_separator_is_said_to_be_one(tmp_path, tiny_classifier, name, content, said):
    """It said 'no text column in 'in.csv'; columns are: text;id; pass --text-column', which cannot help."""
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=f"reads as one column .* seems {said}"):
        predict_file(tiny_classifier, str(tmp_path / name), str(tmp_path / "p.jsonl"))


def test_a_compressed_output_name_is_refused(tmp_path, tiny_classifier):
    """`--output preds.jsonl.gz` wrote plain JSON lines under a gzip name (gunzip: not in gzip format)."""
    write_rows(tmp_path / "in.jsonl", ["good"])
    with pytest.raises(ConfigError, match=r"names a gzip file; predict writes plain JSON lines .* without \.gz"):
        predict_file(tiny_classifier, str(tmp_path / "in.jsonl"), str(tmp_path / "p.jsonl.gz"))
    assert not (tmp_path / "p.jsonl.gz").exists()


@pytest.mark.parametrize("name, sep", [("preds.csv", ","), ("preds.TSV", "\t")])
def test_a_table_output_name_gets_a_table_of_the_same_columns(tmp_path, tiny_classifier, name, sep):
    """`--output preds.csv` wrote JSON lines under that name, which no CSV reader reads; a .csv or .tsv is a table
    of the lines' columns, each nested value (the scores) as its JSON text."""
    import pandas as pd

    clean = [t for t in TEXTS[:10] if t]
    write_rows(tmp_path / "in.jsonl", clean)
    out = tmp_path / name
    assert predict_file(tiny_classifier, str(tmp_path / "in.jsonl"), str(out), batch_size=4) == len(clean)
    lines = tmp_path / "preds.jsonl"
    predict_file(tiny_classifier, str(tmp_path / "in.jsonl"), str(lines), batch_size=4)
    table = pd.read_csv(out, sep=sep, float_precision="round_trip")
    rows = [{**row, "scores": json.loads(row["scores"])} for row in table.to_dict("records")]
    assert list(table.columns) == list(read_jsonl(lines)[0])
    check_against_reference(rows, reference(tiny_classifier, clean))
    assert rows == read_jsonl(lines)
    predict_file(tiny_classifier, str(tmp_path / "in.jsonl"), str(out))  # its own earlier table is replaced


@pytest.mark.parametrize("name", ["preds.txt", "preds.parquet"])
def test_an_output_name_of_no_format_predict_writes_is_refused(tmp_path, tiny_classifier, name):
    write_rows(tmp_path / "in.jsonl", ["good"])
    with pytest.raises(ConfigError, match=r"predict writes \.jsonl \(JSON lines\), \.csv or \.tsv .* or \.npy"):
        predict_file(tiny_classifier, str(tmp_path / "in.jsonl"), str(tmp_path / name))
    assert not (tmp_path / name).exists()


def test_predict_sentence_pairs(tmp_path, tiny_classifier):
    firsts = [t for t in TEXTS[:10] if t]  # tokenizer(a, "") alone drops the empty pair; in a batch it keeps it
    seconds = list(reversed(firsts))
    inp = tmp_path / "pairs.jsonl"
    inp.write_text("".join(json.dumps({"a": a, "b": b}) + "\n" for a, b in zip(firsts, seconds)))
    out = tmp_path / "preds.jsonl"
    predict_file(tiny_classifier, str(inp), str(out), text_columns=["a", "b"], batch_size=4)
    check_against_reference(read_jsonl(out), reference(tiny_classifier, firsts, seconds))


def test_one_column_given_twice_as_a_pair_is_refused_as_training_refuses_it(tmp_path, tiny_classifier, capsys):
    """--text-column text --text-column text predicted each text paired with itself, not a word said (train says
    'names it twice'); the same line, nothing written."""
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "a fine film", "other": "a dull one"}) + "\n")
    out = tmp_path / "p.jsonl"
    args = ["--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--text-column", "text", "--text-column"]
    code, _, err = cli_main(capsys, "predict", tiny_classifier, *args, "text")
    assert code == 2 and "--text-column names 'text' twice; a sentence pair needs two different columns" in err
    assert not out.exists()


@pytest.mark.parametrize("precision", ["bf16", "auto"])
def test_bf16_on_a_cpu_without_native_bf16_is_said_to_be_slower_as_train_says_it(
    tmp_path, tiny_classifier, capsys, precision
):
    from tuneforge.backends.precision import cpu_has_native_bf16

    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "a fine film"}) + "\n")
    args = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "p.jsonl"), "--precision", precision]
    code, _, err = cli_main(capsys, "predict", tiny_classifier, *args)
    emulated = precision == "bf16" and not cpu_has_native_bf16() and not torch.cuda.is_available()
    assert (
        code == 0 and ("note: this CPU has no native bf16 (AVX512-BF16 or AMX), so bf16 runs slower" in err) == emulated
    )


def test_predictor_regression_returns_the_score(tmp_path, minilm_dir):
    from transformers import BertForSequenceClassification

    torch.manual_seed(1)
    regression = dict(num_labels=1, problem_type="regression")
    save_tiny_bert(tmp_path / "reg", minilm_dir, BertForSequenceClassification, num_hidden_layers=1, **regression)
    preds = Predictor(tmp_path / "reg").predict(TEXTS[:8], batch_size=3)
    ref = reference(tmp_path / "reg", TEXTS[:8])
    assert [p["score"] for p in preds] == pytest.approx([r[2][0] for r in ref], abs=1e-4)
    assert all(set(p) == {"score"} for p in preds)


def overflowing_regressor(folder: Path, minilm_dir: str) -> str:
    """A tiny regression model whose scores (about 70,000, a price) are past fp16's largest number (65,504)."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(1)
    regression = dict(num_labels=1, problem_type="regression")
    save_tiny_bert(folder, minilm_dir, BertForSequenceClassification, num_hidden_layers=1, **regression)
    model = BertForSequenceClassification.from_pretrained(folder)
    with torch.no_grad():
        model.classifier.bias.fill_(70_000.0)
    model.save_pretrained(folder)
    return str(folder)


def test_a_score_that_is_no_finite_number_is_written_as_null(tmp_path, minilm_dir, capsys):
    """fp16 forwards of a model scoring past fp16's range give inf: the output is standard JSON (null, not a bare
    Infinity that jq, JSON.parse and Go refuse)."""
    model = overflowing_regressor(tmp_path / "reg", minilm_dir)
    (tmp_path / "in.csv").write_text("text\nhello world\na house by the sea\n")
    out = tmp_path / "out.jsonl"
    code, _, err = cli_main(capsys, "predict", model, "--input", str(tmp_path / "in.csv"), "--output", str(out))
    assert code == 0, err
    assert [json.loads(line)["score"] for line in out.read_text().splitlines()] == pytest.approx([70_000.0] * 2)
    half = tmp_path / "half.jsonl"
    args = ("--input", str(tmp_path / "in.csv"), "--output", str(half), "--precision", "fp16")
    code, _, err = cli_main(capsys, "predict", model, *args)
    assert code == 0, err
    strict = [json.loads(line, parse_constant=no_constant) for line in half.read_text().splitlines()]
    assert strict == [{"index": 0, "score": None}, {"index": 1, "score": None}]


def no_constant(token: str):
    raise ValueError(f"{token} is not standard JSON")


def test_a_multi_label_classifier_scores_each_label_as_transformers_pipeline_does(tmp_path, minilm_dir):
    """A plain HF folder of problem_type multi_label_classification (a toxicity model): each label's own sigmoid,
    as transformers' text-classification pipeline gives it (a softmax across the labels made them share 1)."""
    from transformers import BertForSequenceClassification, pipeline

    torch.manual_seed(2)
    labels = {0: "toxic", 1: "insult", 2: "threat"}
    ids = dict(num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()})
    model = save_tiny_bert(
        tmp_path / "multi",
        minilm_dir,
        BertForSequenceClassification,
        initializer_range=0.3,
        problem_type="multi_label_classification",
        **ids,
    )
    preds = Predictor(model).predict(TEXTS[:8], batch_size=3)
    reference = pipeline("text-classification", model=model, top_k=None)
    for pred, want in zip(preds, reference(TEXTS[:8]), strict=True):
        assert pred["scores"] == pytest.approx({w["label"]: w["score"] for w in want}, abs=1e-5)
        assert (pred["label"], pred["score"]) == (want[0]["label"], pytest.approx(want[0]["score"], abs=1e-5))


def test_a_regressor_of_several_outputs_scores_each_as_transformers_pipeline_does(tmp_path, minilm_dir):
    """A plain HF folder of problem_type regression with 3 outputs (valence, arousal, dominance): each output's own
    value, as transformers' text-classification pipeline gives it (a softmax across them made three numbers that
    share 1, and a 'label' of the largest, as a classifier's)."""
    from transformers import BertForSequenceClassification, pipeline

    torch.manual_seed(2)
    labels = {0: "valence", 1: "arousal", 2: "dominance"}
    ids = dict(num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()}, problem_type="regression")
    model = save_tiny_bert(tmp_path / "vad", minilm_dir, BertForSequenceClassification, initializer_range=0.3, **ids)
    preds = Predictor(model).predict(TEXTS[:8], batch_size=3)
    reference = pipeline("text-classification", model=model, top_k=None)
    for pred, want in zip(preds, reference(TEXTS[:8]), strict=True):
        assert pred == {"scores": pytest.approx({w["label"]: w["score"] for w in want}, abs=1e-5)}


def test_predict_mrpc_dev_matches_transformers(tmp_path, shared_data, tiny_bert, cache_dir):
    """Train a tiny model a few steps on MRPC, then predict all of dev.tsv (BOM, quote characters)."""
    folder = shared_data / "glue" / "MRPC"
    run_dir = tmp_path / "mrpc"
    data = cli_flags(task="glue/mrpc", data_dir=folder, max_train_samples=128, max_eval_samples=64)
    run = cli_flags(
        max_steps=4, batch_size=16, lr="1e-3", output_dir=run_dir, cache_dir=cache_dir, json=True, quiet=True
    )
    proc = run_cli("train", *data, "--model", tiny_bert, *run)
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert {"accuracy", "f1", "loss", "train_loss"} <= set(result) and result["num_examples"] == 64
    model_dir = run_dir / "model"

    out = tmp_path / "dev-preds.jsonl"
    proc = run_cli("predict", str(model_dir), "--input", str(folder / "dev.tsv"), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    preds = read_jsonl(out)
    assert len(preds) == 408

    with open(folder / "dev.tsv", encoding="utf-8-sig", newline="") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
    firsts, seconds = [r["#1 String"] for r in rows], [r["#2 String"] for r in rows]
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    assert model.config.id2label == {0: "not_equivalent", 1: "equivalent"}
    expected = []
    with torch.no_grad():
        for i in range(0, len(rows), 64):  # plain batches in file order, padded to the longest
            enc = tok(
                firsts[i : i + 64],
                seconds[i : i + 64],
                truncation=True,
                max_length=128,
                padding=True,
                return_tensors="pt",
            )
            expected += [model.config.id2label[int(j)] for j in model(**enc).logits.argmax(-1)]
    assert [p["label"] for p in preds] == expected
    assert [p["index"] for p in preds] == list(range(408))


def tiny_task_folder(folder, minilm_dir: str, task: str, model_class: str) -> str:
    """A random tiny BERT of `model_class` (128 positions) as the model folder `task` exports (max_length 64)."""
    import transformers

    model = save_tiny_bert(folder, minilm_dir, getattr(transformers, model_class))
    (folder / "tuneforge.json").write_text(json.dumps({"task": task, "max_length": 64}))
    return model


@pytest.mark.parametrize(
    ("task", "model_class", "row"),
    [
        ("ner", "BertForTokenClassification", {"text": "word " * 300}),
        ("multiple-choice", "BertForMultipleChoice", {"question": "word " * 300, "choices": ["a.", "b."]}),
    ],
)
def test_a_max_length_above_the_models_positions_is_one_error_line(
    tmp_path, minilm_dir, capsys, task, model_class, row
):
    """A tagger's or chooser's --max-length above the model's 128 positions is refused as a classifier's is (it ran
    and crashed at the first long text: RuntimeError, the size of tensor a (304) must match ... (128))."""
    from conftest import cli_main

    model = tiny_task_folder(tmp_path / "model", minilm_dir, task, model_class)
    (tmp_path / "in.jsonl").write_text(json.dumps(row) + "\n")
    args = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "p.jsonl"), "--max-length", "1000"]
    code, _, err = cli_main(capsys, "predict", model, *args)
    assert code == 2 and "max_length 1000 is above the model's limit of 128 positions" in err
    assert "internal error" not in err


@pytest.mark.parametrize(
    ("task", "model_class", "row", "max_length", "said"),
    [
        ("classification", "BertForSequenceClassification", {"text": "word " * 300}, 1, "a text: its tokenizer adds 2"),
        ("classification", "BertForSequenceClassification", {"text": "word " * 300}, 2, "give at least 3"),
        ("ner", "BertForTokenClassification", {"text": "John lives in Paris"}, 2, "give at least 3"),
        ("multiple-choice", "BertForMultipleChoice", {"question": "q " * 300, "choices": ["a.", "b."]}, 2, "least 5"),
        ("embedding", "BertModel", {"text": "word " * 300}, 1, "give at least 3"),
        ("qa", "BertForQuestionAnswering", {"question": "where?", "context": "in Lima"}, 4, "give at least 7"),
    ],
)
def test_a_max_length_that_holds_no_text_is_one_error_line(
    tmp_path, minilm_dir, capsys, task, model_class, row, max_length, said
):
    """A --max-length below the special tokens the tokenizer adds ([CLS] and [SEP]) and a token of each text: the
    tokenizer cannot cut to it and left the input whole (internal error: the size of tensor a (302) must match ...
    (128)), cut a tagger's words to none (no entities, not a word said) or a reader's room for the question to -3;
    one line saying the least it takes, exit 2, nothing written."""
    model = tiny_task_folder(tmp_path / "model", minilm_dir, task, model_class)
    (tmp_path / "in.jsonl").write_text(json.dumps(row) + "\n")
    columns = ["--text-column", "question", "--text-column", "context"] if task == "qa" else []
    out = tmp_path / "p.jsonl"
    args = ["--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--max-length", str(max_length), *columns]
    code, _, err = cli_main(capsys, "predict", model, *args)
    assert code == 2 and f"--max-length {max_length} leaves no room for" in err and said in err, err
    assert "internal error" not in err and err.count("error:") == 1 and not out.exists()


def test_a_codah_tsv_given_to_predict_is_told_what_predict_reads(tmp_path, minilm_dir, capsys):
    """CODAH's headerless TSV given to predict of a multiple-choice model: the refusal named a flag predict does not
    take ('pass --data-format codah', then: unrecognized arguments)."""
    from conftest import cli_main

    model = tiny_task_folder(tmp_path / "model", minilm_dir, "multiple-choice", "BertForMultipleChoice")
    codah = tmp_path / "test.tsv"
    codah.write_text("o\tThe ball is red. Its colour is\tred.\tblue.\tgreen.\twhite.\t0\n" * 2)
    code, _, err = cli_main(capsys, "predict", model, "--input", str(codah), "--output", str(tmp_path / "p.jsonl"))
    assert code == 2 and "--data-format codah" not in err.replace("takes no --data-format", "")
    assert "predict takes no --data-format: give CODAH's rows as such" in err


def test_a_text_column_given_to_a_multiple_choice_model_is_refused(tmp_path, minilm_dir, capsys):
    """A multiple-choice model reads each row's question and choices: --text-column was passed over without a word
    (a user's --text-column goal, meant for the question, predicted on the file's own 'question' column)."""
    from conftest import cli_main

    model = tiny_task_folder(tmp_path / "model", minilm_dir, "multiple-choice", "BertForMultipleChoice")
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"goal": "Open a jar", "question": "", "choices": ["twist the lid", "eat it"]}) + "\n")
    out = tmp_path / "p.jsonl"
    code, _, err = cli_main(
        capsys, "predict", model, "--input", str(rows), "--output", str(out), "--text-column", "goal"
    )
    assert code == 2 and not out.exists()
    assert "--text-column: a multiple-choice model reads each row's question and choices" in err


IOB = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}


@pytest.mark.parametrize(
    ("model_class", "config", "rows", "flags"),
    [
        ("BertForTokenClassification", {"id2label": IOB}, [{"text": "Ana lives in Lima."}], []),
        (
            "BertForQuestionAnswering",
            {},
            [{"question": "Where does Ana live?", "context": "Ana lives in Lima."}],
            ["--text-column", "question", "--text-column", "context"],
        ),
        ("BertForMultipleChoice", {}, [{"question": "It rained, so he", "choices": ["opened it.", "sang."]}], []),
    ],
)
def test_a_plain_hf_folder_is_predicted_by_its_architecture(
    tmp_path, minilm_dir, capsys, model_class, config, rows, flags
):
    """A token-classification, question-answering or multiple-choice folder tuneforge did not write (a hub model:
    no tuneforge.json) runs as its architecture says, as the README says of serve; it was refused as 'not a
    sequence-classification model; use `tuneforge generate` for language models'."""
    import transformers

    from conftest import cli_main

    model = save_tiny_bert(tmp_path / "model", minilm_dir, getattr(transformers, model_class), **config)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "p.jsonl"
    code, _, err = cli_main(
        capsys, "predict", model, "--input", str(tmp_path / "in.jsonl"), "--output", str(out), *flags
    )
    assert code == 0, err
    [got] = read_jsonl(out)
    if "text" in rows[0]:
        assert all(rows[0]["text"][e["start"] : e["end"]] == e["text"] for e in got["entities"])
    elif "context" in rows[0]:
        assert rows[0]["context"][got["start"] : got["end"]] == got["answer"] != ""
    else:
        assert got["choice"] in rows[0]["choices"] and sum(got["scores"]) == pytest.approx(1)


def test_a_plain_token_classifier_without_iob_labels_is_refused(tmp_path, minilm_dir, capsys):
    """Entities are read from IOB tags (O, B-TYPE, I-TYPE): a folder labelled LABEL_0... would give entities of type
    'BEL_1'."""
    from transformers import BertForTokenClassification

    from conftest import cli_main

    model = save_tiny_bert(tmp_path / "model", minilm_dir, BertForTokenClassification, num_labels=3)
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "Ana lives in Lima."}) + "\n")
    code, _, err = cli_main(
        capsys, "predict", model, "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "p")
    )
    assert code == 2 and "labels are not IOB tags (O, B-TYPE, I-TYPE): LABEL_0, LABEL_1, LABEL_2" in err


def test_predict_of_a_model_that_generates_names_the_commands_that_run_it(tmp_path, tiny_t5, capsys):
    """A seq2seq model given to predict: the refusal said '`tuneforge predict` and `serve` take classifiers, ...', but
    serve runs it (its OpenAI routes), and predict takes sentence encoders and scorers too."""
    import shutil

    from conftest import cli_main

    model = shutil.copytree(tiny_t5, tmp_path / "model")
    (model / "tuneforge.json").write_text(json.dumps({"task": "seq2seq", "generates": True, "family": "seq2seq"}))
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "A dog runs."}) + "\n")
    code, _, err = cli_main(
        capsys, "predict", str(model), "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "p")
    )
    assert code == 2 and "and `serve` take" not in err
    assert "use `tuneforge generate` for it, or `tuneforge serve` (its OpenAI routes)" in err


CAUSAL_CLASSIFIERS = {
    "gpt2": ("GPT2", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    # OPT's config names pad token 1 (its tokenizer's <pad>): a tokenizer without one pads with eos
    "opt": (
        "OPT",
        dict(hidden_size=32, word_embed_proj_dim=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4),
    ),
}


@pytest.mark.parametrize("family", CAUSAL_CLASSIFIERS)
def test_a_plain_causal_lm_classifier_without_a_pad_token_is_predicted(tmp_path, family):
    """A hub GPT-2 or OPT sequence classifier (its tokenizer without a pad token): batches pad with its eos token, as
    its training and a reward model's predictor do, and each text scores as alone (it crashed as an internal error:
    'Asking to pad but the tokenizer does not have a padding token'; OPT's config.pad_token_id, another token, had
    its head read a short text's score at a padding position)."""
    import transformers
    from transformers import AutoModelForSequenceClassification

    from conftest import bpe_tokenizer

    tok = bpe_tokenizer(tmp_path)
    torch.manual_seed(0)
    prefix, sizes = CAUSAL_CLASSIFIERS[family]
    labels = dict(num_labels=2, id2label={0: "neg", 1: "pos"}, label2id={"neg": 0, "pos": 1})
    config = getattr(transformers, f"{prefix}Config")(vocab_size=len(tok), bos_token_id=None, eos_token_id=None)
    config.update({**sizes, **labels})
    getattr(transformers, f"{prefix}ForSequenceClassification")(config).save_pretrained(tmp_path)
    texts = ["a good film", "a bad and long and boring film", "ok"]
    preds = Predictor(tmp_path).predict(texts, batch_size=8)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        alone = [model(**tok(t, return_tensors="pt")).logits[0].softmax(-1).tolist() for t in texts]
    assert [list(p["scores"].values()) for p in preds] == [pytest.approx(a, abs=1e-5) for a in alone]


@pytest.mark.parametrize("trained, given", [(["sentence1", "sentence2"], ["a"]), (["text"], ["a", "b"])])
def test_text_columns_of_another_count_than_the_model_was_trained_on_are_refused(
    tmp_path, tiny_classifier, trained, given
):
    """A pair classifier given one --text-column classified single texts (and a single-text one given two, pairs)
    without a word: answers of a model fed what it never saw."""
    import shutil

    from tuneforge.errors import ConfigError

    model = shutil.copytree(tiny_classifier, tmp_path / "model")
    (model / "tuneforge.json").write_text(json.dumps({"task": "classification", "text_columns": trained}))
    inp = tmp_path / "rows.jsonl"
    inp.write_text("".join(json.dumps({"a": t, "b": t}) + "\n" for t in TEXTS[:4]))
    what = "sentence pairs" if len(trained) == 2 else "single texts"
    says = f"was trained on {what} ({', '.join(trained)}), and --text-column names {len(given)} column(s)"
    with pytest.raises(ConfigError, match=re.escape(says)):
        predict_file(str(model), str(inp), str(tmp_path / "out.jsonl"), text_columns=given)
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(
    ("task", "model_class", "row", "rows_said", "kept"),
    [
        ("classification", "BertForSequenceClassification", lambda text: {"text": text}, "texts", "first"),
        (
            "multiple-choice",
            "BertForMultipleChoice",
            lambda text: {"question": text, "choices": ["a.", "b."]},
            "questions with a choice (and its context)",
            "first",
        ),
        ("embedding", "BertModel", lambda text: {"text": text}, "texts", "first"),
        ("reward", "BertForSequenceClassification", lambda text: {"text": text}, "texts", "last"),
    ],
)
def test_inputs_cut_to_the_trained_max_length_are_counted_in_one_note_line(
    tmp_path, minilm_dir, capsys, task, model_class, row, rows_said, kept
):
    """Texts longer than the model's trained max_length (64 here) were predicted from their first (a reward model's:
    last) 64 tokens without a word; one note line on stderr says how many, the output's rows as before."""
    from tuneforge.predict import load_predictor

    model = tiny_task_folder(tmp_path / "model", minilm_dir, task, model_class)
    if task == "reward":  # a scorer: one output, and its export says it scores
        from transformers import BertForSequenceClassification

        save_tiny_bert(tmp_path / "model", minilm_dir, BertForSequenceClassification, num_labels=1)
        (tmp_path / "model" / "tuneforge.json").write_text(json.dumps({"task": task, "max_length": 64, "scores": True}))
    texts = ["a short one", "word " * 100, "another short text", "word " * 70 + "end", "ok"]
    rows = [row(t) for t in texts]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "p.jsonl"
    code, _, err = cli_main(capsys, "predict", model, "--input", str(tmp_path / "in.jsonl"), "--output", str(out))
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert notes == [
        f"note: 2 of 5 {rows_said} longer than max_length 64 tokens cut to their {kept} 64 (raise --max-length to "
        "keep them whole)"
    ]
    items = [r["text"] for r in rows] if "text" in rows[0] else rows
    want = load_predictor(model).predict(items)
    assert read_jsonl(out) == [{"index": i, **json.loads(json.dumps(w))} for i, w in enumerate(want)]  # rows alone

    (tmp_path / "in.jsonl").write_text("".join(json.dumps(row(t)) + "\n" for t in texts[::2]))
    code, _, err = cli_main(capsys, "predict", model, "--input", str(tmp_path / "in.jsonl"), "--output", str(out))
    assert code == 0 and "note:" not in err  # nothing cut, nothing said


def test_a_cut_at_the_models_own_limit_is_not_told_to_raise_max_length(tmp_path, minilm_dir, capsys):
    # --max-length above the model's 128 positions is refused: the note says where the texts end instead
    model = tiny_task_folder(tmp_path / "model", minilm_dir, "classification", "BertForSequenceClassification")
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "word " * 200}) + "\n")
    args = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "p.jsonl"), "--max-length", "128"]
    code, _, err = cli_main(capsys, "predict", model, *args)
    said = "note: 1 of 1 texts longer than max_length 128 tokens cut to their first 128 (the model reads no more than"
    assert code == 0 and f"{said} its 128 positions)" in err.splitlines()


@pytest.mark.parametrize(
    "head, inputs",
    [
        ("GPT2ForTokenClassification", ["John Smith visited Paris on Monday .", "Anna"]),
        ("GPT2ForQuestionAnswering", [("where did John go ?", "John visited Paris ."), ("who ?", "Anna")]),
        ("GPT2Model", ["a good film about a dog and a cat", "ok"]),
    ],
)
def test_a_causal_lm_tagger_reader_or_encoder_without_a_pad_token_is_predicted(tmp_path, head, inputs):
    """A GPT-2 tagger, reader or encoder (its tokenizer without a pad token) predicts a batch padded with its eos token,
    each input as alone, as a classifier does (it was an internal error: 'Asking to pad but the tokenizer does not
    have a padding token')."""
    import numpy as np
    import transformers
    from transformers import GPT2Config

    from conftest import bpe_tokenizer
    from tuneforge.predict import load_predictor
    from tuneforge.tasks.sentence_encoder import SentenceEncoder

    tok = bpe_tokenizer(tmp_path)
    torch.manual_seed(0)
    tags = dict(num_labels=3, id2label={0: "O", 1: "B-PER", 2: "I-PER"}, label2id={"O": 0, "B-PER": 1, "I-PER": 2})
    config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=64, **tags)
    getattr(transformers, head)(config).save_pretrained(tmp_path)
    if head == "GPT2Model":
        (tmp_path / "tuneforge.json").write_text(json.dumps({"task": "embedding"}))
        encoder = SentenceEncoder(tmp_path)
        alone = np.concatenate([encoder.encode([text]) for text in inputs])
        assert np.allclose(encoder.encode(inputs), alone, atol=1e-5)
        return
    predictor = load_predictor(tmp_path)
    batched, alone = predictor.predict(inputs), [predictor.predict([one])[0] for one in inputs]
    assert json.loads(json.dumps(batched), parse_float=lambda s: round(float(s), 5)) == json.loads(
        json.dumps(alone), parse_float=lambda s: round(float(s), 5)
    )
