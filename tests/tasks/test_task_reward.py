"""Reward models (`--task reward`): pairs tokenized as TRL's RewardTrainer does and its loss on them, the first
training step's loss against the Bradley-Terry formula worked by hand, per-pair normalisation under accumulation,
evaluation metrics exact over known scores (across ranks too), the export scored by `tuneforge predict` and
`tuneforge serve`, and every bad input in one line."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
import torch.nn.functional as F
from test_task_dpo import TEMPLATE, pairs, write_jsonl

from conftest import caches_built, cli_main, quiet_task, read_jsonl, run_cli, save_tiny_bert, serving, train_losses
from test_bad_input import assert_refused, in_process

N_TRAIN, N_VALID = 8, 6


@pytest.fixture(scope="module")
def scorer(tmp_path_factory, minilm_dir) -> str:
    """A random tiny BERT scorer (one output, no dropout; initializer range 0.3, so scores spread)."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("reward-scorer")
    return save_tiny_bert(
        folder, minilm_dir, BertForSequenceClassification, dropout=0.0, num_labels=1, initializer_range=0.3
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("reward-data")
    return write_jsonl(folder / "train.jsonl", pairs(N_TRAIN, 1)), write_jsonl(
        folder / "valid.jsonl", pairs(N_VALID, 2)
    )


def reward_args(model: str, data: tuple[Path, Path], cache_dir: str, out: Path, *flags: str) -> list[str]:
    train, valid = data
    args = ["train", "--task", "reward", "--model", model, "--train-file", str(train), "--validation-file", str(valid)]
    args += ["--cache-dir", cache_dir, "--output-dir", str(out), "--lr", "1e-2", "--precision", "fp32"]
    return [*args, "--logging-steps", "1", "--no-group-by-length", "--quiet", *flags]


def reward_run(*args: str) -> Path:
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Path(args[args.index("--output-dir") + 1])


# every step is a whole epoch of the 8 training pairs: the runs see the same pairs in each step
STEPS = ("--max-steps", "2", "--eval-strategy", "steps", "--eval-steps", "2")


@pytest.fixture(scope="module")
def run(tmp_path_factory, scorer, data, cache_dir) -> Path:
    return reward_run(*reward_args(scorer, data, cache_dir, tmp_path_factory.mktemp("reward-run") / "out", *STEPS))


def side_scores(model, rows: list[list[int]]) -> torch.Tensor:
    """Each token-id row scored alone (no padding): the plain definition."""
    with torch.no_grad():
        return torch.tensor([model(input_ids=torch.tensor([r])).logits[0, 0].item() for r in rows], dtype=torch.float64)


def hand_scores(model_dir: str, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores of a pairs file's rows by the model in `model_dir`, tokenized by hand (MiniLM has
    no eos token: prompt + completion, with its special tokens)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    rows = read_jsonl(path)
    ids = {side: [tokenizer(r["prompt"] + r[side])["input_ids"] for r in rows] for side in ("chosen", "rejected")}
    return side_scores(model, ids["chosen"]), side_scores(model, ids["rejected"])


# ---- tokens and the loss, against TRL ------------------------------------------------------------------
def test_sides_are_tokenized_as_trl_does(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    from tuneforge.tasks.reward import encode_scored

    task = quiet_task("reward", tiny_llama, max_length=64)
    tokenizer = task.load_tokenizer()
    assert tokenizer.pad_token == tokenizer.eos_token  # TRL's pad token for a tokenizer without one
    assert encode_scored(tokenizer, "where? ", "here") == tokenizer("where? here" + tokenizer.eos_token)["input_ids"]
    minilm = AutoTokenizer.from_pretrained(quiet_task("reward", None).model_path())  # the default model: no eos
    assert minilm.decode(encode_scored(minilm, "where? ", "here")) == "[CLS] where? here [SEP]"
    user, answer = [{"role": "user", "content": "where?"}], [{"role": "assistant", "content": "here"}]
    # no chat template: the conversation joined as hh-rlhf text
    assert (
        minilm.decode(encode_scored(minilm, user, answer), skip_special_tokens=True)
        == "human : where? assistant : here"
    )
    tokenizer.chat_template = TEMPLATE
    assert tokenizer.decode(encode_scored(tokenizer, user, answer)) == "u>\nwhere?\na>\nhere\n"
    assert tokenizer.decode(encode_scored(tokenizer, user, "here")) == "u>\nwhere?\na>\nhere\n"
    # cut from the left: the completion stays whole, the special tokens stay
    long = encode_scored(minilm, "where is it " * 20, "on the mat", max_length=8)
    assert minilm.decode(long) == "[CLS] where is it on the mat [SEP]"
    batch = task.collate({"chosen_ids": [[5, 6, 7], [8]], "rejected_ids": [[9, 10], [11, 12, 13, 14]]}, tokenizer)
    pad = tokenizer.pad_token_id  # chosen sides first, then rejected, right-padded
    assert batch["input_ids"].tolist() == [[5, 6, 7, pad], [8, pad, pad, pad], [9, 10, pad, pad], [11, 12, 13, 14]]
    assert batch["attention_mask"].sum(1).tolist() == [3, 1, 2, 4]


def test_the_loss_is_bradley_terry_and_equals_trl_reward_trainer(tiny_llama, cache_dir, tmp_path):
    """TRL's RewardTrainer on the same model and pairs: the same tokens (text and conversations), the same loss;
    both the formula worked by hand from each side scored alone."""
    pytest.importorskip("trl", reason="trl is in the dev extra (pip install -e '.[dev]')")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    rows = pairs(6, seed=3)
    train = write_jsonl(tmp_path / "pairs.jsonl", rows)
    task = quiet_task(
        "reward", tiny_llama, max_length=64, train_file=str(train), validation_file=str(train), cache_dir=cache_dir
    )
    tokenizer = task.load_tokenizer()
    feats = task.tokenize(task.load_raw(), tokenizer)["train"]
    torch.manual_seed(0)
    model = task.load_model(tokenizer).eval()  # a Llama with a fresh one-output head
    batch = task.collate(feats[:], tokenizer)
    with torch.no_grad():
        loss_sum, count = task.compute_loss(task.forward(model, batch), batch)
    assert count.item() == 6

    args = RewardConfig(
        str(tmp_path / "trl"), report_to="none", max_length=64, bf16=False, use_cpu=True, save_strategy="no"
    )
    trl = RewardTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(tiny_llama),
    )
    theirs = trl.train_dataset
    assert theirs["chosen_ids"] == feats["chosen_ids"] and theirs["rejected_ids"] == feats["rejected_ids"]
    with torch.no_grad():
        trl_loss = trl.compute_loss(model, trl.data_collator([theirs[i] for i in range(len(theirs))]))
    assert (loss_sum / count).item() == pytest.approx(trl_loss.item(), abs=1e-6)
    chosen, rejected = side_scores(model, feats["chosen_ids"]), side_scores(model, feats["rejected_ids"])
    by_hand = -F.logsigmoid(chosen - rejected).mean().item()
    assert (loss_sum / count).item() == pytest.approx(by_hand, abs=1e-5)
    assert abs(by_hand - 0.6931) > 1e-3  # the scores differ: the comparison means something

    tokenizer.chat_template = TEMPLATE
    user = [{"role": "user", "content": "where is the cat?"}]
    chats = [
        {
            "prompt": user,
            "chosen": [{"role": "assistant", "content": c}],
            "rejected": [{"role": "assistant", "content": r}],
        }
        for c, r in (("on the mat", "no"), ("here", "blue sky"))
    ]
    trl_tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    trl_tokenizer.chat_template = TEMPLATE
    trl = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(chats), processing_class=trl_tokenizer)
    from tuneforge.tasks.reward import encode_scored

    assert trl.train_dataset["chosen_ids"] == [encode_scored(tokenizer, p["prompt"], p["chosen"]) for p in chats]


