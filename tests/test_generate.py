"""`tuneforge generate` and the Generator API: greedy, sampling, beams, seq2seq prefix, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import cli_flags, cli_main, last_json


def test_greedy_continuation_equals_transformers_generate(tiny_gpt2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tuneforge.generate import Generator

    generator = Generator(tiny_gpt2)
    assert generator.family == "clm"  # from the architecture: this folder has no tuneforge.json
    prompts = ["A man is riding", "The dog"]  # different lengths: left padding must not change the result
    texts = generator.generate(prompts, max_new_tokens=6)

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2)
    for prompt, text in zip(prompts, texts):
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        new = out[0, ids["input_ids"].shape[1] :]
        assert len(new) <= 6
        assert text == tokenizer.decode(new, skip_special_tokens=True)


def test_one_text_for_prompts_is_refused_not_read_as_its_characters(tiny_gpt2):
    from tuneforge.generate import Generator

    generator = Generator(tiny_gpt2)
    with pytest.raises(TypeError, match=r"a list of texts, not one text: generate\(\['A man'\]\)"):
        generator.generate("A man", max_new_tokens=2)  # was 5 generations, one per character


def test_sampling_is_reproducible_with_a_seed(tiny_gpt2):
    from tuneforge.generate import Generator

    generator = Generator(tiny_gpt2)
    options = {"max_new_tokens": 12, "do_sample": True, "temperature": 1.5, "top_k": 50, "top_p": 0.95}
    first = generator.generate(["A man is"], seed=1, **options)
    assert generator.generate(["A man is"], seed=1, **options) == first
    assert generator.generate(["A man is"], seed=2, **options) != first
    # top-k 1 leaves one candidate: sampling becomes greedy
    assert generator.generate(["A man is"], max_new_tokens=6, do_sample=True, top_k=1, seed=3) == generator.generate(
        ["A man is"], max_new_tokens=6
    )


def test_seq2seq_puts_the_trained_prefix_first_and_uses_beams(tiny_t5, tmp_path):
    import shutil

    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from tuneforge.generate import Generator

    model_dir = tmp_path / "t5"
    shutil.copytree(tiny_t5, model_dir)
    prefix = "translate English to German: "
    (model_dir / "tuneforge.json").write_text(
        json.dumps({"task": "seq2seq", "source_prefix": prefix, "max_length": 64})
    )
    generator = Generator(model_dir)
    assert generator.family == "seq2seq"
    [text] = generator.generate(["A man is riding a red bike."], max_new_tokens=7, num_beams=3)

    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(prefix + "A man is riding a red bike.", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=7, num_beams=3, do_sample=False)
    assert text == tokenizer.decode(out[0], skip_special_tokens=True)


def test_seq2seq_decodes_as_its_evaluation_did_unless_a_flag_says(tiny_t5, tmp_path, capsys):
    import shutil

    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from tuneforge.generate import Generator

    model_dir = tmp_path / "t5"
    shutil.copytree(tiny_t5, model_dir)
    prefix, source = "summarize: ", "A man is riding a red bike."
    trained = {"source_prefix": prefix, "max_length": 64, "num_beams": 3, "generation_max_length": 9}
    (model_dir / "tuneforge.json").write_text(json.dumps({"task": "seq2seq", **trained}))
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    ids = AutoTokenizer.from_pretrained(model_dir)(prefix + source, return_tensors="pt")

    def transformers_text(inputs=ids, **options) -> str:
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, **options)
        return AutoTokenizer.from_pretrained(model_dir).decode(out[0], skip_special_tokens=True)

    # what `eval` scored: beam search of num_beams, up to generation_max_length new tokens (was greedy, 50 tokens)
    evaluated = transformers_text(num_beams=3, max_new_tokens=9)
    assert Generator(model_dir).generate([source]) == [evaluated]
    capsys.readouterr()  # the loads' progress bars
    code, out, err = cli_main(capsys, "generate", str(model_dir), "--prompt", source)
    assert code == 0 and out.strip() == evaluated, err
    assert err.strip() == (
        "settings the model was trained with (its tuneforge.json; a flag overrides): source_prefix 'summarize: ', "
        "max_length 64, num_beams 3, generation_max_length 9"
    )
    code, out, err = cli_main(capsys, "generate", str(model_dir), "--prompt", source, *cli_flags(num_beams=1))
    assert code == 0 and out.strip() == transformers_text(num_beams=1, max_new_tokens=9), err
    assert err.strip().endswith("source_prefix 'summarize: ', max_length 64, generation_max_length 9")
    sampled = cli_flags(do_sample=True, top_k=1, max_new_tokens=4)  # sampling: beams only where --num-beams says
    code, out, err = cli_main(capsys, "generate", str(model_dir), "--prompt", source, *sampled)
    assert code == 0 and out.strip() == transformers_text(num_beams=1, max_new_tokens=4), err
    assert err.strip().endswith("source_prefix 'summarize: ', max_length 64")
    # --max-length in place of the trained max_length, as predict's and serve's (the line said a flag overrides it,
    # and generate had no such flag)
    cut = AutoTokenizer.from_pretrained(model_dir)(prefix + source, truncation=True, max_length=4, return_tensors="pt")
    code, out, err = cli_main(capsys, "generate", str(model_dir), "--prompt", source, "--max-length", "4")
    assert code == 0 and out.strip() == transformers_text(cut, num_beams=3, max_new_tokens=9), err
    assert err.strip().endswith("source_prefix 'summarize: ', num_beams 3, generation_max_length 9")


def test_cli_prints_prompt_and_continuation(tiny_gpt2, capsys):
    prompts = cli_flags(prompt=["A man is", "The dog"], max_new_tokens=4)
    code, out, err = cli_main(capsys, "generate", tiny_gpt2, *prompts)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("A man is") and any(line.startswith("The dog") for line in lines[1:])

    sampling = cli_flags(max_new_tokens=4, do_sample=True, top_p=0.9, temperature=0.7, seed=0, json=True)
    code, out, err = cli_main(capsys, "generate", tiny_gpt2, "--prompt", "A man is", *sampling)
    assert code == 0, err
    [generation] = last_json(out)["generations"]
    assert generation["prompt"] == "A man is" and isinstance(generation["generated"], str)


def test_the_printed_text_is_the_prompt_and_what_continues_it_with_a_sentencepiece_tokenizer(metaspace_llama, capsys):
    """A SentencePiece tokenizer decodes a text's first token without its leading space: the new tokens decoded
    alone glued "A woman" + " k..." into "A womank..."; the text is the whole row's past the prompt's, as
    transformers' text-generation pipeline cuts it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model = (
        AutoTokenizer.from_pretrained(metaspace_llama),
        AutoModelForCausalLM.from_pretrained(metaspace_llama),
    )
    ids = tokenizer("A woman", return_tensors="pt")["input_ids"]
    row = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)[0]
    expected = tokenizer.decode(row, skip_special_tokens=True)[
        len(tokenizer.decode(ids[0], skip_special_tokens=True)) :
    ]
    assert expected.startswith(" ")  # this case needs the space: the first new token begins a word
    code, out, err = cli_main(capsys, "generate", metaspace_llama, "--prompt", "A woman", "--max-new-tokens", "6")
    assert code == 0, err
    assert out.splitlines()[0] == "A woman" + expected


