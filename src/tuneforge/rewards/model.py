"""A reward model as a reward function (`--reward model:DIR`): the folder of a `tuneforge train --task reward` run
(or a sequence-classification model with one output) scores each prompt + completion, batched, without gradients.

`model_reward(DIR)` gives the scoring function, with TRL's signature; the package (rewards/__init__.py) wraps it
as the RewardFunction named `model:DIR` (this module imports nothing of the package: no import cycle). The folder
is checked when the reward is made (one ConfigError line for a folder that is not a scorer); its weights load at
the first call. Prompts and completions are read as the reward model trained on them (tasks/reward.py
`encode_scored`): text, or conversations (a prompt's messages and the completion's [{"role": "assistant",
"content": ...}]) through the chat template, joined as hh-rlhf text where the tokenizer has none.
"""

from __future__ import annotations

from collections.abc import Callable

BATCH_SIZE = 32  # sequences a forward pass scores


def model_reward(model_dir: str) -> Callable[..., list[float]]:
    """The scoring function of the reward model in `model_dir`: fn(prompts, completions, **columns) -> one float
    per completion, in order (the columns are not read)."""
    from tuneforge.tasks.reward import RewardPredictor, check_scorer

    model_dir = str(model_dir)
    check_scorer(model_dir)
    loaded: list[RewardPredictor] = []

    def score(prompts, completions, **columns) -> list[float]:
        if not loaded:
            loaded.append(RewardPredictor(model_dir))
        return loaded[0].scores(list(prompts), list(completions), batch_size=BATCH_SIZE)

    score.__name__ = f"model:{model_dir}"  # how TRL-style logs name a reward function
    return score
