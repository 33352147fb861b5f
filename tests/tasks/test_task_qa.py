"""Extractive QA: SQuAD v1.1/v2.0 JSON and jsonl, sliding windows whose answer positions map back to the
answer text, the official EM/F1, the best span across windows, and train / eval / predict / serve / ddp /
resume end to end."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch

from conftest import (
    SHARDED_ENGINES,
    TASK_PARITY_RUN,
    cli_flags,
    cli_main,
    float32_and_bf16_predictors,
    max_weight_diff,
    quiet_task,
    run_cli,
    serving,
    train_losses,
    trained_once,
)

NAMES = ["Alice", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivan", "Jonas", "Kemal", "Lena"]
JOBS = ["baker", "pilot", "nurse", "teacher", "farmer", "lawyer", "painter", "chemist", "tailor", "plumber"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Quito", "Dakar", "Riga", "Tunis", "Perth", "Bergen", "Zagreb"]
FILLER = [
    "The weather there was mild for most of the year.",
    "Many visitors came by train during the long summer months.",
    "The old market opened early every single morning.",
    "A small river ran through the middle of the town.",
    "Nobody remembered when the bridge had first been built.",
    "In winter the streets were quiet and covered in snow.",
]
ONE_WINDOW = dict(max_length=64, doc_stride=16)  # tiny_bert has 128 positions; long contexts take 2-3 windows


def paragraphs(n: int, seed: int, people: int = 3, filler: int = 0, unanswerable: int = 0) -> list[dict]:
    """`n` SQuAD paragraphs: `people` "NAME lives in CITY." sentences among `filler` others, and a
    "Where does NAME live?" question for each person (plus `unanswerable` about people not there)."""
    rng = random.Random(seed)
    out = []
    for p in range(n):
        names = rng.sample(NAMES, people + unanswerable)
        cities = rng.sample(CITIES, people)
        sentences = [f"{name} lives in {city}." for name, city in zip(names, cities)] + rng.sample(FILLER, filler)
        rng.shuffle(sentences)
        context = " ".join(sentences)
        qas = []
        for name, city in zip(names, cities):
            start = context.index(f"{name} lives in ") + len(f"{name} lives in ")
            answers = [{"text": city, "answer_start": start}]
            qas.append({"id": f"{seed}-{p}-{name}", "question": f"Where does {name} live?", "answers": answers})
        for name in names[people:]:
            qas.append({"id": f"{seed}-{p}-{name}", "question": f"Where does {name} live?", "answers": []})
            qas[-1].update(is_impossible=True, plausible_answers=[{"text": cities[0], "answer_start": 0}])
        out.append({"context": context, "qas": qas})
    return out


def profiles(n: int, seed: int) -> list[dict]:
    """`n` SQuAD paragraphs, each about one person: where they live, their job and their year of birth, with
    a question on each (what the question asks picks the answer: learnable in a few dozen steps)."""
    rng = random.Random(seed)
    out = []
    for p in range(n):
        name, city, job, year = rng.choice(NAMES), rng.choice(CITIES), rng.choice(JOBS), str(rng.randint(1900, 2000))
        sentences = [f"{name} was born in {year}.", f"{name} lives in {city} and works as a {job}."]
        rng.shuffle(sentences)
        context = " ".join(sentences)
        asked = [("Where does {} live?", city, "lives in "), ("What does {} work as?", job, "works as a ")]
        asked.append(("When was {} born?", year, "born in "))
        qas = []
        for k, (question, answer, before) in enumerate(asked):
            answers = [{"text": answer, "answer_start": context.index(before) + len(before)}]
            qas.append({"id": f"{seed}-{p}-{k}", "question": question.format(name), "answers": answers})
        out.append({"context": context, "qas": qas})
    return out


def write_squad(path: Path, paras: list[dict], version: str = "1.1") -> Path:
    """A SQuAD JSON file of these paragraphs, in two articles."""
    half = len(paras) // 2
    data = [{"title": "A", "paragraphs": paras[:half]}, {"title": "B", "paragraphs": paras[half:]}]
    path.write_text(json.dumps({"version": version, "data": data}), encoding="utf-8")
    return path


def squad_dir(root: Path, n_train: int = 16, n_dev: int = 6, **kw) -> Path:
    """root/squad: train-v1.1.json and dev-v1.1.json (long contexts: 2-3 windows of 64 tokens each)."""
    folder = root / "squad"
    folder.mkdir()
    kw = {"people": 4, "filler": 6, **kw}
    write_squad(folder / "train-v1.1.json", paragraphs(n_train, seed=1, **kw))
    write_squad(folder / "dev-v1.1.json", paragraphs(n_dev, seed=2, **kw))
    return folder


def rows_of(path: Path) -> list[dict]:
    """The questions of a SQuAD file as jsonl rows in the hub's form."""
    rows = []
    for article in json.loads(path.read_text())["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                answers = {"text": [a["text"] for a in qa["answers"]]}
                answers["answer_start"] = [a["answer_start"] for a in qa["answers"]]
                rows.append(
                    {"id": qa["id"], "question": qa["question"], "context": para["context"], "answers": answers}
                )
    return rows


def qa_train(model: str, out, **flags) -> list[str]:
    return ["train", *cli_flags(task="qa", model=model, output_dir=out, **flags)]


def windows(model: str, data_dir: Path, cache_dir: str, **data):
    """(task, tokenizer, raw, features) of `data_dir` with 64-token windows sharing 16."""
    task = quiet_task("qa", model, data_dir=str(data_dir), cache_dir=cache_dir, **{**ONE_WINDOW, **data})
    tokenizer = task.load_tokenizer()
    raw = task.load_raw()
    return task, tokenizer, raw, task.tokenize(raw, tokenizer, log=lambda m: None)


# ---- reading -------------------------------------------------------------------------------
def test_squad_v1_v2_json_and_jsonl_read_to_the_same_columns(tmp_path):
    from tuneforge.data.squad import read_squad

    v1 = read_squad(write_squad(tmp_path / "v1.json", paragraphs(4, seed=3)))
    assert v1.column_names == ["id", "question", "context", "answers_text", "answers_start", "row"]
    assert len(v1) == 12 and v1["row"] == list(range(1, 13))
    first = v1[0]
    assert first["id"] == "3-0-" + first["question"].split()[2] and first["question"].startswith("Where does ")
    start = first["answers_start"][0]
    assert first["context"][start : start + len(first["answers_text"][0])] == first["answers_text"][0]

    v2 = read_squad(write_squad(tmp_path / "v2.json", paragraphs(4, seed=3, unanswerable=1), version="v2.0"))
    assert len(v2) == 16 and sum(not a for a in v2["answers_text"]) == 4  # is_impossible: no answers

    rows = rows_of(tmp_path / "v2.json")
    (tmp_path / "v2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = read_squad(tmp_path / "v2.jsonl")
    assert table.to_dict() == v2.to_dict()
    # SQuAD's list of {"text", "answer_start"}, no ids (the row stands in), as a .json array
    plain = [{"question": r["question"], "context": r["context"], "answers": [{"text": t, "answer_start": s}
             for t, s in zip(r["answers"]["text"], r["answers"]["answer_start"])]} for r in rows[:3]]  # fmt: skip
    (tmp_path / "plain.json").write_text(json.dumps(plain))
    ds = read_squad(tmp_path / "plain.json")
    assert ds["id"] == ["1", "2", "3"] and ds["answers_text"] == v2["answers_text"][:3]


def test_data_dir_and_squad_2_mode(tiny_bert, tmp_path, cache_dir):
    from tuneforge.errors import DataError

    folder = tmp_path / "v2"
    folder.mkdir()
    write_squad(folder / "train-v2.0.json", paragraphs(4, seed=1, unanswerable=1), version="v2.0")
    write_squad(folder / "dev-v2.0.json", paragraphs(2, seed=2, unanswerable=1), version="v2.0")
    task = quiet_task("qa", tiny_bert, data_dir=str(folder), cache_dir=cache_dir)
    raw = task.load_raw()
    assert len(raw["train"]) == 16 and len(raw["validation"]) == 8 and task.version_2
    assert task.export_info()["version_2"] and task.max_length == 384 and task.doc_stride == 128
    task.load_tokenizer()  # no --max-length: qa's 384, cut to the model's 128 positions
    assert (task.max_length, task.doc_stride) == (128, 42)

    write_squad(folder / "train-v1.1.json", paragraphs(2, seed=1))
    with pytest.raises(DataError, match=r"holds 2 train files \(train-v1.1.json, train-v2.0.json\); pass the one"):
        quiet_task("qa", tiny_bert, data_dir=str(folder))


def test_the_shared_squad_files_read_whole_with_no_misplaced_answer(shared_data):
    from tuneforge.data.squad import check_examples, read_squad

    dev = read_squad(shared_data / "squad" / "dev-v1.1.json")
    assert len(dev) == 10570 and sum(len(a) for a in dev["answers_text"]) == 34726  # squad/SOURCE.md
    train = read_squad(shared_data / "squad" / "train-v1.1-subset-du2017.json")
    assert len(train) == 11877
    for ds in (dev, train):
        check_examples(ds, lambda row, qid: f"row {row}")  # raises on the first misplaced answer


# ---- windows -------------------------------------------------------------------------------
def test_window_answer_positions_map_back_to_the_answer_text(tiny_bert, tmp_path, cache_dir):
    task, tokenizer, raw, feats = windows(tiny_bert, squad_dir(tmp_path), cache_dir)
    dev, val = raw["validation"], feats["validation"]
    assert len(val) >= 2 * len(dev) and set(val["example"]) == set(range(len(dev)))  # several windows each
    found = set()
    for f in val:
        example = dev[f["example"]]
        context, text = example["context"], example["answers_text"][0]
        start_char = example["answers_start"][0]
        s, e, cls = f["start_positions"], f["end_positions"], f["cls_index"]
        assert cls == 0 and f["input_ids"][0] == tokenizer.cls_token_id
        inside = [o for o in f["offset_mapping"] if o is not None]
        if (s, e) != (cls, cls):
            assert context[f["offset_mapping"][s][0] : f["offset_mapping"][e][1]] == text
            found.add(f["example"])
        else:  # the answer is not wholly inside this window
            assert not (inside[0][0] <= start_char and start_char + len(text) <= inside[-1][1])
        assert f["length"] == len(f["input_ids"]) <= 64
    assert found == set(range(len(dev)))  # every answer is inside some window
    assert sum(1 for f in val if f["start_positions"] == 0) > 0  # and outside others

    # consecutive windows of a question share --doc-stride (16) context tokens
    ids = [(f["example"], [t for t, o in zip(f["input_ids"], f["offset_mapping"]) if o is not None]) for f in val]
    pairs = [(a[1], b[1]) for a, b in zip(ids, ids[1:]) if a[0] == b[0]]
    assert pairs and all(a[-16:] == b[:16] for a, b in pairs)

    train = feats["train"]  # training windows: the same positions, no offsets kept
    assert "offset_mapping" not in train.column_names and len(train) > len(raw["train"])
    batch = task.collate(val[:4], tokenizer)
    assert batch["start_positions"].tolist() == val["start_positions"][:4] and len(batch["offset_mapping"]) == 4
    assert int(task.count(batch)) == 4  # the loss is summed over windows


# ---- scores ----------------------------------------------------------------------------------
def test_exact_match_and_f1_are_the_official_scripts():
    from tuneforge.tasks.qa import answer_scores, normalize_answer, squad_metrics

    assert normalize_answer("The  Eiffel-Tower, in PARIS!") == "eiffeltower in paris"
    assert normalize_answer("An apple a day") == "apple day"
    assert answer_scores("an Apple, a day.", ["apple day"]) == (1.0, 1.0)
    assert answer_scores("in Paris, France", ["Paris"]) == (0.0, 0.5)  # precision 1/3, recall 1
    assert answer_scores("Paris", ["the city of Paris", "Paris"]) == (1.0, 1.0)  # the best gold counts
    assert answer_scores("city of light", ["the city of Paris"]) == (0.0, pytest.approx(2 / 3))  # p 2/3, r 2/3
    # v1.1 compares normalised strings (both empty: exact) but F1 needs a shared token; v2.0 drops empty golds
    assert answer_scores("a", ["the"]) == (1.0, 0.0)
    assert answer_scores("a", ["the"], version_2=True) == (1.0, 1.0)
    assert answer_scores("", [], version_2=True) == (1.0, 1.0)
    assert answer_scores("Paris", [], version_2=True) == (0.0, 0.0)
    assert answer_scores("", ["Paris"], version_2=True) == (0.0, 0.0)
    scores = squad_metrics(["Paris", "in Paris, France", ""], [["Paris"], ["Paris"], []], version_2=True)
    assert scores["exact_match"] == pytest.approx(200 / 3) and scores["f1"] == pytest.approx(250 / 3)
    assert scores["has_answer_f1"] == 75.0 and scores["no_answer_exact_match"] == 100.0
    # evaluate-v2.0.py splits by whether a question has answers at all (bool(qa['answers'])), not by what is left
    # once they are normalised: a gold "The" is a question with an answer
    split = squad_metrics(["", "Paris"], [["The"], ["Paris"]], version_2=True)
    assert split["has_answer_exact_match"] == 100.0 and "no_answer_exact_match" not in split


def test_a_windows_best_span_keeps_to_the_context_and_the_length_limit():
    from tuneforge.tasks.qa import best_span

    offsets = [None, None, (0, 3), (4, 8), (9, 12), (13, 20), None]
    start = np.array([9.0, 0, 1, 2, 0, 0, 9])  # the best starts are outside the context
    end = np.array([9.0, 0, 0, 5, 0, 3, 9])
    assert best_span(start, end, offsets, n_best=20, max_answer_length=30)[:5] == (7.0, 4, 8, 3, 3)
    end[2] = 8.0  # ends before every good start: never a span
    assert best_span(start, end, offsets, n_best=20, max_answer_length=30)[1:3] == (0, 3)  # start 2 itself
    end[2], start[3] = 0.0, -5.0
    assert best_span(start, end, offsets, n_best=20, max_answer_length=30)[3:] == (2, 3)
    assert best_span(start, end, offsets, n_best=20, max_answer_length=1) == (3.0, 13, 20, 5, 5)  # one token
    assert best_span(start, end, offsets, n_best=2, max_answer_length=30) is None  # top 2: outside only


def fake_backend(*ranks):
    """A backend whose data-parallel ranks are the given streams."""
    return SimpleNamespace(gather_objects=lambda x: [r.windows for r in ranks], reduce_sum=lambda t: t, device="cpu")


def test_the_best_span_over_all_windows_answers_whatever_rank_scored_them(tiny_bert, tmp_path, cache_dir):
    task, tokenizer, raw, feats = windows(tiny_bert, squad_dir(tmp_path), cache_dir)
    val = feats["validation"]
    example = next(i for i in range(len(raw["validation"])) if val["example"].count(i) >= 2)
    rows = [r for r, e in enumerate(val["example"]) if e == example]
    gold = next(r for r in rows if val[r]["start_positions"] != 0)  # a window holding the answer
    other = next(r for r in rows if r != gold)
    batch = task.collate(val.select([other, gold]).to_dict(), tokenizer)
    width = batch["input_ids"].shape[1]
    start, end = torch.full((2, width), -10.0), torch.full((2, width), -10.0)
    context, text = raw["validation"][example]["context"], raw["validation"][example]["answers_text"][0]
    offsets = val[other]["offset_mapping"]
    wrong = next(k for k, o in enumerate(offsets) if o is not None and context[o[0] : o[1]] != text)
    start[0, wrong], end[0, wrong] = 3.0, 3.0  # a wrong one-token span in the other window: score 6
    start[1, val[gold]["start_positions"]], end[1, val[gold]["end_positions"]] = 4.0, 4.0  # the answer: 8
    outputs = SimpleNamespace(start_logits=start, end_logits=end)

    def scores(first, second, version_2=False):
        task.version_2 = version_2
        a, b = task.metric_stream(), task.metric_stream()
        a.update(outputs, batch, torch.tensor(first))
        b.update(outputs, batch, torch.tensor(second))
        return a.compute(fake_backend(a, b))

    for split in ([True, True], [False, True], [True, False]):  # one rank, or each window on its own rank
        got = scores(split, [not v for v in split])
        assert got["exact_match"] == got["f1"] == 100.0 and got["num_examples"] == 1
    # SQuAD 2.0 mode: no answer when the smallest null score ([CLS] start + end) beats the best span (8)
    start[:, 0], end[:, 0] = torch.tensor([5.0, 4.5]), torch.tensor([5.0, 4.5])  # nulls 10 and 9
    assert scores([True, False], [False, True], version_2=True)["exact_match"] == 0.0  # answered ""
    start[1, 0] = 3.0  # null 7.5 in the gold window: the smallest, below 8
    assert scores([True, False], [False, True], version_2=True)["exact_match"] == 100.0
    assert scores([True, True], [False, False])["exact_match"] == 100.0  # SQuAD 1.1: never empty


# ---- train, eval, predict, serve --------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory, minilm_dir):
    """MiniLM fine-tuned on questions about people's profiles: 20 steps (its run folder, data folder, result)."""

    def write_data(root: Path) -> Path:
        data = root / "data"
        data.mkdir()
        write_squad(data / "train.json", profiles(48, seed=1))
        write_squad(data / "dev.json", profiles(12, seed=2))
        write_squad(data / "test.json", profiles(6, seed=3))
        return data

    def command(data: Path, run: Path) -> list[str]:
        flags = dict(train_file=data / "train.json", validation_file=data / "dev.json", max_length=64, max_steps=20)
        return qa_train(minilm_dir, run, lr="4e-4", batch_size=16, json=True, quiet=True, **flags)

    run, data, stdout = trained_once(tmp_path_factory, "qa-trained", write_data, command)
    return run, data, json.loads(stdout.strip().splitlines()[-1])


def test_training_learns_to_answer_and_exports_a_qa_model(trained):
    from transformers import AutoModelForQuestionAnswering

    run, _, result = trained
    assert result["num_examples"] == 36 and result["f1"] > 80 and result["exact_match"] > 70
    assert AutoModelForQuestionAnswering.from_pretrained(run / "model").config.architectures == [
        "BertForQuestionAnswering"
    ]
    info = json.loads((run / "model" / "tuneforge.json").read_text())
    assert info["task"] == "qa" and info["max_length"] == 64 and info["doc_stride"] == 21
    assert info["version_2"] is False and info["max_answer_length"] == 30


def test_eval_on_the_test_file(trained, capsys):
    run, data, _ = trained
    code, out, err = cli_main(
        capsys, "eval", str(run / "model"), "--task", "qa", "--validation-file", str(data / "test.json"), "--json"
    )
    assert code == 0, err
    scores = json.loads(out.strip().splitlines()[-1])
    assert scores["num_examples"] == 18 and scores["f1"] > 80


def test_predict_answers_pairs_with_character_spans(trained, tmp_path, capsys):
    from tuneforge.errors import DataError
    from tuneforge.predict import load_predictor

    run, data, _ = trained
    rows = rows_of(data / "test.json")
    pairs = [(r["question"], r["context"]) for r in rows]
    predictor = load_predictor(run / "model")
    assert predictor.task == "qa" and predictor.accepts == ("pairs",) and predictor.labels == []
    got = predictor.predict(pairs, batch_size=4)
    for (_, context), answer in zip(pairs, got):
        assert context[answer["start"] : answer["end"]] == answer["answer"] and 0 < answer["score"] <= 1
    right = sum(a["answer"] == r["answers"]["text"][0] for a, r in zip(got, rows))
    assert right >= 0.8 * len(rows)
    with pytest.raises(DataError, match=r"takes \(question, context\) pairs"):
        predictor.predict(["just a text"])

    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps({"question": q, "context": c}) + "\n" for q, c in pairs))
    out = tmp_path / "preds.jsonl"
    code, _, err = cli_main(
        capsys, "predict", str(run / "model"), "--input", str(inputs), "--output", str(out),
        "--text-column", "question", "--text-column", "context",
    )  # fmt: skip
    assert code == 0, err
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w.pop("index") for w in written] == list(range(len(pairs)))
    assert_same_answers(written, got)