def test_generate_on_a_classification_model_fails_clearly(tiny_bert, tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    classifier = tmp_path / "classifier"
    AutoModelForSequenceClassification.from_pretrained(tiny_bert, num_labels=2).save_pretrained(classifier)
    AutoTokenizer.from_pretrained(tiny_bert).save_pretrained(classifier)
    code, out, err = cli_main(capsys, "generate", str(classifier), "--prompt", "hello")
    assert code == 2
    assert err.strip() == (
        f"error: model {str(classifier)!r} is a BertForSequenceClassification, not a text-generation "
        "model; generating text needs a causal LM or a sequence-to-sequence model (one trained to generate "
        "text); for classifiers use `tuneforge predict`"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--top-p", "1.5"], "error: --top-p must be in (0, 1] (got 1.5)"),
        (["--max-new-tokens", "0"], "error: --max-new-tokens must be between 1 and 1048576 (got 0)"),
        (["--max-new-tokens", str(10**30)], f"error: --max-new-tokens must be between 1 and 1048576 (got {10**30})"),
        (["--seed", str(10**30)], f"error: --seed must be between 0 and 4294967295 (got {10**30})"),
        (["--seed", "-1"], "error: --seed must be between 0 and 4294967295 (got -1)"),
        (["--do-sample", "--temperature", "nan"], "error: --temperature must be a finite number (got nan)"),
        (["--do-sample", "--temperature", "inf"], "error: --temperature must be a finite number (got inf)"),
        (
            ["--do-sample", "--temperature", "0"],
            "error: --temperature must be at least 1e-05 (got 0.0); without --do-sample decoding is greedy",
        ),
        (  # the logits divided by it overflow: transformers' sampling raised on the nan probabilities
            ["--do-sample", "--temperature", "1e-300"],
            "error: --temperature must be at least 1e-05 (got 1e-300); without --do-sample decoding is greedy",
        ),
        (["--num-beams", str(10**11)], f"error: --num-beams must be between 1 and 1000 (got {10**11})"),
    ],
)
def test_bad_generation_options(tiny_gpt2, capsys, flags, message):
    code, out, err = cli_main(capsys, "generate", tiny_gpt2, "--prompt", "A man", *flags)
    assert code == 2 and err.strip() == message


