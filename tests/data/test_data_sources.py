"""Raw data sources: the original glue_data TSV folders, the hub route offline, and local files
in every supported format (labels as strings or integers, one or two text columns)."""

import json
import re
import time

import datasets
import pandas as pd
import pytest

from conftest import run_cli
from tuneforge.configure import build_config
from tuneforge.errors import DataError
from tuneforge.tasks.classification import ClassificationTask


def examples(task: ClassificationTask):
    """What the Trainer tokenizes: the raw splits, the label set adopted, labels encoded as ids."""
    raw = task.load_raw()
    task.use_labels(task.label_set(raw))
    return task.encode_labels(raw)


def glue_task(name: str, data_dir) -> ClassificationTask:
    return ClassificationTask(build_config(task=f"glue/{name}", data={"data_dir": str(data_dir)}))


def data_rows(path, header: bool) -> int:
    """Rows counted independently of tuneforge: lines of the file, less the header."""
    with open(path, encoding="utf-8-sig", newline="") as fh:
        lines = [line for line in fh.read().split("\n") if line.strip()]
    return len(lines) - (1 if header else 0)


def glue_folder(shared_data, name: str, folder: str, sizes: tuple[int, int], header: bool = True):
    """(task, examples) of a glue_data folder; asserts the (train, validation) sizes, validation also by dev.tsv."""
    task = glue_task(name, shared_data / "glue" / folder)
    raw = examples(task)
    assert (len(raw["train"]), len(raw["validation"])) == sizes
    assert len(raw["validation"]) == data_rows(shared_data / "glue" / folder / "dev.tsv", header=header)
    return task, raw


def test_glue_mrpc_folder(shared_data):
    # this copy of glue_data holds 3,667 training pairs (3,668 lines with the header)
    task, raw = glue_folder(shared_data, "mrpc", "MRPC", (3667, 408))
    assert len(raw["train"]) == data_rows(shared_data / "glue" / "MRPC" / "train.tsv", header=True)
    assert raw["validation"].column_names == ["sentence1", "sentence2", "labels"]
    assert task.text_columns == ["sentence1", "sentence2"]
    assert task.label_names == ["not_equivalent", "equivalent"] and task.metrics == ("accuracy", "f1")
    labels = raw["validation"]["labels"]
    assert set(labels) == {0, 1} and sum(labels) == 279  # 68% paraphrases
    # the BOM did not end up in the first column's name, and quoting is off: literal quote characters stay
    first = raw["validation"][0]
    assert first["labels"] == 1 and first["sentence2"].startswith('" The foodservice pie business')
    assert sum('"' in s for s in raw["train"]["sentence1"]) > 50


def test_glue_sst2_folder(shared_data):
    task, raw = glue_folder(shared_data, "sst2", "SST-2", (67349, 872))
    assert task.text_columns == ["sentence"] and task.label_names == ["negative", "positive"]
    assert sum(raw["validation"]["labels"]) == 444


def test_glue_stsb_folder_is_regression(shared_data):
    task, raw = glue_folder(shared_data, "stsb", "STS-B", (5749, 1500))
    assert task.regression and task.num_labels == 1 and task.metrics == ("pearson", "spearman")
    scores = raw["validation"]["labels"]
    assert all(isinstance(s, float) and 0.0 <= s <= 5.0 for s in scores)
    assert scores[:2] == [5.0, 4.75]
    assert raw["validation"][0]["sentence1"] == "A man with a hard hat is dancing."


def test_glue_cola_folder_has_no_header(shared_data):
    task, raw = glue_folder(shared_data, "cola", "CoLA", (8551, 1043), header=False)
    assert task.metrics[0] == "mcc" and task.label_names == ["unacceptable", "acceptable"]
    # the first line is an example, not a header
    assert raw["validation"][0]["sentence"] == "The sailors rode the breeze clear of the rocks."
    assert sum(raw["validation"]["labels"]) == 721


def test_glue_wrong_folder_is_one_clear_error(shared_data):
    with pytest.raises(DataError, match="#1 String.*not found.*right task"):
        glue_task("mrpc", shared_data / "glue" / "SST-2").load_raw()


