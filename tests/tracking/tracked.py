"""What the tracker tests share (tests/tracking/; a helper module, not a conftest.py, so that `from conftest import`
keeps naming tests/conftest.py): the tiny job each tracker's run is made of, crashed by a SIGKILL after a checkpoint
and resumed (test_crash.py's kill and start), the records a tracker must hold by metrics.jsonl, and a reader of W&B's
offline `.wandb` files.

The job: tiny_bert on 32 sentiment rows, batch 8 (4 steps), the loss logged every step, an evaluation every 3 steps
and a checkpoint every 2. It is SIGKILLed as it starts to save step 4, so the records of steps 3 (train, eval) and 4
were logged after checkpoint 2; the resume re-runs steps 3 and 4 and logs them again.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from conftest import read_jsonl, sentiment_split, train_command
from test_crash import kill_in_save, start

KILLED_AT = 4  # the save of this step is where the first attempt dies
LAST_CHECKPOINT = 2  # what the resume continues from


def job_flags(folder: Path, tiny_bert: str, cache_dir: str, *report_to: str, **flags) -> list[str]:
    """`train` flags of the tiny job (data written into `folder`), reporting to `report_to`."""
    files = sentiment_split(folder, 32, 8)
    run = dict(epochs=1, batch_size=8, logging_steps=1, eval_strategy="steps", eval_steps=3, save_steps=2)
    run.update(precision="fp32", cache_dir=cache_dir, quiet=True, json=True, **flags)
    return train_command(files, tiny_bert, **run) + ["--report-to", ",".join(report_to)]


def prepare_forks() -> None:
    """What the job's processes import, imported here once (seconds each) so that each child forked from this process
    has it: the trainer, the task, BERT's model code, DeepSpeed (which transformers' save_pretrained imports where it is
    installed) and W&B (no threads start on import). Not trackio: it fixes its folder (TRACKIO_DIR) on import."""
    import importlib.util

    import transformers.models.bert.modeling_bert  # noqa: F401

    import tuneforge.tasks.classification  # noqa: F401
    import tuneforge.trainer  # noqa: F401

    for optional in ("deepspeed", "wandb"):
        if importlib.util.find_spec(optional) is not None:
            importlib.import_module(optional)


def crash_and_resume(flags: list[str], out: Path, logs: Path, between=None) -> tuple[str, str]:
    """The job killed at the save of step KILLED_AT, then resumed to its end; the resumed attempt's (stdout,
    stderr). `between()` is called after the kill: what the killed attempt left (it must hold records of the steps
    after the checkpoint, or a test that they are not logged twice could not fail)."""
    prepare_forks()
    logs.mkdir(parents=True, exist_ok=True)
    kill_in_save(flags, out, logs / "killed.log", "start", KILLED_AT, logs / "paused")
    assert (out / "latest").read_text().strip() == f"checkpoint-{LAST_CHECKPOINT}"
    if between is not None:
        between()
    proc = start([*flags, "--resume"], out, logs / "resumed.log")
    assert proc.wait() == 0, (logs / "resumed.log").read_text()[-3000:]
    return (logs / "resumed.log").with_suffix(".out").read_text(), (logs / "resumed.log").read_text()


def expected_histories(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """What a tracker run of the job must hold: by `SPLIT/KEY`, the (step, value) of every numeric value of
    metrics.jsonl (not `step`, nor the wall-clock `time_s`, which a re-run step does not reproduce), in its order.
    Asserts each step is in metrics.jsonl once per key."""
    found: dict[str, list[tuple[int, float]]] = {}
    for record in read_jsonl(run_dir / "metrics.jsonl"):
        for key, value in record.items():
            if (
                key not in ("step", "split", "time_s")
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
            ):
                found.setdefault(f"{record.get('split', 'train')}/{key}", []).append((record["step"], value))
    for key, points in found.items():
        steps = [step for step, _ in points]
        assert steps == sorted(set(steps)), f"{key}: metrics.jsonl itself logs a step twice: {steps}"
    return found


def flattened(values: dict, prefix: str = "") -> dict:
    """A config's nested values as {dotted key: value}, each as the YAML holds it (W&B's and trackio's config)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out.update(flattened(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def as_params(flat: dict) -> dict[str, str]:
    """Flattened config values as MLflow's params hold them: text as is, anything else as JSON."""
    return {key: value if isinstance(value, str) else json.dumps(value) for key, value in flat.items()}


