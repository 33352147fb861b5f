"""encode_within: a batch truncated to a limit exactly as the tokenizer's own truncation, and which rows it cut, for
fast and slow tokenizers, single texts, pairs and targets."""

import os
import random

import pytest

from tuneforge.data.tokenize import encode_within

WORDS = "the a movie was great terrible plot acting long review of this film".split()


def texts(n: int, seed: int, most: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, most))) for _ in range(n)]


@pytest.fixture(scope="module", params=["fast", "slow"])
def tokenizer(request, minilm_dir):
    from transformers import AutoTokenizer
    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    if request.param == "fast":
        return AutoTokenizer.from_pretrained(minilm_dir)
    return BertTokenizerLegacy(os.path.join(minilm_dir, "vocab.txt"))  # a python (slow) tokenizer


@pytest.mark.parametrize("kind", ["text", "pair", "target"])
@pytest.mark.parametrize("limit", [12, 20, None])
def test_the_features_are_the_tokenizers_own_truncation_and_the_cut_rows_are_named(tokenizer, kind, limit):
    first, second = texts(60, 1, 25), texts(60, 2, 15)
    inputs = {"text": {"text": first}, "pair": {"text": first, "text_pair": second}, "target": {"text_target": first}}
    given = inputs[kind]
    enc, cut = encode_within(tokenizer, given, limit)
    direct = tokenizer(**given, truncation=True, max_length=limit)
    assert {key: list(enc[key]) for key in direct} == {key: list(values) for key, values in direct.items()}
    whole = [len(ids) for ids in tokenizer(**given)["input_ids"]]
    assert cut == [n > (limit or tokenizer.model_max_length) for n in whole]
    assert limit is None or 0 < sum(cut) < len(cut)  # some rows cut, not all