def test_a_decoders_training_forward_builds_no_key_value_cache(tiny_llama):
    task = quiet_task("reward", tiny_llama, max_length=64)
    tokenizer = task.load_tokenizer()
    model = task.load_model(tokenizer).train()
    built = caches_built(model)
    task.forward(model, task.collate({"chosen_ids": [[5, 6, 7]], "rejected_ids": [[9, 10]]}, tokenizer))
    assert built == [False]


@pytest.mark.parametrize("family", ["encoder", "decoder"])
def test_a_decoder_scores_its_last_token_before_padding_and_an_encoder_keeps_its_pad_id(
    family, scorer, tiny_llama, tmp_path
):
    """A decoder's head scores the last token that is not config.pad_token_id: the config takes the tokenizer's pad
    (its eos). An encoder's embeddings were built from its own pad id (their padding index, RoBERTa's positions), so
    it keeps it, and its export reloads as the model trained (classification's rule, and the predictor's)."""
    import shutil

    model_dir = shutil.copytree(scorer if family == "encoder" else tiny_llama, tmp_path / "base")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "pad_token_id": 7}))
    task = quiet_task("reward", str(model_dir), max_length=64)
    tokenizer = task.load_tokenizer()
    model = task.load_model(tokenizer)
    if family == "encoder":
        assert tokenizer.pad_token_id != 7
        assert model.config.pad_token_id == 7 == model.get_input_embeddings().padding_idx
    else:
        assert model.config.pad_token_id == tokenizer.pad_token_id == config["eos_token_id"]