@pytest.mark.parametrize(
    "command, flags, named",
    [
        ("generate", ["--temperature", "0.7"], "--temperature sets"),
        ("generate", ["--top-k", "5", "--top-p", "0.9"], "--top-k and --top-p set"),
        ("chat", ["--top-p", "0.9"], "--top-p sets"),
    ],
)
def test_a_sampling_setting_without_do_sample_is_refused(tiny_gpt2, capsys, command, flags, named):
    """Greedy decoding reads no temperature, top-k or top-p: they were dropped without a word (transformers warns)."""
    prompt = ["--prompt", "A man"] if command == "generate" else []
    code, out, err = cli_main(capsys, command, tiny_gpt2, *prompt, *flags)
    assert code == 2 and err.strip() == (
        f"error: {named} how to sample, but decoding is greedy without --do-sample: add --do-sample, or leave them out"
    )


def test_max_length_is_refused_for_a_causal_lm(tiny_gpt2, capsys):
    code, out, err = cli_main(capsys, "generate", tiny_gpt2, "--prompt", "A man", "--max-length", "4")
    assert code == 2 and "is a causal LM, whose prompt is never cut" in err


def test_missing_model_folder(tmp_path, capsys):
    code, out, err = cli_main(capsys, "generate", str(tmp_path / "nope"), "--prompt", "A man")
    assert code == 2 and "does not exist" in err


def test_a_file_given_as_the_model_is_not_said_to_be_missing(tiny_gpt2, tmp_path, capsys):
    exported = tmp_path / "model-f16.gguf"  # a model, but one file: `generate` reads an HF folder
    exported.write_bytes(b"GGUF")
    code, out, err = cli_main(capsys, "generate", str(exported), "--prompt", "A man")
    assert code == 2 and err.strip() == (
        f"error: model {str(exported)!r} is a file, not a model folder; pass an HF model folder (config.json and "
        "weights) or a hub id like bert-base-uncased"
    )


@pytest.mark.parametrize(
    "content, message", [("{not json", "is not valid JSON"), ("[1, 2]", "is not a JSON object (it holds a list)")]
)
def test_corrupt_tuneforge_json_is_one_clear_line(tiny_gpt2, tmp_path, capsys, content, message):
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_gpt2, model_dir)
    (model_dir / "tuneforge.json").write_text(content)
    code, out, err = cli_main(capsys, "generate", str(model_dir), "--prompt", "A man")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {str(model_dir / 'tuneforge.json')!r} {message}")
    assert lines[0].endswith("re-export the model or delete that file")


