"""`tuneforge export --format gguf` (export.py dispatching to tuneforge.gguf_export): the file is loaded back with
transformers' own GGUF loader and must answer as the source model does (greedy output identical at f16, q8_0 close,
q4_0 further), tokenize as it does and carry its chat template; the tensors sit under llama.cpp's names, types and
q/k layout; adapter folders are merged first and checkpoints rebuilt; bad models, flags and destinations are one
`error:` line with nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import cli_main, parallel_pairs, save_random
from test_bad_input_writers import refused

TEXTS = [
    "Hello world!",
    "  two spaces, a tab\tand\nnew lines; digits 3 33 333 4567",
    "The quick brown fox <|endoftext|> jumps",
    "émigrés naïve café 🦙 我想",
    "<|im_start|>user\nhi<|im_end|>",
]
PROMPTS = ["The quick brown fox", "A man is walking", "Ein Hund"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# weights drawn 5x wider than tiny_llama's: attention that depends on the q/k layout (at tiny_llama's 0.02 a file
# without llama.cpp's permutation still answered 2 of the 3 prompts alike)
SHARP = 0.1
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def tiny_config(tiny_llama: str, **changes):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory, tiny_llama) -> str:
    """tiny_llama's tokenizer with ChatML special tokens and template, on a random Llama (SHARP weights) whose output
    matrix is its token embedding (tied) and whose vocab is padded past the tokenizer's (ids no token has)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = tmp_path_factory.mktemp("chat-llama")
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(out)
    config = tiny_config(tiny_llama, vocab_size=len(tok) + 6, tie_word_embeddings=True, initializer_range=SHARP)
    return save_random(out, LlamaForCausalLM, config)


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory, tiny_llama) -> str:
    """A random Mistral (no sliding window, SHARP weights) with tiny_llama's tokenizer: llama.cpp runs it as a
    llama."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    out = tmp_path_factory.mktemp("tiny-mistral")
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(out)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    sizes = {k: getattr(tiny_config(tiny_llama), k) for k in (*keys, "num_key_value_heads", "bos_token_id")}
    ends = dict(eos_token_id=sizes["bos_token_id"], initializer_range=SHARP)
    config = MistralConfig(**sizes, max_position_embeddings=64, sliding_window=None, **ends)
    return save_random(out, MistralForCausalLM, config)


def export_to(out: Path, source: str, quant: str = "f16", *flags: str) -> Path:
    """`tuneforge export SOURCE OUT --format gguf --quant QUANT` in this process; the file it wrote."""
    from tuneforge.cli import main

    assert main(["export", source, str(out), "--format", "gguf", "--quant", quant, *flags]) == 0
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_llama, chat_llama, tiny_mistral) -> dict[tuple[str, str], Path]:
    """(source name, quant) -> the GGUF file of each source at each quant."""
    root = tmp_path_factory.mktemp("gguf")
    sources = {"tiny_llama": tiny_llama, "chat_llama": chat_llama, "tiny_mistral": tiny_mistral}
    return {
        (name, quant): export_to(root / f"{name}-{quant}.gguf", source, quant)
        for name, source in sources.items()
        for quant in ("f16", "q8_0", "q4_0")
        if name != "tiny_mistral" or quant == "f16"
    }


def load_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()


def load_hf(folder: str | Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def greedy(model, tokenizer, prompt: str, n: int = 24) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


def f16_rounded(model):
    """`model` with its matrices rounded to float16 and back, as an f16 GGUF file holds them (its 1-D tensors, the
    norms, stay float32 there)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.copy_(param.half().float())
    return model


def logits(model, tokenizer, text: str) -> torch.Tensor:
    with torch.no_grad():
        return model(tokenizer(text, return_tensors="pt").input_ids).logits[0]


def reader(path: Path):
    from gguf import GGUFReader

    return GGUFReader(path)


def field(path: Path, key: str):
    return reader(path).fields[key].contents()


# ---- the file answers as the model does -----------------------------------------------------------
@pytest.mark.parametrize("source", ["tiny_llama", "chat_llama", "tiny_mistral"])
def test_f16_file_loads_back_with_greedy_output_identical_to_the_source(request, exported, source):
    from transformers import AutoTokenizer

    folder = request.getfixturevalue(source)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    want, got = load_hf(folder), load_gguf(exported[source, "f16"])
    text = " ".join(PROMPTS)
    a, b = logits(want, tokenizer, text), logits(got, tokenizer, text)
    assert (a - b).abs().max() < 1e-2 * a.abs().max()  # f16 rounding only
    answers = [greedy(f16_rounded(want), tokenizer, p) for p in PROMPTS]  # (a near-tie may flip with the rounding)
    assert [greedy(got, tokenizer, p) for p in PROMPTS] == answers
    assert len({tuple(a) for a in answers}) == len(PROMPTS)  # the answers depend on the prompt: the check can fail


