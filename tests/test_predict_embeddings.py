"""`tuneforge predict` of a sentence encoder (a model exported by `--task embedding`): one vector per input text, as
JSON lines or a .npy matrix, equal to sentence-transformers' own load of the folder and to SentenceEncoder within
1e-5 (texts longer than the model's max_length truncated as sentence-transformers truncates them); --dimensions
keeps a Matryoshka slice, renormalised as SentenceTransformer's truncate_dim; token ids embed as their text;
--precision bf16 computes in bf16 (vectors and scores close to fp32's, labels equal); every bad input is one line."""

import json

import numpy as np
import pytest

from conftest import read_jsonl, save_tiny_classifier
from test_bad_input import assert_refused, in_process

TEXTS = [
    "a wonderful, moving film",
    "dull",
    "the plot makes no sense at all and the ending drags on and on and on, long past the point where anyone in the "
    "room still cared about what happened to whom",  # beyond max_length 24: truncated
    "ok",
    "Ein schöner Film über Füchse 🦊 and owls",
    "i wanted my money back",
    "great acting and a clever plot",
]

# longer than the bundled MiniLM folder's max_seq_length (256), shorter than its 512 positions
LONG = " ".join(f"Paragraph {i} of the report says the harbour reopened after the storm." for i in range(30))


