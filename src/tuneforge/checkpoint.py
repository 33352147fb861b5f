"""Checkpoints: complete, atomic, exact; output-dir safety; export to an HF folder.

Layout of `OUTPUT_DIR/checkpoint-STEP/`:
    model + optimizer      written by the backend: model.safetensors + optimizer.pt (+ scaler.pt) for
                           single/ddp, per-rank shards for sharded backends (fsdp, tp, deepspeed)
    scheduler.pt           LR scheduler state
    rank{R}.pt             per rank: python / numpy / torch (/ cuda) RNG states and the logging window
    trainer_state.json     step, epoch, data position (consumed examples, order batch), best metric,
                           early-stopping counter
    meta.json              what the checkpoint is of: task, label set, model architecture, backend,
                           world size, examples per optimizer step
    config.yaml            the resolved config of the run that wrote it
    config.json, tokenizer files, tuneforge.json
                           what `tuneforge export` needs to write a standalone HF folder
    manifest.json          size and sha256 of every other file; written last, checked on load

Atomic: a checkpoint is written to a temporary folder (`.tmp-checkpoint-...`), fsynced, renamed to
`checkpoint-STEP`, and then the one-line `latest` pointer is replaced; `--resume` (latest) takes
the checkpoint `latest` names. A crash at any point leaves the previous checkpoint as the one to
resume; temporary folders are never picked, and the next save removes them.

Loading: weights through safetensors, everything else with `torch.load(weights_only=True)`; a
corrupt, truncated, incomplete or incompatible checkpoint is refused with one line naming what
differs (CheckpointError, exit 2).

Resuming continues at the exact step and the exact next batch: the epoch order is a pure function
of (seed, epoch, global batch), so the trainer rebuilds it and slices from the consumed position
without iterating the batches before it. Data-order rule when the world size or batch size changed
(e.g. a 2-process checkpoint resumed on 1 process): the interrupted epoch's order is rebuilt with
the global batch that epoch was started with, and training continues from the consumed example
count in batches of the new size, so no example of that epoch is skipped or seen twice; later
epochs use the new global batch. The remaining steps are re-planned to finish the configured
epochs, and the LR schedule is re-made over that total at the restored step.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from tuneforge.errors import CheckpointError, ConfigError

RUN_MARKERS = ("config.yaml", "metrics.jsonl", "model", "result.json", "latest")
TMP_PREFIX = ".tmp-"
MANIFEST = "manifest.json"
CHECK_KEYS = ("task", "labels", "model_type", "architecture", "hidden_size", "num_layers", "vocab_size")


# ---- output directory ---------------------------------------------------------------------
def holds_run(path: Path) -> bool:
    return path.is_dir() and (any((path / m).exists() for m in RUN_MARKERS) or any(path.glob("checkpoint-*")))


def prepare_output_dir(config) -> None:
    """Refuse to overwrite an existing run unless `overwrite`; only the launching/main process acts."""
    from tuneforge.launch import process_rank

    if process_rank() != 0 or config.node_rank != 0:  # other nodes' launchers leave the output dir alone
        return
    out = Path(config.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output dir {str(out)!r} is a file; choose another --output-dir")
    if holds_run(out):
        if not config.overwrite:
            raise ConfigError(
                f"output dir {str(out)!r} already holds a run; pass --overwrite to replace it, "
                "--resume to continue it, or choose another --output-dir"
            )
        # the old run is cleared only once this run's inputs have proven good (write_run_files)


def write_run_files(trainer) -> None:
    """Start the run folder: clear a replaced run (--overwrite) and write the resolved config."""
    from tuneforge.launch import restart_count

    cfg = trainer.config
    if trainer.backend.is_main:
        out = Path(cfg.output_dir)
        if cfg.overwrite and not cfg.resume and restart_count() == 0 and holds_run(out):
            for child in out.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        out.mkdir(parents=True, exist_ok=True)
        cfg.save(out / "config.yaml")


# ---- atomic file helpers --------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(root))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _discard(path: Path) -> None:
    """Remove a folder so that a crash half-way never leaves a partial `checkpoint-N` behind."""
    doomed = path.with_name(f"{TMP_PREFIX}deleted-{path.name}-{os.getpid()}-{time.time_ns()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _pause_hook(stage: str, step: int) -> None:
    """Crash-test hook: sleep at one point of a save so a test can SIGKILL the run there.

    TUNEFORGE_PAUSE_IN_SAVE=<seconds>; TUNEFORGE_PAUSE_STAGE = start (nothing of this checkpoint
    written yet) | mid-write (temporary folder half written, the default) | before-latest (renamed,
    pointer not yet updated); TUNEFORGE_PAUSE_STEP limits it to one step's save;
    TUNEFORGE_PAUSE_MARKER is a file written when the pause begins.
    """
    from tuneforge.config import env_flag

    delay = env_flag("TUNEFORGE_PAUSE_IN_SAVE")
    if not delay or stage != (env_flag("TUNEFORGE_PAUSE_STAGE") or "mid-write"):
        return
    only_step = env_flag("TUNEFORGE_PAUSE_STEP")
    if only_step and int(only_step) != step:
        return
    marker = env_flag("TUNEFORGE_PAUSE_MARKER")
    if marker:
        Path(marker).write_text(f"{stage} {step}")
    time.sleep(float(delay))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(files)))) as pool:  # hashlib frees the GIL
        digests = list(pool.map(_sha256, files))
    entries = {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": d} for p, d in zip(files, digests)
    }
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def verify(path: Path) -> str | None:
    """None if every file of the checkpoint is present and intact, else what is wrong (one line)."""
    path = Path(path)
    try:
        entries = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return (
            f"checkpoint {str(path)!r} is incomplete: it has no {MANIFEST} (its write did not finish); "
            "resume from an earlier checkpoint-STEP folder"
        )
    except (OSError, ValueError, KeyError, TypeError) as err:
        return (
            f"checkpoint {str(path)!r} is corrupt: {MANIFEST} is unreadable ({type(err).__name__}); resume from "
            "an earlier checkpoint-STEP folder"
        )
    for name, want in entries.items():
        f = path / name
        if not f.is_file():
            return (
                f"checkpoint {str(path)!r} is incomplete: {name} is missing; resume from an earlier "
                "checkpoint-STEP folder"
            )
        size = f.stat().st_size
        if size != want["bytes"]:
            what = "truncated" if size < want["bytes"] else "corrupt"
            return (
                f"checkpoint {str(path)!r} is {what}: {name} has {size} bytes, {want['bytes']} were written; "
                "resume from an earlier checkpoint-STEP folder"
            )
    names = list(entries)
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(names)))) as pool:
        digests = list(pool.map(lambda n: _sha256(path / n), names))
    for name, digest in zip(names, digests):
        if digest != entries[name]["sha256"]:
            return (
                f"checkpoint {str(path)!r} is corrupt: the content of {name} changed since it was written "
                "(sha256 mismatch); resume from an earlier checkpoint-STEP folder"
            )
    return None


# ---- what a checkpoint is of ------------------------------------------------------------------
def describe(trainer) -> dict:
    model = trainer.backend.unwrap(trainer.model)
    mc = model.config
    task, b, cfg = trainer.task, trainer.backend, trainer.config
    return {
        "task": cfg.task,
        "labels": list(getattr(task, "label_names", None) or []) or None,
        "model_type": getattr(mc, "model_type", None),
        "architecture": type(model).__name__.removeprefix("FSDP"),  # FSDP2 renames the class in place
        "hidden_size": getattr(mc, "hidden_size", getattr(mc, "d_model", None)),
        "num_layers": getattr(mc, "num_hidden_layers", getattr(mc, "num_layers", None)),
        "vocab_size": getattr(mc, "vocab_size", None),
        "backend": b.name,
        "world_size": b.world_size,
        "dp_size": b.dp_size,
        "step_examples": cfg.batch_size * b.dp_size * cfg.grad_accum,
    }


def _rank_state(trainer) -> dict:
    """RNG states as plain tensors/numbers (loadable with weights_only=True) + the logging window."""
    py_version, py_state, py_gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss_next": py_gauss},
        "numpy": {
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    window = getattr(trainer, "log_window", None)
    if window is not None:
        state["log_window"] = torch.stack([w.detach().float().cpu() for w in window])
    return state


def _set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        ("MT19937", npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- save -------------------------------------------------------------------------------------
def save(trainer) -> Path:
    b, cfg, st = trainer.backend, trainer.config, trainer.state
    out = Path(cfg.output_dir)
    final = out / f"checkpoint-{st.step}"
    if b.is_main:
        _pause_hook("start", st.step)
    tmp = out / b.broadcast_object(f"{TMP_PREFIX}checkpoint-{st.step}-{os.getpid()}-{time.time_ns()}")
    if b.is_main:
        tmp.mkdir(parents=True, exist_ok=False)
    b.barrier()
    b.save(tmp, trainer.model, trainer.optimizer)
    torch.save(_rank_state(trainer), tmp / f"rank{b.rank}.pt")
    if b.is_main:
        torch.save(trainer.scheduler.state_dict(), tmp / "scheduler.pt")
        _pause_hook("mid-write", st.step)
        extra = {"best_eval": getattr(trainer, "_best_eval", None), "metrics_records": _count_records(out)}
        (tmp / "trainer_state.json").write_text(json.dumps({**st.to_dict(), **extra}, indent=2))
        (tmp / "meta.json").write_text(json.dumps(describe(trainer), indent=2))
        cfg.save(tmp / "config.yaml")
        b.unwrap(trainer.model).config.save_pretrained(tmp)  # config.json: `tuneforge export` rebuilds the model
        if getattr(trainer, "tokenizer", None) is not None:
            trainer.tokenizer.save_pretrained(tmp)
        (tmp / "tuneforge.json").write_text(json.dumps(trainer.task.export_info(), indent=2))
    b.barrier()
    if b.is_main:
        _write_manifest(tmp)
        _fsync_tree(tmp)
        if final.exists():  # a re-save of the same step (e.g. epoch end == save step)
            _discard(final)
        os.replace(tmp, final)
        _fsync_dir(out)
        _pause_hook("before-latest", st.step)
        _write_atomic(out / "latest", final.name + "\n")
        _apply_retention(out, cfg.save_total_limit, st.best_step, final)
    b.barrier()
    for cb in trainer.callbacks:
        cb.on_save(trainer, final)
    return final


def _step_of(path: Path) -> int:
    return int(path.name.split("-", 1)[1])


def list_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints (renamed into place, with a manifest), oldest first."""
    found = []
    for p in Path(out).glob("checkpoint-*"):
        if p.is_dir() and p.name.split("-", 1)[1].isdigit() and (p / MANIFEST).exists():
            found.append(p)
    return sorted(found, key=_step_of)


