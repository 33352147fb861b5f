"""stops: kill's SIGTERM and a closed terminal's SIGHUP stop a command as Ctrl-C does (a KeyboardInterrupt that says
which signal), real signals sent to this process; what nohup ignores stays ignored."""

import contextlib
import os
import signal
import time

import pytest

from tuneforge import stops


@contextlib.contextmanager
def handlers_set(**handlers):
    """The stop signals' handlers set as given for the block (SIGTERM=signal.SIG_DFL), then set back."""
    before = {sig: signal.getsignal(sig) for sig in stops.STOP_SIGNALS}
    try:
        for name, handler in handlers.items():
            signal.signal(getattr(signal, name), handler)
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_stop_signal_is_a_keyboard_interrupt_in_the_block_only(sig, code):
    with handlers_set(SIGTERM=signal.SIG_DFL, SIGHUP=signal.SIG_DFL):
        with pytest.raises(KeyboardInterrupt) as stopped, stops.stopping_as_ctrl_c():
            os.kill(os.getpid(), sig)
            time.sleep(5)  # (the handler runs at once: the sleep is cut short)
        assert isinstance(stopped.value, stops.StoppedBySignal) and stopped.value.exit_code == code
        assert str(stopped.value) == f"stopped by {signal.Signals(sig).name}"
        assert [signal.getsignal(s) for s in stops.STOP_SIGNALS] == [signal.SIG_DFL, signal.SIG_DFL]


def test_a_signal_ignored_or_handled_already_is_left_as_it_is():
    """nohup's SIGHUP ignored: a run started so goes on when its terminal closes."""
    own = lambda signum, frame: None  # noqa: E731
    with handlers_set(SIGTERM=own, SIGHUP=signal.SIG_IGN), stops.stopping_as_ctrl_c():
        assert signal.getsignal(signal.SIGTERM) is own and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.05)


def test_a_second_ctrl_c_while_the_stopped_command_ends_is_ignored(tmp_path, tiny_bert, cache_dir):
    """Ctrl-C pressed again after 'interrupted' (the libraries' exit handlers and `train --nproc`'s teardown take
    seconds) was a KeyboardInterrupt's traceback from an exit handler, or the process died by SIGINT (exit -2);
    the command's process ignores it and ends with its status. The child's second after main() is such an ending."""
    import sys

    from conftest import Forked, sentiment_split, train_command
    from tuneforge.cli import main

    out, log = tmp_path / "run", tmp_path / "log"
    args = train_command(sentiment_split(tmp_path, 32, 8), tiny_bert, output_dir=out, cache_dir=cache_dir)

    def the_command() -> int:
        sys.argv = ["tuneforge", *args, "--max-steps", "100000"]  # main() reads them, as the program does
        code = main()
        time.sleep(1)
        return code

    with open(log, "w") as err:
        proc = Forked(the_command, err.fileno(), err.fileno(), env={"OMP_NUM_THREADS": "1"})
    try:
        for wanted in (lambda: (out / "metrics.jsonl").exists(), lambda: "interrupted" in log.read_text()):
            deadline = time.monotonic() + 120
            while not wanted():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.02)
            os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 130
    finally:
        proc.kill()
    assert "Traceback" not in log.read_text() and log.read_text().strip().splitlines()[-1] == "interrupted"
