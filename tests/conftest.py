"""Shared fixtures: real tokenizers, tiny random models, real files, a CLI runner.

Tiny models use the bundled MiniLM tokenizer (bert-base-uncased vocabulary) and no dropout, so
runs are deterministic and backends can be compared step by step.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

# keep every test offline and fast-failing; one thread per process (2 cores, 2 workers)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA} (it sits beside the checkout in CI, not in a user's clone)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    from tuneforge.tasks.base import bundled_minilm

    return bundled_minilm()


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory, minilm_dir) -> str:
    """A 2-layer, 32-wide random BERT with the real MiniLM tokenizer, saved as an HF folder."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    import torch

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-bert")
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    BertModel(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(out)
    return str(out)


POSITIVE = ["a wonderful, moving film", "great acting and a clever plot", "i loved every minute of it",
            "a joyful and funny story", "brilliant direction and a superb cast", "warm, witty and wise",
            "the best film of the year", "an uplifting delight", "beautifully shot and deeply felt",
            "charming from start to finish"]
NEGATIVE = ["a dull and tedious mess", "the plot makes no sense at all", "i wanted my money back",
            "boring, slow and far too long", "terrible acting and a weak script", "a lifeless, clumsy film",
            "the worst film of the year", "an ugly and tiresome bore", "badly written and badly shot",
            "painful from start to finish"]


def write_sentiment_csv(path: Path, n: int, seed: int = 0) -> Path:
    """`n` rows of text,label (pos/neg) built from fixed phrases; deterministic for a seed."""
    import random

    rng = random.Random(seed)
    rows = ["text,label"]
    for i in range(n):
        pos = i % 2 == 0
        words = rng.choice(POSITIVE if pos else NEGATIVE)
        extra = " ".join(rng.choice(["really", "truly", "quite", "so", "very", "just"]) for _ in range(rng.randint(0, 6)))
        rows.append(f"\"{words} {extra}\",{'pos' if pos else 'neg'}")
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def sentiment_files(tmp_path) -> tuple[Path, Path]:
    """(train.csv with 96 rows, validation.csv with 33 rows), labels 'pos'/'neg'."""
    return write_sentiment_csv(tmp_path / "train.csv", 96, seed=1), write_sentiment_csv(tmp_path / "validation.csv", 33, seed=2)


def run_cli(*args: str, env: dict | None = None, timeout: float = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `python -m tuneforge.cli ARGS` in a fresh process; returns the CompletedProcess."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "tuneforge.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=cwd or REPO)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """One tokenization cache for the whole session (tests that check caching use their own)."""
    return str(tmp_path_factory.mktemp("tok-cache"))