def test_the_predictor_cuts_long_contexts_and_answers_nothing_where_squad_2_says_so(trained, tmp_path):
    import shutil

    from tuneforge.tasks.qa import AnswerPredictor

    run, data, _ = trained
    rows = rows_of(data / "test.json")
    pairs = [(r["question"], r["context"]) for r in rows]
    narrow = AnswerPredictor(run / "model", max_length=24)  # the 20-token contexts take 2-3 windows
    assert (narrow.max_length, narrow.doc_stride) == (24, 8)
    got = narrow.predict(pairs)
    for (_, context), answer in zip(pairs, got):
        assert context[answer["start"] : answer["end"]] == answer["answer"]
    assert sum(a["answer"] == r["answers"]["text"][0] for a, r in zip(got, rows)) >= 0.8 * len(rows)

    model = shutil.copytree(run / "model", tmp_path / "v2")
    info = json.loads((model / "tuneforge.json").read_text())
    answers = {}
    for threshold in (-1e9, 1e9):  # the null score always wins / never wins
        (model / "tuneforge.json").write_text(
            json.dumps({**info, "version_2": True, "null_score_diff_threshold": threshold})
        )
        answers[threshold] = AnswerPredictor(model).predict(pairs[:4])
    assert all(a["answer"] == "" and a["start"] == a["end"] == -1 and 0 < a["score"] <= 1 for a in answers[-1e9])
    assert_same_answers(answers[1e9], AnswerPredictor(run / "model").predict(pairs[:4]))


