"""Frozen embeddings and bottom layers (--freeze-embeddings, --freeze-layers): what stays fixed, and that their
backward is skipped."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    cli_flags,
    cli_main,
    last_json,
    parallel_pairs,
    save_tiny_bert,
    tiny_bert_config,
    train_command,
)
from tuneforge.freezing import freeze_bottom, transformer_layers
from tuneforge.run import enable_gradient_checkpointing


def classifier(layers: int = 3):
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(tiny_bert_config(num_hidden_layers=layers, num_labels=2))


def test_frozen_bottom_gets_no_gradient_and_the_rest_does():
    model = classifier(3)
    assert freeze_bottom(model, 2) == (2, 3, True)  # 2 of the 3 layers, and the embeddings
    loss = model(input_ids=torch.randint(1000, 2000, (2, 7)), labels=torch.tensor([0, 1])).loss
    loss.backward()
    for name, p in model.named_parameters():
        frozen = name.startswith(("bert.embeddings.", "bert.encoder.layer.0.", "bert.encoder.layer.1."))
        assert p.requires_grad is not frozen, name
        assert (p.grad is None) is frozen, name  # autograd computed nothing below layer 2


def test_zero_freezes_nothing_and_too_many_freezes_every_layer():
    model = classifier(2)
    assert freeze_bottom(model, 0) == (0, 2, False)
    assert all(p.requires_grad for p in model.parameters())
    assert freeze_bottom(model, 5) == (2, 2, True)  # all there are
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        "bert.pooler.dense.weight",
        "bert.pooler.dense.bias",
        "classifier.weight",
        "classifier.bias",
    ]


def test_embeddings_alone_get_no_gradient_and_every_layer_does():
    model = classifier(2)
    assert freeze_bottom(model, 0, embeddings=True) == (0, 2, True)
    loss = model(input_ids=torch.randint(1000, 2000, (2, 7)), labels=torch.tensor([0, 1])).loss
    loss.backward()
    for name, p in model.named_parameters():
        frozen = name.startswith("bert.embeddings.")
        assert p.requires_grad is not frozen, name
        assert (p.grad is None) is frozen, name


def test_gradient_checkpointing_still_skips_the_frozen_layers_backward():
    # transformers' checkpointing makes the embeddings' output require grad (reentrant checkpointing needs it):
    # with frozen embeddings that ran the backward of every frozen layer, for no gradient
    model = classifier(3)
    freeze_bottom(model, 2)
    backend = SimpleNamespace(supports_gradient_checkpointing=True)
    enable_gradient_checkpointing(model, SimpleNamespace(gradient_checkpointing=True), backend)
    assert all(layer.gradient_checkpointing for layer in model.bert.encoder.layer)
    carries_grad = []  # whether a layer's output takes part in the backward
    for layer in model.bert.encoder.layer:
        layer.register_forward_hook(lambda module, args, output: carries_grad.append(output[0].requires_grad))
    model.train()
    model(input_ids=torch.randint(1000, 2000, (2, 7)), labels=torch.tensor([0, 1])).loss.backward()
    assert carries_grad == [False, False, True]
    assert model.bert.encoder.layer[2].output.dense.weight.grad is not None


def test_layer_stacks_of_other_architectures():
    from transformers import GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=100))
    assert transformer_layers(gpt2) is gpt2.transformer.h
    t5 = T5ForConditionalGeneration(
        T5Config(num_layers=2, num_decoder_layers=3, d_model=32, d_ff=64, num_heads=4, d_kv=8, vocab_size=100)
    )
    assert transformer_layers(t5) is t5.decoder.block  # the longest stack
    freeze_bottom(t5, 1)
    assert not t5.get_input_embeddings().weight.requires_grad  # T5's 'shared', found without 'embed' in its name


@pytest.mark.parametrize(
    ("flags", "frozen", "embeddings_frozen"),
    [
        ({"freeze_embeddings": "off"}, 0, False),  # and freeze_layers auto: 0, as the embeddings train
        ({"freeze_layers": 0}, 0, True),
        ({}, 1, True),  # a classifier's default
        ({"freeze_layers": 2}, 2, True),
    ],
)
def test_train_keeps_the_frozen_layers_as_loaded(
    capsys, tmp_path, minilm_dir, sentiment_files, cache_dir, flags, frozen, embeddings_frozen
):
    base = save_tiny_bert(tmp_path / "base", minilm_dir, num_hidden_layers=3)
    out = tmp_path / "run"
    cmd = train_command(
        sentiment_files, base, max_steps=3, lr=1e-2, precision="fp32", output_dir=out, cache_dir=cache_dir, json=True
    )
    code, stdout, stderr = cli_main(capsys, *cmd, *cli_flags(**flags))
    assert code == 0, stderr[-3000:]
    assert last_json(stdout)["steps"] == 3
    assert ("the embeddings stay fixed" in stderr) is (embeddings_frozen and not frozen)
    assert (f"the embeddings and the bottom {frozen} of 3 layers stay fixed" in stderr) is (frozen > 0)
    start, trained = load_file(f"{base}/model.safetensors"), load_file(out / "model/model.safetensors")
    for layer in range(3):
        name = f"encoder.layer.{layer}.output.dense.weight"
        assert torch.equal(trained["bert." + name], start[name]) is (layer < frozen), name
    embeddings = "embeddings.word_embeddings.weight"
    assert torch.equal(trained["bert." + embeddings], start[embeddings]) is embeddings_frozen


def test_a_generating_model_trains_its_embeddings_by_default(capsys, tmp_path, tiny_gpt2, cache_dir):
    # auto freezes a classifier's embeddings only: GPT-2's are its output layer too
    train = tmp_path / "train.txt"
    train.write_text("".join(f"{en} {de}\n" for en, de in parallel_pairs(40)), encoding="utf-8")
    out = tmp_path / "run"
    flags = dict(task="clm", block_size=16, max_steps=2, lr=1e-2, eval_strategy="no", output_dir=out)
    code, stdout, stderr = cli_main(capsys, *train_command((train, train), tiny_gpt2, cache_dir=cache_dir, **flags))
    assert code == 0, stderr[-3000:]
    assert "stay fixed" not in stderr
    start, trained = load_file(f"{tiny_gpt2}/model.safetensors"), load_file(out / "model/model.safetensors")
    key = next(k for k in start if k.endswith("wte.weight"))
    assert not torch.equal(trained[key], start[key])


@pytest.mark.parametrize("value", ["x", "-1", "1.5"])
def test_a_bad_layer_count_is_one_clear_line(capsys, value):
    code, _, stderr = cli_main(capsys, "train", "--freeze-layers", value)
    assert code == 2
    assert stderr.strip().splitlines()[-1] == (
        f"error: bad value for 'freeze_layers': needs a number of layers (0 or more) or auto (got '{value}')"
    )