def test_a_margin_column_shifts_the_loss_as_trl_reward_trainer_does(scorer, cache_dir, tmp_path):
    """TRL's RewardTrainer reads a `margin` column: -log sigmoid(r(chosen) - r(rejected) - margin), training and
    evaluating; the accuracy and the margin metric stay those of the scores."""
    rows = [{**row, "margin": m} for row, m in zip(pairs(4, seed=5), (0.0, 1.5, -2, 3.25))]
    train = write_jsonl(tmp_path / "pairs.jsonl", rows)
    task = quiet_task("reward", scorer, train_file=str(train), validation_file=str(train), cache_dir=cache_dir)
    tokenizer = task.load_tokenizer()
    feats = task.tokenize(task.load_raw(), tokenizer, log=lambda _: None)["train"]
    model = task.load_model(tokenizer).eval()
    batch = task.collate(feats[:], tokenizer)
    with torch.no_grad():
        outputs = task.forward(model, batch)
        loss_sum, count = task.compute_loss(outputs, batch)
    chosen, rejected = hand_scores(scorer, train)
    margins = torch.tensor([r["margin"] for r in rows], dtype=torch.float64)
    by_hand = -F.logsigmoid(chosen - rejected - margins).mean().item()
    assert (loss_sum / count).item() == pytest.approx(by_hand, abs=1e-5)
    stream = task.metric_stream()
    stream.update(outputs, batch, torch.ones(4))
    out = stream.compute(SimpleNamespace(reduce_sum=lambda t: t, device="cpu"))
    assert out["loss"] == pytest.approx(by_hand, abs=1e-5)
    assert out["margin"] == pytest.approx((chosen - rejected).mean().item(), abs=1e-5)


@pytest.mark.parametrize(
    "rows, needles",
    [
        ([{"margin": "big"}, {}], ("row 1 of", "`margin` is 'big'", "a number")),
        ([{"margin": 1.0}, {}], ("row 2 of", "no `margin`", "row 1 has one")),
    ],
)
def test_bad_margins_are_refused(capfd, tmp_path, scorer, rows, needles):
    train = write_jsonl(tmp_path / "train.jsonl", [{**p, **r} for p, r in zip(pairs(2), rows)])
    assert_refused(in_process(capfd, *bad_args(tmp_path, scorer, train)), tmp_path, *needles)


# ---- training through the CLI --------------------------------------------------------------------------
def test_the_first_step_loss_is_the_formula_and_pairs_normalise_under_accumulation(
    run, scorer, data, cache_dir, tmp_path
):
    chosen, rejected = hand_scores(scorer, data[0])
    losses = train_losses(run)
    assert losses[1] == pytest.approx(-F.logsigmoid(chosen - rejected).mean().item(), abs=1e-5)
    assert losses[1] - losses[2] > 0.01  # it learns: the comparisons mean something
    acc = reward_run(
        *reward_args(scorer, data, cache_dir, tmp_path / "acc", *STEPS, "--batch-size", "4", "--grad-accum", "2")
    )
    assert max(abs(losses[s] - train_losses(acc)[s]) for s in losses) < 1e-5


