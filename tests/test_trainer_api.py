"""The Python API: `Trainer(TrainConfig(...)).fit(...)` on the user's own model, tokenizer and raw
datasets; a subclass overriding `forward_step` / `compute_loss` (FlagAI's MyTrainer pattern);
callbacks receiving the loop's events."""

import re
from pathlib import Path

import pytest
import torch

from conftest import NEGATIVE, POSITIVE, model_spy
from tuneforge.config import TrainConfig
from tuneforge.trainer import Callback, Trainer


def raw_dataset(n: int, offset: int = 0):
    import datasets

    texts, labels = [], []
    for i in range(offset, offset + n):
        pos = i % 2 == 0
        phrases = POSITIVE if pos else NEGATIVE
        texts.append(f"{phrases[i % len(phrases)]} {'really ' * (i % 4)}".strip())
        labels.append("pos" if pos else "neg")
    return datasets.Dataset.from_dict({"text": texts, "label": labels})


def make_config(tmp_path, tiny_bert, cache_dir, **extra):
    values = dict(
        task="classification",
        model=tiny_bert,
        output_dir=str(tmp_path / "run"),
        epochs=2,
        batch_size=8,
        logging_steps=1,
        quiet=True,
        precision="fp32",
        data={"cache_dir": cache_dir},
        optim={"lr": 2e-3, "weight_decay": 0.0, "warmup_ratio": 0.0},
    )
    values.update(extra)
    return TrainConfig(**values)


def load_user_model(tiny_bert):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert, num_labels=2)
    return model, AutoTokenizer.from_pretrained(tiny_bert)


class Recorder(Callback):
    def __init__(self):
        self.logs, self.evals, self.ended = [], [], None

    def on_log(self, trainer, logs):
        self.logs.append(dict(logs))

    def on_evaluate(self, trainer, metrics):
        self.evals.append(dict(metrics))

    def on_train_end(self, trainer, result):
        self.ended = dict(result)


def test_fit_user_model_tokenizer_and_raw_datasets_with_callbacks(tmp_path, tiny_bert, cache_dir):
    model, tokenizer = load_user_model(tiny_bert)
    recorder = Recorder()
    trainer = Trainer(make_config(tmp_path, tiny_bert, cache_dir), callbacks=[recorder])
    result = trainer.fit(
        model=model, tokenizer=tokenizer, train_dataset=raw_dataset(48), eval_dataset=raw_dataset(20, offset=100)
    )

    assert trainer.model is model  # the user's own model object was trained
    assert result["num_examples"] == 20 and result["steps"] == 12  # 48 examples / batch 8 * 2 epochs
    # on_log: every step (logging_steps=1), with the loss of that step
    assert [r["step"] for r in recorder.logs] == list(range(1, 13))
    assert all(r["split"] == "train" and r["loss"] > 0 for r in recorder.logs)
    assert recorder.logs[-1]["loss"] < recorder.logs[0]["loss"]  # it learns
    # on_evaluate: once per epoch, with the task's metrics
    assert len(recorder.evals) == 2 and all({"accuracy", "f1", "loss"} <= set(m) for m in recorder.evals)
    # on_train_end: the very result fit returns
    assert recorder.ended == result and result["accuracy"] == recorder.evals[-1]["accuracy"]
    assert result["train_loss"] == pytest.approx(recorder.logs[-1]["loss"])


def test_fit_builds_the_model_from_raw_datasets(tmp_path, tiny_bert, cache_dir):
    """No model given: the task builds one with the label set of the data."""
    result = Trainer(make_config(tmp_path, tiny_bert, cache_dir, max_steps=2)).fit(
        train_dataset=raw_dataset(32), eval_dataset=raw_dataset(8, offset=50)
    )
    from transformers import AutoModelForSequenceClassification

    saved = AutoModelForSequenceClassification.from_pretrained(result["model_dir"])
    assert saved.config.id2label == {0: "neg", 1: "pos"}


