"""NER (token classification): CoNLL files as published and jsonl, IOB1 -> IOB2, labels on first sub-tokens,
seqeval entity scores exact across ranks, and train / eval / predict / serve / resume / ddp end to end."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
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
    tagged_sentences,
    tokenized_fresh_then_cached,
    train_losses,
    trained_once,
    write_conll_dir,
)


def ner_train(model: str, data_dir, out, **flags) -> list[str]:
    return ["train", *cli_flags(task="ner", model=model, data_dir=data_dir, output_dir=out, **flags)]


# ---- reading -------------------------------------------------------------------------------
def test_the_published_conll2003_files_read_to_the_standard_counts(shared_data):
    from tuneforge.data.conll import read_conll

    valid = read_conll(shared_data / "conll2003" / "valid.txt")
    assert len(valid) == 3250 and sum(len(t) for t in valid["tokens"]) == 51362  # conll2003/SOURCE.md
    assert valid[0]["tokens"] == ["CRICKET", "-", "LEICESTERSHIRE", "TAKE", "OVER", "AT", "TOP", "AFTER", "INNINGS"] + [
        "VICTORY",
        ".",
    ]
    # this copy is IOB2 already (its SOURCE.md says IOB1, but no entity starts with I-): read as written
    assert valid[0]["tags"][:3] == ["O", "O", "B-ORG"]
    assert valid[0]["line"] == 3  # after the -DOCSTART- line and its blank line


def test_conll_columns_docstart_tabs_and_line_numbers(tmp_path):
    from tuneforge.data.conll import read_tagged

    f = tmp_path / "x.conll"
    f.write_text("-DOCSTART- O\n\nEU\tB-ORG\nrejects\tO\n\n\n-DOCSTART- O\nPeter B-PER\nBlackburn I-PER\n")
    ds = read_tagged(f)
    assert ds["tokens"] == [["EU", "rejects"], ["Peter", "Blackburn"]]
    assert ds["tags"] == [["B-ORG", "O"], ["B-PER", "I-PER"]] and ds["line"] == [3, 8]


def test_a_word_holding_other_whitespace_stays_one_word(tmp_path):
    """Columns split at spaces and tabs, lines at \\n, \\r\\n and \\r, as the hub's CoNLL loaders read; str.split
    cut '10\\u00a0000' (a no-break space) in two columns and a U+2028 ended the line, each refused as a bad line."""
    from tuneforge.data.conll import read_tagged

    f = tmp_path / "x.conll"
    f.write_bytes("EU B-ORG\r\npays O\r\n10\u00a0000 O\r\nfor\u2028x O\r\n\r\nPeter\tB-PER\rleft O\r".encode())
    ds = read_tagged(f)
    assert ds["tokens"] == [["EU", "pays", "10\u00a0000", "for\u2028x"], ["Peter", "left"]]
    assert ds["tags"] == [["B-ORG", "O", "O", "O"], ["B-PER", "O"]] and ds["line"] == [1, 6]


def test_iob1_is_trained_as_iob2_and_entities_read_as_conlleval():
    from tuneforge.data.conll import entities, iob_label_set, to_iob2

    assert to_iob2(["I-ORG", "O", "I-PER", "I-PER", "B-PER", "I-LOC"]) == ["B-ORG", "O", "B-PER", "I-PER"] + [
        "B-PER",
        "B-LOC",
    ]
    iob2 = ["B-PER", "I-PER", "O", "B-LOC"]
    assert to_iob2(iob2) == iob2
    # a stray I- starts an entity; a change of type ends one
    assert entities(["I-PER", "I-PER", "O", "B-LOC", "I-ORG", "B-ORG", "I-ORG"]) == [
        ("PER", 0, 2),
        ("LOC", 3, 4),
        ("ORG", 4, 5),
        ("ORG", 5, 7),
    ]
    assert iob_label_set([["B-PER", "O"], ["B-LOC", "I-LOC"]]) == ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]


def test_labels_sit_on_the_first_sub_token_of_each_word(minilm_dir, conll_dir, cache_dir):
    task = quiet_task("ner", minilm_dir, data_dir=str(conll_dir), cache_dir=cache_dir)
    tokenizer = task.load_tokenizer()
    raw = task.load_raw()
    assert raw["train"][0]["tags"][0].startswith("B-")  # the file's IOB1 I- read as IOB2 B-
    task.use_labels(task.label_set(raw))
    assert task.label_names == ["O", "B-LOC", "I-LOC", "B-MISC", "I-MISC", "B-ORG", "I-ORG", "B-PER", "I-PER"]
    feats = task.tokenize(task.encode_labels(raw), tokenizer, log=lambda m: None)["train"]
    split_words = 0
    for row, (words, tags) in enumerate(tagged_sentences(64, seed=1)):
        enc = tokenizer(words, is_split_into_words=True)
        word_ids = enc.word_ids()
        want = [
            -100 if w is None or w == word_ids[i - 1] else task.label_names.index(tags[w])
            for i, w in enumerate(word_ids)
        ]
        assert feats[row]["labels"] == want
        split_words += sum(1 for i, w in enumerate(word_ids) if w is not None and i > 0 and w == word_ids[i - 1])
    assert split_words > 0  # some words are several sub-tokens here, so the rule was exercised

    batch = task.collate(feats[:4], tokenizer)
    assert batch["labels"].shape == batch["input_ids"].shape
    assert int(task.count(batch)) == sum(len(w) for w, _ in tagged_sentences(4, seed=1))  # one per word


def test_a_tokenizer_that_pads_on_the_left_keeps_each_label_on_its_token(minilm_dir, conll_dir, cache_dir):
    """A token classifier's tokenizer may pad on the left (padding_side="left", as many causal LMs' do): the labels,
    placed from each row's first position, sat on the padding and on the wrong words of every shorter row (training
    and scoring the wrong tokens). transformers' DataCollatorForTokenClassification follows the side; here the
    batch is padded on the right whatever the tokenizer's side, as qa's, so the labels stay where tokenized."""
    task = quiet_task("ner", minilm_dir, data_dir=str(conll_dir), cache_dir=cache_dir)
    tokenizer = task.load_tokenizer()
    raw = task.load_raw()
    task.use_labels(task.label_set(raw))
    feats = task.tokenize(task.encode_labels(raw), tokenizer, log=lambda m: None)["train"]
    rows = feats[:6]
    assert len({len(ids) for ids in rows["input_ids"]}) > 1  # rows of several lengths: some are padded
    right = task.collate(dict(rows), tokenizer)
    tokenizer.padding_side = "left"
    left = task.collate(dict(rows), tokenizer)
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(left[key], right[key]), key
    assert bool((left["attention_mask"][left["labels"] != -100] == 1).all())  # no label on a padding position


def test_entity_scores_are_seqeval_and_truncated_words_are_misses(tiny_bert, tmp_path, cache_dir):
    from tuneforge.tasks.ner import entity_metrics

    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "O"]]
    scores = entity_metrics(gold, pred)
    assert scores["precision"] == scores["recall"] == pytest.approx(2 / 3)
    assert scores["f1_PER"] == 1.0 and scores["f1_LOC"] == 0.0 and scores["accuracy"] == pytest.approx(5 / 6)

    # a sentence longer than --max-length: the words cut off count as predicted O
    long = tmp_path / "long"
    long.mkdir()
    words = ["Paris"] + ["and"] * 20 + ["Berlin"]
    lines = [f"{w} {'B-LOC' if w != 'and' else 'O'}" for w in words]
    for name in ("train.txt", "valid.txt"):
        (long / name).write_text("\n".join(lines) + "\n")
    task = quiet_task("ner", tiny_bert, data_dir=str(long), max_length=8, cache_dir=cache_dir)
    batch, scores = scored_as_gold(task)
    assert int((batch["labels"] != -100).sum()) == 6  # [CLS] + 6 words + [SEP]
    assert scores["precision"] == 1.0 and scores["recall"] == 0.5  # Berlin, past the window, is missed


def test_a_validation_set_without_entities_scores_as_seqeval_without_a_numpy_warning():
    """No entity in gold or predictions: seqeval's zero_division scores (0), and none of the numpy RuntimeWarnings
    its averages of nothing print, which --quiet promises to keep off stderr."""
    import warnings

    from seqeval.metrics import accuracy_score, f1_score

    from tuneforge.tasks.ner import entity_metrics

    gold, pred = [["O", "O"], ["O"]], [["O", "O"], ["O"]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = entity_metrics(gold, pred)
    assert scores == {"precision": 0.0, "recall": 0.0, "f1": f1_score(gold, pred, zero_division=0), "accuracy": 1.0}
    assert scores["accuracy"] == accuracy_score(gold, pred)


def test_sentences_cut_to_max_length_are_counted_and_counted_again_from_the_cache(tiny_bert, conll_dir, tmp_path):
    # a sentence longer than --max-length trained on its first words and scored with the rest missed, without a word
    task = quiet_task("ner", tiny_bert, data_dir=str(conll_dir), max_length=12, cache_dir=str(tmp_path / "cache"))
    tokenizer = task.load_tokenizer()
    raw = task.load_raw()
    task.use_labels(task.label_set(raw))
    raw = {"validation": task.encode_labels(raw)["validation"]}
    words = list(raw["validation"]["tokens"])
    whole = [len(ids) for ids in tokenizer(words, is_split_into_words=True)["input_ids"]]
    cut = sum(n > 12 for n in whole)
    assert 0 < cut < len(words)
    for lines, feats in tokenized_fresh_then_cached(task, raw, tokenizer, "validation"):  # cached: said again
        assert lines[-1] == (
            f"validation: {cut} of {len(words)} sentences longer than max_length 12 tokens cut to their first 12 "
            "(raise --max-length to keep them whole)"
        )
        want = tokenizer(words, is_split_into_words=True, truncation=True, max_length=12)["input_ids"]
        assert feats["input_ids"] == want  # as before
        assert "sentence_cut" not in feats.column_names


def scored_as_gold(task) -> tuple[dict, dict]:
    """(the first validation sentence's batch, the scores of a model that predicts the gold tag at every token with a
    label): what evaluation makes of a perfect tagger."""
    tokenizer = task.load_tokenizer()
    raw = task.load_raw()
    task.use_labels(task.label_set(raw))
    feats = task.tokenize(task.encode_labels(raw), tokenizer, log=lambda m: None)
    batch = task.collate(feats["validation"][:1], tokenizer)
    perfect = torch.full((*batch["labels"].shape, len(task.label_names)), -10.0)
    perfect.scatter_(-1, batch["labels"].clamp(min=0)[..., None], 10.0)  # the gold tag wherever a word is seen
    stream = task.metric_stream()
    stream.update(SimpleNamespace(logits=perfect), batch, torch.tensor([True]))
    return batch, stream.compute(SimpleNamespace(gather_objects=lambda x: [x], reduce_sum=lambda t: t, device="cpu"))


def test_a_word_without_tokens_does_not_shift_the_scored_tags(tiny_bert, tmp_path, cache_dir):
    # a zero-width space or a soft hyphen is a word of the file that the tokenizer drops: it has no token, so no
    # prediction; the words after it must be scored against their own tags, not the one before them
    data = tmp_path / "zw"
    data.mkdir()
    words = [("Peter", "B-PER"), ("\u200b", "O"), ("visited", "O"), ("\xad", "O"), ("New", "B-LOC"), ("York", "I-LOC")]
    lines = "\n".join(f"{w} {t}" for w, t in words) + "\n"
    for name in ("train.txt", "valid.txt"):
        (data / name).write_text(lines, encoding="utf-8")
    task = quiet_task("ner", tiny_bert, data_dir=str(data), cache_dir=cache_dir)
    batch, scores = scored_as_gold(task)
    assert int((batch["labels"] != -100).sum()) == 4  # the two dropped words have no token
    assert scores["precision"] == scores["recall"] == scores["f1"] == 1.0


# ---- train, eval, predict, serve --------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory, minilm_dir):
    """MiniLM fine-tuned on the synthetic CoNLL files: 18 steps (its run folder and data folder)."""
    run, data, stdout = trained_once(
        tmp_path_factory,
        "ner-trained",
        lambda root: write_conll_dir(root / "conll"),
        lambda data, run: ner_train(minilm_dir, data, run, max_steps=18, lr="5e-4", json=True, quiet=True),
    )
    return run, data, json.loads(stdout.strip().splitlines()[-1])


def test_training_learns_the_entities_and_exports_a_token_classifier(trained):
    from transformers import AutoModelForTokenClassification

    run, _, result = trained
    assert result["num_examples"] == 21 and result["f1"] > 0.9
    assert {"precision", "recall", "accuracy", "f1_PER", "f1_LOC", "f1_ORG", "f1_MISC"} <= set(result)
    model = AutoModelForTokenClassification.from_pretrained(run / "model")
    assert model.config.id2label[0] == "O" and "B-PER" in model.config.label2id
    assert json.loads((run / "model" / "tuneforge.json").read_text())["task"] == "ner"


def test_eval_on_the_test_file(trained, capsys):
    run, data, _ = trained
    code, out, err = cli_main(
        capsys, "eval", str(run / "model"), "--task", "ner", "--validation-file", str(data / "test.txt"), "--json"
    )
    assert code == 0, err
    scores = json.loads(out.strip().splitlines()[-1])
    assert scores["num_examples"] == 10 and scores["f1"] > 0.9


def test_predict_finds_entities_with_character_offsets(trained, tmp_path, capsys):
    from tuneforge.predict import load_predictor

    run, _, _ = trained
    texts = ["John Smith visited New York on Monday.", "Reuters said Anna will travel to Cairo.", "nothing here"]
    predictor = load_predictor(run / "model")
    got = predictor.predict(texts)
    first = [(e["entity"], e["text"]) for e in got[0]["entities"]]
    assert first == [("PER", "John Smith"), ("LOC", "New York")]
    assert [(e["entity"], e["text"]) for e in got[1]["entities"]] == [("ORG", "Reuters"), ("PER", "Anna")] + [
        ("LOC", "Cairo")
    ]
    for text, result in zip(texts, got):
        for e in result["entities"]:
            assert text[e["start"] : e["end"]] == e["text"] and 0 < e["score"] <= 1

    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    code, out, err = cli_main(
        capsys, "predict", str(run / "model"), "--input", str(inputs), "--output", str(tmp_path / "p")
    )
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "p").read_text().splitlines()]
    assert [r["entities"] for r in rows] == [g["entities"] for g in got]


def test_a_word_the_tokenizer_drops_leaves_the_other_words_their_tags(trained):
    """A zero-width space, soft hyphen or control character is a word to CoNLL's split but no token to BERT's
    tokenizer: the words after it kept their own tags (each tag went to the word before: "New York" came out as
    the invisible character and "York")."""
    from tuneforge.predict import load_predictor

    run, _, _ = trained
    predictor = load_predictor(run / "model")
    for invisible in ("\u200b", "\u00ad", "\x01"):
        text = f"John Smith visited {invisible} New York on Monday."
        [got] = predictor.predict([text])
        assert [(e["entity"], e["text"]) for e in got["entities"]] == [("PER", "John Smith"), ("LOC", "New York")]
        for e in got["entities"]:
            assert text[e["start"] : e["end"]] == e["text"]


def test_a_word_with_combining_marks_stays_one_word(trained):
    """A text in decomposed form (NFD: 'i' + U+0301 for 'í', as macOS and some editors write it) is tagged as its
    composed form is: a combining mark belongs to its word (each mark was a word of its own, so 'Brzezin' + U+0301
    + 'ski' were three words, and an entity ending in a mark lost it)."""
    import unicodedata

    from tuneforge.predict import load_predictor

    run, _, _ = trained
    predictor = load_predictor(run / "model")
    composed = [
        "Zbigniew Brzeziński visited Buenos Aires on Monday.",
        "Reuters said María García will travel to Paris.",
    ]
    decomposed = [unicodedata.normalize("NFD", t) for t in composed]
    want, got = predictor.predict(composed), predictor.predict(decomposed)
    assert [(e["entity"], e["text"]) for e in want[0]["entities"]] == [
        ("PER", "Zbigniew Brzeziński"),
        ("LOC", "Buenos Aires"),
    ]
    for text, w, g in zip(decomposed, want, got, strict=True):
        assert [(e["entity"], unicodedata.normalize("NFC", e["text"])) for e in g["entities"]] == [
            (e["entity"], e["text"]) for e in w["entities"]
        ]
        for e in g["entities"]:
            assert text[e["start"] : e["end"]] == e["text"]


@pytest.mark.parametrize(
    "text", ["我住在北京和上海。", "東京に住んでいる田中さん", "Merkel besuchte 北京 (Peking).", "葛\U000e0100飾区"]
)
def test_chinese_characters_are_words_of_their_own_as_the_tokenizer_splits_them(minilm_dir, text):
    """Chinese NER data has a tag per character (CoNLL files of a character a line) and BERT's tokenizer splits each
    ideograph off as a word, as transformers' token-classification pipeline tags them: a run of Chinese characters was
    one word tagged at its first, so "我住在北京和上海" was one entity or none (a variation selector stays with its
    character, as a combining mark does)."""
    from transformers import AutoTokenizer

    from tuneforge.tasks.ner import text_words

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = {word: start for word, (start, _) in reversed(list(zip(enc.word_ids(), enc["offset_mapping"])))}
    words = text_words(text)
    assert [start for _, start, end in words if tokenizer.tokenize(text[start:end])] == sorted(starts.values())
    assert all(text[start:end] == word for word, start, end in words)
    assert [w for w, _, _ in words if w.startswith("葛")] in ([], ["葛\U000e0100"])


def test_a_text_longer_than_max_length_is_tagged_to_its_last_word(trained):
    """A text of more tokens than the model's max_length (128 here: a page, not a sentence) is tagged in windows of
    whole words: the entities of its end are found as those of its start (words past the first 128 tokens were cut
    off without a word, 14 of the 40 sentences' entities found)."""
    from tuneforge.predict import load_predictor

    run, _, _ = trained
    predictor = load_predictor(run / "model")
    assert predictor.max_length == 128
    sentence = "John Smith visited New York on Monday. "
    text = sentence * 40 + "Reuters said Anna will travel to Cairo."
    [got] = predictor.predict([text])
    found = [(e["entity"], e["text"]) for e in got["entities"]]
    assert found == [("PER", "John Smith"), ("LOC", "New York")] * 40 + [("ORG", "Reuters"), ("PER", "Anna")] + [
        ("LOC", "Cairo")
    ]
    for e in got["entities"]:
        assert text[e["start"] : e["end"]] == e["text"]
    assert got["entities"][-1]["end"] == len(text) - 1


def test_words_at_a_window_edge_are_tagged_as_in_the_whole_text(trained):
    """Windows of a long text overlap, as transformers' TokenClassificationPipeline's `stride` makes them, and each
    word is read where it has the most words around it: with windows one after the other, a window's first word was
    tagged without its left neighbours ("Maria | Garcia" came out as two people, "Reuters" after a full stop an
    organisation it was not), 4 of the 1234 entities of these texts at max_length 64 unlike the whole texts'."""
    from tuneforge.predict import load_predictor

    run, _, _ = trained
    texts = [" ".join(w for words, _ in tagged_sentences(12, seed=1000 + s) for w in words) for s in range(40)]

    def found(max_length: int) -> list[list[tuple]]:
        got = load_predictor(run / "model", max_length=max_length).predict(texts)
        return [[(e["entity"], e["start"], e["end"]) for e in row["entities"]] for row in got]

    assert found(64) == found(512)  # the whole texts: under 512 tokens each


def test_windows_overlap_and_move_on():
    from tuneforge.tasks.ner import word_windows

    assert word_windows([3, 3, 3, 3, 3], room=7, overlap=3) == [(0, 2), (1, 3), (2, 4), (3, 5)]
    assert word_windows([2, 9, 2, 2], room=6, overlap=2) == [(0, 1), (1, 2), (2, 4)]  # a word above the room: alone
    assert word_windows([1] * 10, room=4, overlap=0) == [(0, 4), (4, 8), (8, 10)]
    assert word_windows([], room=4, overlap=1) == []


def test_serve_answers_entities(trained):
    from tuneforge.predict import load_predictor

    run, _, _ = trained
    texts = ["Maria Garcia joined Siemens last year.", "Omar visited Tokyo on Monday."]
    with serving(str(run / "model")) as url:
        r = httpx.post(f"{url}/predict", json={"texts": texts}, timeout=60)
        assert r.status_code == 200
        want = load_predictor(run / "model").predict(texts)
        got = r.json()["predictions"]
        for g, w in zip(got, want, strict=True):
            assert [{**e, "score": None} for e in g["entities"]] == [{**e, "score": None} for e in w["entities"]]
            assert [e["score"] for e in g["entities"]] == pytest.approx([e["score"] for e in w["entities"]], abs=1e-4)
        refused = httpx.post(f"{url}/predict", json={"pairs": [["a", "b"]]}, timeout=60)
        assert (
            refused.status_code == 422 and 'this model takes "texts", not "pairs"' in refused.json()["error"]["message"]
        )
        assert httpx.get(f"{url}/health", timeout=10).json()["task"] == "ner"


def test_a_bf16_predictor_finds_the_same_entities(trained):
    """`precision.use("bf16")` (what `serve --precision bf16` does): bf16 linear layers under autocast, the entities
    of float32's, their scores within 2e-2."""
    run, _, _ = trained
    texts = ["Maria Garcia joined Siemens last year.", "Omar visited Tokyo on Monday."]
    loaded, switched = float32_and_bf16_predictors(run / "model")
    want, got = loaded.predict(texts), switched.predict(texts)
    for g, w in zip(got, want, strict=True):
        assert [{**e, "score": None} for e in g["entities"]] == [{**e, "score": None} for e in w["entities"]]
        assert [e["score"] for e in g["entities"]] == pytest.approx([e["score"] for e in w["entities"]], abs=2e-2)


# ---- other data forms and the Python API ------------------------------------------------------
def test_jsonl_tokens_and_tags_through_the_python_api(tiny_bert, tmp_path, cache_dir):
    import datasets

    from tuneforge.trainer import Trainer

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"words": w, "ner": t}) + "\n" for w, t in tagged_sentences(24, seed=4)))
    steps = dict(max_steps=2, batch_size=8, eval_strategy="no", quiet=True)
    data = {"train_file": str(train), "text_columns": ["words"], "label_column": "ner", "cache_dir": cache_dir}
    result = Trainer(task="ner", model=tiny_bert, output_dir=str(tmp_path / "a"), data=data, **steps).fit()
    assert result["num_examples"] == 3  # 10% of 24 held out
    sentences = tagged_sentences(12, seed=5)
    given = datasets.Dataset.from_dict({"tokens": [w for w, _ in sentences], "tags": [t for _, t in sentences]})
    trainer = Trainer(
        task="ner", model=tiny_bert, output_dir=str(tmp_path / "b"), data={"cache_dir": cache_dir}, **steps
    )
    assert trainer.fit(train_dataset=given, eval_dataset=given.select(range(5)))["num_examples"] == 5


