"""Checkpoints: complete, atomic, exact; output-dir safety; export to an HF folder.

Layout of `OUTPUT_DIR/checkpoint-STEP/`:
    model + optimizer      written by the backend (safetensors + optimizer.pt, or per-rank shards)
    scheduler.pt           LR scheduler state
    rng-rank{R}.pt         python / numpy / torch (/ cuda) RNG states of every rank
    trainer_state.json     step, epoch, data position (consumed examples, order batch), best metric,
                           early-stopping counter
    meta.json              what the checkpoint is of: task, label set, model architecture, world size
    config.yaml            the resolved config of the run that wrote it

A checkpoint is written to a temporary folder, fsynced and renamed; `latest` (a one-line file)
is written last, so a partial checkpoint is never picked by a resume.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from tuneforge.errors import CheckpointError, ConfigError

RUN_MARKERS = ("config.yaml", "metrics.jsonl", "model", "result.json", "latest")
TMP_PREFIX = ".tmp-"


# ---- output directory ---------------------------------------------------------------------
def holds_run(path: Path) -> bool:
    return path.is_dir() and (any((path / m).exists() for m in RUN_MARKERS) or any(path.glob("checkpoint-*")))


def prepare_output_dir(config) -> None:
    """Refuse to overwrite an existing run unless `overwrite`; only the launching/main process acts."""
    from tuneforge.launch import process_rank

    if process_rank() != 0:
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
        for child in out.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()


def write_run_files(trainer) -> None:
    if trainer.backend.is_main:
        out = Path(trainer.config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        trainer.config.save(out / "config.yaml")


# ---- atomic file helpers --------------------------------------------------------------------
def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                os.fsync(fh.fileno())
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _pause_hook(stage: str) -> None:
    """Test hook: TUNEFORGE_PAUSE_IN_SAVE=<seconds> sleeps inside the write window (crash tests)."""
    from tuneforge.config import env_flag

    delay = env_flag("TUNEFORGE_PAUSE_IN_SAVE")
    if delay and stage == "mid-write":
        marker = env_flag("TUNEFORGE_PAUSE_MARKER")
        if marker:
            Path(marker).write_text(stage)
        time.sleep(float(delay))


# ---- what a checkpoint is of ------------------------------------------------------------------
def describe(trainer) -> dict:
    model = trainer.backend.unwrap(trainer.model)
    mc = model.config
    task = trainer.task
    return {
        "task": trainer.config.task,
        "labels": list(getattr(task, "label_names", None) or []) or None,
        "model_type": getattr(mc, "model_type", None),
        "architecture": type(model).__name__,
        "hidden_size": getattr(mc, "hidden_size", getattr(mc, "d_model", None)),
        "num_layers": getattr(mc, "num_hidden_layers", getattr(mc, "num_layers", None)),
        "vocab_size": getattr(mc, "vocab_size", None),
        "backend": trainer.backend.name,
        "world_size": trainer.backend.world_size,
    }


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- save -------------------------------------------------------------------------------------
def save(trainer) -> Path:
    b, cfg, st = trainer.backend, trainer.config, trainer.state
    out = Path(cfg.output_dir)
    final = out / f"checkpoint-{st.step}"
    tmp_name = b.broadcast_object(f"{TMP_PREFIX}checkpoint-{st.step}-{os.getpid()}-{int(time.time() * 1000)}")
    tmp = out / tmp_name
    if b.is_main:
        tmp.mkdir(parents=True, exist_ok=False)
    b.barrier()
    b.save(tmp, trainer.model, trainer.optimizer)
    # RNG states: one small file per rank (python's random state is a tuple; torch.save keeps it)
    torch.save(_rng_state(), tmp / f"rng-rank{b.rank}.pt")
    if b.is_main:
        torch.save(trainer.scheduler.state_dict(), tmp / "scheduler.pt")
        _pause_hook("mid-write")
        (tmp / "trainer_state.json").write_text(json.dumps(st.to_dict(), indent=2))
        (tmp / "meta.json").write_text(json.dumps(describe(trainer), indent=2))
        cfg.save(tmp / "config.yaml")
    b.barrier()
    if b.is_main:
        _fsync_tree(tmp)
        if final.exists():  # a re-save of the same step (e.g. epoch end == save step)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(out / "latest", final.name + "\n")
        _apply_retention(out, cfg.save_total_limit, st.best_step)
    b.barrier()
    for cb in trainer.callbacks:
        cb.on_save(trainer, final)
    return final


def list_checkpoints(out: Path) -> list[Path]:
    found = []
    for p in Path(out).glob("checkpoint-*"):
        suffix = p.name.split("-", 1)[1]
        if p.is_dir() and suffix.isdigit() and (p / "trainer_state.json").exists():
            found.append(p)
    return sorted(found, key=lambda p: int(p.name.split("-", 1)[1]))


def _apply_retention(out: Path, limit: int | None, best_step: int | None) -> None:
    if not limit:
        return
    ckpts = list_checkpoints(out)
    keep = set(ckpts[-limit:])
    keep |= {p for p in ckpts if best_step is not None and p.name == f"checkpoint-{best_step}"}
    for p in ckpts:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)
    for p in out.glob(f"{TMP_PREFIX}checkpoint-*"):  # leftovers of a crashed write
        shutil.rmtree(p, ignore_errors=True)


# ---- resume -----------------------------------------------------------------------------------
def find_checkpoint(resume: str, output_dir: str) -> Path:
    if resume in ("latest", "true", "True", "auto"):
        out = Path(output_dir)
        pointer = out / "latest"
        if pointer.exists():
            cand = out / pointer.read_text().strip()
            if (cand / "trainer_state.json").exists():
                return cand
        ckpts = list_checkpoints(out)
        if not ckpts:
            raise CheckpointError(f"no complete checkpoint in {str(out)!r} to resume from; train with --save-steps N or --save-strategy epoch first")
        return ckpts[-1]
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"checkpoint {resume!r} does not exist; pass a checkpoint-STEP folder or --resume latest")
    if not (path / "trainer_state.json").exists():
        raise CheckpointError(f"{resume!r} is not a complete tuneforge checkpoint (no trainer_state.json); pass a checkpoint-STEP folder")
    return path


def check_compatible(path: Path, trainer) -> None:
    try:
        saved = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: meta.json unreadable ({err})") from None
    now = describe(trainer)
    for key in ("task", "labels", "model_type", "architecture", "hidden_size", "num_layers", "vocab_size"):
        if saved.get(key) != now.get(key):
            raise CheckpointError(
                f"checkpoint {str(path)!r} is incompatible: its {key} is {saved.get(key)!r}, this run's is {now.get(key)!r}; "
                "resume with the same task, labels and model, or start a new run"
            )


def restore(trainer, resume: str) -> Path:
    from tuneforge.trainer import TrainState

    b, cfg = trainer.backend, trainer.config
    path = find_checkpoint(resume, cfg.output_dir)
    check_compatible(path, trainer)
    try:
        b.load(path, trainer.model, trainer.optimizer)
        trainer.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        state = json.loads((path / "trainer_state.json").read_text())
    except CheckpointError:
        raise
    except Exception as err:  # safetensors/pickle/JSON errors on damaged files
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt or truncated ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
            "resume from an earlier checkpoint-STEP folder"
        ) from None
    trainer.state = TrainState(**state)
    rng_file = path / f"rng-rank{b.rank}.pt"
    if rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    trainer.report.print(f"resumed from {path} at step {trainer.state.step} (epoch {trainer.state.epoch}, example {trainer.state.consumed})")
    return path


# ---- export ---------------------------------------------------------------------------------
def export_model(trainer, out_dir: Path, state_dict: dict | None = None) -> Path:
    """Save an HF folder (safetensors, config, tokenizer) that `from_pretrained` loads."""
    b = trainer.backend
    if state_dict is None:
        state_dict = b.full_state_dict(trainer.model)  # collective on sharded backends
    if b.is_main:
        model = b.unwrap(trainer.model)
        out_dir = Path(out_dir)
        tmp = out_dir.with_name(f"{TMP_PREFIX}{out_dir.name}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        if trainer.tokenizer is not None:
            trainer.tokenizer.save_pretrained(tmp)
        (tmp / "tuneforge.json").write_text(json.dumps(trainer.task.export_info(), indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    b.barrier()
    return Path(out_dir)
