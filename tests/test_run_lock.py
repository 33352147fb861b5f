"""One run at a time in an output dir: a second run into a folder whose run is still going (a fresh one, one with
--overwrite, a --resume) stops with one line and leaves that run's files alone; a killed run's lock is gone."""

import os
import signal
import time

import pytest

from conftest import Forked, cli_flags, cli_main, sentiment_split, train_command
from tuneforge import run_lock
from tuneforge.cli import main
from tuneforge.errors import ConfigError

IN_USE = "is in use by another tuneforge run that is still going"


def test_a_lock_is_held_once_and_a_folder_it_made_goes_when_left_empty(tmp_path):
    out = tmp_path / "run"
    first = run_lock.take(out)
    with pytest.raises(ConfigError, match=IN_USE):
        run_lock.take(out)
    first.release()
    assert not out.exists()  # taking the lock made it; the run wrote nothing
    again = run_lock.take(out)
    (out / "config.yaml").write_text("a run's file\n")
    again.release()
    assert (out / "config.yaml").exists()
    run_lock.take(out).release()  # released: free again, and a folder it did not make stays
    assert out.is_dir()
    run_lock.take(tmp_path / "new" / "parents" / "run").release()  # the parents it made for the folder go too
    assert not (tmp_path / "new").exists()


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_here(capsys, *args):
    """`tuneforge ARGS` in this process: (exit code, last stderr line)."""
    capsys.readouterr()  # what the test printed before
    code, _, err = cli_main(capsys, *args)
    assert "Traceback" not in err
    return code, (err.strip().splitlines() or [""])[-1]


def test_a_second_run_into_a_folder_in_use_is_refused_until_the_first_is_gone(tmp_path, tiny_bert, cache_dir, capsys):
    # 96 rows, batch 16: 6 steps an epoch; checkpoints at 3 and 6, the first run paused in the save of step 6
    run = cli_flags(epochs=1, batch_size=16, cache_dir=cache_dir, save_strategy="steps", save_steps=3)
    flags = [*train_command(sentiment_split(tmp_path, 96, 33), tiny_bert), *run, "--output-dir", str(tmp_path / "out")]
    out, marker, log = tmp_path / "out", tmp_path / "paused", tmp_path / "first.log"
    pause = dict(TUNEFORGE_PAUSE_IN_SAVE="600", TUNEFORGE_PAUSE_STAGE="start", TUNEFORGE_PAUSE_STEP="6")
    with open(log, "w") as stderr:
        first = Forked(
            lambda: main(flags), stderr.fileno(), stderr.fileno(), env={**pause, "TUNEFORGE_PAUSE_MARKER": str(marker)}
        )
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.1)
    before = snapshot(out)
    for extra in (["--overwrite"], ["--resume"], ["--resume", str(out / "checkpoint-3")], []):
        code, line = run_here(capsys, *flags, *extra)
        assert code == 2 and IN_USE in line, (extra, line)
    assert snapshot(out) == before  # the first run's config, metrics and checkpoint as it left them
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    code, line = run_here(capsys, *flags, "--resume")  # the kernel dropped the killed run's lock
    assert code == 0, line
    assert (out / "model" / "config.json").exists()