def test_datasets_in_the_hubs_form_with_class_label_tags(tiny_bert, cache_dir):
    # the hub's conll2003 holds each tag as the id of a ClassLabel: read as its name (it was a TypeError)
    import datasets

    names = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG", "B-MISC", "I-MISC"]
    sentences = tagged_sentences(6, seed=7)
    features = datasets.Features(
        {"tokens": datasets.List(datasets.Value("string")), "ner_tags": datasets.List(datasets.ClassLabel(names=names))}
    )
    rows = {"tokens": [w for w, _ in sentences], "ner_tags": [[names.index(t) for t in tags] for _, tags in sentences]}
    given = datasets.Dataset.from_dict(rows, features=features)
    task = quiet_task("ner", tiny_bert, label_column="ner_tags", cache_dir=cache_dir)
    raw = task.prepare_raw({"train": given, "validation": given})
    assert raw["train"]["tags"] == [tags for _, tags in sentences]


def test_parquet_rows_read_as_jsonl_rows(tmp_path):
    # parquet's list cells come back as numpy arrays: every row was refused as 'must each be a list'
    import pandas as pd

    from tuneforge.data.conll import read_tagged

    sentences = tagged_sentences(5, seed=6)
    frame = pd.DataFrame({"words": [w for w, _ in sentences], "ner": [t for _, t in sentences]})
    frame.to_parquet(tmp_path / "train.parquet")
    (tmp_path / "train.jsonl").write_text(frame.to_json(orient="records", lines=True))
    from_parquet = read_tagged(tmp_path / "train.parquet", "words", "ner")
    assert from_parquet["tokens"] == [w for w, _ in sentences] and from_parquet["tags"] == [t for _, t in sentences]
    assert from_parquet.to_dict() == read_tagged(tmp_path / "train.jsonl", "words", "ner").to_dict()


