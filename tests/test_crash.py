"""Crash safety: a run SIGKILLed at several points, three of them inside checkpoint writes, resumes
each time from the last committed checkpoint and ends with the uninterrupted run's final weights.

The kill points are reached deliberately with the save's test hook: TUNEFORGE_PAUSE_IN_SAVE makes
the writer sleep at a stage of the save of one step and write a marker file; the test then kills
the process with SIGKILL (no cleanup of any kind runs).
"""

import json
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import Forked, cli_flags, sentiment_split, train_command
from tuneforge import checkpoint


@pytest.fixture(scope="module")
def crash_setup(tmp_path_factory, tiny_bert, cache_dir):
    d = tmp_path_factory.mktemp("crash")
    # 96 rows, batch 16: 6 steps per epoch, 12 steps; checkpoints at 3, 6, 9, 12
    run = cli_flags(epochs=2, batch_size=16, lr="1e-3", cache_dir=cache_dir, save_strategy="steps", save_steps=3)
    return d, train_command(sentiment_split(d, 96, 33), tiny_bert, logging_steps=1) + run


def start(flags, out, log, **env):
    """The CLI in a child forked from this process (conftest.Forked: no start-up of the libraries again), its output
    to files; one thread in every run, so all runs reduce floats in the same order."""
    from tuneforge.cli import main

    args = [*flags, "--output-dir", str(out)]
    with open(log.with_suffix(".out"), "w") as stdout, open(log, "w") as stderr:
        return Forked(lambda: main(args), stdout.fileno(), stderr.fileno(), env={"OMP_NUM_THREADS": "1", **env})


def kill_in_save(flags, out, log, stage, step, marker):
    """Run until the save of `step` reaches `stage`, then SIGKILL the process there."""
    assert stop_in_save(flags, out, log, stage, step, marker, signal.SIGKILL) == -signal.SIGKILL


def stop_in_save(flags, out, log, stage, step, marker, stop) -> int:
    """Run until the save of `step` reaches `stage`, then send `stop` to the process there; its exit code."""
    proc = start(
        flags,
        out,
        log,
        TUNEFORGE_PAUSE_IN_SAVE="600",
        TUNEFORGE_PAUSE_STAGE=stage,
        TUNEFORGE_PAUSE_STEP=str(step),
        TUNEFORGE_PAUSE_MARKER=str(marker),
    )
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert proc.poll() is None, f"the run ended before the pause: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, "the run never reached the pause"
        time.sleep(0.1)
    os.kill(proc.pid, stop)
    code = proc.wait(60)
    marker.unlink()
    return code


def resumed_from(log) -> str:
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("resumed from ")]
    assert len(lines) == 1, log.read_text()[-2000:]
    return lines[0].split()[2].rsplit("/", 1)[-1]


def records(out):
    return [
        {k: v for k, v in json.loads(ln).items() if k != "time_s"}
        for ln in (out / "metrics.jsonl").read_text().splitlines()
    ]


def test_sigkill_at_any_point_resumes_to_the_uninterrupted_result(crash_setup, tmp_path):
    d, flags = crash_setup
    reference = tmp_path / "reference"
    proc = start(flags, reference, tmp_path / "reference.log")
    assert proc.wait() == 0, (tmp_path / "reference.log").read_text()[-2000:]

    out, marker = tmp_path / "run", tmp_path / "paused"
    # 1. killed half-way through writing checkpoint 6: only its temporary folder exists
    kill_in_save(flags, out, tmp_path / "1.log", "mid-write", 6, marker)
    partial = list(out.glob(".tmp-checkpoint-6-*"))
    assert len(partial) == 1 and (partial[0] / "optimizer.pt").exists() and not (partial[0] / "manifest.json").exists()
    assert (out / "latest").read_text().strip() == "checkpoint-3"
    assert checkpoint.list_checkpoints(out) == [out / "checkpoint-3"]
    with pytest.raises(checkpoint.CheckpointError, match="not a complete tuneforge checkpoint"):
        checkpoint.find_checkpoint(str(partial[0]), str(out))

    # 2. resumed from 3; killed after checkpoint 6 was renamed into place, before `latest` named it
    kill_in_save(flags + ["--resume"], out, tmp_path / "2.log", "before-latest", 6, marker)
    assert resumed_from(tmp_path / "2.log") == "checkpoint-3"
    assert checkpoint.verify(out / "checkpoint-6") is None and (out / "latest").read_text().strip() == "checkpoint-3"

    # 3. resumed from the committed checkpoint 3 again; killed between checkpoints (steps 7-9 done, 9 not saved)
    kill_in_save(flags + ["--resume"], out, tmp_path / "3.log", "start", 9, marker)
    assert resumed_from(tmp_path / "3.log") == "checkpoint-3"
    assert (out / "latest").read_text().strip() == "checkpoint-6" and not (out / "checkpoint-9").exists()
    assert not list(out.glob(".tmp-checkpoint-*"))  # the next complete save removed the partial folder

    # 4. resumed from 6 and finished
    proc = start(flags + ["--resume"], out, tmp_path / "4.log")
    assert proc.wait() == 0, (tmp_path / "4.log").read_text()[-2000:]
    assert resumed_from(tmp_path / "4.log") == "checkpoint-6"

    final, expected = (
        load_file(str(out / "model" / "model.safetensors")),
        load_file(str(reference / "model" / "model.safetensors")),
    )
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)
    assert records(out) == records(reference)  # per-step losses and learning rates, evaluations
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        "checkpoint-12",
        "checkpoint-3",
        "checkpoint-6",
        "checkpoint-9",
    ]
    assert not list(out.glob(".tmp-*"))


@pytest.mark.parametrize(
    "stop, code, line",
    [
        (signal.SIGINT, 130, "interrupted"),
        (signal.SIGTERM, 143, "error: stopped by SIGTERM"),  # a scheduler's stop (Slurm's, at the time limit)
    ],
)
def test_a_stop_in_a_checkpoint_write_frees_what_it_took(crash_setup, tmp_path, stop, code, line):
    """Ctrl-C while a checkpoint was written left its temporary folder (the weights and optimizer state, gigabytes
    on a large model) until a later save of a resumed run; the save removes it, as on any other failure. SIGTERM
    (a scheduler's stop) killed the run at once, without a word, leaving that folder too (where `train --nproc 2`
    said 'stopped by SIGTERM'); it stops the run as Ctrl-C does, exits 143 (128 + 15), resumable."""
    _, flags = crash_setup
    out, log = tmp_path / "run", tmp_path / "run.log"
    assert stop_in_save(flags, out, log, "mid-write", 6, tmp_path / "paused", stop) == code
    assert log.read_text().strip().splitlines()[-1] == line
    assert not list(out.glob(".tmp-*")) and (out / "latest").read_text().strip() == "checkpoint-3"
    assert checkpoint.list_checkpoints(out) == [out / "checkpoint-3"]