def test_evaluation_is_exact_over_the_pairs_scored_by_hand(run, data):
    final = [r for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "eval"][-1]
    chosen, rejected = hand_scores(str(run / "model"), data[1])
    margin = chosen - rejected
    assert final["num_pairs"] == N_VALID
    assert final["loss"] == pytest.approx(-F.logsigmoid(margin).mean().item(), abs=1e-5)
    assert final["accuracy"] == pytest.approx((margin > 0).double().mean().item(), abs=1e-9)
    assert final["margin"] == pytest.approx(margin.mean().item(), abs=1e-5)
    assert final["chosen_score"] == pytest.approx(chosen.mean().item(), abs=1e-5)
    assert final["rejected_score"] == pytest.approx(rejected.mean().item(), abs=1e-5)


def test_the_metrics_sum_every_pair_across_ranks_and_skip_padding_rows():
    from tuneforge.tasks.reward import ScoreStream

    def rank(chosen, rejected, valid):
        stream = ScoreStream(None)
        logits = torch.tensor(chosen + rejected)[:, None]
        stream.update(SimpleNamespace(logits=logits), {}, torch.tensor(valid))
        return stream

    a = rank([2.0, 0.0], [1.0, 3.0], [True, False])  # the second row pads rank a's last batch: not counted
    b = rank([1.0, 4.0], [1.5, 0.0], [True, True])
    out = a.compute(SimpleNamespace(reduce_sum=lambda t: t + b.sums, device="cpu"))
    margins = torch.tensor([1.0, -0.5, 4.0], dtype=torch.float64)
    assert out["num_pairs"] == 3 and out["accuracy"] == pytest.approx(2 / 3)
    assert out["margin"] == pytest.approx(1.5) and out["chosen_score"] == pytest.approx(7 / 3)
    assert out["rejected_score"] == pytest.approx(2.5 / 3)
    assert out["loss"] == pytest.approx(-F.logsigmoid(margins).mean().item())