def test_a_config_value_of_the_wrong_type_is_one_line(tiny_gpt2, tmp_path, capsys):
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_gpt2, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "n_embd": "32"}))  # a hand edit: a string
    code, out, err = cli_main(capsys, "generate", str(model_dir), "--prompt", "A man")
    assert code == 2 and err.strip() == (
        f"error: could not load the model config from {str(model_dir)!r}: Validation error for field 'n_embd': "
        "TypeError: Field 'n_embd' expected int, got str (value: '32')"
    )


# ---- never past the model's context --------------------------------------------------------------------
def test_a_continuation_stops_at_the_context_with_a_note(tiny_gpt2, capsys):
    from transformers import AutoTokenizer

    prompt = "A man is riding a red bike"
    n = len(AutoTokenizer.from_pretrained(tiny_gpt2)(prompt)["input_ids"])
    code, out, err = cli_main(capsys, "generate", tiny_gpt2, "--prompt", prompt, "--max-new-tokens", "500", "--json")
    assert code == 0, err
    assert err.strip() == (
        f"note: generation stops at the model's context of 64 tokens: {64 - n} new tokens after prompt 1's {n} "
        "tokens at most, not 500"
    )
    from tuneforge.generate import Generator

    # exactly the continuation that fits: what asking for the room alone gives
    assert last_json(out)["generations"][0]["generated"] == Generator(tiny_gpt2).generate([prompt], 64 - n)[0]


def test_a_prompt_that_fills_the_context_is_one_line(tiny_gpt2, capsys):
    long = " ".join(["a man is riding a red bike"] * 20)
    code, out, err = cli_main(capsys, "generate", tiny_gpt2, "--prompt", "The dog", "--prompt", long)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: prompt 2 has ") and "the model's context is 64, which leaves no room" in err


def test_seq2seq_stops_at_the_decoders_positions_and_refuses_a_longer_input(tiny_bart, capsys):
    code, out, err = cli_main(capsys, "generate", tiny_bart, "--prompt", "a man", "--max-new-tokens", "300")
    assert code == 0, err
    assert err.strip() == "note: generation stops at the model's context of 128 tokens: 127 new tokens at most, not 300"
    long = " ".join(["a man is riding a red bike"] * 30)
    code, out, err = cli_main(capsys, "generate", tiny_bart, "--prompt", long)
    assert code == 2 and err.strip().startswith("error: input 1 has ") and "reads at most 128" in err


@pytest.mark.parametrize("max_length", ["1", "2"])
def test_a_max_length_that_holds_no_input_text_is_one_line(tiny_bart, capsys, max_length):
    """A seq2seq --max-length at or below the special tokens ([CLS] and [SEP]) the tokenizer adds: 1 was not cut at
    all ('input 1 has 212 tokens ...: shorten it'), 2 cut each input to [CLS] [SEP] and generated from nothing."""
    long = " ".join(["a man is riding a red bike"] * 30)
    code, out, err = cli_main(capsys, "generate", tiny_bart, "--prompt", long, "--max-length", max_length)
    assert code == 2 and not out, err
    assert err.strip() == (
        f"error: --max-length {max_length} leaves no room for a text: its tokenizer adds 2 special tokens to each "
        "input; give at least 3"
    )


def test_a_prompt_that_is_not_utf8_is_one_line(tiny_gpt2, capsys):
    # a byte a terminal sent in another encoding reaches argv as a lone surrogate (Python's surrogateescape)
    code, out, err = cli_main(capsys, "generate", tiny_gpt2, "--prompt", "A man", "--prompt", "caf\udce9 au lait")
    assert code == 2 and out == ""
    assert err.strip() == "error: prompt 2 is not UTF-8 text (byte 0xe9 at character 4); pass it as UTF-8"