def _apply_retention(out: Path, limit: int | None, best_step: int | None, just_saved: Path) -> None:
    """Keep the last `limit` checkpoints plus the best one; remove leftovers of crashed writes."""
    for pattern in ("checkpoint-*", "deleted-*", "latest.*", "metrics.jsonl.*"):
        for p in out.glob(TMP_PREFIX + pattern):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    if not limit:
        return
    ckpts = list_checkpoints(out)
    keep = set(ckpts[-limit:]) | {just_saved}
    keep |= {p for p in ckpts if best_step is not None and p.name == f"checkpoint-{best_step}"}
    for p in ckpts:
        if p not in keep:
            _discard(p)


# ---- resume -----------------------------------------------------------------------------------
def find_checkpoint(resume: str, output_dir: str) -> Path:
    """`latest`: the checkpoint the `latest` pointer names (else the newest complete one); or a path."""
    if resume in ("latest", "true", "True", "auto"):
        out = Path(output_dir)
        pointer = out / "latest"
        if pointer.exists():
            cand = out / pointer.read_text().strip()
            if (cand / MANIFEST).exists():
                return cand
        ckpts = list_checkpoints(out)
        if not ckpts:
            raise CheckpointError(
                f"no complete checkpoint in {str(out)!r} to resume from; train with --save-steps N or "
                "--save-strategy epoch first"
            )
        return ckpts[-1]
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {resume!r} does not exist; pass a checkpoint-STEP folder or --resume latest")
    if not (path / MANIFEST).exists():
        raise CheckpointError(
            f"{resume!r} is not a complete tuneforge checkpoint (no {MANIFEST}: not a checkpoint, or its write did "
            "not finish); "
            "pass a checkpoint-STEP folder"
        )
    return path


