"""Causal LM task: packing keeps every token once, the label shift by hand, exact perplexity,
and train / eval / save / resume / generate through the Trainer and CLI on single and ddp."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from conftest import (
    caches_built,
    cli_flags,
    cli_main,
    last_json,
    model_spy,
    parallel_pairs,
    quiet_task,
    run_cli,
    tokenized_fresh_then_cached,
    train_command,
)

BLOCK = 16


def write_text(path: Path, n: int, seed: int) -> Path:
    """English and German sentences, one per line, with a blank line every 7 lines (as in wikitext)."""
    lines = []
    for i, (en, de) in enumerate(parallel_pairs(n, seed)):
        lines.append(f"{en} {de}\n")
        if i % 7 == 6:
            lines.append("\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


@pytest.fixture
def text_files(tmp_path) -> tuple[Path, Path]:
    return write_text(tmp_path / "train.txt", 60, seed=1), write_text(tmp_path / "valid.txt", 23, seed=2)


def clm_train(model: str, files: tuple[Path, Path], cache_dir: str, **flags) -> list[str]:
    """`train --task clm` arguments on these (train, validation) text files in BLOCK-token blocks, then `flags`."""
    return train_command(files, model, task="clm", block_size=BLOCK, cache_dir=cache_dir, **flags)


def clm_task(model: str, train: Path | None, valid: Path, cache_dir: str, **data):
    files = {"train_file": str(train) if train else None, "validation_file": str(valid)}
    return quiet_task("clm", model, **{**files, "block_size": BLOCK, "cache_dir": cache_dir, **data})


# ---- data ------------------------------------------------------------------------------------
def test_packing_keeps_every_token_exactly_once(tiny_gpt2, text_files, cache_dir):
    train, valid = text_files
    task = clm_task(tiny_gpt2, None, valid, cache_dir)
    tokenizer = task.load_tokenizer()
    raw = task.load_raw()
    assert list(raw) == ["validation"]  # evaluation alone needs no training file
    lines = raw["validation"]["text"]
    assert lines[0].endswith("\n") and "\n" in lines  # line breaks kept (run_clm keep_linebreaks)
    blocks = task.tokenize(raw, tokenizer, log=lambda m: None)["validation"]

    stream = [t for line in lines for t in tokenizer(line)["input_ids"]]
    packed = [t for block in blocks["input_ids"] for t in block]
    assert packed == stream  # nothing lost, nothing duplicated, order kept
    sizes = [len(b) for b in blocks["input_ids"]]
    assert sizes[:-1] == [BLOCK] * (len(sizes) - 1) and 0 < sizes[-1] < BLOCK  # the remainder is a short block
    assert blocks["length"] == sizes


def test_no_packing_pads_one_example_per_text(tiny_gpt2, text_files, cache_dir):
    train, valid = text_files
    task = clm_task(tiny_gpt2, None, valid, cache_dir, packing=False)
    tokenizer = task.load_tokenizer()
    assert tokenizer.pad_token == tokenizer.eos_token  # GPT-2 has none; padding is masked anyway
    raw = task.load_raw()
    feats = task.tokenize(raw, tokenizer, log=lambda m: None)["validation"]
    texts = [t for t in raw["validation"]["text"] if t.strip()]
    assert len(feats) == len(texts) == 23
    assert feats["input_ids"] == [tokenizer(t)["input_ids"][:BLOCK] for t in texts]

    batch = task.collate(feats[:3], tokenizer)
    lengths = [len(x) for x in feats[:3]["input_ids"]]
    assert batch["input_ids"].shape == (3, max(lengths))
    for row, n in enumerate(lengths):  # right padding, masked out of the labels
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (max(lengths) - n)
        assert batch["labels"][row, :n].tolist() == feats[row]["input_ids"]
        assert (batch["labels"][row, n:] == -100).all()
    assert int(task.count(batch)) == sum(n - 1 for n in lengths)


def test_jsonl_with_a_text_column(tiny_gpt2, tmp_path, cache_dir, capsys):
    rows = [{"id": i, "body": f"{en} {de}"} for i, (en, de) in enumerate(parallel_pairs(12, seed=4))]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = clm_task(tiny_gpt2, data, data, cache_dir, text_columns=["body"])
    raw = task.load_raw()
    assert raw["train"]["text"] == [r["body"] for r in rows]

    code, out, err = cli_main(capsys, *train_command((data, data), tiny_gpt2, task="clm", output_dir=tmp_path / "r"))
    assert code == 2  # the default column is `text`
    assert err.strip() == (
        f"error: column 'text' not found in the train data ({data}); columns are: id, body; pass --text-column"
    )


def test_loss_is_the_shifted_next_token_loss_by_hand(tiny_gpt2, tmp_path, cache_dir):
    from transformers import AutoModelForCausalLM

    task = clm_task(tiny_gpt2, None, tmp_path / "unused.txt", cache_dir)
    tokenizer = task.load_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval()
    batch = task.collate({"input_ids": [[5, 9, 7, 3], [8, 2]]}, tokenizer)
    assert batch["labels"].tolist() == [[5, 9, 7, 3], [8, 2, -100, -100]]  # labels = inputs, padding masked

    outputs = model(**task.model_inputs(batch))
    assert "labels" not in task.model_inputs(batch)  # the shift is ours, not the model's
    loss, n = task.compute_loss(outputs, batch)
    logp = outputs.logits.log_softmax(-1)
    # position t predicts token t+1; the first token of each row is never a target
    by_hand = -(logp[0, 0, 9] + logp[0, 1, 7] + logp[0, 2, 3] + logp[1, 0, 2])
    assert int(n) == 4 == int(task.count(batch))
    assert torch.allclose(loss, by_hand, atol=1e-5)
    # transformers' own shifted loss (a mean over the same targets) agrees
    hf_mean = model(**task.model_inputs(batch), labels=batch["labels"]).loss
    assert torch.allclose(loss / n, hf_mean, atol=1e-5)


@pytest.mark.parametrize("model, lora", [("tiny_gpt2", False), ("tiny_llama", False), ("tiny_llama", True)])
def test_a_training_forward_builds_no_key_value_cache_and_leaves_the_models_use_cache(model, lora, request, tmp_path):
    """transformers' Trainer turns the cache off for training; a decoder's own use_cache=True built one per step.
    A LoRA run's model is peft's wrapper, whose forward passes the setting on to the model inside it."""
    from peft import LoraConfig, get_peft_model

    task = clm_task(request.getfixturevalue(model), None, tmp_path / "unused.txt", None)
    tokenizer = task.load_tokenizer()
    model = task.load_model(tokenizer).train()
    if lora:
        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    built = caches_built(model)
    task.forward(model, task.collate({"input_ids": [[5, 9, 7, 3], [8, 2]]}, tokenizer))
    assert built == [False]
    assert model.config.use_cache is True  # what the export saves: generation keeps its cache


def test_perplexity_is_over_exactly_the_eval_tokens(tiny_gpt2, text_files, cache_dir):
    from transformers import AutoModelForCausalLM

    from tuneforge.trainer import Trainer

    train, valid = text_files
    # eval batch 3 leaves a short last batch; tokens are weighted, not batches
    metrics = Trainer(
        task="clm",
        model=tiny_gpt2,
        output_dir=str(valid.parent / "eval"),
        quiet=True,
        eval_batch_size=3,
        data={"validation_file": str(valid), "block_size": BLOCK, "cache_dir": cache_dir},
    ).validate()

    task = clm_task(tiny_gpt2, None, valid, cache_dir)
    tokenizer = task.load_tokenizer()
    blocks = task.tokenize(task.load_raw(), tokenizer, log=lambda m: None)["validation"]["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for block in blocks:  # one block at a time, by hand
            ids = torch.tensor([block])
            logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
            total -= logp.gather(1, ids[0, 1:, None]).sum().item()
            count += len(block) - 1
    assert metrics["num_tokens"] == count == sum(len(b) for b in blocks) - len(blocks)
    assert metrics["loss"] == pytest.approx(total / count, rel=1e-5)  # float32 batched vs one by one
    assert metrics["perplexity"] == math.exp(metrics["loss"])


# ---- end to end ------------------------------------------------------------------------------
def test_gpt2_trains_saves_resumes_evaluates_and_generates(tiny_gpt2, text_files, tmp_path, cache_dir, capsys):
    _, valid = text_files
    flags = dict(batch_size=4, max_steps=6, lr="3e-3", eval_strategy="no", quiet=True, json=True)
    common = clm_train(tiny_gpt2, text_files, cache_dir, **flags)
    run = tmp_path / "run"
    code, out, err = cli_main(capsys, *common, *cli_flags(save_strategy="steps", save_steps=3, output_dir=run))
    assert code == 0, err
    first = last_json(out)
    assert first["steps"] == 6 and first["perplexity"] == pytest.approx(math.exp(first["loss"]))
    assert (run / "checkpoint-3").is_dir() and (run / "model" / "model.safetensors").exists()
    assert json.loads((run / "model" / "tuneforge.json").read_text())["block_size"] == BLOCK
    assert json.loads((run / "model" / "config.json").read_text())["use_cache"] is True  # as GPT-2's own config

    # resume from step 3 in a new folder: the same steps 4-6 give the same final model
    resume = cli_flags(resume=run / "checkpoint-3", output_dir=tmp_path / "resumed")
    code, out, err = cli_main(capsys, *common, *resume)
    assert code == 0, err
    resumed = last_json(out)
    assert resumed["steps"] == 6
    assert resumed["loss"] == pytest.approx(first["loss"], rel=1e-5)

    data = cli_flags(task="clm", validation_file=valid, block_size=BLOCK, cache_dir=cache_dir, quiet=True, json=True)
    code, out, err = cli_main(capsys, "eval", str(run / "model"), *data, "--output-dir", str(tmp_path / "eval"))
    assert code == 0, err
    evaluated = last_json(out)
    assert {"loss", "perplexity"} <= set(evaluated)
    assert evaluated["loss"] == pytest.approx(first["loss"], rel=1e-5)

    prompt = cli_flags(prompt="A man is", max_new_tokens=5, json=True)
    code, out, err = cli_main(capsys, "generate", str(run / "model"), *prompt)
    assert code == 0, err
    [generation] = last_json(out)["generations"]
    assert generation["prompt"] == "A man is" and generation["generated"]


def test_llama_trains_with_no_packing_through_the_python_api(tiny_llama, text_files, tmp_path, cache_dir):
    import datasets
    from transformers import AutoTokenizer

    from tuneforge.generate import Generator
    from tuneforge.trainer import Trainer

    train, valid = text_files
    texts = [line for line in train.read_text().splitlines() if line.strip()]
    # user-given datasets with another column name: --text-column
    train_ds = datasets.Dataset.from_dict({"body": texts[:40]})
    eval_ds = datasets.Dataset.from_dict({"body": texts[40:]})
    data = {"packing": False, "block_size": 32, "text_columns": ["body"], "cache_dir": cache_dir}
    steps = dict(max_steps=4, batch_size=4, optim={"lr": 3e-3}, eval_strategy="no", data=data)
    trainer = Trainer(task="clm", model=tiny_llama, output_dir=str(tmp_path / "llama"), quiet=True, **steps)
    result = trainer.fit(train_dataset=train_ds, eval_dataset=eval_ds)
    tokenizer = AutoTokenizer.from_pretrained(result["model_dir"])
    targets = sum(len(tokenizer(t)["input_ids"][:32]) - 1 for t in texts[40:])
    assert result["num_tokens"] == targets and result["train_loss"] > 0
    generator = Generator(result["model_dir"])
    assert generator.family == "clm"
    assert len(generator.generate(["A man is", "The dog"], max_new_tokens=4)) == 2


def test_ddp_two_processes_train_resume_and_exact_perplexity(tiny_gpt2, text_files, tmp_path, cache_dir):
    from tuneforge.trainer import Trainer

    _, valid = text_files
    flags = dict(batch_size=2, max_steps=4, lr="3e-3", eval_strategy="no", quiet=True, json=True)
    common = clm_train(tiny_gpt2, text_files, cache_dir, backend="ddp", nproc=2, **flags)
    run = tmp_path / "ddp"
    proc = run_cli(*common, "--save-strategy", "steps", "--save-steps", "2", "--output-dir", str(run))
    assert proc.returncode == 0, proc.stderr
    first = last_json(proc.stdout)
    proc = run_cli(*common, "--resume", str(run / "checkpoint-2"), "--output-dir", str(tmp_path / "ddp-resumed"))
    assert proc.returncode == 0, proc.stderr
    assert last_json(proc.stdout)["loss"] == pytest.approx(first["loss"], rel=1e-5)

    # the two-rank evaluation equals one process evaluating the same model
    single = Trainer(
        task="clm",
        model=first["model_dir"],
        output_dir=str(tmp_path / "eval"),
        quiet=True,
        data={"validation_file": str(valid), "block_size": BLOCK, "cache_dir": cache_dir},
    ).validate()
    assert first["num_tokens"] == single["num_tokens"]
    assert first["perplexity"] == pytest.approx(single["perplexity"], rel=1e-5)


def test_an_encoders_causal_lm_head_attends_to_earlier_tokens_only(tiny_bert, text_files, cache_dir):
    """BERT's causal-LM class (BertLMHeadModel) attends both ways unless its config says is_decoder, as
    transformers' warning asks: trained so, each token sees the one it predicts. The task's model is causal."""
    task = clm_task(tiny_bert, *text_files, cache_dir)
    model = task.load_model(task.load_tokenizer()).eval()
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102]])
    changed = ids.clone()
    changed[0, -1] = 2154
    with torch.no_grad():
        first, second = (model(input_ids=x).logits[0, :-1] for x in (ids, changed))
    assert model.config.is_decoder
    assert torch.equal(first, second)


# ---- bad input: one line, exit code 2 --------------------------------------------------------
def test_block_size_above_the_models_context(tiny_gpt2, text_files, tmp_path, capsys):
    args = train_command(text_files, tiny_gpt2, task="clm", block_size=128, output_dir=tmp_path / "r")
    code, out, err = cli_main(capsys, *args)
    assert code == 2
    assert err.strip() == "error: block size 128 is above the model's context of 64 tokens; use --block-size 64 or less"


def test_empty_text_file(tiny_gpt2, text_files, tmp_path, capsys):
    train, valid = text_files
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    args = train_command((empty, valid), tiny_gpt2, task="clm", output_dir=tmp_path / "r")
    code, out, err = cli_main(capsys, *args)
    assert code == 2
    assert err.strip() == f"error: train text file {str(empty)!r} is empty; give a file with at least one line of text"


def test_bundled_smollm2_is_located_without_importing_its_package():
    from tuneforge.tasks.clm import SMOLLM2_PACKAGE, smollm2_gguf

    gguf = smollm2_gguf()
    assert gguf.suffix == ".gguf" and gguf.stat().st_size > 50_000_000
    assert SMOLLM2_PACKAGE not in sys.modules


@pytest.mark.parametrize("packing, expected", [(True, "sdpa"), (False, "eager")])
def test_bf16_cpu_attention_is_sdpa_for_packed_blocks_and_eager_for_padded_texts(
    tiny_llama, text_files, tmp_path, cache_dir, packing, expected
):
    from tuneforge.trainer import Trainer

    train, valid = text_files
    spy = model_spy()
    files = {"train_file": str(train), "validation_file": str(valid)}
    data = {**files, "packing": packing, "block_size": BLOCK, "cache_dir": cache_dir}
    one_step = dict(max_steps=1, batch_size=4, precision="bf16", eval_strategy="no", callbacks=[spy], data=data)
    Trainer(task="clm", model=tiny_llama, output_dir=str(tmp_path / "run"), quiet=True, **one_step).fit()
    assert spy.attention == expected


@pytest.mark.parametrize("mapped", [False, True], ids=["in-memory", "memory-mapped"])
def test_a_null_text(tiny_gpt2, tmp_path, capsys, monkeypatch, mapped):
    # a jsonl row with "text": null crashed tokenization as an internal error (TypeError: TextEncodeInput ...)
    from tuneforge.data import mapped as mapped_files

    if mapped:  # a file this large is read memory-mapped
        monkeypatch.setattr(mapped_files, "LARGE_FILE_BYTES", 0)
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "A man."}\n{"text": null}\n{"text": "A dog."}\n{"text": null}\n')
    args = train_command((data, data), tiny_gpt2, task="clm", output_dir=tmp_path / "r", cache_dir=tmp_path / "c")
    code, out, err = cli_main(capsys, *args)
    assert code == 2
    assert err.strip() == (
        f"error: the train data ({data}), row 2: column 'text' is null (2 rows are); give each row its text, or drop "
        "those rows"
    )


def test_a_null_text_in_a_dataset_given_to_fit(tiny_gpt2):
    # as in a file: the tokenizer crashed on it (TypeError: TextEncodeInput must be ...)
    import datasets

    from tuneforge.errors import DataError

    ds = datasets.Dataset.from_dict({"text": ["A man.", None, "A dog."]})
    with pytest.raises(DataError, match=r"the train data \(the dataset given\), row 2: column 'text' is null \(1 rows"):
        quiet_task("clm", tiny_gpt2).prepare_raw({"train": ds, "validation": None})


@pytest.mark.parametrize("split", ["train", "validation"])
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "unpacked"])
def test_text_of_one_token_per_example_is_one_line(tiny_gpt2, tmp_path, capsys, split, packing):
    """A lone token has no next token: a training file of one trained steps on zero targets without a word, a
    validation file of one scored `loss nan, perplexity inf`."""
    short, long = tmp_path / "short.jsonl", tmp_path / "long.jsonl"
    short.write_text('{"text": "a"}\n')
    long.write_text('{"text": "A man walks his dog in the park."}\n' * 4)
    files = (short, long) if split == "train" else (long, short)
    flags = dict(task="clm", output_dir=tmp_path / "r", cache_dir=tmp_path / "c", max_steps=1)
    packed = "--packing" if packing else "--no-packing"
    code, _, err = cli_main(capsys, *train_command(files, tiny_gpt2, **flags), packed)
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        f"error: the {split} text is one token per example after tokenization, and a causal LM learns each next "
        "token: nothing to train on or score; give longer text"
    )


def test_no_packing_counts_the_texts_cut_to_block_size_and_counts_them_again_from_the_cache(tiny_gpt2, tmp_path):
    # with --no-packing a text longer than --block-size trained on its first tokens without a word
    text = tmp_path / "valid.txt"
    text.write_text("".join(f"{'so ' * (i % 5) * 3}line {i}\n" for i in range(10)))
    task = clm_task(tiny_gpt2, None, text, str(tmp_path / "cache"), packing=False, block_size=8)
    tokenizer = task.load_tokenizer()
    raw = task.load_raw()
    texts = [t for t in raw["validation"]["text"] if t.strip()]
    cut = sum(len(tokenizer(t)["input_ids"]) > 8 for t in texts)
    assert 0 < cut < len(texts)
    for lines, feats in tokenized_fresh_then_cached(task, raw, tokenizer, "validation"):  # cached: said again
        assert lines[-1] == (
            f"validation: {cut} of {len(texts)} texts longer than block_size 8 tokens cut to their first 8 (raise "
            "--block-size to keep them whole)"
        )
        assert feats["input_ids"] == [tokenizer(t)["input_ids"][:8] for t in texts]  # as before
        assert feats.column_names == ["input_ids", "length"]
