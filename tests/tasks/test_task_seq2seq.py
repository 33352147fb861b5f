"""Seq2seq task: parallel files and columns, label padding, the summed loss, BLEU from `generate`
not cut at 20 tokens, and train / eval / save / resume / generate on single and ddp."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import cli_flags, cli_main, last_json, parallel_pairs, quiet_task, run_cli, train_command, write_parallel

PREFIX = "translate English to German: "


@pytest.fixture
def parallel_files(tmp_path) -> dict[str, str]:
    train_en, train_de = write_parallel(tmp_path, "train", 48, seed=1)
    val_en, val_de = write_parallel(tmp_path, "val", 10, seed=2)
    return {
        "source_file": str(train_en),
        "target_file": str(train_de),
        "validation_source_file": str(val_en),
        "validation_target_file": str(val_de),
    }


def seq2seq_train(model: str, files: dict[str, str], **flags) -> list[str]:
    """`train --task seq2seq` arguments on `files` (parallel_files' keys are flag names), then `flags`."""
    return ["train", *cli_flags(task="seq2seq", model=model, **files, **flags)]


def seq2seq_task(model: str | None, cache_dir: str, **data):
    return quiet_task("seq2seq", model, cache_dir=cache_dir, **data)


# ---- data ------------------------------------------------------------------------------------
def test_parallel_files_get_the_prefix_and_labels_padded_with_minus_100(tiny_t5, parallel_files, cache_dir):
    task = seq2seq_task(tiny_t5, cache_dir, source_prefix=PREFIX, **parallel_files)
    tokenizer = task.load_tokenizer()
    raw = task.load_raw()
    assert len(raw["train"]) == 48 and len(raw["validation"]) == 10  # the trailing newline is no pair
    feats = task.tokenize(raw, tokenizer, log=lambda m: None)["validation"]
    en, de = parallel_pairs(10, seed=2)[0]
    assert feats[0]["input_ids"] == tokenizer(PREFIX + en)["input_ids"]
    assert (
        feats[0]["labels"] == tokenizer(text_target=de)["input_ids"]
        and feats[0]["labels"][-1] == tokenizer.eos_token_id
    )

    batch = task.collate(feats[:4], tokenizer)
    for row in range(4):
        n_src, n_tgt = len(feats[row]["input_ids"]), len(feats[row]["labels"])
        assert batch["input_ids"][row, n_src:].eq(tokenizer.pad_token_id).all()
        assert batch["attention_mask"][row].sum() == n_src
        assert batch["labels"][row, :n_tgt].tolist() == feats[row]["labels"]
        assert batch["labels"][row, n_tgt:].eq(-100).all()
    assert int(task.count(batch)) == sum(len(x) for x in feats[:4]["labels"])


def test_loss_is_the_sum_over_target_tokens(tiny_bart, parallel_files, cache_dir):
    from transformers import AutoModelForSeq2SeqLM

    task = seq2seq_task(tiny_bart, cache_dir, **parallel_files)
    tokenizer = task.load_tokenizer()
    feats = task.tokenize(task.load_raw(), tokenizer, log=lambda m: None)["validation"]
    assert feats[0]["labels"][0] == tokenizer.cls_token_id  # BART keeps <s>; only the decoder start is dropped
    batch = task.collate(feats[:3], tokenizer)
    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_bart).eval()
    outputs = model(**task.model_inputs(batch))
    loss, n = task.compute_loss(outputs, batch)
    assert int(n) == int(task.count(batch))
    assert torch.allclose(loss / n, outputs.loss, atol=1e-5)  # transformers' mean over the same tokens
    valid = torch.tensor([True, False, True])
    masked, n_masked = task.compute_loss(outputs, batch, row_mask=valid)
    assert int(n_masked) == len(feats[0]["labels"]) + len(feats[2]["labels"])


def test_table_columns_and_bert_style_targets_for_the_minilm_default(tmp_path, cache_dir):
    rows = ["en,de"] + [f'"{en}","{de}"' for en, de in parallel_pairs(6, seed=3)]
    (tmp_path / "pairs.csv").write_text("\n".join(rows) + "\n")
    task = seq2seq_task(
        None,
        cache_dir,
        train_file=str(tmp_path / "pairs.csv"),
        validation_file=str(tmp_path / "pairs.csv"),
        source_column="en",
        target_column="de",
    )
    tokenizer = task.load_tokenizer()  # the bundled MiniLM's
    feats = task.tokenize(task.load_raw(), tokenizer, log=lambda m: None)["validation"]
    # [CLS] is the encoder-decoder's decoder start token: the target starts after it, ends with [SEP]
    assert feats[0]["labels"][0] != tokenizer.cls_token_id and feats[0]["labels"][-1] == tokenizer.sep_token_id
    assert feats[0]["input_ids"][0] == tokenizer.cls_token_id