def assert_same_answers(got: list[dict], want: list[dict]) -> None:
    assert [{k: v for k, v in a.items() if k != "score"} for a in got] == [
        {k: v for k, v in a.items() if k != "score"} for a in want
    ]
    assert [a["score"] for a in got] == pytest.approx([a["score"] for a in want], abs=1e-6)


def test_serve_answers_question_context_pairs(trained):
    from tuneforge.predict import load_predictor

    run, data, _ = trained
    pairs = [(r["question"], r["context"]) for r in rows_of(data / "test.json")[:5]]
    with serving(str(run / "model")) as url:
        r = httpx.post(f"{url}/predict", json={"pairs": [list(p) for p in pairs]}, timeout=60)
        assert r.status_code == 200, r.text
        assert_same_answers(r.json()["predictions"], load_predictor(run / "model").predict(pairs))
        assert httpx.post(f"{url}/predict", json={"texts": ["a question"]}, timeout=60).status_code == 422
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["task"] == "qa" and health["labels"] == [] and health["regression"] is False


def test_a_bf16_predictor_gives_the_same_answers(trained):
    """`precision.use("bf16")` (what `serve --precision bf16` does): bf16 linear layers under autocast, float32's
    answers, their scores within 2e-2."""
    run, data, _ = trained
    pairs = [(r["question"], r["context"]) for r in rows_of(data / "test.json")[:5]]
    loaded, switched = float32_and_bf16_predictors(run / "model")
    want, got = loaded.predict(pairs), switched.predict(pairs)
    assert [a["answer"] for a in got] == [a["answer"] for a in want]
    assert [a["score"] for a in got] == pytest.approx([a["score"] for a in want], abs=2e-2)