def test_a_generation_config_that_is_json_but_no_object_is_one_error_line(tiny_llama, tmp_path, capsys):
    """transformers fails on it with a TypeError inside loading the model: it was an internal error."""
    import shutil

    folder = tmp_path / "list"
    shutil.copytree(tiny_llama, folder)
    (folder / "generation_config.json").write_text("[1, 2]")
    code, _, err = cli_main(capsys, "generate", str(folder), "--prompt", "The dog")
    said = f"error: {folder}/generation_config.json holds a JSON list, not an object of generation settings: fix it "
    assert code == 2 and err.strip() == said + "or remove it"


MALFORMED_GENERATION_SETTINGS = {
    "watermark-unknown-key": ("watermarking_config", {"bias": 2.0, "colour": "green"}, "unexpected keyword argument"),
    "watermark-bad-value": ("watermarking_config", {"seeding_scheme": "nope"}, "seeding_scheme"),
    "watermark-not-object": ("watermarking_config", "on", "not a JSON object"),
    "bias-pair-without-list": ("sequence_bias", [[5, 1.0]], "non-empty list of lists"),
    "bias-not-list": ("sequence_bias", "oops", "non-empty dictionary, or non-empty list of lists"),
}


@pytest.mark.parametrize("command", ["generate", "train"])
@pytest.mark.parametrize("case", MALFORMED_GENERATION_SETTINGS)
def test_a_generation_setting_transformers_cannot_use_is_one_error_line(
    tiny_llama, cache_dir, tmp_path, capsys, case, command
):
    """A watermarking_config of keys transformers does not know (or values it refuses), or a sequence_bias not of
    [[token ids], bias] pairs: an internal error loading the model (TypeError: WatermarkingConfig.__init__() got an
    unexpected keyword argument) or at generate's first prompt (ValueError: Each element in `sequence_bias` ...), in
    training after the data were read; one line naming the file and the setting, before any work."""
    import shutil

    key, value, why = MALFORMED_GENERATION_SETTINGS[case]
    folder = tmp_path / "odd"
    shutil.copytree(tiny_llama, folder)
    settings = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**settings, key: value}))
    (tmp_path / "train.txt").write_text("the cat sat on the mat\n" * 8)
    args = ["generate", str(folder), "--prompt", "The dog"]
    if command == "train":
        args = ["train", "--task", "clm", "--model", str(folder), "--train-file", str(tmp_path / "train.txt")]
        args += ["--cache-dir", cache_dir, "--output-dir", str(tmp_path / "run")]
    code, _, err = cli_main(capsys, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: {folder}/generation_config.json's {key} ") and why in err, err


@pytest.mark.parametrize(
    ("setting", "value", "outside"),
    [
        ("forced_eos_token_id", 99999, 99999),
        ("bad_words_ids", [[7], [99999]], 99999),
        ("suppress_tokens", [5, -3], -3),
        ("sequence_bias", [[[7, 99999], 1.5]], 99999),
    ],
)
def test_a_generation_config_token_outside_the_vocabulary_is_left_out_with_a_note(
    tiny_llama, tmp_path, capsys, setting, value, outside
):
    """transformers' generate indexes the logits with these: an id the model does not have was an internal error at
    the first prompt (IndexError: index 99999 is out of bounds; ValueError: The model vocabulary size is 320, but the
    following tokens were being biased); each is left out with a note, as a sampling default out of bounds is."""
    import shutil

    folder = tmp_path / "odd"
    shutil.copytree(tiny_llama, folder)
    settings = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**settings, setting: value}))
    code, out, err = cli_main(capsys, "generate", str(folder), "--prompt", "The dog", "--max-new-tokens", "3")
    assert code == 0 and out.strip(), err
    assert err.strip() == (
        f"note: generation_config.json's {setting} {value!r} is left out (token {outside} is outside the model's 320 "
        "tokens)"
    )