def read_meta(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "meta.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt: meta.json is unreadable ({type(err).__name__})"
        ) from None


def check_compatible(path: Path, trainer) -> None:
    saved, now = read_meta(path), describe(trainer)
    for key in CHECK_KEYS:
        if saved.get(key) != now.get(key):
            raise CheckpointError(
                f"checkpoint {str(path)!r} does not match this run: {key} is {saved.get(key)!r} in the checkpoint "
                f"but {now.get(key)!r} here; resume with the same task, labels and model, or start a new run"
            )
    if not trainer.backend.sharded and not (Path(path) / "model.safetensors").exists():
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds sharded weights written by backend {saved.get('backend')!r}, which "
            "backend "
            f"{trainer.backend.name!r} cannot read; resume with --backend {saved.get('backend')}, or `tuneforge "
            "export` it "
            "and start a new run from the exported model"
        )


def restore(trainer, resume: str) -> Path:
    """Load a checkpoint into a trainer whose model, optimizer and scheduler are built."""
    from dataclasses import fields

    from tuneforge.trainer import TrainState

    b, cfg = trainer.backend, trainer.config
    path = find_checkpoint(resume, cfg.output_dir)
    problem = b.broadcast_object(verify(path) if b.is_main else None)  # one rank reads every byte
    if problem:
        raise CheckpointError(problem)
    check_compatible(path, trainer)
    meta = read_meta(path)
    try:
        b.load(path, trainer.model, trainer.optimizer)
        trainer.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        saved = json.loads((path / "trainer_state.json").read_text())
        same_world = meta.get("world_size") == b.world_size
        rank_file = path / f"rank{b.rank}.pt"
        rank_state = torch.load(rank_file, weights_only=True) if rank_file.exists() else None
        window = _resumed_window(path, b, rank_state, same_world)
    except CheckpointError:
        raise
    except Exception as err:  # safetensors/pickle/JSON errors on damaged files
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt or truncated ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]}); "
            "resume from an earlier checkpoint-STEP folder"
        ) from None
    known = {f.name for f in fields(TrainState)}
    trainer.state = TrainState(**{k: v for k, v in saved.items() if k in known})
    trainer.resumed_from = path
    trainer._resumed_window = window
    if rank_state is not None:
        _set_rng_state(rank_state)
    if b.is_main and saved.get("metrics_records") is not None:
        _cut_metrics(Path(cfg.output_dir), saved["metrics_records"])
    if cfg.load_best_model_at_end and trainer.state.best_step is not None:
        _restore_best(trainer, path.parent, saved.get("best_eval"))
    trainer.report.print(
        f"resumed from {path} at step {trainer.state.step} (epoch {trainer.state.epoch}, example "
        f"{trainer.state.consumed})"
    )
    return path