@pytest.fixture(scope="module")
def reference(tiny_encoder) -> np.ndarray:
    """sentence-transformers' embeddings of TEXTS, from its own load of the exported folder."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(tiny_encoder, device="cpu").encode(TEXTS)


def write_texts(path, texts, column: str = "text"):
    path.write_text("".join(json.dumps({column: t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def test_predict_writes_a_vector_per_text_as_sentence_transformers_does(capfd, tmp_path, tiny_encoder, reference):
    from tuneforge.tasks.sentence_encoder import SentenceEncoder

    out = tmp_path / "vectors.jsonl"
    args = ["predict", tiny_encoder, "--input", write_texts(tmp_path / "texts.jsonl", TEXTS), "--output", out]
    proc = in_process(capfd, *args, "--batch-size", "3")
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {len(TEXTS)} predictions to {out}" in proc.stdout
    rows = read_jsonl(out)
    assert [r["index"] for r in rows] == list(range(len(TEXTS))) and all(set(r) == {"index", "embedding"} for r in rows)
    got = np.array([r["embedding"] for r in rows], dtype=np.float32)
    assert got.shape == (len(TEXTS), 32)
    assert np.abs(got - reference).max() < 1e-5
    assert np.abs(got - SentenceEncoder(tiny_encoder, device="cpu").encode(TEXTS)).max() < 1e-5
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert min(np.abs(got[i] - got[j]).max() for i in range(len(TEXTS)) for j in range(i)) > 1e-3  # each its own


def test_predict_replaces_its_own_earlier_vectors(capfd, tmp_path, tiny_encoder):
    out = tmp_path / "vectors.jsonl"
    for texts in (TEXTS, TEXTS[:2]):
        proc = in_process(
            capfd, "predict", tiny_encoder, "--input", write_texts(tmp_path / "t.jsonl", texts), "--output", out
        )
        assert proc.returncode == 0, proc.stderr
    assert len(read_jsonl(out)) == 2


def test_a_npy_output_is_the_float32_matrix(capfd, tmp_path, tiny_encoder, reference):
    inp = tmp_path / "texts.csv"
    inp.write_text("sentence,id\n" + "".join(f'"{t}",{i}\n' for i, t in enumerate(TEXTS)), encoding="utf-8")
    out = tmp_path / "sub" / "vectors.npy"
    proc = in_process(capfd, "predict", tiny_encoder, "--input", inp, "--output", out)
    assert proc.returncode == 0, proc.stderr
    matrix = np.load(out, allow_pickle=False)
    assert matrix.dtype == np.float32 and matrix.shape == (len(TEXTS), 32)
    assert np.abs(matrix - reference).max() < 1e-5
    assert [p.name for p in out.parent.iterdir()] == ["vectors.npy"]  # no temporary left behind


def test_precision_bf16_gives_bf16s_own_vectors_close_to_float32s(capfd, tmp_path, tiny_encoder, reference):
    inp = write_texts(tmp_path / "texts.jsonl", TEXTS)
    for precision in ("bf16", "fp32"):
        out = tmp_path / f"{precision}.npy"
        proc = in_process(capfd, "predict", tiny_encoder, "--input", inp, "--output", out, "--precision", precision)
        assert proc.returncode == 0, proc.stderr
    bf16, fp32 = np.load(tmp_path / "bf16.npy"), np.load(tmp_path / "fp32.npy")
    assert bf16.dtype == np.float32 and np.allclose(np.linalg.norm(bf16, axis=1), 1, atol=1e-5)
    assert np.abs(fp32 - reference).max() < 1e-5  # asked for by name: the default's numbers
    assert np.abs(bf16 - reference).max() > 1e-5  # computed in bf16: its own rounding
    assert ((bf16 * reference).sum(1) > 0.999).all()


def test_dimensions_keep_a_renormalised_matryoshka_slice(tmp_path, tiny_encoder):
    from sentence_transformers import SentenceTransformer

    from tuneforge.predict import predict_file

    out = tmp_path / "short.npy"
    assert predict_file(tiny_encoder, str(write_texts(tmp_path / "t.jsonl", TEXTS)), str(out), dimensions=8) == 7
    short = np.load(out)
    st = SentenceTransformer(tiny_encoder, device="cpu", truncate_dim=8)
    assert short.shape == (len(TEXTS), 8)
    assert np.abs(short - st.encode(TEXTS, normalize_embeddings=True)).max() < 1e-5
    assert np.allclose(np.linalg.norm(short, axis=1), 1, atol=1e-5)
    predict_file(tiny_encoder, str(tmp_path / "t.jsonl"), str(tmp_path / "short.jsonl"), dimensions=8)
    rows = np.array([r["embedding"] for r in read_jsonl(tmp_path / "short.jsonl")], dtype=np.float32)
    assert np.abs(rows - short).max() < 1e-6


def test_the_predictor_embeds_token_ids_as_their_text(tiny_encoder):
    from tuneforge.predict import load_predictor

    predictor = load_predictor(tiny_encoder)
    assert predictor.embedding_size == 32 and predictor.matryoshka_dims == [16, 8] and predictor.max_length == 24
    ids = predictor.encoder.tokenizer(TEXTS[:2])["input_ids"]  # special tokens included, as the tokenizer gives them
    mixed = predictor.encode([ids[0], TEXTS[1]], batch_size=2)
    assert np.abs(mixed - predictor.encode(TEXTS[:2])).max() < 1e-6
    [one, two] = predictor.embed([TEXTS[0], ids[1]])
    assert (one.tokens, two.tokens) == (len(ids[0]), len(ids[1]))


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, minilm_dir) -> str:
    return save_tiny_classifier(tmp_path_factory.mktemp("classifier"), minilm_dir, {0: "neg", 1: "pos"})


@pytest.mark.parametrize(
    "rows, extra, needles",
    [
        (TEXTS, ("--dimensions", "33"), ("--dimensions 33 is outside the 32 dimensions", "give 1 to 32")),
        (TEXTS, ("--dimensions", "0"), ("--dimensions must be between 1 and",)),
        (["a cat", "", "a dog"], (), ("input 2 is empty",)),
        (TEXTS, ("--text-column", "text", "--text-column", "text"), ("--text-column names 'text' twice",)),
        (TEXTS, ("--text-column", "text", "--text-column", "id"), ("row 1 of", "column 'id' holds 0, not text")),
        (TEXTS, ("--text-column", "body"), ("column 'body' not found",)),
        # JSON values that are not text: training refuses them; predict embedded their Python str ('True', "['a']")
        (["a cat", 7, "a dog"], (), ("row 2 of", "texts.jsonl", "column 'text' holds 7, not text")),
        (["a cat", True], (), ("row 2 of", "column 'text' holds True, not text")),
        (["a cat", ["a", "b"]], (), ("row 2 of", "column 'text' holds ['a', 'b'], not text")),
        (["a cat", {"a": 1}], (), ("row 2 of", "column 'text' holds {'a': 1}, not text")),
    ],
)
def test_bad_input_is_one_line(capfd, tmp_path, tiny_encoder, rows, extra, needles):
    inp = write_texts(tmp_path / "texts.jsonl", rows)
    proc = in_process(capfd, "predict", tiny_encoder, "--input", inp, "--output", tmp_path / "out.jsonl", *extra)
    assert_refused(proc, tmp_path, *needles)
    assert not (tmp_path / "out.jsonl").exists()


def test_vectors_options_are_refused_for_a_model_without_vectors(capfd, tmp_path, classifier):
    inp = write_texts(tmp_path / "texts.jsonl", TEXTS)
    proc = in_process(capfd, "predict", classifier, "--input", inp, "--output", tmp_path / "o.jsonl", "--dimensions", 8)
    assert_refused(proc, tmp_path, "--dimensions keeps the first dimensions", "does not answer with vectors")
    proc = in_process(capfd, "predict", classifier, "--input", inp, "--output", tmp_path / "o.npy")
    assert_refused(proc, tmp_path, "names a .npy matrix of vectors", "name a .jsonl file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["texts.jsonl"]


def test_a_classifier_predicts_in_bf16_with_float32s_labels(capfd, tmp_path, classifier):
    inp = write_texts(tmp_path / "texts.jsonl", TEXTS)
    rows = {}
    for precision in ("bf16", "fp32"):
        out = tmp_path / f"{precision}.jsonl"
        proc = in_process(capfd, "predict", classifier, "--input", inp, "--output", out, "--precision", precision)
        assert proc.returncode == 0, proc.stderr
        rows[precision] = read_jsonl(out)
    assert [r["label"] for r in rows["bf16"]] == [r["label"] for r in rows["fp32"]]
    bf16, fp32 = ([r["score"] for r in rows[p]] for p in ("bf16", "fp32"))
    assert bf16 != fp32 and np.allclose(bf16, fp32, atol=2e-2)


def test_a_bf16_folder_predicts_in_float32_when_fp32_is_asked(capfd, tmp_path, classifier):
    """transformers loads a folder in the dtype its config.json names: a classifier saved in bf16 ran every forward
    in bf16 (norms and softmax too) under --precision fp32, predict's default; its float32 forwards now, as those of
    the same weights loaded in float32."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = tmp_path / "bf16"
    AutoModelForSequenceClassification.from_pretrained(classifier, dtype=torch.bfloat16).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    tokenizer.save_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        want = model(**tokenizer(TEXTS[:2], padding=True, return_tensors="pt")).logits.softmax(-1)[:, 0]
    out = tmp_path / "out.jsonl"
    inp = write_texts(tmp_path / "texts.jsonl", TEXTS[:2])
    assert in_process(capfd, "predict", folder, "--input", inp, "--output", out).returncode == 0
    assert np.allclose([row["scores"]["neg"] for row in read_jsonl(out)], want.numpy(), atol=1e-6, rtol=0)