class ZeroLossTrainer(Trainer):
    """FlagAI-style subclass: its own forward step and loss."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forward_calls = {"train": 0, "eval": 0}
        self.loss_calls = 0

    def forward_step(self, model, batch):
        self.forward_calls["train" if model.training else "eval"] += 1
        return super().forward_step(model, batch)

    def compute_loss(self, outputs, batch):
        self.loss_calls += 1
        loss_sum, count = super().compute_loss(outputs, batch)
        return loss_sum * 0.0, count  # no gradient: the weights must not move


def test_subclass_overrides_are_really_used(tmp_path, tiny_bert, cache_dir):
    model, tokenizer = load_user_model(tiny_bert)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = ZeroLossTrainer(make_config(tmp_path, tiny_bert, cache_dir, epochs=1))
    result = trainer.fit(
        model=model, tokenizer=tokenizer, train_dataset=raw_dataset(32), eval_dataset=raw_dataset(12, offset=7)
    )

    assert trainer.loss_calls == 4 and result["steps"] == 4  # one compute_loss per micro-batch
    assert trainer.forward_calls["train"] == 4
    assert trainer.forward_calls["eval"] == 1  # 12 eval examples in one batch of 16
    assert result["train_loss"] == 0.0
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "zero loss still changed the weights"

    # the same run without the override moves the weights: the check above can fail
    model2, _ = load_user_model(tiny_bert)
    Trainer(make_config(tmp_path, tiny_bert, cache_dir, epochs=1, output_dir=str(tmp_path / "plain"))).fit(
        model=model2, tokenizer=tokenizer, train_dataset=raw_dataset(32), eval_dataset=raw_dataset(12, offset=7)
    )
    assert not all(torch.equal(before[k], v) for k, v in model2.state_dict().items())


@pytest.mark.parametrize(
    "precision, attention, expected",
    [
        ("bf16", "auto", "eager"),  # CPU SDPA is the slower kernel under bf16 autocast (benchmarks/cpu_step_kernels.py)
        ("fp32", "auto", "sdpa"),  # fp32: the model's own default stays
        ("fp32", "eager", "eager"),  # asked for by name
    ],
)
def test_attention_kernel_chosen_for_training(tmp_path, tiny_bert, cache_dir, precision, attention, expected):
    spy = model_spy()
    Trainer(
        make_config(
            tmp_path,
            tiny_bert,
            cache_dir,
            precision=precision,
            attn_implementation=attention,
            max_steps=1,
            eval_strategy="no",
        ),
        callbacks=[spy],
    ).fit(train_dataset=raw_dataset(8), eval_dataset=raw_dataset(4))
    assert spy.attention == expected


def test_unknown_attention_kernel_is_a_config_error(tmp_path, tiny_bert, cache_dir):
    from tuneforge.errors import ConfigError

    trainer = Trainer(make_config(tmp_path, tiny_bert, cache_dir, attn_implementation="warp_drive", max_steps=1))
    with pytest.raises(ConfigError, match="attn_implementation 'warp_drive'"):
        trainer.fit(train_dataset=raw_dataset(8), eval_dataset=raw_dataset(4))


@pytest.mark.parametrize("dropout, expected", [(None, {0.1}), (0.0, {0.0}), (0.25, {0.25})])
def test_dropout_setting_reaches_every_dropout_layer_and_the_saved_config(
    tmp_path, minilm_dir, cache_dir, dropout, expected
):
    import json

    spy = model_spy()  # MiniLM's own dropout is 0.1, so None (keep the model's own) is told apart from 0
    result = Trainer(
        make_config(tmp_path, minilm_dir, cache_dir, dropout=dropout, max_steps=1, eval_strategy="no"), callbacks=[spy]
    ).fit(train_dataset=raw_dataset(8), eval_dataset=raw_dataset(4))
    assert spy.dropouts == expected
    saved = json.loads((Path(result["model_dir"]) / "config.json").read_text())
    assert {saved["hidden_dropout_prob"], saved["attention_probs_dropout_prob"]} == expected


def test_fit_without_an_eval_dataset_refuses_evaluation_settings_else_trains_without(tmp_path, tiny_bert, cache_dir):
    """As transformers' Trainer refuses an eval_strategy without an eval_dataset: one ConfigError before the model
    loads (it was a TypeError at the run's end); with evaluation off the run trains and exports, evaluating
    nothing. Rows as a list of dicts are taken as a datasets.Dataset."""
    from tuneforge.errors import ConfigError

    rows = raw_dataset(8).to_list()
    with pytest.raises(ConfigError, match="no eval_dataset, and eval_strategy='epoch' needs evaluations"):
        Trainer(make_config(tmp_path, tiny_bert, cache_dir, max_steps=2)).fit(train_dataset=rows)
    with pytest.raises(ConfigError, match="load_best_model_at_end=True needs evaluations"):
        config = make_config(tmp_path, tiny_bert, cache_dir, eval_strategy="no", load_best_model_at_end=True)
        Trainer(config).fit(train_dataset=rows)
    config = make_config(tmp_path, tiny_bert, cache_dir, max_steps=2, eval_strategy="no", overwrite=True)
    result = Trainer(config).fit(train_dataset=rows)
    assert result["steps"] == 2 and "accuracy" not in result and Path(result["model_dir"], "config.json").is_file()


@pytest.mark.parametrize("kind", ["iterable", "dataset_dict", "path"])
def test_a_dataset_fit_cannot_take_is_a_type_error_naming_what_it_takes(tmp_path, tiny_bert, cache_dir, kind):
    import datasets

    data = raw_dataset(8)
    given = {"iterable": data.to_iterable_dataset(), "dataset_dict": datasets.DatasetDict(train=data)}
    with pytest.raises(TypeError, match="must be a datasets.Dataset, a list of row dicts") as refused:
        Trainer(make_config(tmp_path, tiny_bert, cache_dir)).fit(train_dataset=given.get(kind, "train.csv"))
    assert ("data['train']" in str(refused.value)) == (kind == "dataset_dict")
    assert not (tmp_path / "run").exists()  # refused before any work


def test_a_given_models_head_must_fit_the_label_set_and_gets_its_names(tmp_path, tiny_bert, cache_dir):
    """A user's model whose head has another size than the data's label set: one ConfigError (it was an IndexError
    mid-step, or a 3-way model exported for 2 labels); one that fits is exported with the data's label names
    (its config said LABEL_0/LABEL_1, so the folder predicted those)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tuneforge.errors import ConfigError

    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    three = AutoModelForSequenceClassification.from_pretrained(tiny_bert, num_labels=3)
    with pytest.raises(ConfigError, match=r"3 outputs in its head and the data 2 labels \(neg, pos\)"):
        Trainer(make_config(tmp_path, tiny_bert, cache_dir, max_steps=1)).fit(
            model=three, tokenizer=tokenizer, train_dataset=raw_dataset(8), eval_dataset=raw_dataset(4)
        )
    model, tokenizer = load_user_model(tiny_bert)
    result = Trainer(make_config(tmp_path, tiny_bert, cache_dir, max_steps=1, overwrite=True)).fit(
        model=model, tokenizer=tokenizer, train_dataset=raw_dataset(8), eval_dataset=raw_dataset(4)
    )
    saved = AutoModelForSequenceClassification.from_pretrained(result["model_dir"])
    assert saved.config.id2label == {0: "neg", 1: "pos"}


def test_validate_reads_a_given_models_own_label_order(tmp_path, tiny_bert, cache_dir):
    """validate() given a fine-tuned model whose classes are in another order than the data's sorted names: the
    model's id2label decides the label ids (the same model with its head rows and names swapped scores the same)."""
    model, tokenizer = load_user_model(tiny_bert)
    config = make_config(tmp_path, tiny_bert, cache_dir)
    with torch.no_grad():  # confident logits, so that a label order mixed up shows in the loss
        model.classifier.weight.mul_(100)
    model.config.id2label, model.config.label2id = {0: "neg", 1: "pos"}, {"neg": 0, "pos": 1}
    before = Trainer(config).validate(model=model, tokenizer=tokenizer, eval_dataset=raw_dataset(8))
    with torch.no_grad():
        model.classifier.weight.copy_(model.classifier.weight.flip(0))
        model.classifier.bias.copy_(model.classifier.bias.flip(0))
    model.config.id2label, model.config.label2id = {0: "pos", 1: "neg"}, {"pos": 0, "neg": 1}
    swapped = Trainer(config).validate(model=model, tokenizer=tokenizer, eval_dataset=raw_dataset(8))
    assert swapped["loss"] == pytest.approx(before["loss"], rel=1e-5) and swapped["accuracy"] == before["accuracy"]


@pytest.mark.parametrize("config_pad", [None, 7], ids=["no-config-pad", "config-pad-differs"])
def test_a_given_decoder_classifier_scores_its_last_token_before_padding(tmp_path, tiny_llama, cache_dir, config_pad):
    """A causal LM's classifier given to validate() or fit() scores the last token that is not config.pad_token_id,
    as the task's own does: batches pad with the tokenizer's pad (eos where it has none), and the config takes it
    (None crashed in transformers at a batch of 2; another id read short texts' scores at padding positions, so the
    loss changed with the batch size)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_llama, num_labels=2, pad_token_id=config_pad)
    model.config.id2label, model.config.label2id = {0: "neg", 1: "pos"}, {"neg": 0, "pos": 1}
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.pad_token = tokenizer.eos_token  # what transformers asks of a tokenizer without one
    losses = [
        Trainer(make_config(tmp_path, tiny_llama, cache_dir, eval_batch_size=size)).validate(
            model=model, tokenizer=tokenizer, eval_dataset=raw_dataset(8)
        )["loss"]
        for size in (8, 1)
    ]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert model.config.pad_token_id == tokenizer.eos_token_id


def test_validate_after_fit_evaluates_the_trained_model_on_fits_eval_data(tmp_path, tiny_bert, cache_dir):
    """As transformers' evaluate() after train(): the model fit exported (not the config's, reloaded with a new
    random head) on fit's eval_dataset, so it scores what fit's result says; a model given still wins."""
    trainer = Trainer(make_config(tmp_path, tiny_bert, cache_dir, epochs=1))
    result = trainer.fit(train_dataset=raw_dataset(16), eval_dataset=raw_dataset(12, offset=100))
    again = trainer.validate()
    assert again["loss"] == pytest.approx(result["loss"], rel=1e-4) and again["num_examples"] == 12
    model, tokenizer = load_user_model(tiny_bert)
    given = trainer.validate(model=model, tokenizer=tokenizer, eval_dataset=raw_dataset(8))
    assert given["num_examples"] == 8 and given["loss"] != pytest.approx(result["loss"], rel=1e-4)


def test_quiet_silences_the_libraries_for_fit_and_validate_and_gives_their_settings_back(
    capfd, tmp_path, tiny_bert, cache_dir
):
    """quiet=True from Python let transformers' load report and the weights', shards' and tokenization's progress
    bars through (only the CLI turned them off); they are off for the call and back as the user set them after."""
    import datasets
    import transformers

    logs = transformers.utils.logging
    before = (logs.get_verbosity(), logs.is_progress_bar_enabled(), datasets.is_progress_bar_enabled())
    logs.set_verbosity_warning(), logs.enable_progress_bar(), datasets.enable_progress_bars()  # a user's settings
    try:
        capfd.readouterr()
        trainer = Trainer(make_config(tmp_path, tiny_bert, cache_dir, max_steps=1, eval_strategy="no"))
        trainer.fit(train_dataset=raw_dataset(8))  # a new head: the load report lists it as missing
        trainer.validate(eval_dataset=raw_dataset(4))
        assert capfd.readouterr() == ("", "")
        settings = (logs.get_verbosity(), logs.is_progress_bar_enabled(), datasets.is_progress_bar_enabled())
        assert settings == (transformers.logging.WARNING, True, True)
    finally:
        logs.set_verbosity(before[0])
        logs.enable_progress_bar() if before[1] else logs.disable_progress_bar()
        datasets.enable_progress_bars() if before[2] else datasets.disable_progress_bars()


def test_a_trainers_second_fit_takes_its_own_datas_label_set(tmp_path, tiny_bert, cache_dir):
    """One Trainer fit twice (a notebook's cells): the second run's label set is its own data's, as a new Trainer's
    would be; the first run's labels were kept, so labels the second data has were refused as not in the set."""
    import datasets
    from transformers import AutoModelForSequenceClassification

    trainer = Trainer(make_config(tmp_path, tiny_bert, cache_dir, max_steps=1, eval_strategy="no", overwrite=True))
    trainer.fit(train_dataset=raw_dataset(8))
    three = datasets.Dataset.from_dict({"text": ["red", "green", "blue"] * 4, "label": ["r", "g", "b"] * 4})
    result = trainer.fit(train_dataset=three)
    saved = AutoModelForSequenceClassification.from_pretrained(result["model_dir"])
    assert saved.config.id2label == {0: "b", 1: "g", 2: "r"}


def test_a_compute_loss_override_returning_a_mean_alone_is_told_what_to_return(tmp_path, tiny_bert, cache_dir):
    class MeanLoss(Trainer):
        def compute_loss(self, outputs, batch):
            loss_sum, count = super().compute_loss(outputs, batch)
            return loss_sum / count  # (was: TypeError: iteration over a 0-d tensor)

    with pytest.raises(TypeError, match=r"compute_loss returns \(the loss summed over the batch's items, their count"):
        MeanLoss(make_config(tmp_path, tiny_bert, cache_dir, max_steps=1)).fit(
            train_dataset=raw_dataset(8), eval_dataset=raw_dataset(4)
        )


def test_a_given_transformers_model_of_another_kind_is_refused_by_name(tmp_path, tiny_bert, cache_dir):
    """AutoModel's bare encoder for a classifier failed in the step ('... has no attribute logits'), a causal LM
    with 'Expected target size [4, 320], got [4]'; now one line naming both classes."""
    from transformers import AutoModel, AutoTokenizer

    from tuneforge.errors import ConfigError

    bare, tokenizer = AutoModel.from_pretrained(tiny_bert), AutoTokenizer.from_pretrained(tiny_bert)
    says = "the model given is a BertModel, and task 'classification' trains a sequence-classification model (e.g. "
    with pytest.raises(ConfigError, match=re.escape(says + "BertForSequenceClassification)")):
        Trainer(make_config(tmp_path, tiny_bert, cache_dir, max_steps=1)).fit(
            model=bare, tokenizer=tokenizer, train_dataset=raw_dataset(8), eval_dataset=raw_dataset(4)
        )


class NoOptimizer(Trainer):
    def make_optimizer(self, model):
        return None  # (forgot the return of the optimizer it built)


class NoSchedule(Trainer):
    def make_scheduler(self, optimizer, total_steps, start_step=0):
        return None


@pytest.mark.parametrize(
    "trainer_class, says",
    [
        (NoOptimizer, r"^make_optimizer returns a torch\.optim\.Optimizer .*, not NoneType$"),
        (NoSchedule, r"^make_scheduler returns an LR scheduler of the optimizer .*, not NoneType"),
    ],
)
def test_an_override_returning_no_optimizer_or_schedule_is_one_error_before_training(
    tmp_path, tiny_bert, cache_dir, trainer_class, says
):
    """Was an AttributeError ('NoneType' object has no attribute 'param_groups'; for the schedule, after the first
    step trained: "has no attribute 'step'")."""
    trainer = trainer_class(make_config(tmp_path, tiny_bert, cache_dir, max_steps=2))
    with pytest.raises(TypeError, match=says):
        trainer.fit(train_dataset=raw_dataset(8), eval_dataset=raw_dataset(4))
    assert trainer.state.step == 0


def test_an_optimizer_over_some_of_the_parameters_trains_those_alone(tmp_path, tiny_bert, cache_dir):
    class HeadOnly(Trainer):
        def make_optimizer(self, model):
            return torch.optim.SGD(model.classifier.parameters(), lr=0.1)

    model, tokenizer = load_user_model(tiny_bert)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    HeadOnly(make_config(tmp_path, tiny_bert, cache_dir, max_steps=2)).fit(
        model=model, tokenizer=tokenizer, train_dataset=raw_dataset(16), eval_dataset=raw_dataset(4)
    )
    moved = {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}
    assert moved == {"classifier.weight", "classifier.bias"}


class RecordedPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """torch's ReduceLROnPlateau, its metrics kept (what transformers steps it with: the evaluation's metric)."""

    def __init__(self, optimizer):
        super().__init__(optimizer, mode="min", patience=0, factor=0.5)
        self.heard = []

    def step(self, metrics):
        self.heard.append(metrics)
        super().step(metrics)


class OnPlateau(Trainer):
    def make_scheduler(self, optimizer, total_steps, start_step=0):
        return RecordedPlateau(optimizer)


def test_a_reduce_lr_on_plateau_schedule_steps_on_each_scheduled_evaluations_metric(tmp_path, tiny_bert, cache_dir):
    """As transformers' reduce_lr_on_plateau: stepped with metric_for_best after each scheduled evaluation, never
    per optimizer step (was a TypeError, "step() missing 1 required positional argument: 'metrics'", after the
    first step trained); without scheduled evaluations it would never move: one TypeError before training."""
    recorder = Recorder()
    config = make_config(tmp_path, tiny_bert, cache_dir, max_steps=3, eval_strategy="steps", eval_steps=1)
    trainer = OnPlateau(config.model_copy(update={"metric_for_best": "loss"}), callbacks=[recorder])
    trainer.fit(train_dataset=raw_dataset(16), eval_dataset=raw_dataset(8))
    assert trainer.scheduler.heard == [metrics["loss"] for metrics in recorder.evals] and len(recorder.evals) == 3
    assert {log["lr"] for log in recorder.logs} <= {2e-3 * 0.5**k for k in range(3)}  # as the plateau set them
    assert trainer.optimizer.param_groups[0]["lr"] == trainer.scheduler.get_last_lr()[0]
    unscheduled = OnPlateau(make_config(tmp_path / "no-eval", tiny_bert, cache_dir, max_steps=2, eval_strategy="no"))
    with pytest.raises(TypeError, match=r"^make_scheduler returns a ReduceLROnPlateau, .*set eval_strategy"):
        unscheduled.fit(train_dataset=raw_dataset(8), eval_dataset=raw_dataset(4))
    assert unscheduled.state.step == 0


def meta_copy(model):
    """`model`'s architecture on the 'meta' device: shapes without values (from_config under torch.device('meta'))."""
    with torch.device("meta"):
        return type(model)(model.config)


def peft_wrapped(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(task_type="SEQ_CLS", target_modules=["query", "value"]))


def with_an_added_token(tokenizer):
    tokenizer.add_tokens(["zzzqqx"])
    return tokenizer


PEFT_SAYS = r"^the model given is a peft PeftModelForSequenceClassification: tuneforge adds and exports LoRA"


@pytest.mark.parametrize(
    "spoil_model, spoil_tokenizer, adapter, says",
    [
        (meta_copy, None, "none", r"^the model given has weights on the 'meta' device \(shapes without values\)"),
        (peft_wrapped, None, "none", PEFT_SAYS),
        (peft_wrapped, None, "lora", PEFT_SAYS),
        (None, with_an_added_token, "none", r"^the tokenizer has 30523 tokens, more than the model's 30522 token"),
    ],
    ids=["meta", "peft", "peft-lora", "vocabulary"],
)
def test_a_given_model_that_cannot_train_is_one_config_error_before_any_data_work(
    tmp_path, tiny_bert, cache_dir, spoil_model, spoil_tokenizer, adapter, says
):
    """Were errors mid-run: 'Cannot copy out of meta tensor' (meta), a FileNotFoundError at the export after training
    (a PeftModel; with adapter='lora': 'has no linear layers outside its head'), an IndexError at the first step (a
    token the embeddings have no row for)."""
    from tuneforge.errors import ConfigError

    model, tokenizer = load_user_model(tiny_bert)
    model = spoil_model(model) if spoil_model else model
    tokenizer = spoil_tokenizer(tokenizer) if spoil_tokenizer else tokenizer
    trainer = Trainer(make_config(tmp_path, tiny_bert, cache_dir, max_steps=1, eval_strategy="no", adapter=adapter))
    unlabelled = raw_dataset(8).remove_columns("label")  # a DataError once the data are read
    with pytest.raises(ConfigError, match=says):
        trainer.fit(model=model, tokenizer=tokenizer, train_dataset=unlabelled)


@pytest.mark.parametrize("task", ["classification", "embedding"])
def test_a_given_tokenizer_without_a_pad_token_pads_with_eos_as_the_tasks_own_does(
    tmp_path, tiny_llama, cache_dir, task
):
    """A GPT-2 or Llama tokenizer given to validate() / fit() failed inside transformers' pad ('Asking to pad but the
    tokenizer does not have a padding token'); it pads with eos, as the task's own tokenizer does and TRL's trainers
    do to a tokenizer given to them."""
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert tokenizer.pad_token is None
    if task == "classification":
        model = AutoModelForSequenceClassification.from_pretrained(tiny_llama, num_labels=2)
        model.config.id2label, model.config.label2id = {0: "neg", 1: "pos"}, {"neg": 0, "pos": 1}
        data = raw_dataset(4)
    else:
        model, texts = AutoModel.from_pretrained(tiny_llama), list(raw_dataset(4)["text"])
        data = {"anchor": texts, "positive": [text.upper() for text in texts]}
    config = make_config(tmp_path, tiny_llama, cache_dir, task=task)
    metrics = Trainer(config).validate(model=model, tokenizer=tokenizer, eval_dataset=data)
    assert metrics["num_examples"] == 4 and tokenizer.pad_token == tokenizer.eos_token


def test_a_given_model_gets_its_own_trainable_flags_back_after_fit(tmp_path, tiny_bert, cache_dir):
    """A classifier's default freezes its embeddings and bottom layer for the run; the user's model object keeps no
    trace of it (transformers' Trainer never changes requires_grad), so a second fit that trains every weight does."""
    model, tokenizer = load_user_model(tiny_bert)
    data = dict(tokenizer=tokenizer, train_dataset=raw_dataset(16))
    Trainer(make_config(tmp_path / "a", tiny_bert, cache_dir, max_steps=1, eval_strategy="no")).fit(model, **data)
    assert all(p.requires_grad for p in model.parameters())
    before = model.get_input_embeddings().weight.detach().clone()
    every = make_config(
        tmp_path / "b", tiny_bert, cache_dir, max_steps=1, eval_strategy="no", freeze_layers=0, freeze_embeddings="off"
    )
    Trainer(every).fit(model, **data)
    assert not torch.equal(model.get_input_embeddings().weight, before)


def test_a_given_model_is_left_without_the_runs_gradient_checkpointing(tmp_path, tiny_bert, cache_dir):
    """--gradient-checkpointing is the run's setting: the user's model object comes back as it was given (a later
    forward of theirs, or a fit without it, would recompute every layer in its backward)."""
    model, tokenizer = load_user_model(tiny_bert)
    config = make_config(tmp_path, tiny_bert, cache_dir, max_steps=1, eval_strategy="no", gradient_checkpointing=True)
    Trainer(config).fit(model, tokenizer=tokenizer, train_dataset=raw_dataset(16))
    assert model.is_gradient_checkpointing is False