def _resumed_window(path: Path, b, rank_state: dict | None, same_world: bool) -> tuple[float, float] | None:
    """The logging window of this rank; after a world-size change rank 0 takes the whole window."""
    if same_world:
        return tuple(rank_state["log_window"].tolist()) if rank_state and "log_window" in rank_state else None
    if b.rank != 0:
        return None
    total = torch.zeros(2)
    for f in path.glob("rank*.pt"):
        total += torch.load(f, weights_only=True).get("log_window", torch.zeros(2))
    return tuple(total.tolist())


def restored_log_window(trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, item count) since the last log line: zeros, or what the checkpoint held."""
    saved = getattr(trainer, "_resumed_window", None) or (0.0, 0.0)
    dev = trainer.backend.device
    return torch.tensor(saved[0], dtype=torch.float32, device=dev), torch.tensor(
        saved[1], dtype=torch.float32, device=dev
    )


def _count_records(out: Path) -> int:
    f = out / "metrics.jsonl"
    return sum(1 for ln in f.read_text().splitlines() if ln.strip()) if f.exists() else 0


def _cut_metrics(out: Path, records: int) -> None:
    """metrics.jsonl keeps the records written before the checkpoint: it reads like an uninterrupted run."""
    f = out / "metrics.jsonl"
    if not f.exists():
        return
    lines = [ln for ln in f.read_text().splitlines() if ln.strip()]
    if len(lines) > records:
        _write_atomic(f, "".join(ln + "\n" for ln in lines[:records]))


def _restore_best(trainer, folder: Path, best_eval: dict | None) -> None:
    """load_best_model_at_end across a resume: the best weights come from the best step's checkpoint."""
    best = folder / f"checkpoint-{trainer.state.best_step}"
    if (best / "model.safetensors").exists() and best_eval is not None:
        if trainer.backend.is_main:
            from safetensors.torch import load_file

            weights = load_file(str(best / "model.safetensors"))
            # safetensors stores tied weights once: give every alias of a stored tensor its value
            model = trainer.backend.unwrap(trainer.model)
            aliases: dict[int, list[str]] = {}
            for name, param in model.named_parameters(remove_duplicate=False):
                aliases.setdefault(id(param), []).append(name)
            for names in aliases.values():
                stored = [n for n in names if n in weights]
                weights.update({n: weights[stored[0]] for n in names if stored and n not in weights})
            trainer._best_weights = weights
        trainer._best_eval = best_eval
    else:
        trainer.report.print(
            f"note: the best model (step {trainer.state.best_step}) is not in a readable checkpoint; "
            "load_best_model_at_end will pick among the evaluations after this resume"
        )
        trainer.state.best_metric = trainer.state.best_step = None