# ---- backends and resume -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def parity_reference(tiny_bert, tmp_path_factory, cache_dir) -> tuple[Path, Path]:
    """(data folder, run folder) of the one-process run the ddp and sharded-engine tests compare with."""
    common = dict(TASK_PARITY_RUN, cache_dir=cache_dir)
    run, data, _ = trained_once(
        tmp_path_factory,
        "ner-parity",
        lambda root: write_conll_dir(root / "conll"),
        lambda data, run: ner_train(tiny_bert, data, run, batch_size=8, **common),
    )
    return data, run


def test_ddp_matches_one_process_and_its_scores_are_exact(tiny_bert, parity_reference, tmp_path, cache_dir):
    from tuneforge.trainer import Trainer

    conll_dir, single = parity_reference
    common = dict(TASK_PARITY_RUN, cache_dir=cache_dir)
    ddp = run_cli(*ner_train(tiny_bert, conll_dir, tmp_path / "two", backend="ddp", nproc=2, batch_size=4, **common))
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    one, two = train_losses(single), train_losses(tmp_path / "two")
    assert one.keys() == two.keys() == {1, 2, 3, 4}
    assert max(abs(one[s] - two[s]) for s in one) < 1e-5  # loss normalised by the global count of words
    assert max_weight_diff(single / "model", tmp_path / "two" / "model") < 1e-5
    # 21 validation sentences on 2 ranks (one padded slot): every sentence scored once, as one process does
    ddp_scores = json.loads(ddp.stdout.strip().splitlines()[-1])
    again = Trainer(
        task="ner",
        model=str(tmp_path / "two" / "model"),
        quiet=True,
        precision="fp32",
        data={"data_dir": str(conll_dir)},
    ).validate()
    assert ddp_scores["num_examples"] == again["num_examples"] == 21
    for key in ("f1", "precision", "recall", "accuracy", "loss"):
        assert ddp_scores[key] == pytest.approx(again[key], abs=1e-6), key