def test_sources_and_targets_cut_to_their_limits_are_counted(tiny_t5, parallel_files, cache_dir):
    # they were cut without a word: the model learnt to end a target where the cut fell, and BLEU's references
    # (the decoded labels) were the cut targets
    task = seq2seq_task(tiny_t5, cache_dir, max_length=22, max_target_length=21, **parallel_files)
    tokenizer = task.load_tokenizer()
    raw = task.load_raw()["validation"]
    lines = []
    feats = task.tokenize({"validation": raw}, tokenizer, log=lines.append)["validation"]
    assert feats.column_names == ["input_ids", "attention_mask", "labels", "length"]
    sources = [tokenizer(s, max_length=22, truncation=True)["input_ids"] for s in raw["source"]]
    targets = [tokenizer(text_target=t, max_length=21, truncation=True)["input_ids"] for t in raw["target"]]
    assert feats["input_ids"] == sources and feats["labels"] == targets  # cut as before, the end token kept
    cut_sources = sum(len(tokenizer(s)["input_ids"]) > 22 for s in raw["source"])
    cut_targets = sum(len(tokenizer(text_target=t)["input_ids"]) > 21 for t in raw["target"])
    assert 0 < cut_sources < len(raw) and 0 < cut_targets < len(raw)  # some rows cut (at 22, 23 tokens...), not all
    assert lines[-1] == (
        f"validation: {cut_sources} of 10 sources longer than max_length 22 tokens cut to their first 22, "
        f"{cut_targets} of 10 targets longer than max_target_length 21 tokens cut to their first 21 (raise "
        "--max-length / --max-target-length to keep them whole)"
    )


# ---- end to end ------------------------------------------------------------------------------
def test_t5_trains_saves_resumes_evaluates_and_generates(tiny_t5, parallel_files, tmp_path, cache_dir, capsys):
    beams = dict(source_prefix=PREFIX, num_beams=2, generation_max_length=24, cache_dir=cache_dir, quiet=True)
    steps = dict(batch_size=8, max_steps=6, lr="3e-3", eval_strategy="no", json=True)
    common = seq2seq_train(tiny_t5, parallel_files, **steps, **beams)
    run = tmp_path / "run"
    code, out, err = cli_main(capsys, *common, *cli_flags(save_strategy="steps", save_steps=3, output_dir=run))
    assert code == 0, err
    first = last_json(out)
    assert first["num_examples"] == 10 and 0 <= first["bleu"] <= 100
    assert first["gen_len"] > 20  # generation_max_length 24 holds: outputs are not cut at the HF default of 20
    info = json.loads((run / "model" / "tuneforge.json").read_text())
    assert info["source_prefix"] == PREFIX and info["generation_max_length"] == 24

    resume = cli_flags(resume=run / "checkpoint-3", output_dir=tmp_path / "resumed")
    code, out, err = cli_main(capsys, *common, *resume)
    assert code == 0, err
    resumed = last_json(out)
    assert resumed["loss"] == pytest.approx(first["loss"], rel=1e-5) and resumed["bleu"] == pytest.approx(first["bleu"])

    validation = {key: value for key, value in parallel_files.items() if key.startswith("validation_")}
    evaluation = cli_flags(task="seq2seq", **validation, **beams, output_dir=tmp_path / "eval", json=True)
    code, out, err = cli_main(capsys, "eval", str(run / "model"), *evaluation)
    assert code == 0, err
    evaluated = last_json(out)
    assert {"bleu", "loss"} <= set(evaluated) and evaluated["bleu"] == pytest.approx(first["bleu"])

    prompt = cli_flags(prompt="A man is riding a red bike.", num_beams=2, max_new_tokens=6, json=True)
    code, out, err = cli_main(capsys, "generate", str(run / "model"), *prompt)
    assert code == 0, err
    [generation] = last_json(out)["generations"]
    assert generation["generated"]