def continue_plan(trainer, total_steps: int, steps_per_epoch: int) -> int:
    """Total steps after a resume: the configured epochs, counted from the restored data position.

    With the same batch geometry this equals the original plan. After a world-size or batch-size
    change, the rest of the interrupted epoch and the later epochs are counted at the new global
    batch, and the LR schedule is re-made over the new total at the restored step.
    """
    from tuneforge.data.samplers import epoch_order, rank_batches

    cfg, st, b = trainer.config, trainer.state, trainer.backend
    if cfg.max_steps:
        return total_steps
    global_batch = cfg.batch_size * b.dp_size
    step_examples = global_batch * cfg.grad_accum
    lengths = np.asarray(trainer.train_data["length"])
    order = epoch_order(
        lengths,
        seed=cfg.seed,
        epoch=st.epoch,
        global_batch=st.order_global_batch,
        group_by_length=cfg.data.group_by_length,
    )
    batches_left = len(rank_batches(order, start=st.consumed, global_batch=global_batch, dp_rank=0, dp_size=b.dp_size))
    left_in_epoch = math.ceil(batches_left / cfg.grad_accum)
    whole = int(cfg.epochs)
    last_part = math.ceil(cfg.epochs * steps_per_epoch) - whole * steps_per_epoch  # steps of a final partial epoch
    if st.epoch < whole:
        left = left_in_epoch + (whole - st.epoch - 1) * steps_per_epoch + last_part
    elif st.epoch == whole and last_part:
        left = min(left_in_epoch, math.ceil(max(0, last_part * step_examples - st.consumed) / step_examples))
    else:
        left = 0
    planned = st.step + left
    if planned != total_steps:
        sched_state = trainer.scheduler.state_dict()
        trainer.scheduler = trainer._make_scheduler(planned)  # resets the optimizer's lr ...
        trainer.scheduler.load_state_dict(sched_state)
        s = trainer.scheduler
        for group, base, fn in zip(trainer.optimizer.param_groups, s.base_lrs, s.lr_lambdas):
            group["lr"] = base * fn(s.last_epoch)  # ... so set it to the new schedule's value at this step
        s._last_lr = [g["lr"] for g in trainer.optimizer.param_groups]
        trainer.report.print(
            f"batch geometry changed ({read_meta(trainer.resumed_from).get('step_examples')} -> "
            f"{step_examples} examples per step): {left} steps left to finish {cfg.epochs:g} epochs"
        )
    return planned


# ---- export ---------------------------------------------------------------------------------
def export_model(trainer, out_dir: Path, state_dict: dict | None = None, gather: bool = True) -> Path:
    """Save an HF folder (safetensors, config, tokenizer) that `from_pretrained` loads.

    `gather=False`: use `state_dict` as given (the main rank's copy of the best weights); every
    rank must pass the same `gather`, since gathering is a collective on sharded backends.
    """
    b = trainer.backend
    if gather and state_dict is None:
        state_dict = b.full_state_dict(trainer.model)  # collective on sharded backends
    if b.is_main:
        model = b.unwrap(trainer.model)
        out_dir = Path(out_dir)
        tmp = out_dir.with_name(f"{TMP_PREFIX}{out_dir.name}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=state_dict)
        if trainer.tokenizer is not None:
            trainer.tokenizer.save_pretrained(tmp)
        (tmp / "tuneforge.json").write_text(json.dumps(trainer.task.export_info(), indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    b.barrier()
    return Path(out_dir)
