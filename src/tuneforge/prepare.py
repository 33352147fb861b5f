"""`tuneforge prepare CONFIG`: read and tokenize a config's training and validation data once, into memory-mapped
Arrow shards (data/prepared.py) that every later run of that config, and each of its ranks, reads without reading,
parsing or tokenizing the raw files again. A mixture's sources are prepared one by one; `--num-workers N` tokenizes
with N processes. The command does no model work: it needs the tokenizer only. The tokenization cache files the
prepared shards were copied from, and the memory-mapped copies of large raw files (data/mapped.py), are removed
after, so the data is on disk once besides the raw files; those another process reads (a run of the same data) are
kept, and said so.
"""

from __future__ import annotations

import time
from pathlib import Path

from tuneforge.data.mapped import drop_raw_copies
from tuneforge.data.tokenize import KEY_CHARS, default_cache_dir, drop_key
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
    freed, kept = drop_tokenized_copies(data, config.data.cache_dir)
    if freed:
        log(f"removed the tokenization cache of these features ({freed / 1e9:.2f} GB): the prepared shards hold them")
    if kept:
        log(
            "kept the tokenization cache of these features: another process reads it (a run of the same data); "
            f"remove {', '.join(kept)} when it has ended"
        )
    freed = drop_raw_copies(given_files(config.data), config.data.cache_dir)
    if freed:
        log(f"removed the memory-mapped copies of the raw files ({freed / 1e9:.2f} GB): the prepared shards suffice")
    return result


def given_files(data) -> list[Path]:
    """The local files a data config names: its train and validation files, each source's file or the files of
    its folder, and each source's validation file."""
    named = [data.train_file, data.validation_file, data.data_dir]
    for source in data.sources:
        named += [source.path, source.validation_file]
    files = []
    for path in (Path(p) for p in named if p):
        files += sorted(f for f in path.iterdir() if f.is_file()) if path.is_dir() else [path]
    return files


def drop_tokenized_copies(data, cache_dir: str | None) -> tuple[int, list[str]]:
    """Remove the tokenization cache files that `data`'s features were read from, with the files of the same
    cache key (the shards of a map with several workers, the unpacked features of packed blocks), unless another
    process reads them: (bytes freed, the files kept, as KEY*.arrow patterns). Only files right in tuneforge's
    tokenization cache folder: never prepared shards (a folder below it) nor anything else."""
    folder = (Path(cache_dir) if cache_dir else default_cache_dir()).resolve()
    features = [data.train, data.evals, *data.eval_parts.values()]
    files = {Path(c["filename"]).resolve() for ds in features if ds is not None for c in ds.cache_files}
    keys = {f.name[:KEY_CHARS] for f in files if f.parent == folder and _is_key(f.name[:KEY_CHARS])}
    freed, kept = 0, []
    for key in sorted(keys):
        dropped = drop_key(folder, key)
        if dropped is None:
            kept.append(str(folder / f"{key}*.arrow"))
        freed += dropped or 0
    return freed, kept


def _is_key(text: str) -> bool:
    return len(text) == KEY_CHARS and all(c in "0123456789abcdef" for c in text)