def test_the_export_scores_text_in_predict_and_serve(run, data, capsys, tmp_path):
    from tuneforge.predict import load_predictor

    model_dir = str(run / "model")
    assert json.loads((run / "model" / "tuneforge.json").read_text())["task"] == "reward"
    assert json.loads((run / "model" / "tuneforge.json").read_text())["scores"] is True
    predictor = load_predictor(model_dir)
    rows = read_jsonl(data[1])[:2]
    texts = [r["prompt"] + r["chosen"] for r in rows]
    expected = [s["score"] for s in predictor.predict(texts)]
    chosen, _ = hand_scores(model_dir, data[1])
    assert expected == pytest.approx(chosen[:2].tolist(), abs=1e-5)
    assert predictor.predict([(r["prompt"], r["chosen"]) for r in rows]) == [{"score": s} for s in expected]

    table = tmp_path / "in.jsonl"
    write_jsonl(table, [{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows])
    args = ("predict", model_dir, "--input", str(table), "--output", str(tmp_path / "out.jsonl"))
    code, _, err = cli_main(capsys, *args, "--text-column", "prompt", "--text-column", "completion")
    assert code == 0, err
    assert [r["score"] for r in read_jsonl(tmp_path / "out.jsonl")] == pytest.approx(expected, abs=1e-6)

    with serving(model_dir) as url:
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["kind"] == "predict" and health["task"] == "reward" and health["accepts"] == ["texts", "pairs"]
        answer = httpx.post(f"{url}/predict", json={"texts": texts}, timeout=60).json()["predictions"]
        assert [a["score"] for a in answer] == pytest.approx(expected, abs=1e-5)
        answer = httpx.post(f"{url}/predict", json={"pairs": [[r["prompt"], r["chosen"]] for r in rows]}, timeout=60)
        assert [a["score"] for a in answer.json()["predictions"]] == pytest.approx(expected, abs=1e-5)
        refused = httpx.post(f"{url}/predict", json={"inputs": [{"question": "q", "choices": ["a"]}]}, timeout=60)
        assert refused.status_code == 422 and '"texts" or "pairs"' in refused.json()["error"]["message"]


# ---- bad input: one line, exit 2, nothing written ------------------------------------------------------
def bad_args(tmp_path: Path, model: str, train: Path, *extra: str) -> list[str]:
    return reward_args(model, (train, train), str(tmp_path / "cache"), tmp_path / "out", "--max-steps", "1", *extra)


@pytest.mark.parametrize(
    "row, needles",
    [
        ({"prompt": "hi", "chosen": "yes"}, ("row 3 of", "has no `rejected`", "`chosen` and `rejected`")),
        ({"prompt": "hi", "text": "yes"}, ("row 3 of", "has no `chosen` or `rejected`")),
        ({"prompt": "hi", "chosen": "same", "rejected": "same"}, ("row 3 of", "identical", "--drop-identical-pairs")),
        ({"prompt": "hi", "chosen": 3, "rejected": "no"}, ("row 3 of", "`chosen` is a int")),
    ],
)
def test_bad_pairs_are_refused(capfd, tmp_path, scorer, row, needles):
    train = write_jsonl(tmp_path / "train.jsonl", [*pairs(2), row])
    assert_refused(in_process(capfd, *bad_args(tmp_path, scorer, train)), tmp_path, *needles)


def test_bad_files_models_and_lengths_are_refused(capfd, tmp_path, scorer, minilm_dir):
    from transformers import BertForSequenceClassification

    train = write_jsonl(tmp_path / "train.jsonl", pairs(4))
    table = tmp_path / "pairs.csv"
    table.write_text("prompt,chosen,rejected\nhi,yes,no\n")
    assert_refused(in_process(capfd, *bad_args(tmp_path, scorer, table)), tmp_path, "--task reward reads .jsonl")
    proc = in_process(capfd, *bad_args(tmp_path, scorer, train, "--max-length", "512"))
    assert_refused(proc, tmp_path, "max_length 512 is above the model's limit of 128")
    proc = in_process(capfd, "train", "--task", "reward", "--model", scorer, "--output-dir", str(tmp_path / "out"))
    assert_refused(proc, tmp_path, "task 'reward' needs preference pairs", "--train-file")
    torch.manual_seed(0)
    classifier = save_tiny_bert(tmp_path / "clf", minilm_dir, BertForSequenceClassification, num_labels=3)
    proc = in_process(capfd, *bad_args(tmp_path, classifier, train))
    assert_refused(proc, tmp_path, "is a classifier with 3 labels", "a scorer with one output")


def test_pairs_longer_than_max_length_are_dropped_and_counted(capfd, tmp_path, scorer, cache_dir):
    long = {"prompt": "where is the cat " * 10, "chosen": "here", "rejected": "there"}
    train = write_jsonl(tmp_path / "train.jsonl", [*pairs(3), long])
    task = quiet_task(
        "reward", scorer, cache_dir=cache_dir, train_file=str(train), validation_file=str(train), max_length=24
    )
    said = []
    feats = task.tokenize(task.load_raw(), task.load_tokenizer(), log=said.append)["train"]
    assert len(feats) == 3 and max(feats["length"]) <= 24
    assert (
        "train: 1 of 4 pairs dropped: a side holds more than max_length 24 tokens (raise --max-length to keep them)"
        in said
    )
    proc = in_process(capfd, *bad_args(tmp_path, scorer, train, "--max-length", "4"))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "every train pair holds more than max_length 4" in lines[0]


def test_a_chat_template_whose_code_fails_on_a_pair_names_the_row(tiny_llama, cache_dir, tmp_path):
    from test_tool_calls import save_tool_model
    from tuneforge.errors import ConfigError

    failing = "{% for m in messages if m['content'] == 'boom' %}{{ 1 / 0 }}{% endfor %}" + TEMPLATE
    model = save_tool_model(tmp_path / "model", tiny_llama, template=failing)  # the model's own template fails
    good = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "no"}]}
    good["rejected"] = [{"role": "assistant", "content": "yes"}]
    train = write_jsonl(
        tmp_path / "train.jsonl", [good, good, {**good, "prompt": [{"role": "user", "content": "boom"}]}]
    )
    task = quiet_task(
        "reward", model, max_length=64, train_file=str(train), validation_file=str(train), cache_dir=cache_dir
    )
    with pytest.raises(ConfigError, match="fails on row 3 of .*train.jsonl': division by zero"):
        task.tokenize(task.load_raw(), task.load_tokenizer(), log=lambda _: None)