def test_an_existing_npy_file_is_never_replaced(capfd, tmp_path, tiny_encoder):
    theirs = tmp_path / "vectors.npy"
    np.save(theirs, np.arange(3.0))
    before = theirs.read_bytes()
    inp = write_texts(tmp_path / "texts.jsonl", TEXTS)
    proc = in_process(capfd, "predict", tiny_encoder, "--input", inp, "--output", theirs)
    assert_refused(proc, tmp_path, "exists; a .npy file does not say what wrote it", "delete it or choose another")
    assert theirs.read_bytes() == before


# ---- a sentence-transformers folder tuneforge did not write -------------------------------------------------
def test_a_sentence_transformers_folder_is_embedded_as_sentence_transformers_does(capfd, tmp_path, minilm_dir):
    """The bundled all-MiniLM-L6-v2 as published (modules.json: Transformer, mean Pooling, Normalize; no task in a
    tuneforge.json): predict and serve run it as a sentence encoder, not as a classifier with a new head."""
    from sentence_transformers import SentenceTransformer

    from tuneforge.predict import load_servable
    from tuneforge.tasks.sentence_encoder import EmbeddingPredictor

    assert isinstance(load_servable(minilm_dir), EmbeddingPredictor)
    texts = [*TEXTS, LONG]
    out = tmp_path / "vectors.npy"
    proc = in_process(
        capfd, "predict", minilm_dir, "--input", write_texts(tmp_path / "t.jsonl", texts), "--output", out
    )
    assert proc.returncode == 0, proc.stderr
    theirs = SentenceTransformer(minilm_dir, device="cpu")
    assert theirs.max_seq_length == 256 < len(theirs.tokenizer(LONG)["input_ids"]) < 512
    assert np.abs(np.load(out) - theirs.encode(texts)).max() < 1e-5  # the long text cut where theirs cuts it