def test_the_python_api_takes_datasets_in_the_hub_form(tiny_bert, tmp_path, cache_dir):
    import datasets

    from tuneforge.trainer import Trainer

    rows = rows_of(write_squad(tmp_path / "x.json", paragraphs(6, seed=4)))
    given = datasets.Dataset.from_list(rows)
    data = {"cache_dir": cache_dir, **ONE_WINDOW}
    trainer = Trainer(task="qa", model=tiny_bert, output_dir=str(tmp_path / "run"), data=data, max_steps=2, quiet=True)
    result = trainer.fit(train_dataset=given, eval_dataset=given.select(range(5)))
    assert result["num_examples"] == 5 and {"exact_match", "f1", "loss"} <= set(result)


# ---- backends and resume -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def parity_reference(tiny_bert, tmp_path_factory, cache_dir) -> tuple[Path, Path]:
    """(data folder, run folder) of the one-process run the ddp and sharded-engine tests compare with (its
    evaluation batch size, which the compared training does not depend on, is the ddp test's)."""
    common = dict(TASK_PARITY_RUN, cache_dir=cache_dir, eval_batch_size=2, **ONE_WINDOW)
    run, data, _ = trained_once(
        tmp_path_factory,
        "qa-parity",
        squad_dir,
        lambda data, run: qa_train(tiny_bert, run, batch_size=8, data_dir=data, **common),
    )
    return data, run


