"""`tuneforge prepare CONFIG`: read and tokenize a config's training and validation data once, into memory-mapped
Arrow shards (data/prepared.py) that every later run of that config, and each of its ranks, reads without reading,
parsing or tokenizing the raw files again. A mixture's sources are prepared one by one; `--num-workers N` tokenizes
with N processes. The command does no model work: it needs the tokenizer only.
"""

from __future__ import annotations

import time

from tuneforge.tasks import get_task
from tuneforge.training_data import load_mixture, load_single


def prepare(config, log=print) -> dict:
    """Prepare `config`'s data; returns rows per split and the time taken."""
    t0 = time.perf_counter()
    task = get_task(config)
    task.log = log
    tokenizer = task.load_tokenizer()
    if config.data.sources:
        data = load_mixture(task, config, tokenizer, log, save=True)
    else:
        data = load_single(task, tokenizer, ("train", "validation"), log, save=True)
    result = {
        "train_rows": len(data.train) if data.train is not None else 0,
        "validation_rows": len(data.evals) if data.evals is not None else 0,
        "epoch_rows": data.epoch_rows if data.train is not None else 0,
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    if data.mixture is not None:
        result["sources"] = dict(zip(data.mixture.names, data.mixture.sizes))
    return result
