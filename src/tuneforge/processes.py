"""Child processes that end with the process that forked them: on Linux the kernel sends them SIGTERM when it ends,
however it ends (even by SIGKILL), so none outlives it holding its files and locks; and the cores this process may
give its children (`usable_cores`)."""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def end_with_parent(parent: int) -> None:
    """Called in a forked child: it gets SIGTERM when `parent` (the forking thread's process) ends (Linux, prctl
    PR_SET_PDEATHSIG); it exits at once where the parent ended before the call."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)


def usable_cores() -> int:
    """The cores this process may run on: its affinity (taskset, a container's cpuset), not the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