def test_ddp_matches_one_process_and_its_scores_are_exact(tiny_bert, parity_reference, tmp_path, cache_dir):
    from safetensors.torch import load_file

    from tuneforge.data.samplers import eval_batches
    from tuneforge.trainer import Trainer

    data, single = parity_reference
    common = dict(TASK_PARITY_RUN, data_dir=data, cache_dir=cache_dir, eval_batch_size=2, **ONE_WINDOW)
    ddp = run_cli(*qa_train(tiny_bert, tmp_path / "two", backend="ddp", nproc=2, batch_size=4, **common))
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    one, two = train_losses(single), train_losses(tmp_path / "two")
    assert one.keys() == two.keys() == {1, 2, 3, 4}
    assert max(abs(one[s] - two[s]) for s in one) < 1e-5  # the loss normalised by the global count of windows
    # the span head's bias and the LayerNorm bias under it shift all of a window's logits alike, which the softmax
    # ignores: their gradient is rounding noise (~1e-9) that Adam turns into lr-sized steps. Every other weight:
    one_w, two_w = (load_file(run / "model" / "model.safetensors") for run in (single, tmp_path / "two"))
    shift = {"qa_outputs.bias", "bert.encoder.layer.1.output.LayerNorm.bias"}
    assert max((one_w[k] - two_w[k]).abs().max().item() for k in one_w if k not in shift) < 1e-5

    # the windows of some questions were scored on different ranks
    _, _, _, feats = windows(tiny_bert, data, cache_dir)
    lengths, examples = np.asarray(feats["validation"]["length"]), feats["validation"]["example"]
    ranks: dict[int, set[int]] = {}
    for rank in (0, 1):
        for idx in eval_batches(lengths, batch_size=2, dp_rank=rank, dp_size=2):
            for i in (i for i in idx if i >= 0):
                ranks.setdefault(examples[i], set()).add(rank)
    assert any(len(r) == 2 for r in ranks.values())
    # every question scored once, as one process scores it
    ddp_scores = json.loads(ddp.stdout.strip().splitlines()[-1])
    data_cfg = {"data_dir": str(data), "cache_dir": cache_dir, **ONE_WINDOW}
    again = Trainer(
        task="qa", model=str(tmp_path / "two" / "model"), quiet=True, precision="fp32", data=data_cfg
    ).validate()
    assert ddp_scores["num_examples"] == again["num_examples"] == 24
    for key in ("exact_match", "f1", "loss"):
        assert ddp_scores[key] == pytest.approx(again[key], abs=1e-6), key


