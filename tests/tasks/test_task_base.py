"""Helpers every task shares and the task contract (tuneforge/tasks/base.py)."""

import inspect
from types import SimpleNamespace

import pytest
import torch
from transformers import BartConfig, BertConfig, EncoderDecoderConfig, GPT2Config, LlamaConfig, T5Config

from conftest import quiet_task, write_sentiment_csv
from tuneforge.tasks.base import EvalTools, Task, set_dropout
from tuneforge.tasks.classification import ClassificationTask
from tuneforge.tasks.clm import CausalLMTask
from tuneforge.tasks.seq2seq import Seq2SeqTask


def dropouts(config) -> dict:
    return {k: v for k, v in vars(config).items() if isinstance(v, float) and ("dropout" in k or "pdrop" in k)}


def test_set_dropout_reaches_each_architectures_own_names():
    expected = {
        BertConfig: {"hidden_dropout_prob", "attention_probs_dropout_prob"},
        GPT2Config: {"resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout"},
        T5Config: {"dropout_rate", "classifier_dropout"},
        LlamaConfig: {"attention_dropout"},
        BartConfig: {"dropout", "attention_dropout", "activation_dropout", "classifier_dropout"},
    }
    for kind, names in expected.items():
        config = set_dropout(kind(), 0.05)
        assert dropouts(config) == dict.fromkeys(names, 0.05), kind.__name__
    assert set_dropout(BartConfig(encoder_layerdrop=0.2), 0.0).encoder_layerdrop == 0.2  # layer drop is not dropout