def test_a_folder_that_lowercases_its_texts_is_embedded_as_sentence_transformers_does(capfd, tmp_path):
    """A sentence-transformers folder whose sentence_bert_config.json says do_lower_case (older models), with a cased
    tokenizer: its texts lowercased before tokenizing, by predict as by SentenceTransformer."""
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import BertModel

    from conftest import bpe_tokenizer, tiny_bert_config
    from tuneforge.tasks.sentence_encoder import sentence_transformers_files

    folder = tmp_path / "st"
    tokenizer = bpe_tokenizer(folder)  # byte-level BPE: cased
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    BertModel(tiny_bert_config(vocab_size=len(tokenizer))).save_pretrained(folder)
    for name, text in sentence_transformers_files(32, 64).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": True}))
    texts = ["The Cat SAT on the Mat", "the cat sat on the mat", "A DULL film"]
    out = tmp_path / "vectors.npy"
    proc = in_process(capfd, "predict", folder, "--input", write_texts(tmp_path / "t.jsonl", texts), "--output", out)
    assert proc.returncode == 0, proc.stderr
    ours, theirs = np.load(out), SentenceTransformer(str(folder), device="cpu").encode(texts)
    assert np.abs(ours - theirs).max() < 1e-5
    assert np.abs(ours[0] - ours[1]).max() < 1e-6  # the same text once lowercased
    assert tokenizer("The Cat")["input_ids"] != tokenizer("the cat")["input_ids"]  # which the tokenizer alone is not


def test_a_folder_saved_by_sentence_transformers_6_is_embedded_as_it_embeds(capfd, tmp_path, tiny_encoder):
    """The format sentence-transformers 6 saves (Pooling's {"pooling_mode": "mean"}; no max_seq_length in
    sentence_bert_config.json: the tokenizer's model_max_length, 24 here, holds it): embedded, not refused, each text
    cut where that folder cuts it."""
    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "st6"
    theirs = SentenceTransformer(tiny_encoder, device="cpu")
    theirs.save(str(folder))
    assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "mean"
    assert "max_seq_length" not in json.loads((folder / "sentence_bert_config.json").read_text())
    out = tmp_path / "vectors.npy"
    proc = in_process(capfd, "predict", folder, "--input", write_texts(tmp_path / "t.jsonl", TEXTS), "--output", out)
    assert proc.returncode == 0, proc.stderr
    reloaded = SentenceTransformer(str(folder), device="cpu")
    assert reloaded.max_seq_length == 24 < len(reloaded.tokenizer(TEXTS[2])["input_ids"])
    assert np.abs(np.load(out) - reloaded.encode(TEXTS)).max() < 1e-5

    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 32, "pooling_mode": "cls"}))
    proc = in_process(capfd, "predict", folder, "--input", tmp_path / "t.jsonl", "--output", tmp_path / "cls.npy")
    assert_refused(proc, tmp_path, "sentence-transformers folder with cls pooling", "mean pooling")


def test_a_folder_with_a_default_prompt_embeds_each_text_after_it(capfd, tmp_path, tiny_encoder):
    """config_sentence_transformers.json's default_prompt_name: sentence-transformers encodes prompt + text, and so
    does predict; a Pooling that leaves the prompt's tokens out (include_prompt false) is refused in one line."""
    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "prompted"
    SentenceTransformer(tiny_encoder, device="cpu").save(str(folder))
    config_file = folder / "config_sentence_transformers.json"
    config = json.loads(config_file.read_text())
    config.update(prompts={"query": "query: ", "document": ""}, default_prompt_name="query")
    config_file.write_text(json.dumps(config))
    texts = TEXTS[:2] + TEXTS[3:]  # (none cut at max_length 24 once prompted)
    out = tmp_path / "vectors.npy"
    proc = in_process(capfd, "predict", folder, "--input", write_texts(tmp_path / "t.jsonl", texts), "--output", out)
    assert proc.returncode == 0, proc.stderr
    theirs = SentenceTransformer(str(folder), device="cpu")
    assert np.abs(np.load(out) - theirs.encode(texts)).max() < 1e-5
    assert np.abs(np.load(out) - theirs.encode(texts, prompt="")).max() > 1e-3  # the prompt made a difference

    pooling_file = folder / "1_Pooling" / "config.json"
    pooling_file.write_text(json.dumps({**json.loads(pooling_file.read_text()), "include_prompt": False}))
    proc = in_process(capfd, "predict", folder, "--input", tmp_path / "t.jsonl", "--output", tmp_path / "o.npy")
    assert_refused(proc, tmp_path, "without its default prompt's tokens (include_prompt false)")