@pytest.mark.parametrize("engine", SHARDED_ENGINES)
def test_sharded_engines_train_a_reader_as_one_process_does(engine, tiny_bert, parity_reference, tmp_path, cache_dir):
    from safetensors.torch import load_file

    data, single = parity_reference
    common = dict(TASK_PARITY_RUN, data_dir=data, cache_dir=cache_dir, **ONE_WINDOW)
    sharded = run_cli(*qa_train(tiny_bert, tmp_path / "two", **common), *engine.split())
    assert sharded.returncode == 0, sharded.stderr[-2000:]
    one, two = train_losses(single), train_losses(tmp_path / "two")
    assert one.keys() == two.keys() == {1, 2, 3, 4} and max(abs(one[s] - two[s]) for s in one) < 1e-4
    assert max(one.values()) - min(one.values()) > 0.01  # it learns: the comparison means something
    one_w, two_w = (load_file(run / "model" / "model.safetensors") for run in (single, tmp_path / "two"))
    shift = {"qa_outputs.bias", "bert.encoder.layer.1.output.LayerNorm.bias"}  # as in the ddp test above
    assert max((one_w[k] - two_w[k]).abs().max().item() for k in one_w if k not in shift) < 1e-4


def test_mid_epoch_resume_is_bitwise_identical(tiny_bert, tmp_path, cache_dir, capsys):
    data = squad_dir(tmp_path)
    common = dict(
        max_steps=6, batch_size=8, lr="3e-3", precision="fp32", eval_strategy="no", quiet=True, cache_dir=cache_dir
    )
    common.update(data_dir=data, **ONE_WINDOW)
    for name, extra in (("whole", {}), ("cut", {"save_steps": 3})):
        code, _, err = cli_main(capsys, *qa_train(tiny_bert, tmp_path / name, **common, **extra))
        assert code == 0, err
    resume = str(tmp_path / "cut" / "checkpoint-3")
    code, _, err = cli_main(capsys, *qa_train(tiny_bert, tmp_path / "resumed", resume=resume, **common))
    assert code == 0, err
    assert max_weight_diff(tmp_path / "whole" / "model", tmp_path / "resumed" / "model") == 0.0


