"""A reward model as a GRPO reward (`--reward model:DIR`, tuneforge.rewards.model): the export of a real
`--task reward` run scores text and conversations as its predictor does, deterministically and in input order,
through `load_rewards` and `score` too; a folder that is not a scorer is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_cli, save_tiny_bert
from tuneforge.errors import ConfigError
from tuneforge.rewards import RewardFunction, RewardSettings, load_rewards, score

PROMPTS = ["where is the cat? ", "where is the dog? ", "where is my bird? "]
COMPLETIONS = ["it is on the mat", "blue sky", "it is in the house, by the tree"]


@pytest.fixture(scope="module")
def scorer(tmp_path_factory, minilm_dir) -> str:
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("reward-model-scorer")
    return save_tiny_bert(folder, minilm_dir, BertForSequenceClassification, dropout=0.0, num_labels=1)


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory, scorer, cache_dir) -> str:
    """The model folder of a one-step `--task reward` run."""
    folder = tmp_path_factory.mktemp("reward-model")
    rows = [{"prompt": p, "chosen": c, "rejected": "no idea"} for p, c in zip(PROMPTS, COMPLETIONS)]
    pairs = folder / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["train", "--task", "reward", "--model", scorer, "--train-file", str(pairs), "--validation-file", str(pairs)]
    args += ["--max-steps", "1", "--cache-dir", cache_dir, "--output-dir", str(folder / "run"), "--quiet"]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return str(folder / "run" / "model")


def test_the_reward_scores_text_and_conversations_as_the_predictor_does(reward_model):
    from tuneforge.rewards.model import model_reward
    from tuneforge.tasks.reward import RewardPredictor

    function = model_reward(reward_model)
    rewards = function(prompts=PROMPTS, completions=COMPLETIONS, answer=["1", "2", "3"], completion_ids=[[1], [2], [3]])
    assert len(rewards) == 3 and all(isinstance(r, float) for r in rewards)
    assert len(set(rewards)) == 3  # the texts differ: so do their scores
    assert function(PROMPTS, COMPLETIONS) == rewards  # deterministic
    assert function(PROMPTS[::-1], COMPLETIONS[::-1]) == pytest.approx(rewards[::-1], abs=1e-6)  # in input order
    alone = [p["score"] for p in RewardPredictor(reward_model).predict([p + c for p, c in zip(PROMPTS, COMPLETIONS)])]
    assert rewards == pytest.approx(alone, abs=1e-6)
    # TRL's conversational form: MiniLM has no chat template, so the model reads hh-rlhf text
    chats = [[{"role": "user", "content": p.strip()}] for p in PROMPTS]
    answers = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    joined = [f"\n\nHuman: {p.strip()}\n\nAssistant: {c}" for p, c in zip(PROMPTS, COMPLETIONS)]
    expected = [p["score"] for p in RewardPredictor(reward_model).predict(joined)]
    assert function(chats, answers) == pytest.approx(expected, abs=1e-6)
    # as GRPO loads and calls it
    (loaded,) = load_rewards([f"model:{reward_model}"], RewardSettings())
    assert isinstance(loaded, RewardFunction) and loaded.name == f"model:{reward_model}" and loaded.columns == ()
    table = score([loaded], chats, answers, {"answer": ["1", "2", "3"]})
    assert table[:, 0].tolist() == pytest.approx(expected, abs=1e-6)


def test_a_folder_that_is_not_a_scorer_is_one_line(tmp_path, tiny_llama, scorer, minilm_dir):
    from transformers import BertForSequenceClassification

    from tuneforge.rewards.model import model_reward

    regression = tmp_path / "regression"
    shutil.copytree(scorer, regression)
    (regression / "tuneforge.json").write_text(json.dumps({"task": "regression", "generates": False}))
    torch.manual_seed(0)
    classifier = save_tiny_bert(tmp_path / "clf", minilm_dir, BertForSequenceClassification, num_labels=2)
    cases = [
        (str(tmp_path / "nope"), "does not exist"),
        (tiny_llama, "is a LlamaForCausalLM, not a sequence scorer"),
        (classifier, "is a classifier with 2 labels, not a scorer with one output"),
        (str(regression), "was trained by --task regression, not --task reward"),
        (minilm_dir, "is a BertModel, not a sequence scorer"),
    ]
    for folder, needle in cases:
        with pytest.raises(ConfigError) as err:
            model_reward(folder)
        assert needle in str(err.value) and "need a reward model" in str(err.value)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="does not exist"):
        load_rewards([f"model:{Path(tmp_path) / 'nope'}"], RewardSettings())


def test_a_scorer_without_a_tokenizer_is_one_line_when_the_reward_is_made(tmp_path, scorer):
    """Its tokenizer loads with the weights, at the first call: missing, it was found only after the policy had
    loaded and generated, as a failure 'on row 0 of the batch'."""
    from tuneforge.rewards.model import model_reward

    folder = tmp_path / "no-tokenizer"
    shutil.copytree(scorer, folder)
    for file in folder.iterdir():
        if "tokenizer" in file.name or file.name in ("vocab.txt", "special_tokens_map.json"):
            file.unlink()
    with pytest.raises(ConfigError) as err:
        model_reward(str(folder))
    assert "has no tokenizer files" in str(err.value) and "\n" not in str(err.value)


def test_a_scorer_that_fails_to_load_is_its_own_line_naming_no_row(tmp_path, scorer):
    """A tokenizer that cannot be read shows at the first call: the folder's own line, not a row's fault."""
    folder = tmp_path / "corrupt"
    shutil.copytree(scorer, folder)
    (folder / "tokenizer.json").write_text("not json")
    (loaded,) = load_rewards([f"model:{folder}"], RewardSettings())
    with pytest.raises(ConfigError) as err:
        score([loaded], PROMPTS, COMPLETIONS, {})
    message = str(err.value)
    assert message.startswith(f"reward 'model:{folder}': ") and "\n" not in message
    assert "row" not in message and "prompt" not in message
