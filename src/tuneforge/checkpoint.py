"""Checkpoints: complete, atomic, exact; output-dir safety.

`Checkpointer(output_dir, backend, meta, ...)` writes and reads the checkpoints of one run:
`save(model, optimizer, scheduler, progress) -> Path` and `load(path, model, optimizer, scheduler)
-> Progress`. It reads nothing of the Trainer: what it writes comes in as arguments (`progress` is
the plain `tuneforge.progress.Progress`), and the Trainer fires its callbacks itself.

Layout of `OUTPUT_DIR/checkpoint-STEP/`:
    model + optimizer      written by the backend in its checkpoint layout (backends/layouts.py, the one
                           place that knows these files): model.safetensors + optimizer.pt for single/ddp,
                           per-rank shards for sharded backends (fsdp, tp, deepspeed); an adapter run
                           (--adapter lora) holds only the weights that train (single/ddp:
                           trainable.safetensors) and their optimizer state; scaler.pt: fp16's grad scaler
    scheduler.pt           LR scheduler state
    rank{R}.pt             per rank: python / numpy / torch (/ cuda) RNG states and the logging window
    trainer_state.json     the Progress: step, epoch, data position (consumed examples, order batch),
                           best metric and evaluation, early-stopping counter, records in metrics.jsonl
    meta.json              what the checkpoint is of (`describe`): task, label set, model architecture,
                           backend, world size, examples per optimizer step, weight tensors trained
    config.yaml            the resolved config of the run that wrote it
    config.json, tokenizer files, tuneforge.json
                           what `tuneforge export` needs to write a standalone HF folder
    model_files/           the task's files for other libraries (`Task.model_files`: a sentence encoder's
                           sentence-transformers modules), copied into the exported folder
    manifest.json          size and sha256 of every other file; written last, checked on load

Atomic: a checkpoint is written to a temporary folder (`.tmp-checkpoint-...`), fsynced, renamed to
`checkpoint-STEP`, and then the one-line `latest` pointer is replaced; `--resume` (latest) takes
the checkpoint `latest` names. A crash at any point leaves the previous checkpoint as the one to
resume; temporary folders are never picked, and the next save removes them.

Output dir safety: a folder holding a run is refused without --overwrite; --overwrite removes only the
entries a run writes (paths.is_run_entry: config.yaml, metrics.jsonl, result.json, latest, plot.png, model/,
tensorboard/, checkpoint-N/, their temporaries), never the user's files beside them, and a run whose inputs
(data, model, template, config file, checkpoint) lie inside those entries is refused before any work.

Loading: weights through safetensors, everything else with `torch.load(weights_only=True)`; a
corrupt, truncated, incomplete or incompatible checkpoint is refused with one line naming what
differs (CheckpointError, exit 2).

Resuming continues at the exact step and the exact next batch: the epoch order is a pure function
of (seed, epoch, global batch), so the trainer rebuilds it and slices from the consumed position
without iterating the batches before it. Data-order rule when the world size or batch size changed
(e.g. a 2-process checkpoint resumed on 1 process): the interrupted epoch's order is rebuilt with
the global batch that epoch was started with, and training continues from the consumed example
count in batches of the new size, so no example of that epoch is seen twice, and none skipped but a
last batch of fewer examples than processes (dropped, as in every epoch: each rank needs one); later
epochs use the new global batch. The remaining steps are re-planned to finish the configured
epochs (`plan.StepPlan.resumed_at`), and the Trainer re-makes the LR schedule over that total at the
restored step.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from tuneforge.artifacts import first_error_line, write_model_info
from tuneforge.backends.layouts import full_weights as full_weights
from tuneforge.backends.layouts import has_full_weights as has_full_weights
from tuneforge.backends.layouts import new_run_hint
from tuneforge.errors import CheckpointError, ConfigError
from tuneforge.files import (
    TMP_PREFIX,
    discard,
    fsync_dir,
    fsync_tree,
    json_text,
    remove,
    room_for,
    torch_save,
    write_text,
)
from tuneforge.paths import (
    CHECKPOINT_NAME,
    check_inputs_outside_run,
    check_no_clashes,
    check_output_dir,
    check_outside_inputs,
    run_entries,
)
from tuneforge.progress import Progress

MANIFEST = "manifest.json"
MODEL_FILES = "model_files"  # the task's files for other libraries, copied into an exported folder
LATEST = ("latest", "true", "True", "auto")  # --resume values that mean the latest checkpoint of the output dir
RESTORED_OPTIM = ("lr", "weight_decay", "betas", "eps")  # the optimizer settings its state_dict restores
# data settings that never order an epoch: left out where a resume names what orders it otherwise
ORDER_FREE = (
    "data.cache_dir",
    "data.num_workers",
    "data.allow_changed_data",
    "data.validation_file",
    "data.max_eval_samples",
)
CHECK_KEYS = ("task", "labels", "model_type", "architecture", "hidden_size", "num_layers", "vocab_size")


# ---- output directory ---------------------------------------------------------------------
def holds_run(path: Path) -> bool:
    """`path` holds what a tuneforge run writes (a crashed save's temporaries alone do not count)."""
    return any(not e.name.startswith(TMP_PREFIX) for e in run_entries(Path(path)))


def prepare_output_dir(config) -> None:
    """Refuse to overwrite an existing run unless `overwrite`, or a run that would write over its own
    inputs; only the launching/main process acts."""
    from tuneforge.launch import process_rank

    if process_rank() != 0 or config.node_rank != 0:  # other nodes' launchers leave the output dir alone
        return
    out = Path(config.output_dir)
    check_output_dir(config.output_dir)  # empty, a file, or unwritable: one line, before any work
    check_inputs_outside_run(out, config.inputs())
    data = {flag: path for flag, path in config.inputs().items() if flag not in ("--model", "--resume")}
    check_outside_inputs(out, "output dir", "--output-dir", data)  # (the model's folder is read, not fingerprinted)
    check_no_clashes(out)
    if holds_run(out):
        if not config.overwrite:
            how = "--resume to continue it, " if not config.resume else ""
            elsewhere = (
                f", and --resume names a checkpoint of another folder ({config.resume})" if config.resume else ""
            )
            raise ConfigError(
                f"output dir {str(out)!r} already holds a run{elsewhere}; pass --overwrite to replace it, "
                f"{how}or choose another --output-dir"
            )
        # the old run is cleared only once this run's inputs have proven good (write_run_files)


def continues_own_run(config) -> bool:
    """The run resumes a checkpoint of its own output dir (`--resume` latest, or a checkpoint-STEP folder in it);
    one that resumes another folder's checkpoint starts a run in its output dir, with that folder's safety."""
    if not config.resume:
        return False
    if config.resume in LATEST:
        return True
    here = Path(config.output_dir).expanduser().resolve()
    return Path(config.resume).expanduser().resolve().parent == here


def write_run_files(config, is_main: bool, replace_old: bool) -> None:
    """Start the run folder: clear a replaced run and write the resolved config (main rank only).

    `replace_old`: the first start of an --overwrite run (not a resume, not an elastic restart). Only the
    entries a run writes go (paths.is_run_entry); the user's files beside them stay as they are.
    """
    if not is_main:
        return
    out = Path(config.output_dir)
    if replace_old:
        check_inputs_outside_run(out, config.inputs())  # as checked up front; the folder may have changed
        for entry in run_entries(out):
            discard(entry) if entry.is_dir() else entry.unlink()
    out.mkdir(parents=True, exist_ok=True)
    config.save(out / "config.yaml")


# ---- crash-test hook, manifest ---------------------------------------------------------------
def _pause_hook(stage: str, step: int) -> None:
    """Crash-test hook: sleep at one point of a save so a test can SIGKILL the run there.

    TUNEFORGE_PAUSE_IN_SAVE=<seconds>; TUNEFORGE_PAUSE_STAGE = start (nothing of this checkpoint
    written yet) | mid-write (temporary folder half written, the default) | before-latest (renamed,
    pointer not yet updated); TUNEFORGE_PAUSE_STEP limits it to one step's save;
    TUNEFORGE_PAUSE_MARKER is a file written when the pause begins.
    """
    from tuneforge.launch import env_flag

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
def describe(model, backend, *, task: str, labels, step_examples: int, adapter: dict | None = None) -> dict:
    """meta.json: what a checkpoint is of. `model` is the unwrapped model, `labels` the task's label
    names (None for tasks without labels), `adapter` the LoRA adapter's settings (`Adapter.info()`)."""
    mc = model.config
    return {
        "task": task,
        "labels": list(labels or []) or None,
        "model_type": getattr(mc, "model_type", None),
        "architecture": type(model).__name__.removeprefix("FSDP"),  # FSDP2 renames the class in place
        "hidden_size": getattr(mc, "hidden_size", getattr(mc, "d_model", None)),
        "num_layers": getattr(mc, "num_hidden_layers", getattr(mc, "num_layers", None)),
        "vocab_size": getattr(mc, "vocab_size", None),
        "backend": backend.name,
        "world_size": backend.world_size,
        "dp_size": backend.dp_size,
        "step_examples": step_examples,
        # which weights train (--freeze-layers, --freeze-embeddings) decides what the optimizer state holds
        "trained_tensors": sum(1 for p in model.parameters() if p.requires_grad),
        # an adapter run's checkpoint holds the adapters and the head only: the base comes from `base_model`
        "adapter": adapter,
    }


def rank_state(progress: Progress) -> dict:
    """This rank's RNG states as plain tensors/numbers (loadable with weights_only=True) + its logging window."""
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
        "log_window": torch.tensor([progress.log_loss, progress.log_count], dtype=torch.float32),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the RNG states `rank_state` saved."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        ("MT19937", npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def read_model_files(path: str | os.PathLike) -> dict[str, str]:
    """The task's files a checkpoint keeps for the exported folder (a path inside it -> its text); {} if none."""
    root = Path(path) / MODEL_FILES
    if not root.is_dir():
        return {}
    files = sorted(f for f in root.rglob("*") if f.is_file())
    return {f.relative_to(root).as_posix(): f.read_text(encoding="utf-8") for f in files}


# ---- the checkpointer ---------------------------------------------------------------------------
class Checkpointer:
    """Writes and reads the checkpoints of one run in `output_dir`.

    `meta` is `describe(...)` of this run (written as meta.json, and compared with a checkpoint's on
    load); `run_config` (anything with `.save(path)`), `tokenizer`, `model_info` (the task's
    tuneforge.json) and `model_files` (the task's files for other libraries, a path -> its text) are
    written beside the weights so that `tuneforge export` needs nothing else.
    `save_total_limit`: keep the last N checkpoints (plus the best one); None keeps all.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        backend,
        meta: dict,
        *,
        save_total_limit: int | None = None,
        run_config=None,
        tokenizer=None,
        model_info: dict | None = None,
        model_files: dict[str, str] | None = None,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.backend = backend
        self.meta = meta
        self.save_total_limit = save_total_limit
        self.run_config = run_config
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.model_files = model_files or {}

    def save(self, model, optimizer, scheduler, progress: Progress) -> Path:
        """Write `checkpoint-STEP` (a collective: every rank calls it); returns its path. A write that fails for
        want of room is one line (NoRoomError); the checkpoint before it stays the one to resume."""
        b, out, step = self.backend, self.output_dir, progress.step
        final = out / f"checkpoint-{step}"
        if b.is_main:
            _pause_hook("start", step)
        tmp = out / b.broadcast_object(f"{TMP_PREFIX}checkpoint-{step}-{os.getpid()}-{time.time_ns()}")
        try:
            with room_for(final, "the checkpoint"):
                self._write(tmp, model, optimizer, scheduler, progress)
                b.barrier()
                if b.is_main:
                    _write_manifest(tmp)
                    fsync_tree(tmp)
                    if final.exists():  # a re-save of the same step (e.g. epoch end == save step)
                        discard(final)
                    os.replace(tmp, final)
                    fsync_dir(out)
                    _pause_hook("before-latest", step)
                    write_text(out / "latest", final.name + "\n")
        except BaseException:  # (Ctrl-C too)
            if b.is_main:  # what it took of the disk is freed
                remove(tmp)
            raise
        if b.is_main:
            _apply_retention(out, self.save_total_limit, progress.best_step, final)
        b.barrier()
        return final

    def _write(self, tmp: Path, model, optimizer, scheduler, progress: Progress) -> None:
        """Every file of a checkpoint but its manifest, into the temporary folder `tmp` (a collective)."""
        b = self.backend
        if b.is_main:
            tmp.mkdir(parents=True, exist_ok=False)
        b.barrier()
        b.save(tmp, model, optimizer)
        torch_save(rank_state(progress), tmp / f"rank{b.rank}.pt")
        if not b.is_main:
            return
        torch_save(scheduler.state_dict(), tmp / "scheduler.pt")
        _pause_hook("mid-write", progress.step)
        (tmp / "trainer_state.json").write_text(json_text(progress.shared_dict(), indent=2))
        (tmp / "meta.json").write_text(json_text(self.meta, indent=2))
        if self.run_config is not None:
            self.run_config.save(tmp / "config.yaml")
        b.unwrap(model).config.save_pretrained(tmp)  # config.json: `tuneforge export` rebuilds the model
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(tmp)
        if self.model_info is not None:
            write_model_info(tmp, self.model_info)
        for name, text in self.model_files.items():
            (tmp / MODEL_FILES / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / MODEL_FILES / name).write_text(text, encoding="utf-8")

    def load(self, path: str | os.PathLike, model, optimizer, scheduler) -> Progress:
        """Restore model, optimizer, scheduler and this rank's RNG states from a checkpoint folder
        (a collective); returns the Progress it was saved at, with this rank's logging window.

        A damaged or incompatible checkpoint is refused with one line (CheckpointError).
        """
        b, path = self.backend, Path(path)
        problem = b.broadcast_object(verify(path) if b.is_main else None)  # one rank reads every byte
        if problem:
            raise CheckpointError(problem)
        saved_meta = read_meta(path)
        check_compatible(path, saved_meta, self.meta, b)
        try:
            b.load(path, model, optimizer)
            scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
            saved = json.loads((path / "trainer_state.json").read_text())
            progress = Progress.from_dict(saved)
            rank_file = path / f"rank{b.rank}.pt"
            rank = torch.load(rank_file, weights_only=True) if rank_file.exists() else None
            same_world = saved_meta.get("world_size") == b.world_size
            progress.log_loss, progress.log_count = _resumed_window(path, b.rank, rank, same_world)
        except CheckpointError:
            raise
        except Exception as err:  # safetensors/pickle/JSON errors on damaged files
            raise CheckpointError(
                f"checkpoint {str(path)!r} is corrupt or truncated ({type(err).__name__}: {first_error_line(err)}); "
                "resume from an earlier checkpoint-STEP folder"
            ) from None
        if rank is not None:
            set_rng_state(rank)
        return progress


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
            discard(p)


# ---- resume -----------------------------------------------------------------------------------
def find_checkpoint(resume: str, output_dir: str) -> Path:
    """`latest`: the checkpoint the `latest` pointer names (else the newest complete one); or a path."""
    check_no_clashes(output_dir)  # a folder named `latest` is the user's: the resumed run's saves would replace it
    if resume in LATEST:
        out = Path(output_dir)
        if not out.exists():  # most often a run folder moved or renamed: its config.yaml still names the old place
            raise CheckpointError(
                f"output dir {str(out)!r} does not exist, so it holds no checkpoint to resume from; if the run's "
                "folder moved, pass its new place with --output-dir"
            )
        named = _named_by_latest(out / "latest")
        if named and (out / named / MANIFEST).exists():
            return out / named
        ckpts = list_checkpoints(out)
        if not ckpts:
            raise CheckpointError(
                f"no complete checkpoint in {str(out)!r} to resume from; train with --save-steps N or "
                "--save-strategy epoch first (a run stopped before its first checkpoint starts again with --overwrite)"
            )
        return ckpts[-1]
    path = Path(resume)
    if not path.is_dir():
        # `train --resume epochs=3`: the flag took the override (or config) after it as its checkpoint
        taken = "=" in resume or resume.lower().endswith((".yaml", ".yml"))
        hint = "; --resume takes the word after it: put the config and key=value overrides before it" if taken else ""
        raise CheckpointError(
            f"checkpoint {resume!r} does not exist; pass a checkpoint-STEP folder or --resume latest{hint}"
        )
    if not (path / MANIFEST).exists():
        raise CheckpointError(
            f"{resume!r} is not a complete tuneforge checkpoint (no {MANIFEST}: not a checkpoint, or its write did "
            "not finish); "
            "pass a checkpoint-STEP folder"
        )
    return path


def resume_advice(out: Path, step: int) -> str:
    """What a run that stopped at `step` for want of room for its checkpoint does once there is room: continue from
    the checkpoint --resume latest takes, or (none written) start again."""
    named = _named_by_latest(out / "latest")
    whole = [out / named] if named and (out / named / MANIFEST).exists() else list_checkpoints(out)
    if not whole:
        return f", then train again with --overwrite (the run stopped at step {step}, and wrote no checkpoint)"
    return f", then continue the run from {whole[-1].name} with --resume latest (it stopped at step {step})"


def _named_by_latest(pointer: Path) -> str | None:
    """The checkpoint-STEP name the `latest` pointer holds; None where it is missing, unreadable or holds anything
    else (a crash or a hand edit left it so: the newest complete checkpoint is taken instead)."""
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if CHECKPOINT_NAME.fullmatch(name) else None


def check_resumable(config) -> None:
    """Before any data is read or model loaded: --resume names a complete checkpoint of this run's task and of
    this kind of model (labels, sizes and weights are checked again on load)."""
    path = find_checkpoint(config.resume, config.output_dir)
    meta = read_meta(path)
    check_same_optimizer(path, config)
    check_backend_reads(path, meta, config)
    now = {"task": config.task}
    model_config = Path(config.model or "") / "config.json"
    if config.model and model_config.is_file():
        try:
            now["model_type"] = json.loads(model_config.read_text()).get("model_type")
        except (OSError, ValueError):
            pass  # the model check says what is wrong with that folder
    for key, value in now.items():
        if value and meta.get(key) and meta[key] != value:
            raise CheckpointError(
                f"checkpoint {str(path)!r} does not match this run: {key} is {meta[key]!r} in the checkpoint but "
                f"{value!r} here; resume with the same task, labels and model, or start a new run"
            )
    if not config.data.allow_changed_data:  # the training files it was written from, unchanged
        from tuneforge.data.fingerprint import check_unchanged, fingerprints

        saved = _read_state(path).get("data_fingerprints") or {}
        check_unchanged(saved, fingerprints(config) if saved else {}, str(path))


def check_backend_reads(path: Path, meta: dict, config) -> None:
    """The run's backend can resume the checkpoint's files (an fsdp checkpoint on ddp, a ZeRO-3 one on stage 2
    cannot): one line here, in the launching process, not one per worker from each worker's load."""
    from tuneforge.backends import get_backend
    from tuneforge.launch import dist_env

    backend = get_backend(config, dist_env())
    refused = backend.layout.refusal(backend, path, meta.get("backend"), adapter=bool(meta.get("adapter")))
    if refused:
        raise CheckpointError(refused)


def check_same_optimizer(path: Path, config) -> None:
    """The optimizer's settings of `config` are the checkpoint's: its restored state holds them (the lr in each
    group and the schedule's base), so a changed one would be ignored while the run's config.yaml showed it."""
    import yaml

    try:
        saved = yaml.safe_load((Path(path) / "config.yaml").read_text()).get("optim") or {}
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return  # a checkpoint without its config (or a damaged one): the load says what is wrong
    now = config.optim.model_dump(mode="json")
    for key in RESTORED_OPTIM:
        if key in saved and saved[key] != now[key]:
            raise CheckpointError(
                f"optim.{key} is {saved[key]!r} in the checkpoint's config.yaml but {now[key]!r} here, and a resume "
                f"continues the optimizer state of {str(path)!r}, which holds it; resume with its value"
                f"{new_run_hint(bool(read_meta(path).get('adapter')))}"
            )


def settings_changed(path: Path, config) -> list[str]:
    """The seed, data and task settings (those that may order an epoch or change the loss) whose value in the
    checkpoint's config.yaml is not `config`'s, each as 'KEY is OLD in its config.yaml, NEW here' (none where it has
    no config)."""
    import yaml

    from tuneforge.tracking import flat_config

    try:
        saved = flat_config(yaml.safe_load((Path(path) / "config.yaml").read_text()))
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return []
    now = flat_config(config.to_dict())
    keys = [k for k in now if (k == "seed" or k.startswith(("data.", "task_options."))) and k not in ORDER_FREE]
    return [
        f"{k} is {json.dumps(saved.get(k))} in its config.yaml, {json.dumps(now[k])} here"
        for k in keys
        if saved.get(k) != now[k]
    ]


def _read_state(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return {}  # the load says what is wrong with it


def read_meta(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "meta.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt: meta.json is unreadable ({type(err).__name__})"
        ) from None


def check_compatible(path: Path, saved: dict, now: dict, backend) -> None:
    """Refuse a checkpoint (meta.json `saved`) that is not of this run (`now`) or that `backend` cannot read."""
    for key in CHECK_KEYS:
        if saved.get(key) != now.get(key):
            raise CheckpointError(
                f"checkpoint {str(path)!r} does not match this run: {key} is {saved.get(key)!r} in the checkpoint "
                f"but {now.get(key)!r} here; resume with the same task, labels and model, or start a new run"
            )
    if saved.get("adapter") != now.get("adapter"):
        raise CheckpointError(_adapter_mismatch(path, saved.get("adapter"), now.get("adapter")))
    trained, trains = saved.get("trained_tensors"), now.get("trained_tensors")
    if trained is not None and trained != trains:  # checkpoints before this key: not checked
        raise CheckpointError(
            f"checkpoint {str(path)!r} trained {trained} weight tensors but this run trains {trains}: resume "
            "with the --freeze-layers and --freeze-embeddings it was saved with (its config.yaml has them)"
        )
    refused = backend.layout.refusal(backend, path, saved.get("backend"), adapter=bool(saved.get("adapter")))
    if refused:
        raise CheckpointError(refused)


def _adapter_mismatch(path: Path, saved: dict | None, now: dict | None) -> str:
    """Why a checkpoint's adapter (meta.json: Adapter.settings) is not this run's, in one line."""
    if saved and now and _adapter_words(saved) == _adapter_words(now):  # the same adapter on other base weights
        return (
            f"checkpoint {str(path)!r} holds adapters trained on other base weights than this run's --model "
            "(fingerprints differ); resume with the base model of its config.yaml"
        )
    return (
        f"checkpoint {str(path)!r} was trained with {_adapter_words(saved)} but this run has "
        f"{_adapter_words(now)}; resume with the --adapter and --lora-* flags of its config.yaml"
    )


def _adapter_words(adapter: dict | None) -> str:
    """'adapter lora r=16 alpha=32 targets=q_proj,v_proj' (its base's fingerprint left out), or 'no adapter'."""
    if not adapter:
        return "no adapter"
    settings = [
        f"{key}={_setting_text(value)}"
        for key, value in adapter.items()
        if key not in ("type", "base_fingerprint") and value not in (None, [])
    ]
    return " ".join([f"adapter {adapter.get('type', '?')}", *settings])


def _setting_text(value) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)  # --lora-alpha 8 is stored as 8.0


def _resumed_window(path: Path, rank: int, state: dict | None, same_world: bool) -> tuple[float, float]:
    """The logging window of this rank; after a world-size change rank 0 takes the whole window."""
    if same_world:
        return tuple(state["log_window"].tolist()) if state and "log_window" in state else (0.0, 0.0)
    if rank != 0:
        return 0.0, 0.0
    total = torch.zeros(2)
    for f in path.glob("rank*.pt"):
        total += torch.load(f, weights_only=True).get("log_window", torch.zeros(2))
    return tuple(total.tolist())