def test_quantized_files_come_closer_the_more_bits_they_keep(exported, tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    text = " ".join(f"{en} {de}" for en, de in parallel_pairs(4, seed=3))
    want = logits(load_hf(tiny_llama), tokenizer, text)
    error = {q: (logits(load_gguf(exported["tiny_llama", q]), tokenizer, text) - want).abs().mean() for q in
             ("f16", "q8_0", "q4_0")}  # fmt: skip
    assert error["f16"] < error["q8_0"] < error["q4_0"]  # each file holds what its name says
    assert error["q8_0"] < 0.02 * want.abs().mean()  # q8_0: within 2% of the logits' size
    agree = (logits(load_gguf(exported["tiny_llama", "q8_0"]), tokenizer, text).argmax(-1) == want.argmax(-1)).float()
    assert agree.mean() > 0.9


# ---- what the file holds --------------------------------------------------------------------------
@pytest.mark.parametrize("quant", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("source", ["tiny_llama", "chat_llama"])
def test_tensors_have_llama_cpp_names_and_the_types_of_the_quant(exported, quant, source):
    tied = source == "chat_llama"
    tensors = {t.name: t.tensor_type.name for t in reader(exported[source, quant]).tensors}
    layers = {f"blk.{i}.{name}.weight" for i in range(2) for name in LAYER_TENSORS}
    assert set(tensors) == {"token_embd.weight", "output_norm.weight", *layers} | (set() if tied else {"output.weight"})
    matrix, output = {"f16": ("F16", "F16"), "q8_0": ("Q8_0", "Q8_0"), "q4_0": ("Q4_0", "Q8_0")}[quant]
    for name, kind in tensors.items():
        if name.endswith("norm.weight"):
            assert kind == "F32", name
        elif name == "output.weight" or (tied and name == "token_embd.weight"):
            assert kind == output, name
        else:
            assert kind == matrix, name
    file_type = {"f16": 1, "q8_0": 7, "q4_0": 2}[quant]  # llama.cpp's LLAMA_FTYPE_MOSTLY_*
    assert field(exported[source, quant], "general.file_type") == file_type


def test_hyperparameters_are_llama_cpp_keys(exported, tiny_llama):
    config = json.loads((Path(tiny_llama) / "config.json").read_text())
    path = exported["tiny_llama", "f16"]
    assert field(path, "general.architecture") == "llama"
    want = {
        "llama.block_count": 2,
        "llama.context_length": 64,
        "llama.embedding_length": 32,
        "llama.feed_forward_length": 64,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.dimension_count": 8,
        "llama.vocab_size": config["vocab_size"],
    }
    assert {key: field(path, key) for key in want} == want
    assert field(path, "llama.rope.freq_base") == pytest.approx(config["rope_parameters"]["rope_theta"])
    assert field(path, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(config["rms_norm_eps"])
    assert field(path, "tuneforge.exported_by").startswith("tuneforge ")


def test_q_and_k_rows_are_in_llama_cpps_interleaved_rotary_order(exported, tiny_llama):
    """HF keeps each head's two rotary halves apart (rows 0..d/2-1, then d/2..d-1); llama.cpp interleaves them
    (row 2i is HF's i, row 2i+1 HF's d/2+i): written out here, not with the exporter's own permutation."""
    from safetensors.torch import load_file

    hf = load_file(str(Path(tiny_llama) / "model.safetensors"))
    tensors = {t.name: t for t in reader(exported["tiny_llama", "f16"]).tensors}
    d = 8  # head_dim
    for gguf_name, hf_name, heads in (("attn_q", "q_proj", 4), ("attn_k", "k_proj", 2)):
        want = hf[f"model.layers.1.self_attn.{hf_name}.weight"].numpy()
        order = [h * d + (i // 2 if i % 2 == 0 else d // 2 + i // 2) for h in range(heads) for i in range(d)]
        got = np.asarray(tensors[f"blk.1.{gguf_name}.weight"].data, dtype=np.float32)
        np.testing.assert_allclose(got, want[order].astype(np.float16).astype(np.float32))
        assert not np.allclose(got, want.astype(np.float16))  # the layouts differ: the check can fail


def test_tokenizer_round_trips_with_its_ids_types_and_chat_template(exported, chat_llama):
    from transformers import AutoTokenizer

    path = exported["chat_llama", "f16"]
    want = AutoTokenizer.from_pretrained(chat_llama)
    got = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert got(text).input_ids == want(text).input_ids, text
        assert got.decode(want(text).input_ids) == want.decode(want(text).input_ids)
    assert got.chat_template == CHATML
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    assert got.apply_chat_template(chat, tokenize=False) == want.apply_chat_template(chat, tokenize=False)
    fields = reader(path).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert fields["tokenizer.ggml.add_bos_token"].contents() is False
    assert fields["tokenizer.ggml.bos_token_id"].contents() == want.bos_token_id
    assert fields["tokenizer.ggml.eos_token_id"].contents() == want.eos_token_id
    merges = json.loads((Path(chat_llama) / "tokenizer.json").read_text())["model"]["merges"]
    assert len(fields["tokenizer.ggml.merges"].contents()) == len(merges)
    types = fields["tokenizer.ggml.token_type"].contents()
    tokens = fields["tokenizer.ggml.tokens"].contents()
    vocab = want.get_vocab()
    assert len(tokens) == len(vocab) + 6 and tokens[-1] == f"[PAD{len(tokens) - 1}]"
    assert [types[vocab[t]] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [3, 3, 3]  # CONTROL
    assert types[-6:] == [5] * 6 and types[vocab["e"]] == 1  # UNUSED padding, NORMAL tokens


def test_llama3_rotary_scaling_is_written_as_llama_cpps_rope_freqs(tmp_path, tiny_llama):
    """Llama 3's frequency scaling becomes llama.cpp's rope_freqs tensor: each frequency's divisor, computed here
    with convert_hf_to_gguf.py's formula (1 above the high-frequency wavelength, the factor past the low one, a
    smooth blend between)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0}
    rope.update(high_freq_factor=4.0, original_max_position_embeddings=64)
    config = tiny_config(tiny_llama, hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=rope)
    save_random(tmp_path / "llama3", LlamaForCausalLM, config)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(tmp_path / "llama3")
    path = export_to(tmp_path / "llama3.gguf", str(tmp_path / "llama3"))
    freqs = 1.0 / (10000.0 ** (np.arange(0, 16, 2) / 16))
    want = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < 64 / 4.0:
            want.append(1.0)
        elif wavelen > 64 / 1.0:
            want.append(8.0)
        else:
            smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
            want.append(1 / ((1 - smooth) / 8.0 + smooth))
    assert 1.0 in want and 8.0 in want and len(set(want)) > 2  # every branch of the formula
    tensors = {t.name: t for t in reader(path).tensors}
    np.testing.assert_allclose(np.asarray(tensors["rope_freqs.weight"].data), want, rtol=1e-5)


# ---- inputs: adapter folders, checkpoints ---------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_llama, cache_dir) -> dict[str, Path]:
    """Two 2-step clm runs on tiny_llama, each with checkpoint-2: full weights, and LoRA (its model/ an adapter
    folder), at a learning rate high enough that the adapter changes the answers."""
    from tuneforge.trainer import Trainer

    root = tmp_path_factory.mktemp("gguf-runs")
    text = root / "train.txt"
    text.write_text("".join(f"{en} {de}\n" for en, de in parallel_pairs(40, seed=1)), encoding="utf-8")
    data = {"train_file": str(text), "block_size": 16, "cache_dir": cache_dir}
    steps = dict(max_steps=2, batch_size=4, eval_strategy="no", save_steps=2, quiet=True, data=data)
    out = {}
    for name, extra in (("full", {"optim": {"lr": 1e-2}}), ("lora", {"optim": {"lr": 5e-2}, "adapter": "lora"})):
        out[name] = root / name
        Trainer(task="clm", model=tiny_llama, output_dir=str(out[name]), **steps, **extra).fit()
    return out


def test_an_adapter_folder_is_merged_into_its_base_first(capsys, runs, tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    adapter = runs["lora"] / "model"
    assert (adapter / "adapter_config.json").exists()
    code, _, err = cli_main(capsys, "export", "--merge", str(adapter), str(tmp_path / "merged"))
    assert code == 0, err
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    merged, base = load_hf(tmp_path / "merged"), load_hf(tiny_llama)
    assert [greedy(merged, tokenizer, p) for p in PROMPTS] != [greedy(base, tokenizer, p) for p in PROMPTS]
    # the merged weights as the f16 file holds them: a merge moves weights off f16's grid, and a near-tie in 24
    # greedy tokens then flips with the CPU's summation order (it did on AVX2)
    want = [greedy(f16_rounded(merged), tokenizer, p) for p in PROMPTS]
    got = load_gguf(export_to(tmp_path / "lora.gguf", str(adapter)))
    assert [greedy(got, tokenizer, p) for p in PROMPTS] == want
    assert field(tmp_path / "lora.gguf", "general.name") == "lora"  # the run's name, not model/
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora.gguf", "merged"]  # no staging folder left


def test_a_checkpoint_is_rebuilt_and_exported(runs, tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    want = [greedy(load_hf(runs["full"] / "model"), tokenizer, p) for p in PROMPTS]
    got = load_gguf(export_to(tmp_path / "ckpt.gguf", str(runs["full"] / "checkpoint-2"), "f16"))
    assert [greedy(got, tokenizer, p) for p in PROMPTS] == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.gguf"]


def test_overwrite_replaces_a_file_tuneforge_wrote(capsys, tiny_llama, tmp_path):
    out = export_to(tmp_path / "m.gguf", tiny_llama, "q4_0")
    small = out.stat().st_size
    refused(capsys, (tmp_path,), "export", tiny_llama, str(out), "--format", "gguf", needles=("exists", "--overwrite"))
    export_to(out, tiny_llama, "f16", "--overwrite")
    assert out.stat().st_size > small and field(out, "general.file_type") == 1


def test_a_destination_without_room_is_one_line_and_leaves_no_file(tmp_path, tiny_llama):
    """Writing the .gguf file failed for want of room (a full disk, a quota; here a file size limit, which fails the
    write the same way): one line naming the file, where it was an internal error, and no partial file left."""
    from conftest import cli_without_room

    out = tmp_path / "out" / "m.gguf"
    line = cli_without_room(["export", tiny_llama, str(out), "--format", "gguf"], 32 * 1024)
    assert f"{str(out)!r} has no room" in line and "free space" in line, line
    assert not (tmp_path / "out").exists()


# ---- refusals: one line, nothing written -----------------------------------------------------------
def bad_case(case: str, tmp_path: Path, fixtures: dict[str, str]) -> tuple[list[str], tuple[str, ...]]:
    """(export arguments, needles of the error line) of one bad export."""
    llama, out = fixtures["tiny_llama"], str(tmp_path / "out" / "m.gguf")
    gguf = ["--format", "gguf"]
    if case == "bert model":  # a model folder: no advice to export it without --format (that takes a checkpoint)
        return [fixtures["tiny_bert"], out, *gguf], ("is of the bert family", "Llama-family", "a checkpoint of it")
    if case == "gpt2 model":
        return [fixtures["tiny_gpt2"], out, *gguf], ("is of the gpt2 family",)
    if case == "llama classifier":
        shutil.copytree(llama, tmp_path / "cls")
        config = json.loads((tmp_path / "cls" / "config.json").read_text())
        (tmp_path / "cls" / "config.json").write_text(
            json.dumps({**config, "architectures": ["LlamaForSequenceClassification"]})
        )
        return [str(tmp_path / "cls"), out, *gguf], ("is a LlamaForSequenceClassification", "causal LMs")
    if case == "sliding window":
        shutil.copytree(fixtures["tiny_mistral"], tmp_path / "mistral")
        config = json.loads((tmp_path / "mistral" / "config.json").read_text())
        (tmp_path / "mistral" / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))
        return [str(tmp_path / "mistral"), out, *gguf], ("sliding window of 16",)
    if case == "sentencepiece tokenizer":
        shutil.copytree(llama, tmp_path / "spm", ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*"))
        for name in ("spiece.model", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json"):
            if (Path(fixtures["tiny_t5"]) / name).exists():
                shutil.copy(Path(fixtures["tiny_t5"]) / name, tmp_path / "spm" / name)
        return [str(tmp_path / "spm"), out, *gguf], ("not a byte-level BPE",)
    if case == "unknown quant":
        return [llama, out, *gguf, "--quant", "q5_k"], ("--quant 'q5_k' is not a GGUF type", "q4_0")
    if case == "quant without gguf":
        return [llama, str(tmp_path / "out"), "--quant", "q8_0"], ("--quant q8_0 goes with --format gguf",)
    if case == "a .gguf name without --format gguf":  # it was a checkpoint's refusal, which did not say why
        return [llama, out], ("names a .gguf file", "add --format gguf")
    if case == "unknown format":
        return [llama, out, "--format", "onnx"], ("--format 'onnx' is not one tuneforge writes",)
    if case == "not a .gguf path":
        return [llama, str(tmp_path / "out"), *gguf], (".gguf file",)
    if case == "destination is a folder":
        (tmp_path / "dir.gguf").mkdir()
        return [llama, str(tmp_path / "dir.gguf"), *gguf, "--overwrite"], ("not a plain file",)
    if case == "destination exists":
        (tmp_path / "mine.gguf").write_bytes(b"GGUF not from tuneforge")
        return [llama, str(tmp_path / "mine.gguf"), *gguf], ("exists", "--overwrite")
    if case == "overwrite a file tuneforge did not write":
        (tmp_path / "mine.gguf").write_bytes(b"GGUF not from tuneforge")
        return [llama, str(tmp_path / "mine.gguf"), *gguf, "--overwrite"], ("not written by tuneforge",)
    if case == "destination under a file":
        (tmp_path / "notes.txt").write_text("mine")
        return [llama, str(tmp_path / "notes.txt" / "sub" / "m.gguf"), *gguf], ("cannot be created", "is a file")
    if case == "destination inside the source":
        shutil.copytree(llama, tmp_path / "src")
        return [str(tmp_path / "src"), str(tmp_path / "src" / "m.gguf"), *gguf], ("inside the source",)
    if case in ("weights missing", "weights cut short"):
        shutil.copytree(llama, tmp_path / "broken")
        weights = tmp_path / "broken" / "model.safetensors"
        if case == "weights missing":
            weights.unlink()
            return [str(tmp_path / "broken"), out, *gguf], ("could not load the model", "no file named model")
        with open(weights, "r+b") as fh:
            fh.truncate(5000)
        return [str(tmp_path / "broken"), out, *gguf], ("could not load the model", "incomplete metadata")
    if case == "config that does not fit the weights":  # a size edited in config.json: was an internal error
        shutil.copytree(llama, tmp_path / "edited")
        config = json.loads((tmp_path / "edited" / "config.json").read_text())
        (tmp_path / "edited" / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
        return [str(tmp_path / "edited"), out, *gguf], ("could not load the model", "shapes differ", "config.json")
    if case == "config value of the wrong type":
        shutil.copytree(llama, tmp_path / "edited")
        config = json.loads((tmp_path / "edited" / "config.json").read_text())
        (tmp_path / "edited" / "config.json").write_text(json.dumps({**config, "hidden_size": "32"}))
        return [str(tmp_path / "edited"), out, *gguf], ("config.json cannot be read", "expected int, got str")
    if case == "missing source":
        return [str(tmp_path / "nope"), out, *gguf], ("does not exist",)
    if case == "merge of a model folder":
        return [llama, out, *gguf, "--merge"], ("is not an adapter folder",)
    if case == "base without an adapter":
        return [llama, out, *gguf, "--base", llama], ("--base goes with an adapter folder",)
    raise AssertionError(case)


BAD_CASES = [
    "bert model",
    "gpt2 model",
    "llama classifier",
    "sliding window",
    "sentencepiece tokenizer",
    "unknown quant",
    "quant without gguf",
    "a .gguf name without --format gguf",
    "unknown format",
    "not a .gguf path",
    "destination is a folder",
    "destination exists",
    "overwrite a file tuneforge did not write",
    "destination under a file",
    "destination inside the source",
    "missing source",
    "weights missing",
    "weights cut short",
    "config value of the wrong type",
    "config that does not fit the weights",
    "merge of a model folder",
    "base without an adapter",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_exports_are_one_line_and_write_nothing(
    capsys, tmp_path, case, tiny_llama, tiny_bert, tiny_gpt2, tiny_t5, tiny_mistral
):
    fixtures = dict(tiny_llama=tiny_llama, tiny_bert=tiny_bert, tiny_gpt2=tiny_gpt2, tiny_t5=tiny_t5)
    args, needles = bad_case(case, tmp_path, {**fixtures, "tiny_mistral": tiny_mistral})
    refused(capsys, (tmp_path, Path(tiny_llama)), "export", *args, needles=needles)
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_of_an_adapter_run_is_refused_naming_its_adapter_folder(capsys, runs, tmp_path):
    ckpt = runs["lora"] / "checkpoint-2"
    line = refused(capsys, (tmp_path, runs["lora"]), "export", str(ckpt), str(tmp_path / "m.gguf"), "--format", "gguf")
    assert "adapter run" in line and "OUTPUT_DIR/model" in line
