"""Timing a whole process for the end-to-end benchmarks (sft_vs_trl.py, embedding_vs_st.py): wall time from start
to exit, its peak resident memory, and what it printed."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def timed(cmd: list[str], log: Path) -> tuple[float, int, str]:
    """(wall s, peak RSS MiB, stdout) of a whole process; its stderr goes to `log`; a failure stops the benchmark."""
    start = time.perf_counter()
    with open(log, "w") as err, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True) as proc:
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed; see {log}:\n{log.read_text()[-3000:]}")
    return wall, round(usage.ru_maxrss / 1024), stdout
