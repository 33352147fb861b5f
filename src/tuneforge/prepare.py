"""`tuneforge prepare CONFIG`: read and tokenize a config's training and validation data once, into memory-mapped
Arrow shards (data/prepared.py) that every later run of that config, and each of its ranks, reads without reading,
parsing or tokenizing the raw files again. A mixture's sources are prepared one by one; `--num-workers N` tokenizes
with N processes. The command does no model work: it needs the tokenizer only. The tokenization cache files the
prepared shards were copied from are removed after, so the data is on disk once.
"""

from __future__ import annotations

import time
from pathlib import Path

from tuneforge.data.tokenize import default_cache_dir
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
    freed = drop_tokenized_copies(data, config.data.cache_dir)
    if freed:
        log(f"removed the tokenization cache of these features ({freed / 1e9:.2f} GB): the prepared shards hold them")
    return result


def drop_tokenized_copies(data, cache_dir: str | None) -> int:
    """Remove the tokenization cache files that `data`'s features were read from (bytes freed). Only files right in
    tuneforge's tokenization cache folder: never prepared shards (a folder below it) nor anything else."""
    folder = (Path(cache_dir) if cache_dir else default_cache_dir()).resolve()
    features = [data.train, data.evals, *data.eval_parts.values()]
    files = {Path(c["filename"]).resolve() for ds in features if ds is not None for c in ds.cache_files}
    freed = 0
    for f in files:
        if f.parent == folder and f.suffix == ".arrow" and f.is_file():
            freed += f.stat().st_size
            f.unlink()
    return freed