# ---- bad input: one line, exit 2, nothing written -------------------------------------------------
def bad_run(capsys, tmp_path, model, **flags) -> str:
    out = tmp_path / "run"
    code, _, err = cli_main(capsys, *qa_train(model, out, **flags))
    assert code == 2 and not out.exists(), err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_an_answer_that_is_not_at_its_answer_start(tiny_bert, tmp_path, capsys):
    train = write_squad(tmp_path / "train.json", paragraphs(4, seed=1))
    doc = json.loads(train.read_text())
    qa = doc["data"][1]["paragraphs"][0]["qas"][1]
    qa["answers"][0]["answer_start"] += 3
    train.write_text(json.dumps(doc))
    err = bad_run(capsys, tmp_path, tiny_bert, train_file=train)
    text, start = qa["answers"][0]["text"], qa["answers"][0]["answer_start"]
    found = doc["data"][1]["paragraphs"][0]["context"][start : start + len(text)]
    assert err == (
        f"error: {train}, question {qa['id']!r} (row 8): answer {text!r} is not at its answer_start {start} (the "
        f"context has {found!r} there); 1 of 12 answers are misplaced. Each answer_start must be the character "
        "offset of the answer's text in its context: fix the offsets"
    )


@pytest.mark.parametrize("field", ["question", "context"])
def test_an_empty_question_or_a_question_without_context(tiny_bert, tmp_path, capsys, field):
    rows = rows_of(write_squad(tmp_path / "x.json", paragraphs(2, seed=1)))
    rows[4][field] = "  " if field == "question" else ""
    if field == "context":
        rows[4]["answers"] = {"text": [], "answer_start": []}
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = bad_run(capsys, tmp_path, tiny_bert, train_file=train)
    assert err.startswith(f"error: {train}, question {rows[4]['id']!r} (row 5): ")
    assert err.endswith(
        "the question is empty; give it its text, or drop it"
        if field == "question"
        else "the question has no context; extractive QA finds its answer in a context: give one, or drop the question"
    )


def test_a_doc_stride_not_below_max_length(tiny_bert, tmp_path, capsys):
    train = write_squad(tmp_path / "train.json", paragraphs(2, seed=1))
    err = bad_run(capsys, tmp_path, tiny_bert, train_file=train, max_length=64, doc_stride=64)
    assert err == (
        "error: --doc-stride 64 must be below --max-length 64: it is how many tokens consecutive windows of 64 "
        "tokens share; use --doc-stride 21 (the default, max_length // 3) or raise --max-length"
    )


def test_a_question_too_long_for_its_window(tiny_bert, tmp_path, capsys):
    rows = rows_of(write_squad(tmp_path / "x.json", paragraphs(2, seed=1)))
    rows[2]["question"] = "Where, of all the places in the world, " * 6 + "does this person live?"
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = bad_run(capsys, tmp_path, tiny_bert, train_file=train, validation_file=train, **ONE_WINDOW)
    assert err.startswith(f"error: {train}, question {rows[2]['id']!r} (row 3): the question is ")
    assert "leave room for questions of at most 44: raise --max-length, lower --doc-stride" in err