# ---- W&B's offline files -----------------------------------------------------------------------
# A .wandb file is W&B's transaction log: a 7-byte header (":W&B", magic, version), then LevelDB-log-style blocks of
# 32 KiB, each record a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes, each
# record a `wandb_internal_pb2.Record` (wandb >= 0.19 ships no Python reader of it; the protobuf is wandb's own).
BLOCK = 32768


def wandb_records(path: Path):
    """The `Record` messages of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a .wandb file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_folders(wandb_dir: Path) -> list[Path]:
    """The offline run folders under WANDB_DIR, oldest first."""
    return sorted((wandb_dir / "wandb").glob("offline-run-*"))


def wandb_history(folder: Path) -> list[tuple[int, dict]]:
    """(step, {key: value}) of each history row an offline run folder holds (W&B's own `_...` keys left out)."""
    rows = []
    for record in wandb_records(next(folder.glob("run-*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.append((record.history.step.num, {k: v for k, v in items.items() if not k.startswith("_")}))
    return rows


def wandb_kinds(folder: Path) -> list[str]:
    """The kinds of the records of an offline run folder's .wandb file, in order."""
    return [record.WhichOneof("record_type") for record in wandb_records(next(folder.glob("run-*.wandb")))]


def run_ids_in_checkpoint(run_dir: Path, step: int) -> dict[str, str]:
    return json.loads((run_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())["tracker_runs"]


def forget_tracker_run(checkpoint: Path, tracker: str) -> None:
    """`checkpoint` as if `tracker` had no run in it (a checkpoint of before it, or of a job without it): its entry
    left out of trainer_state.json's tracker_runs, and the manifest made to match (it is checked on load)."""
    state_file, manifest_file = checkpoint / "trainer_state.json", checkpoint / "manifest.json"
    state = json.loads(state_file.read_text())
    del state["tracker_runs"][tracker]
    state_file.write_text(json.dumps(state, indent=2))
    data, manifest = state_file.read_bytes(), json.loads(manifest_file.read_text())
    manifest["files"]["trainer_state.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_file.write_text(json.dumps(manifest))


# ---- the job without a server: W&B offline, trackio's local store, TensorBoard -------------------
def offline_environment(root: Path) -> dict[str, str]:
    """W&B offline, its folders and trackio's store under `root` (W&B and trackio read these themselves)."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(root / "wandb-dir"),
        "WANDB_CACHE_DIR": str(root / "wandb-home" / "cache"),
        "WANDB_DATA_DIR": str(root / "wandb-home" / "data"),
        "WANDB_CONFIG_DIR": str(root / "wandb-home" / "config"),
        "TRACKIO_DIR": str(root / "trackio"),
    }


def offline_job(tmp_path_factory, tiny_bert: str, cache_dir: str) -> Path:
    """The tiny job reporting to W&B (offline, --log-model), trackio and TensorBoard; made once a session
    (conftest.made_once) for the three trackers' tests. Three attempts:
    1. SIGKILLed as it saves step 4 (after checkpoint 2, steps 3 and 4 logged);
    2. resumed from checkpoint 2, to its end (step 4, checkpoint 4);
    3. continued from checkpoint 4 with --max-steps 6, that checkpoint holding no trackio run (as one of before trackio,
       or of a job without it): trackio starts a new run, W&B and TensorBoard continue theirs.
    Its folder: run/ (the run), wandb-dir/, trackio/ (the trackers' stores), flags.json (the job's flags)."""
    import pytest

    from conftest import made_once

    def make(root: Path) -> None:
        flags = job_flags(root, tiny_bert, cache_dir, "wandb", "trackio", "tensorboard", log_model=True)
        (root / "flags.json").write_text(json.dumps(flags))
        (root / "wandb-dir").mkdir()

        def killed_attempt_logged_the_steps_after_the_checkpoint():  # what the trackers were sent, too
            records = read_jsonl(root / "run" / "metrics.jsonl")
            assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]

        with pytest.MonkeyPatch.context() as env:  # the forked job's processes inherit it
            for key, value in offline_environment(root).items():
                env.setenv(key, value)
            crash_and_resume(flags, root / "run", root / "logs", killed_attempt_logged_the_steps_after_the_checkpoint)
            forget_tracker_run(root / "run" / "checkpoint-4", "trackio")
            proc = start([*flags, "--resume", "--max-steps", "6"], root / "run", root / "logs" / "continued.log")
            assert proc.wait() == 0, (root / "logs" / "continued.log").read_text()[-3000:]

    return made_once(tmp_path_factory, "tracking-offline-job", make)