def test_bart_trains_on_datasets_through_the_python_api(tiny_bart, tmp_path, cache_dir):
    import datasets

    from tuneforge.generate import Generator
    from tuneforge.trainer import Trainer

    def as_dataset(n, seed):
        pairs = parallel_pairs(n, seed)
        return datasets.Dataset.from_dict({"en": [e for e, _ in pairs], "de": [d for _, d in pairs]})

    steps = dict(max_steps=3, batch_size=8, optim={"lr": 3e-3}, eval_strategy="no", generation_max_length=8, quiet=True)
    data = {"source_column": "en", "target_column": "de", "cache_dir": cache_dir}
    trainer = Trainer(task="seq2seq", model=tiny_bart, output_dir=str(tmp_path / "bart"), data=data, **steps)
    result = trainer.fit(train_dataset=as_dataset(24, 4), eval_dataset=as_dataset(6, 5))
    assert result["num_examples"] == 6 and result["gen_len"] <= 8 and result["train_loss"] > 0
    generator = Generator(result["model_dir"])
    assert generator.family == "seq2seq"
    assert len(generator.generate(["A man is riding a red bike."], max_new_tokens=4)) == 1


def test_gen_len_counts_the_generated_tokens_as_the_transformers_recipe_does(tiny_bart, parallel_files, capsys):
    """gen_len left out every special token (the decoder's start and end tokens); run_translation and
    run_summarization count every token of `generate`'s output but padding: np.count_nonzero(pred != pad_token_id)."""
    import numpy as np
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from tuneforge.tasks.seq2seq import generated_lengths

    validation = {key: value for key, value in parallel_files.items() if key.startswith("validation_")}
    flags = cli_flags(task="seq2seq", **validation, generation_max_length=8, batch_size=4, quiet=True, json=True)
    code, out, err = cli_main(capsys, "eval", tiny_bart, *flags)
    assert code == 0, err
    tokenizer, model = AutoTokenizer.from_pretrained(tiny_bart), AutoModelForSeq2SeqLM.from_pretrained(tiny_bart)
    sources = [line for line in open(validation["validation_source_file"], encoding="utf-8").read().splitlines()]
    with torch.no_grad():
        inputs = tokenizer(sources, return_tensors="pt", padding=True, return_token_type_ids=False)
        preds = model.generate(**inputs, max_new_tokens=8).numpy()
    expected = np.mean([np.count_nonzero(pred != tokenizer.pad_token_id) for pred in preds])
    assert last_json(out)["gen_len"] == pytest.approx(expected)
    start = eos = tokenizer.sep_token_id  # the tiny BART's decoder start and end tokens
    pad = tokenizer.pad_token_id
    ended = torch.tensor([[start, 2023, eos, pad, pad], [start, 2023, 2003, 1037, eos]])  # padded after its end
    assert generated_lengths(ended, pad) == [np.count_nonzero(row != pad) for row in ended.numpy()] == [3, 5]


def test_ddp_two_processes_train_save_and_exact_bleu(tiny_t5, parallel_files, tmp_path, cache_dir):
    from tuneforge.trainer import Trainer

    steps = dict(max_steps=4, lr="3e-3", eval_strategy="no", generation_max_length=24, cache_dir=cache_dir)
    flags = seq2seq_train(tiny_t5, parallel_files, save_strategy="steps", save_steps=2, quiet=True, json=True, **steps)
    run = tmp_path / "ddp"
    proc = run_cli(*flags, *cli_flags(backend="ddp", nproc=2, batch_size=4, output_dir=run))
    assert proc.returncode == 0, proc.stderr
    ddp = last_json(proc.stdout)

    # the ddp checkpoint resumes in one process with the same global batch (2 x 4) to the same model
    values = {
        "task": "seq2seq",
        "model": tiny_t5,
        "max_steps": 4,
        "batch_size": 8,
        "eval_strategy": "no",
        "quiet": True,
        "generation_max_length": 24,
        "optim": {"lr": 3e-3},
        "output_dir": str(tmp_path / "single"),
        "resume": str(run / "checkpoint-2"),
        "data": {"cache_dir": cache_dir, **parallel_files},
    }
    single = Trainer(values).fit()
    assert single["loss"] == pytest.approx(ddp["loss"], rel=1e-4)
    # the two-rank evaluation (predictions gathered from both ranks) equals one process on the same model
    again = Trainer({**values, "model": ddp["model_dir"], "resume": None}).validate()
    assert again["num_examples"] == ddp["num_examples"] == 10
    assert again["bleu"] == pytest.approx(ddp["bleu"]) and again["loss"] == pytest.approx(ddp["loss"], rel=1e-5)


