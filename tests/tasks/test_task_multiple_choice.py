"""Multiple choice: SWAG csv, question + choices jsonl and CODAH's TSV; choices encoded as run_swag.py does;
accuracy exact across ranks; train / eval / predict / serve / resume end to end; one-line errors."""

from __future__ import annotations

import csv
import json
import random
import re
from pathlib import Path

import httpx
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    SHARDED_ENGINES,
    TASK_PARITY_RUN,
    cli_flags,
    cli_main,
    float32_and_bf16_predictors,
    max_weight_diff,
    query_weights,
    quiet_task,
    run_cli,
    save_tiny_bert,
    serving,
    tokenized_fresh_then_cached,
    train_losses,
    trained_once,
)

COLORS = ["red", "blue", "green", "black", "white", "yellow"]
THINGS = ["car", "house", "ball", "coat", "door", "boat"]


def choice_rows(n: int, seed: int = 0, width: int = 4) -> list[dict]:
    """Rows whose right ending names the colour its question names (learnable in a few steps)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        thing, colors = rng.choice(THINGS), rng.sample(COLORS, width)
        label = rng.randrange(width)
        question = f"The {thing} is painted {colors[label]}. Its colour is"
        rows.append({"question": question, "choices": [f"{c}." for c in colors], "label": label})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_swag(path, rows):
    """SWAG's csv layout: sent1, sent2 (the ending's start), ending0..N, label."""
    width = len(rows[0]["choices"])
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["video-id", "sent1", "sent2", *[f"ending{i}" for i in range(width)], "label"])
        for i, r in enumerate(rows):
            w.writerow([f"v{i}", r["question"], "It is", *r["choices"], r["label"]])
    return path


def write_choice_dir(folder: Path) -> Path:
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", choice_rows(64, seed=1))
    write_jsonl(folder / "dev.jsonl", choice_rows(21, seed=2))
    return folder


@pytest.fixture
def choice_dir(tmp_path):
    return write_choice_dir(tmp_path / "mc")


def mc_train(model, data_dir, out, **flags) -> list[str]:
    return ["train", *cli_flags(task="multiple-choice", model=model, data_dir=data_dir, output_dir=out, **flags)]


# ---- reading and features -------------------------------------------------------------------
def test_swag_csv_question_jsonl_and_codah_tsv_read_alike(tmp_path):
    from tuneforge.data.choices import read_choices

    rows = choice_rows(5, seed=3)
    swag = read_choices(write_swag(tmp_path / "swag.csv", rows))
    assert swag["context"] == [r["question"] for r in rows] and swag["prefix"] == ["It is"] * 5
    assert swag["choices"] == [r["choices"] for r in rows] and swag["label"] == [r["label"] for r in rows]
    jsonl = read_choices(write_jsonl(tmp_path / "q.jsonl", rows))
    assert jsonl["choices"] == swag["choices"] and jsonl["prefix"] == [""] * 5
    pd.DataFrame(rows).to_parquet(tmp_path / "q.parquet")  # its choices come back as numpy arrays
    assert read_choices(tmp_path / "q.parquet").to_dict() == jsonl.to_dict()
    codah = tmp_path / "codah.tsv"
    codah.write_text("".join("\t".join(["o", r["question"], *r["choices"], str(r["label"])]) + "\n" for r in rows[:4]))
    read = read_choices(codah, data_format="codah")
    assert read["context"] == jsonl["context"][:4] and read["label"] == jsonl["label"][:4]


@pytest.mark.parametrize("need_labels", [True, False])  # a file to train on, and rows to predict
@pytest.mark.parametrize(
    "change, says",
    [
        ({"question": None}, "row 2: the question is empty (null)"),
        ({"choices": ["red.", None, "blue."]}, "row 2: choice 2 is empty (null)"),
        ({"choices": ["red.", ["blue."], "green."]}, "row 2: choice 2 holds ['blue.'], not a text"),
        ({"question": {"text": "Q"}}, "row 2: the question holds {'text': 'Q'}, not a text"),
    ],
)
def test_a_null_or_non_text_question_or_choice_in_a_file_is_named(tmp_path, change, says, need_labels):
    """A jsonl row's null question or choice was read as the text 'nan' or 'None', trained on or predicted (and
    'None' could come back as the chosen choice); a list or object as its Python text ("['blue.']")."""
    from tuneforge.data.choices import read_choices
    from tuneforge.errors import DataError

    rows = choice_rows(3, seed=4, width=3)
    rows[1].update(change)
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    with pytest.raises(DataError, match=re.escape(f"{path}, {says}")):
        read_choices(path, need_labels=need_labels)


def test_a_prefix_column_of_question_and_choices_rows_starts_every_ending(tmp_path, minilm_dir, capsys):
    """A jsonl row {"question", "prefix", "choices"} (serve's /predict input) was read without its prefix by
    `tuneforge predict` (and training): each choice was scored as (question, ending), not (question, prefix ending)."""
    import transformers

    from tuneforge.data.choices import read_choices
    from tuneforge.predict import load_predictor

    rows = [{**r, "prefix": "It is"} for r in choice_rows(3, seed=5, width=3)]
    rows[1]["prefix"] = None  # a row without one
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    assert read_choices(path, need_labels=False)["prefix"] == ["It is", "", "It is"]

    model = save_tiny_bert(tmp_path / "model", minilm_dir, transformers.BertForMultipleChoice, initializer_range=0.3)
    (tmp_path / "model" / "tuneforge.json").write_text(json.dumps({"task": "multiple-choice", "max_length": 64}))
    served = load_predictor(model).predict([{k: r[k] or "" for k in ("question", "prefix", "choices")} for r in rows])
    code, _, err = cli_main(capsys, "predict", model, "--input", str(path), "--output", str(tmp_path / "p.jsonl"))
    assert code == 0, err
    predicted = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    for got, want in zip(predicted, served, strict=True):
        assert got["scores"] == pytest.approx(want["scores"], abs=1e-5)
    unprefixed = load_predictor(model).predict([{"question": r["question"], "choices": r["choices"]} for r in rows])
    assert predicted[0]["scores"] != pytest.approx(unprefixed[0]["scores"], abs=1e-5)


def test_a_null_swag_ending_is_an_absent_one(tmp_path):
    """SWAG rows as jsonl: a null ending is left out as an empty csv cell is (it was kept as the choice 'nan'), a null
    sent2 is no prefix (it was the prefix 'nan' of every ending)."""
    from tuneforge.data.choices import read_choices

    rows = [
        {"sent1": "The car is red.", "sent2": "It is", "ending0": "red.", "ending1": "blue.", "ending2": None},
        {"sent1": "The car is blue.", "sent2": None, "ending0": "red.", "ending1": "blue.", "ending2": "green."},
    ]
    read = read_choices(write_jsonl(tmp_path / "swag.jsonl", rows), need_labels=False)
    assert read["choices"] == [["red.", "blue."], ["red.", "blue.", "green."]] and read["prefix"] == ["It is", ""]


@pytest.mark.parametrize("need_labels", [True, False], ids=["train", "predict"])
def test_an_empty_swag_ending_before_a_given_one_is_named(tmp_path, need_labels):
    """An empty SWAG ending before a given one was dropped, so the endings after it moved down: the label (2: 'green.')
    named 'yellow.', trained on as the right one, and predict's label and scores indexed no ending column."""
    from tuneforge.data.choices import read_choices
    from tuneforge.errors import DataError

    endings = {"ending0": "red.", "ending1": "", "ending2": "green.", "ending3": "yellow."}
    rows = [{"sent1": "The car is green.", "sent2": "It is", **endings, "label": 2}]
    pd.DataFrame(rows).to_csv(tmp_path / "swag.csv", index=False)
    with pytest.raises(DataError, match=r"swag.csv'?, row 1: ending1 is empty and ending2 after it is not"):
        read_choices(tmp_path / "swag.csv", need_labels=need_labels)


def test_the_shared_codah_fold_reads(shared_data):
    from tuneforge.data.choices import read_choices

    dev = read_choices(shared_data / "codah" / "cv_split" / "fold_0" / "dev.tsv", data_format="codah")
    assert len(dev) == 556 and {len(c) for c in dev["choices"]} == {4} and set(dev["label"]) <= {0, 1, 2, 3}


def test_each_choice_is_the_pair_context_and_prefixed_ending(tiny_bert, tmp_path, cache_dir):
    from transformers import AutoModelForMultipleChoice

    rows = choice_rows(6, seed=4)
    folder = tmp_path / "swag"
    folder.mkdir()
    write_swag(folder / "train.csv", rows)
    write_swag(folder / "dev.csv", rows)
    task = quiet_task("multiple-choice", tiny_bert, data_dir=str(folder), cache_dir=cache_dir)
    tokenizer = task.load_tokenizer()
    feats = task.tokenize(task.load_raw(), tokenizer, log=lambda m: None)["validation"]
    for feat, row in zip(feats, rows):
        for ids, ending in zip(feat["input_ids"], row["choices"]):
            assert ids == tokenizer(row["question"], f"It is {ending}")["input_ids"]
    batch = task.collate(feats[:3], tokenizer)
    assert batch["input_ids"].shape[:2] == (3, 4) and batch["labels"].tolist() == [r["label"] for r in rows[:3]]
    model = AutoModelForMultipleChoice.from_pretrained(tiny_bert).eval()
    outputs = model(**task.model_inputs(batch), labels=batch["labels"])
    loss, n = task.compute_loss(outputs, batch)
    assert int(n) == 3 and torch.allclose(loss / n, outputs.loss, atol=1e-6)  # transformers' mean over rows


# ---- train, eval, predict, serve ----------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory, minilm_dir):
    def write_data(root: Path) -> Path:
        data = root / "data"
        data.mkdir()
        write_jsonl(data / "train.jsonl", choice_rows(96, seed=1))
        write_jsonl(data / "dev.jsonl", choice_rows(21, seed=2))
        write_jsonl(data / "test.jsonl", choice_rows(10, seed=3))
        return data

    run, data, stdout = trained_once(
        tmp_path_factory,
        "mc-trained",
        write_data,
        lambda data, run: mc_train(minilm_dir, data, run, max_steps=12, lr="3e-4", json=True, quiet=True),
    )
    return run, data, json.loads(stdout.strip().splitlines()[-1])


def test_training_learns_to_choose_and_exports_a_multiple_choice_model(trained, capsys):
    from transformers import AutoModelForMultipleChoice

    run, data, result = trained
    assert result["num_examples"] == 21 and result["accuracy"] >= 0.9
    AutoModelForMultipleChoice.from_pretrained(run / "model")
    test = str(data / "test.jsonl")
    code, out, err = cli_main(
        capsys, "eval", str(run / "model"), "--task", "multiple-choice", "--validation-file", test, "--json"
    )
    assert code == 0, err
    scores = json.loads(out.strip().splitlines()[-1])
    assert scores["num_examples"] == 10 and scores["accuracy"] >= 0.9


def test_predict_and_serve_choose_the_named_colour(trained, tmp_path, capsys):
    from tuneforge.predict import load_predictor

    run, _, _ = trained
    rows = choice_rows(6, seed=7)
    three = [{"question": "The ball is painted green. Its colour is", "choices": ["red.", "green.", "white."]}]
    predictor = load_predictor(run / "model")
    got = predictor.predict([{"question": r["question"], "choices": r["choices"]} for r in rows] + three)
    assert [g["label"] for g in got[:6]] == [r["label"] for r in rows]
    assert got[6]["choice"] == "green." and len(got[6]["scores"]) == 3 and sum(got[6]["scores"]) == pytest.approx(1)

    unlabelled = write_jsonl(
        tmp_path / "in.jsonl", [{"question": r["question"], "choices": r["choices"]} for r in rows]
    )
    code, out, err = cli_main(
        capsys, "predict", str(run / "model"), "--input", str(unlabelled), "--output", str(tmp_path / "p")
    )
    assert code == 0, err
    assert [json.loads(line)["label"] for line in (tmp_path / "p").read_text().splitlines()] == [
        r["label"] for r in rows
    ]

    with serving(str(run / "model")) as url:
        r = httpx.post(f"{url}/predict", json={"inputs": three}, timeout=60)
        assert r.status_code == 200 and r.json()["predictions"][0]["choice"] == "green."
        assert httpx.post(f"{url}/predict", json={"texts": ["a"]}, timeout=60).status_code == 422
        labelled = [{**three[0], "id": "q1", "label": 1}]  # a labelled row's own fields are carried along unread
        r = httpx.post(f"{url}/predict", json={"inputs": labelled}, timeout=60)
        assert r.status_code == 200 and r.json()["predictions"][0]["choice"] == "green."
        # a row's choices run in one forward: one request must not send it a million (nor a key it would pass over)
        many = [{"question": "pick", "choices": ["a."] * 65}]
        r = httpx.post(f"{url}/predict", json={"inputs": three + many}, timeout=60)
        assert r.status_code == 422 and "input 2 has 65 choices, above 64" in r.json()["error"]["message"]
        misnamed = [{"context": three[0]["question"], "choices": three[0]["choices"]}]
        r = httpx.post(f"{url}/predict", json={"inputs": misnamed}, timeout=60)
        assert r.status_code == 422 and "input 1: unknown key 'context'" in r.json()["error"]["message"]


def test_rows_of_mixed_lengths_run_apart_and_score_as_each_alone(trained):
    """A long question among short ones (and a row of three choices among rows of four) in one call: the long row
    runs in a forward of its own on a CPU (the short ones are not padded to it), and every row's scores are those
    it gets predicted alone (within 1e-5)."""
    from tuneforge.predict import load_predictor

    run, _, _ = trained
    rows = [{"question": r["question"], "choices": r["choices"]} for r in choice_rows(6, seed=7)]
    rows[1]["question"] += " It stayed that way all through the long and very hot summer." * 6
    rows.append({"question": "The ball is painted green. Its colour is", "choices": ["red.", "green.", "white."]})
    predictor = load_predictor(run / "model")
    shapes = []
    predictor.model.register_forward_pre_hook(lambda _, a, kw: shapes.append(kw["input_ids"].shape), with_kwargs=True)
    together = predictor.predict(rows, batch_size=16)
    assert sorted(shape[0] for shape in shapes) == [1, 1, 5]  # the long row, the 3-choice row, the other five
    for got, row in zip(together, rows, strict=True):
        assert got["scores"] == pytest.approx(predictor.predict([row])[0]["scores"], abs=1e-5)


def test_a_bf16_predictor_chooses_as_float32_does(trained):
    """`precision.use("bf16")` (what `serve --precision bf16` does): bf16 linear layers under autocast, float32's
    choices, their scores within 2e-2."""
    run, _, _ = trained
    rows = [{"question": r["question"], "choices": r["choices"]} for r in choice_rows(6, seed=7)]
    loaded, switched = float32_and_bf16_predictors(run / "model")
    want, got = loaded.predict(rows), switched.predict(rows)
    assert [g["choice"] for g in got] == [w["choice"] for w in want]
    for g, w in zip(got, want, strict=True):
        assert g["scores"] == pytest.approx(w["scores"], abs=2e-2)


# ---- backends and resume -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def parity_reference(tiny_bert, tmp_path_factory, cache_dir) -> tuple[Path, Path]:
    """(data folder, run folder) of the one-process run the ddp and sharded-engine tests compare with."""
    common = dict(TASK_PARITY_RUN, cache_dir=cache_dir)
    run, data, _ = trained_once(
        tmp_path_factory,
        "mc-parity",
        lambda root: write_choice_dir(root / "mc"),
        lambda data, run: mc_train(tiny_bert, data, run, batch_size=8, **common),
    )
    return data, run


def test_ddp_matches_one_process_and_accuracy_is_exact(tiny_bert, parity_reference, tmp_path, cache_dir):
    from tuneforge.trainer import Trainer

    choice_dir, single = parity_reference
    common = dict(TASK_PARITY_RUN, cache_dir=cache_dir)
    two = run_cli(*mc_train(tiny_bert, choice_dir, tmp_path / "two", backend="ddp", nproc=2, batch_size=4, **common))
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = train_losses(single), train_losses(tmp_path / "two")
    assert a.keys() == b.keys() == {1, 2, 3, 4} and max(abs(a[s] - b[s]) for s in a) < 1e-5
    # every weight but classifier.bias: softmax over a row's choices ignores a shift shared by all of them, so
    # that bias's gradient is zero up to rounding, and Adam turns rounding noise into steps of the size of lr
    one_w, two_w = (load_file(run / "model" / "model.safetensors") for run in (single, tmp_path / "two"))
    assert max((one_w[k] - two_w[k]).abs().max().item() for k in one_w if k != "classifier.bias") < 1e-4
    ddp = json.loads(two.stdout.strip().splitlines()[-1])
    again = Trainer(
        task="multiple-choice",
        model=str(tmp_path / "two" / "model"),
        quiet=True,
        precision="fp32",
        data={"data_dir": str(choice_dir)},
    ).validate()
    assert ddp["num_examples"] == again["num_examples"] == 21  # odd: one rank's share is padded
    assert ddp["accuracy"] == again["accuracy"] and ddp["loss"] == pytest.approx(again["loss"], abs=1e-6)


@pytest.mark.parametrize("engine", SHARDED_ENGINES)
def test_sharded_engines_train_a_chooser_as_one_process_does(engine, tiny_bert, parity_reference, tmp_path, cache_dir):
    choice_dir, single = parity_reference
    common = dict(TASK_PARITY_RUN, cache_dir=cache_dir)
    two = run_cli(*mc_train(tiny_bert, choice_dir, tmp_path / "two", **common), *engine.split())
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = train_losses(single), train_losses(tmp_path / "two")
    assert a.keys() == b.keys() == {1, 2, 3, 4} and max(abs(a[s] - b[s]) for s in a) < 1e-4
    start, trained = query_weights(tiny_bert, tmp_path / "two" / "model")
    assert (trained - start).abs().max() > 1e-3  # the sharded weights moved (4 steps leave the loss near ln 4)
    one_w, two_w = (load_file(run / "model" / "model.safetensors") for run in (single, tmp_path / "two"))
    # as in the ddp test, without classifier.bias; 5e-4 (a sixth of one step at lr 3e-3), not ddp's 1e-4: at a loss
    # still near ln 4 most gradients are tiny, and Adam turns tp's other reduction order into steps up to 1.3e-4
    assert max((one_w[k] - two_w[k]).abs().max().item() for k in one_w if k != "classifier.bias") < 5e-4


def test_mid_epoch_resume_is_bitwise_identical(tiny_bert, choice_dir, tmp_path, cache_dir):
    common = dict(
        max_steps=6, batch_size=8, lr="3e-3", precision="fp32", eval_strategy="no", quiet=True, cache_dir=cache_dir
    )
    whole = run_cli(*mc_train(tiny_bert, choice_dir, tmp_path / "whole", **common))
    cut = run_cli(*mc_train(tiny_bert, choice_dir, tmp_path / "cut", save_steps=3, **common))
    assert whole.returncode == 0 and cut.returncode == 0, (whole.stderr[-2000:], cut.stderr[-2000:])
    checkpoint = str(tmp_path / "cut" / "checkpoint-3")
    resumed = run_cli(*mc_train(tiny_bert, choice_dir, tmp_path / "resumed", resume=checkpoint, **common))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert max_weight_diff(tmp_path / "whole" / "model", tmp_path / "resumed" / "model") == 0.0


# ---- bad input: one line, exit 2, nothing written -------------------------------------------------
def refused(capsys, tmp_path, model, data_dir) -> str:
    out = tmp_path / "run"
    code, _, err = cli_main(capsys, *mc_train(model, data_dir, out))
    assert code == 2 and not out.exists() and len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_a_row_with_another_number_of_choices(tiny_bert, choice_dir, tmp_path, capsys):
    rows = choice_rows(8, seed=1)
    rows[5]["choices"] = rows[5]["choices"][:3]
    rows[5]["label"] = 0
    write_jsonl(choice_dir / "train.jsonl", rows)
    assert refused(capsys, tmp_path, tiny_bert, choice_dir) == (
        f"error: {choice_dir / 'train.jsonl'}, row 6: 3 choices where the first row has 4; every row needs the same "
        "number"
    )


def test_a_label_outside_the_choices(tiny_bert, choice_dir, tmp_path, capsys):
    rows = choice_rows(8, seed=2)
    rows[2]["label"] = 4
    write_jsonl(choice_dir / "dev.jsonl", rows)
    assert refused(capsys, tmp_path, tiny_bert, choice_dir) == (
        f"error: {choice_dir / 'dev.jsonl'}, row 3: label 4 is not a choice index (0 to 3); fix that row"
    )


def test_a_row_without_a_label(tiny_bert, choice_dir, tmp_path, capsys):
    # one row's label missing made pandas read the column as floats: row 1 was blamed ('label 0.0 is not a choice
    # index'), and a file of float labels (1.0) was refused whole
    rows = choice_rows(8, seed=2)
    rows = [{**r, "label": float(r["label"])} for r in rows]
    del rows[4]["label"]
    write_jsonl(choice_dir / "dev.jsonl", rows)
    assert refused(capsys, tmp_path, tiny_bert, choice_dir) == (
        f"error: {choice_dir / 'dev.jsonl'}, row 5: no label; give the index of the right choice (0 to 3)"
    )


@pytest.mark.parametrize(
    "first, second, says",
    [  # (an Arrow column holds one type: the good first row's value is of the second's type)
        ({"label": "0"}, {"label": "second"}, "row 2: label 'second' is not a choice index (0 to 1)"),
        ({}, {"label": None}, "row 2: no label; give the index of the right choice (0 to 1)"),
        ({"label": 0.0}, {"label": 1.0}, None),  # a whole float, as pandas reads a column with a gap: its index
        ({}, {"question": None}, "row 2: the question is empty (null); fill or drop that row"),
        ({"choices": "cd"}, {"choices": "ab"}, "row 1: choices must be a list of texts (got str)"),
    ],
)
def test_datasets_given_to_fit_are_checked_as_files_are(tiny_bert, first, second, says):
    """fit's datasets went through int() and str(): a text label was a ValueError, a null question the text 'None'
    and choices given as one text its characters (here 'a' and 'b')."""
    import datasets

    from tuneforge.errors import DataError

    good = {"question": "2 + 2?", "choices": ["4", "5"], "label": 0}
    ds = datasets.Dataset.from_list([{**good, **first}, {**good, **second}])
    task = quiet_task("multiple-choice", tiny_bert)
    if says is None:
        assert task.prepare_raw({"train": ds, "validation": None})["train"]["label"] == [0, 1]
        return
    with pytest.raises(DataError, match=re.escape(f"the train dataset, {says}")):
        task.prepare_raw({"train": ds, "validation": None})


def test_questions_whose_choices_are_cut_to_max_length_are_counted_and_counted_again_from_the_cache(
    tiny_bert, tmp_path
):
    # a long question's choices lost their ending (what the model chooses by) without a word
    rows = choice_rows(12, seed=5)
    for i, row in enumerate(rows):
        row["question"] += " really" * (i % 4)
    folder = tmp_path / "mc"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", rows)
    write_jsonl(folder / "dev.jsonl", rows)
    task = quiet_task("multiple-choice", tiny_bert, data_dir=str(folder), max_length=16, cache_dir=str(tmp_path / "c"))
    tokenizer = task.load_tokenizer()
    raw = {"validation": task.load_raw()["validation"]}
    pairs = [([r["question"]] * 4, r["choices"]) for r in rows]
    cut = sum(max(len(ids) for ids in tokenizer(*pair)["input_ids"]) > 16 for pair in pairs)
    assert 0 < cut < len(rows)
    for lines, feats in tokenized_fresh_then_cached(task, raw, tokenizer, "validation"):  # cached: said again
        assert lines[-1] == (
            f"validation: {cut} of 12 questions with a choice (and its context) longer than max_length 16 tokens "
            "cut to their first 16 (raise --max-length to keep them whole)"
        )
        assert feats["input_ids"] == [tokenizer(*p, truncation=True, max_length=16)["input_ids"] for p in pairs]
        assert "choice_cut" not in feats.column_names
