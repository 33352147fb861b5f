"""Timing a whole process for the end-to-end benchmarks (sft_vs_trl.py, embedding_vs_st.py): wall time from start
to exit, its peak resident memory, and what it printed; `tree_memory` samples a process tree's anonymous memory
(what must fit in RAM, apart from the file pages the kernel can drop)."""

from __future__ import annotations

import os
import subprocess
import threading
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


class tree_memory:
    """Samples, every `every` s while in use, the anonymous memory of this process's children and their descendants
    (the sum of their proportional shares, `Pss_Anon`, so that pages a fork shares count once) and keeps the peak,
    with the file-backed share (`Pss_File`: mapped files, reclaimable) at that moment; in MiB."""

    def __init__(self, every: float = 0.2) -> None:
        self.every, self.peak_anon_mib, self.file_mib_then = every, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> tree_memory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            anon = file = 0
            for pid in _descendants(os.getpid()):
                share = _pss(pid)
                anon, file = anon + share.get("Pss_Anon", 0), file + share.get("Pss_File", 0)
            if anon > self.peak_anon_mib:
                self.peak_anon_mib, self.file_mib_then = anon, file


def _descendants(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                for child in map(int, fh.read().split()):
                    out += [child, *_descendants(child)]
    except OSError:  # gone meanwhile
        pass
    return out


def _pss(pid: int) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            rows = [line.split() for line in fh if line.startswith(("Pss_Anon", "Pss_File"))]
    except OSError:
        return {}
    return {row[0].rstrip(":"): int(row[1]) >> 10 for row in rows}