@pytest.mark.parametrize("engine", SHARDED_ENGINES)
def test_sharded_engines_train_a_tagger_as_one_process_does(engine, tiny_bert, parity_reference, tmp_path, cache_dir):
    conll_dir, single = parity_reference
    common = dict(TASK_PARITY_RUN, cache_dir=cache_dir)
    sharded = run_cli(*ner_train(tiny_bert, conll_dir, tmp_path / "two", **common), *engine.split())
    assert sharded.returncode == 0, sharded.stderr[-2000:]
    one, two = train_losses(single), train_losses(tmp_path / "two")
    assert one.keys() == two.keys() == {1, 2, 3, 4} and max(abs(one[s] - two[s]) for s in one) < 1e-4
    assert one[1] - one[4] > 0.05  # it learns: the comparison means something
    assert max_weight_diff(single / "model", tmp_path / "two" / "model") < 1e-4


def test_mid_epoch_resume_is_bitwise_identical(tiny_bert, conll_dir, tmp_path, cache_dir):
    common = dict(
        max_steps=6, batch_size=8, lr="3e-3", precision="fp32", eval_strategy="no", quiet=True, cache_dir=cache_dir
    )
    whole = run_cli(*ner_train(tiny_bert, conll_dir, tmp_path / "whole", **common))
    cut = run_cli(*ner_train(tiny_bert, conll_dir, tmp_path / "cut", save_steps=3, **common))
    assert whole.returncode == 0 and cut.returncode == 0, (whole.stderr[-2000:], cut.stderr[-2000:])
    resumed = run_cli(
        *ner_train(tiny_bert, conll_dir, tmp_path / "resumed", resume=str(tmp_path / "cut" / "checkpoint-3"), **common)
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert max_weight_diff(tmp_path / "whole" / "model", tmp_path / "resumed" / "model") == 0.0


# ---- bad input: one line, exit 2, nothing written -------------------------------------------------
def bad_run(capsys, tmp_path, model, data_dir, **flags) -> str:
    out = tmp_path / "run"
    code, _, err = cli_main(capsys, *ner_train(model, data_dir, out, **flags))
    assert code == 2 and not out.exists(), err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_a_conll_line_with_the_wrong_number_of_columns(tiny_bert, conll_dir, tmp_path, capsys):
    train = conll_dir / "train.txt"
    lines = train.read_text().splitlines()
    lines[5] = "Paris NNP B-LOC"
    train.write_text("\n".join(lines) + "\n")
    err = bad_run(capsys, tmp_path, tiny_bert, conll_dir)
    assert err == (
        f"error: {train}, line 6: 3 columns where the file's first token line has 4 ('Paris NNP B-LOC'); every "
        "token line needs a word and a tag in the same columns"
    )


def test_a_validation_tag_outside_the_training_label_set(tiny_bert, conll_dir, tmp_path, capsys):
    valid = conll_dir / "valid.txt"
    valid.write_text(valid.read_text().replace("I-MISC", "I-EVENT", 1))
    err = bad_run(capsys, tmp_path, tiny_bert, conll_dir)
    assert err.startswith(f"error: {valid}, sentence at line ") and "tag 'B-EVENT' is not in the label set" in err
    assert err.endswith("fix the tag or add sentences with it to the training data")


def test_tokens_and_tags_of_different_lengths(tiny_bert, tmp_path, capsys):
    train = tmp_path / "train.jsonl"
    rows = [{"tokens": w, "tags": t} for w, t in tagged_sentences(6, seed=1)]
    rows[3]["tags"] = rows[3]["tags"][:-1]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    code, _, err = cli_main(capsys, "train", *cli_flags(task="ner", model=tiny_bert, train_file=train, output_dir=out))
    n = len(rows[3]["tokens"])
    assert code == 2 and not out.exists()
    assert err.strip() == f"error: {train}, row 4: {n} tokens but {n - 1} tags; give one tag per token"


def test_a_tag_that_is_not_iob(tiny_bert, conll_dir, tmp_path, capsys):
    train = conll_dir / "train.txt"
    train.write_text(train.read_text().replace("I-PER", "PERSON", 1))
    err = bad_run(capsys, tmp_path, tiny_bert, conll_dir)
    assert "tag 'PERSON' is not IOB; NER tags are O, B-TYPE or I-TYPE (e.g. B-PER)" in err