@pytest.mark.parametrize(
    "pooling, weights, extra, needles",
    [
        ("pooling_mode_cls_token", "", None, ("sentence-transformers folder with cls pooling", "mean pooling")),
        ("pooling_mode_mean_tokens", "0_Transformer", None, ("weights in the subfolder '0_Transformer'",)),
        ("pooling_mode_mean_tokens", "", "sentence_transformers.models.Dense", ("with Dense after its pooling",)),
    ],
)
def test_a_sentence_transformers_folder_tuneforge_cannot_embed_alike_is_refused(
    capfd, tmp_path, tiny_encoder, pooling, weights, extra, needles
):
    """Another pooling than mean, a module after the pooling that changes the vectors (a Dense projection, as LaBSE
    has), or the weights in a subfolder (older sentence-transformers): one line, not other vectors or a classifier's
    predictions."""
    import shutil

    folder = tmp_path / "st"
    shutil.copytree(tiny_encoder, folder)
    modules = json.loads((folder / "modules.json").read_text())
    modules[0]["path"] = weights
    if extra:
        modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": extra})
    (folder / "modules.json").write_text(json.dumps(modules))
    config = json.loads((folder / "1_Pooling" / "config.json").read_text())
    config = {k: (k == pooling) if k.startswith("pooling_mode_") else v for k, v in config.items()}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    (folder / "tuneforge.json").unlink()
    out = tmp_path / "vectors.npy"
    proc = in_process(capfd, "predict", folder, "--input", write_texts(tmp_path / "t.jsonl", TEXTS), "--output", out)
    assert_refused(proc, tmp_path, *needles)
    assert not out.exists()


def test_a_sentence_transformers_folder_of_the_old_layout_names_its_model_subfolder(capfd, tmp_path, tiny_encoder):
    """sentence-transformers before 2.x kept the model (config.json, weights, tokenizer) in 0_Transformer, which
    SentenceTransformer(folder) still loads: predict and train said the folder was 'not a Hugging Face model folder
    (no config.json)'; one line naming the subfolder."""
    import shutil

    folder = tmp_path / "st"
    shutil.copytree(tiny_encoder, folder)
    (folder / "0_Transformer").mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).rename(folder / "0_Transformer" / name)
    modules = json.loads((folder / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (folder / "modules.json").write_text(json.dumps(modules))
    said = (
        f"model {str(folder)!r} is a sentence-transformers folder with its model in the subfolder '0_Transformer', not "
        f"in its root; pass {str(folder / '0_Transformer')!r} to train from it"
    )
    texts = write_texts(tmp_path / "t.jsonl", TEXTS)
    assert_refused(
        in_process(capfd, "predict", folder, "--input", texts, "--output", tmp_path / "o.npy"), tmp_path, said
    )
    train = ["train", "--task", "embedding", "--model", folder, "--train-file", texts, "--output-dir", tmp_path / "out"]
    assert_refused(in_process(capfd, *train), tmp_path, said)


def test_a_bare_encoder_folder_is_refused_with_what_to_do(capfd, tmp_path, tiny_bert):
    """A BertModel folder without sentence-transformers' modules.json: no vectors without a pooling, and no advice to
    `tuneforge generate` it (a bare encoder does not generate)."""
    proc = in_process(
        capfd, "predict", tiny_bert, "--input", write_texts(tmp_path / "t.jsonl", TEXTS), "--output", tmp_path / "o.npy"
    )
    assert_refused(proc, tmp_path, "is a BertModel, without a task head", "--task embedding for sentence vectors")
    assert "tuneforge generate" not in proc.stderr