def test_glue_from_hub_offline_suggests_data_dir(tmp_path, tiny_bert):
    t0 = time.perf_counter()
    proc = run_cli(
        "train",
        "--task",
        "glue/mrpc",
        "--model",
        tiny_bert,
        "--output-dir",
        str(tmp_path / "out"),
        env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: could not load nyu-mll/glue/mrpc from the Hugging Face hub")
    assert "--data-dir" in line and "MRPC" in line
    assert not (tmp_path / "out").exists()
    assert time.perf_counter() - t0 < 90  # offline fails fast, no retries


# ---- local files ---------------------------------------------------------------------------
ROWS = [("a wonderful film", "pos"), ("a dull mess", "neg"), ("great acting", "pos"), ("so boring", "neg")]


def write_table(path, fmt: str, rows, int_labels: bool = False) -> None:
    df = pd.DataFrame(
        {
            "review": [r[0] for r in rows],
            "other": [f"note {i}" for i in range(len(rows))],
            "stars": [(1 if r[1] == "pos" else 0) if int_labels else r[1] for r in rows],
        }
    )
    if fmt == "csv":
        df.to_csv(path, index=False)
    elif fmt == "tsv":
        df.to_csv(path, sep="\t", index=False)
    elif fmt == "json":  # one JSON array of records
        path.write_text(json.dumps(df.to_dict(orient="records")))
    elif fmt == "jsonl":
        df.to_json(path, orient="records", lines=True)
    else:
        df.to_parquet(path)


@pytest.mark.parametrize("fmt", ["csv", "tsv", "json", "jsonl", "parquet"])
@pytest.mark.parametrize("int_labels", [False, True], ids=["str-labels", "int-labels"])
def test_local_file_formats(tmp_path, fmt, int_labels):
    train, val = tmp_path / f"train.{fmt}", tmp_path / f"val.{fmt}"
    write_table(train, fmt, ROWS, int_labels)
    write_table(val, fmt, ROWS[:3], int_labels)
    config = build_config(
        task="classification",
        data={
            "train_file": str(train),
            "validation_file": str(val),
            "text_columns": ["review"],
            "label_column": "stars",
        },
    )
    task = ClassificationTask(config)
    raw = examples(task)
    assert (len(raw["train"]), len(raw["validation"])) == (4, 3)
    assert raw["train"]["review"] == [r[0] for r in ROWS]
    # string labels sort by name, integer labels by value (whether the file kept ints or not)
    assert task.label_names == (["0", "1"] if int_labels else ["neg", "pos"])
    assert raw["train"]["labels"] == [1, 0, 1, 0]
    assert raw["validation"]["labels"] == [1, 0, 1]


@pytest.mark.parametrize("indent", [None, 1], ids=["one-line", "pretty"])
def test_a_jsonl_file_holding_a_json_array_is_read_as_its_rows(tmp_path, indent):
    """As `datasets`' json reader reads it (a file that starts with '[' is one array of rows, whatever its suffix):
    it was one row of 4 columns named 0..3 ('too few to hold out'), or not JSON lines at all."""
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps([{"review": text, "stars": label} for text, label in ROWS], indent=indent))
    reference = datasets.load_dataset("json", data_files=str(train), split="train", cache_dir=str(tmp_path / "hf"))
    data = {"train_file": str(train), "validation_file": str(train), "text_columns": ["review"]}
    data["label_column"] = "stars"
    raw = examples(ClassificationTask(build_config(task="classification", data=data)))
    assert raw["train"]["review"] == reference["review"] == [r[0] for r in ROWS]
    assert raw["train"]["labels"] == [1, 0, 1, 0]


def test_two_text_columns_make_pairs(tmp_path):
    train = tmp_path / "train.jsonl"
    write_table(train, "jsonl", ROWS)
    config = build_config(
        task="classification",
        data={"train_file": str(train), "text_columns": ["review", "other"], "label_column": "stars"},
    )
    task = ClassificationTask(config)
    raw = examples(task)  # no validation file: 10% of train is held out
    assert task.text_columns == ["review", "other"]
    assert len(raw["train"]) + len(raw["validation"]) == 4 and len(raw["validation"]) >= 1


def test_integer_labels_keep_numeric_order(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps({"text": f"t{i}", "label": v}) for i, v in enumerate([10, 2, 2, 10, 7])))
    task = ClassificationTask(
        build_config(task="classification", data={"train_file": str(train), "validation_file": str(train)})
    )
    raw = examples(task)
    assert task.label_names == ["2", "7", "10"]
    assert raw["train"]["labels"] == [2, 0, 0, 2, 1]


def test_integer_label_outside_training_labels_is_an_error(tmp_path):
    """An int label that is not a training label is not silently taken as a class id."""
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("\n".join(json.dumps({"text": f"t{i}", "label": v}) for i, v in enumerate([1, 2, 1])))
    val.write_text(json.dumps({"text": "x", "label": 0}))
    task = ClassificationTask(
        build_config(task="classification", data={"train_file": str(train), "validation_file": str(val)})
    )
    with pytest.raises(DataError, match=r"label 0 in the validation data .*val.jsonl.* not in the label set \[1, 2\]"):
        examples(task)


def test_mixed_types_and_null_text_are_clear_errors(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"text": "fine", "label": 1}\n{"text": null, "label": 0}\n')
    task = ClassificationTask(
        build_config(task="classification", data={"train_file": str(train), "validation_file": str(train)})
    )
    with pytest.raises(DataError, match="text column 'text' .* 1 empty"):
        task.load_raw()
    train.write_text('{"text": "fine", "label": 1}\n{"text": "bad", "label": "neg"}\n')
    with pytest.raises(DataError, match="mixed value types"):
        task.load_raw()


@pytest.mark.parametrize(
    ("name", "content", "said"),
    [
        ("rows.jsonl", '{"text": "a"}\n\n[1, 2]\n', "line 3: [1, 2] is not a row"),
        ("rows.jsonl", '{"text": "a"}\nnull\n', "line 2: null is not a row"),
        ("rows.jsonl", '{"text": "a"}\n5\n', "line 2: 5 is not a row"),
        ("rows.jsonl", '{"text": "a"}\n"just a text"\n', 'line 2: "just a text" is not a row'),
        ("rows.json", '[{"text": "a"}, true]', "item 2: true is not a row"),
    ],
)
def test_a_json_row_that_is_no_object_is_named(tmp_path, name, content, said):
    """A JSON lines row (or array item) that is a list, a number, null or true was an internal error (TypeError:
    'int' object is not iterable), a text one 'could not be parsed (dictionary update sequence element #0 has length
    1; 2 is required)'; one line naming the row."""
    from tuneforge.data.sources import read_table

    (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(said)):
        read_table(tmp_path / name)
