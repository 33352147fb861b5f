"""How a command stops on kill's SIGTERM (a scheduler's: Slurm, Kubernetes) and a closed terminal's SIGHUP: as on
Ctrl-C, by an exception (`StoppedBySignal`, a KeyboardInterrupt) that unwinds the command, so what it was writing
(a checkpoint's, the export's, predict's temporaries) is removed and its run folder stays resumable, then one line
and exit status 128 + the signal's number, as a process killed by it (and `train --nproc`'s launcher) exits. Also:
how a forked helper (a tokenization worker) ends on those signals (`exit_on_stop_in_child`), and that a stopped
command's process ignores further stops while it ends (`ignore_further_stops`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class StoppedBySignal(KeyboardInterrupt):
    """The command was stopped by `signum`; whatever takes Ctrl-C takes this too."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.exit_code = 128 + signum

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}"


def _raise_stop(signum, _frame) -> None:
    raise StoppedBySignal(signum)


@contextlib.contextmanager
def stopping_as_ctrl_c():
    """Within the block, the stop signals raise `StoppedBySignal` in the main thread. A signal this process was
    started ignoring (nohup's SIGHUP) stays ignored, and one whose handler is already set stays the caller's."""
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) == signal.SIG_DFL:
                handlers[sig] = signal.signal(sig, _raise_stop)
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def exit_on_stop_in_child(before_exit: Callable[[], None]) -> None:
    """In a forked helper (a tokenization worker), which gets SIGTERM when its parent ends or stops it: a stop signal
    runs `before_exit`, then ends it by SystemExit, not in the parent's code it inherited, letting go of the locks
    it holds on the way (killed at once, a pool worker waiting for a task kept its pool's task queue locked, and the
    pool's terminate waited for ever); multiprocessing ends on a SystemExit without a word. A signal ignored (nohup's
    SIGHUP) stays ignored."""

    def exit_on_stop(signum, _frame) -> None:
        before_exit()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_on_stop)
    if signal.getsignal(signal.SIGHUP) in (_raise_stop, signal.SIG_DFL):
        signal.signal(signal.SIGHUP, exit_on_stop)


def ignore_further_stops() -> None:
    """After the command has stopped and said so, in the process it ran in: another Ctrl-C or stop signal while the
    process ends (the libraries' exit handlers, a launcher's teardown: a few seconds) is ignored, not a
    KeyboardInterrupt's traceback from an exit handler or a death by the signal (exit -2). Ignored, not handled:
    Python sets handled signals back to their default as it finalizes."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, *STOP_SIGNALS):
            signal.signal(sig, signal.SIG_IGN)