def test_set_dropout_recurses_into_encoder_decoder_and_none_keeps_the_model_own():
    pair = EncoderDecoderConfig.from_encoder_decoder_configs(BertConfig(), BertConfig())
    set_dropout(pair, 0.0)
    assert (
        dropouts(pair.encoder)
        == dropouts(pair.decoder)
        == {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    )
    assert dropouts(set_dropout(BertConfig(), None)) == {
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
    }


# ---- the task contract (issue #10) ------------------------------------------------------------


@pytest.mark.parametrize("cls", [Task, ClassificationTask, CausalLMTask, Seq2SeqTask])
def test_one_signature_for_compute_loss_and_eval_step(cls):
    loss = inspect.signature(cls.compute_loss)
    assert list(loss.parameters) == ["self", "outputs", "batch", "row_mask"]
    assert loss.parameters["row_mask"].default is None
    assert list(inspect.signature(cls.eval_step).parameters) == ["self", "batch", "valid", "stream", "tools"]


def test_classification_row_mask_drops_the_masked_rows_from_the_loss_sum(tmp_path):
    train = write_sentiment_csv(tmp_path / "train.csv", 8)
    task = quiet_task("classification", None, train_file=str(train), validation_file=str(train))
    task.use_labels(["neg", "pos"])
    outputs = SimpleNamespace(logits=torch.tensor([[2.0, -1.0], [0.5, 0.5], [-3.0, 1.0]]))
    batch = {"labels": torch.tensor([0, 1, 1])}
    whole, n = task.compute_loss(outputs, batch)
    per_row = torch.nn.functional.cross_entropy(outputs.logits, batch["labels"], reduction="none")
    assert torch.allclose(whole, per_row.sum()) and int(n) == 3
    masked, _ = task.compute_loss(outputs, batch, row_mask=torch.tensor([True, False, True]))
    assert torch.allclose(masked, per_row[0] + per_row[2])


def test_the_label_set_is_an_explicit_step_not_a_side_effect_of_load_raw(tmp_path):
    train = tmp_path / "train.csv"
    train.write_text("text,label\na,10\nb,2\nc,2\nd,7\n", encoding="utf-8")
    task = quiet_task("classification", None, train_file=str(train), validation_file=str(train))
    raw = task.load_raw()
    assert task.label_names is None and task.num_labels is None  # reading data decides nothing
    assert list(raw["train"]["label"]) == ["10", "2", "2", "7"]  # labels as written (csv: text)
    names = task.label_set(raw)
    assert names == ["2", "7", "10"] and task.label_names is None  # label_set is pure
    task.use_labels(names)
    assert task.label_names == ["2", "7", "10"] and task.num_labels == 3
    assert task.encode_labels(raw)["train"]["labels"] == [2, 0, 0, 1]


def test_bbc_news_label_set_is_the_sorted_topics():
    from tuneforge.data.sources import BBC_LABELS

    task = quiet_task("bbc-news", None)
    raw = task.load_raw()
    assert task.label_names is None
    assert task.label_set(raw) == sorted(BBC_LABELS) == BBC_LABELS


def test_tasks_without_classes_have_no_label_set(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("one line\nanother line\n", encoding="utf-8")
    task = quiet_task("clm", None, train_file=str(text), validation_file=str(text))
    raw = task.load_raw()
    assert task.label_set(raw) is None and task.encode_labels(raw) is raw


def test_eval_step_uses_only_its_tools(tmp_path):
    """No Trainer, no backend: forward and generate come in as EvalTools."""
    from tuneforge.tasks.seq2seq import GenerationStream

    task = quiet_task("seq2seq", None, source_file=None)
    calls = {}

    class Tok:
        pad_token_id, all_special_ids = 0, [0, 1]

        def batch_decode(self, ids, skip_special_tokens=True):
            return [" ".join(str(t) for t in row if t not in (0, 1)) for row in ids.tolist()]

    def forward(batch):
        calls["forward"] = batch
        return SimpleNamespace(logits=torch.zeros(2, 3, 5))

    def generate(**kwargs):
        calls["generate"] = kwargs
        return torch.tensor([[1, 4, 3, 0], [1, 2, 0, 0]])

    batch = {
        "input_ids": torch.tensor([[5, 6], [7, 0]]),
        "attention_mask": torch.tensor([[1, 1], [1, 0]]),
        "labels": torch.tensor([[4, 3, -100], [2, 2, 2]]),
    }
    stream = GenerationStream(task)
    task.eval_step(batch, torch.tensor([True, True]), stream, EvalTools(forward, generate, Tok()))
    assert calls["forward"] is batch
    assert calls["generate"]["input_ids"] is batch["input_ids"] and "synced_gpus" not in calls["generate"]
    assert calls["generate"]["max_new_tokens"] == task.options.generation_max_length
    assert stream.predictions == ["4 3", "2"] and stream.references == ["4 3", "2 2 2"]
    assert stream.generated_tokens == 5  # every token but padding, the start token too (the recipes' gen_len)


@pytest.mark.parametrize("sharded, world_size, synced", [(False, 2, False), (True, 1, False), (True, 2, True)])
def test_backend_generate_unwraps_autocasts_and_syncs_sharded_ranks(sharded, world_size, synced):
    from tuneforge.backends.base import Backend

    seen = {}

    class Model(torch.nn.Module):
        def generate(self, **kwargs):
            seen.update(kwargs, autocast=torch.is_autocast_enabled("cpu"))
            return torch.ones(1, 2, dtype=torch.long)

    wrapper = torch.nn.Module()
    wrapper.module = Model()
    # a bf16 CPU backend of that geometry, without a process group (only generate is under test)
    probe = type("Probe", (Backend,), {"__init__": lambda self: None, "precision": "bf16", "sharded": sharded})
    probe.device, probe.world_size = torch.device("cpu"), world_size
    backend = probe()
    out = backend.generate(wrapper, input_ids=torch.ones(1, 1, dtype=torch.long), max_new_tokens=1)
    assert out.tolist() == [[1, 1]]
    assert seen["synced_gpus"] is synced and seen["max_new_tokens"] == 1 and seen["autocast"]


def test_max_train_samples_counts_the_examples_the_model_sees(tmp_path, tiny_bert, tiny_gpt2, cache_dir):
    """One rule (Task.select_examples): rows for classification, packed blocks for clm."""
    from tuneforge.trainer import Trainer

    train = write_sentiment_csv(tmp_path / "train.csv", 40)
    common = {"max_steps": 1, "batch_size": 4, "quiet": True, "eval_strategy": "no"}
    cls = Trainer(
        task="classification",
        model=tiny_bert,
        output_dir=str(tmp_path / "cls"),
        data={"train_file": str(train), "validation_file": str(train), "max_train_samples": 7, "cache_dir": cache_dir},
        **common,
    )
    cls.fit()
    assert len(cls.train_data) == 7 and cls.task.label_names == ["neg", "pos"]
    text = tmp_path / "train.txt"
    text.write_text("".join(f"line number {i} of a small text file\n" for i in range(40)), encoding="utf-8")
    clm = Trainer(
        task="clm",
        model=tiny_gpt2,
        output_dir=str(tmp_path / "clm"),
        data={
            "train_file": str(text),
            "validation_file": str(text),
            "block_size": 8,
            "max_train_samples": 5,
            "cache_dir": cache_dir,
        },
        **common,
    )
    clm.fit()
    assert len(clm.train_data) == 5 and all(n == 8 for n in clm.train_data["length"])  # 5 blocks, not 5 lines


@pytest.mark.parametrize("task", ["ner", "qa", "embedding"])
def test_a_tokenizer_without_a_pad_token_pads_with_its_eos_token(tiny_gpt2, task):
    """A tagger's, reader's or encoder's batches are padded: a GPT-2-style tokenizer without a pad token pads with its
    eos token there, as a classifier's does (TRL's rule); its first batch was an internal error ('Asking to pad but
    the tokenizer does not have a padding token')."""
    tokenizer = quiet_task(task, tiny_gpt2, max_length=32).load_tokenizer()
    batch = tokenizer.pad({"input_ids": [[5, 6, 7], [8]]}, return_tensors="pt", padding_side="right")
    assert tokenizer.pad_token == tokenizer.eos_token == "<|endoftext|>"
    assert batch["input_ids"][1].tolist() == [8, tokenizer.eos_token_id, tokenizer.eos_token_id]
    assert batch["attention_mask"][1].tolist() == [1, 0, 0]


def save_in_dtype(model_dir: str, out, dtype) -> str:
    """The model folder `model_dir` (weights and tokenizer) saved again with its weights in `dtype`, as hub models
    ship in bf16 or fp16 (config.json's `dtype` names it)."""
    import transformers

    model_class = getattr(transformers, transformers.AutoConfig.from_pretrained(model_dir).architectures[0])
    model_class.from_pretrained(model_dir, dtype=dtype).save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return str(out)


@pytest.mark.parametrize(
    ("task", "labels", "dtype"),
    [
        ("classification", ["neg", "pos"], torch.float16),
        ("ner", ["O", "B-PER", "I-PER"], torch.bfloat16),
        ("embedding", None, torch.bfloat16),
        ("clm", None, torch.float16),
    ],
)
def test_a_half_precision_model_folder_trains_on_float32_weights(tmp_path, tiny_bert, tiny_llama, task, labels, dtype):
    """transformers loads a folder in the dtype its config.json names: an fp16 or bf16 model trained its weights in
    that dtype (an fp16 classifier's loss was nan at step 2 on a CPU) though the run said 'fp32'; the precision
    (autocast) computes in half, the weights the optimizer steps stay float32."""
    model = save_in_dtype(tiny_llama if task == "clm" else tiny_bert, tmp_path / "half", dtype)
    built = quiet_task(task, model, max_length=32)
    if labels:
        built.use_labels(labels)
    loaded = built.load_model(built.load_tokenizer())
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}


@pytest.mark.parametrize(("task", "labels"), [("classification", ["a", "b", "c"]), ("ner", ["O", "B-PER", "I-PER"])])
def test_a_head_of_other_labels_starts_new_with_a_word_and_the_rest_loads(tmp_path, minilm_dir, task, labels):
    """A classifier of 2 labels trained on 3 labels, or given to --task ner: its head's shapes differ from the run's.
    The run stopped with 'its weights' shapes differ from those its config.json gives (a size edited there, or
    another model's weights)', neither of which was so; the head starts new, said in a line, the body is the
    folder's (as transformers' ignore_mismatched_sizes)."""
    from safetensors.torch import load_file

    from conftest import save_tiny_classifier

    folder = save_tiny_classifier(tmp_path / "two-labels", minilm_dir, {0: "neg", 1: "pos"})
    built = quiet_task(task, folder, max_length=32)
    said = []
    built.log = said.append
    built.use_labels(labels)
    model = built.load_model(built.load_tokenizer())
    assert said == [
        f"model {folder!r}: its head (classifier) has other shapes than this run's (classifier.bias: [2] in the "
        "folder, [3] here); it starts from random weights"
    ]
    saved = load_file(f"{folder}/model.safetensors")["bert.encoder.layer.1.output.dense.weight"]
    assert torch.equal(model.state_dict()["bert.encoder.layer.1.output.dense.weight"], saved)
    assert model.classifier.weight.shape == (3, 32)