# ---- bad input: one line, exit code 2 --------------------------------------------------------
def test_source_and_target_files_of_different_lengths(tiny_t5, parallel_files, tmp_path, capsys):
    short = tmp_path / "short.de"
    short.write_text("Ein Mann.\nEine Frau.\n")
    files = {**parallel_files, "target_file": str(short)}
    code, out, err = cli_main(capsys, *seq2seq_train(tiny_t5, files, output_dir=tmp_path / "r"))
    assert code == 2
    assert err.strip() == (
        f"error: train source file {parallel_files['source_file']!r} has 48 lines but target file "
        f"{str(short)!r} has 2; parallel files need one sentence per line on both sides"
    )


@pytest.mark.parametrize(
    "table, said",
    [
        ("train_file", "--train-file and --source-file/--target-file both give the train pairs"),
        ("validation_file", "--validation-file and --validation-source-file/--validation-target-file both give"),
    ],
)
def test_parallel_files_and_a_table_for_one_split_are_one_line(tiny_t5, parallel_files, tmp_path, capsys, table, said):
    """The table beside the parallel files of its split was not read, without a word: the pairs were the files'."""
    data = tmp_path / "pairs.csv"
    data.write_text("source,target\nA man.,Ein Mann.\n")
    files = {**parallel_files, table: str(data)}
    args = seq2seq_train(tiny_t5, files, output_dir=tmp_path / "r", max_steps=1, cache_dir=tmp_path / "c")
    code, out, err = cli_main(capsys, *args)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {said}"), err
    assert "keep one" in err and not (tmp_path / "r").exists()


def test_missing_target_column(tiny_t5, tmp_path, capsys):
    data = tmp_path / "pairs.csv"
    data.write_text("source,text\nA man.,Ein Mann.\n")
    code, out, err = cli_main(capsys, *train_command((data, data), tiny_t5, task="seq2seq", output_dir=tmp_path / "r"))
    assert code == 2
    assert err.strip() == (
        f"error: column 'target' not found in the train data ({data}); columns are: source, text; pass --target-column"
    )


def test_a_null_source_or_target(tiny_t5, tmp_path, capsys):
    # a jsonl row with "target": null was trained as the text "None"
    data = tmp_path / "pairs.jsonl"
    rows = [{"source": "A man.", "target": "Ein Mann."}, {"source": "A dog.", "target": None}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = cli_main(capsys, *train_command((data, data), tiny_t5, task="seq2seq", output_dir=tmp_path / "r"))
    assert code == 2
    assert err.strip() == (
        f"error: the train data ({data}), row 2: the target is null (column 'target'); give it its text, or drop "
        "the row"
    )


def test_targets_or_generation_past_the_decoders_positions(tiny_bart, parallel_files, tmp_path, capsys):
    # tiny_bart's decoder has 128 positions: a longer target, or more new tokens than fit after its start token,
    # failed inside the position embedding (IndexError: an internal error) after the data was tokenized
    long_en, long_de = tmp_path / "long.en", tmp_path / "long.de"
    long_en.write_text("A man is riding a red bike.\n" * 4)
    long_de.write_text((" ".join(["ein rotes Fahrrad"] * 60) + "\n") * 4)
    files = cli_flags(task="seq2seq", validation_source_file=long_en, validation_target_file=long_de)
    code, out, err = cli_main(capsys, "eval", tiny_bart, *files, *cli_flags(max_target_length=200, output_dir=tmp_path))
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "error: max_target_length 200 is above the model's decoder limit of 128 positions; use --max-target-length "
        "128 or less"
    )

    validation = {key: value for key, value in parallel_files.items() if key.startswith("validation_")}
    flags = cli_flags(task="seq2seq", **validation, generation_max_length=300, output_dir=tmp_path / "b")
    code, out, err = cli_main(capsys, "eval", tiny_bart, *flags)
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "error: generation_max_length 300 is above the 127 new tokens the model's decoder has room for (128 "
        "positions, one for its start token); use --generation-max-length 127 or less"
    )
