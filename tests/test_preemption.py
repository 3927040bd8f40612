"""Tests for paraml.loop.preemption: real signals sent to this very process (no TensorFlow)."""

from __future__ import annotations

import ast
import ctypes
import doctest
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import paraml.loop.preemption
from paraml.loop.preemption import EXIT_SIGINT, EXIT_SIGTERM, Preempted, PreemptionGuard, exit_code_for

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(autouse=True)
def _keep_handlers() -> Iterator[None]:
    """Every test starts with Python's usual handlers (SIGINT may be ignored in a background run) and ends with the
    handlers it found, so a failing test cannot leave this process without its SIGTERM disposition."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _deliver(sig: int) -> None:
    """Send ``sig`` to this process; Python runs the handler at the next bytecode of the main thread."""
    os.kill(os.getpid(), sig)
    time.sleep(0.01)


def test_sigterm_is_recorded_and_the_process_goes_on() -> None:
    with PreemptionGuard() as guard:
        assert guard.active and not guard.requested and guard.signum is None and guard.exit_code is None
        _deliver(signal.SIGTERM)
        assert guard.requested
        assert guard.signum == signal.SIGTERM
        assert guard.signal_name == "SIGTERM"
        assert guard.exit_code == 143 == EXIT_SIGTERM
        assert guard.seconds_since_request is not None and guard.seconds_since_request >= 0
    assert not guard.active


def test_sigint_is_recorded_instead_of_keyboard_interrupt() -> None:
    with PreemptionGuard() as guard:
        _deliver(signal.SIGINT)
        assert guard.requested and guard.signal_name == "SIGINT" and guard.exit_code == 130 == EXIT_SIGINT


def test_second_sigint_while_pending_is_a_keyboard_interrupt() -> None:
    with PreemptionGuard() as guard:
        _deliver(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            _deliver(signal.SIGINT)
    assert guard.signum == signal.SIGINT  # the first request stands


def test_sigint_after_sigterm_force_quits_too() -> None:
    with PreemptionGuard() as guard, pytest.raises(KeyboardInterrupt):
        _deliver(signal.SIGTERM)
        _deliver(signal.SIGINT)
    assert guard.signum == signal.SIGTERM


def test_repeated_sigterm_keeps_the_first_request() -> None:
    with PreemptionGuard() as guard:
        _deliver(signal.SIGTERM)
        first = guard.seconds_since_request
        _deliver(signal.SIGTERM)  # no exception, no change
        assert guard.signum == signal.SIGTERM
        assert guard.seconds_since_request >= first


def test_previous_handlers_are_restored_even_after_an_exception() -> None:
    seen: list[int] = []

    def mine(signum: int, frame: object) -> None:
        seen.append(signum)

    signal.signal(signal.SIGTERM, mine)
    with pytest.raises(ZeroDivisionError), PreemptionGuard():
        assert signal.getsignal(signal.SIGTERM) is not mine
        1 / 0  # noqa: B018
    assert signal.getsignal(signal.SIGTERM) is mine
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    _deliver(signal.SIGTERM)
    assert seen == [signal.SIGTERM]  # the signal reaches the old handler, not the guard


def test_after_the_block_sigint_is_a_keyboard_interrupt_again() -> None:
    with PreemptionGuard() as guard:
        _deliver(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        _deliver(signal.SIGINT)
    assert guard.requested  # the state stays readable after the block


def test_an_ignored_signal_stays_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with PreemptionGuard() as guard:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        _deliver(signal.SIGINT)
        assert not guard.requested
        _deliver(signal.SIGTERM)
        assert guard.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def _natively_ignored(sig: int) -> bool:
    """Whether the kernel ignores ``sig`` for this process (Linux: the SigIgn mask in /proc/self/status)."""
    status = Path("/proc/self/status").read_text()
    mask = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    return bool(mask & (1 << (sig - 1)))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_a_handler_installed_outside_python_is_restored() -> None:
    """TensorFlow's multi-worker strategy installs a native SIGTERM handler that signal.getsignal cannot see."""
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(signal.SIGTERM, 1)  # SIG_IGN, behind Python's back
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and _natively_ignored(signal.SIGTERM)
    with PreemptionGuard() as guard:
        assert not _natively_ignored(signal.SIGTERM)
        _deliver(signal.SIGTERM)
        assert guard.requested
    assert _natively_ignored(signal.SIGTERM)  # back as it was, not SIG_DFL
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_only_the_chosen_signals_are_caught() -> None:
    with PreemptionGuard(signals=[signal.SIGTERM]) as guard:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            _deliver(signal.SIGINT)
        assert not guard.requested
    with pytest.raises(ValueError, match="at least one signal"):
        PreemptionGuard(signals=[])


def test_in_a_thread_it_is_a_no_op_that_never_reports() -> None:
    received: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    outer = signal.getsignal(signal.SIGTERM)
    entered, done = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def worker() -> None:
        with PreemptionGuard() as guard:
            seen["active"] = guard.active
            seen["handler_is_outer"] = signal.getsignal(signal.SIGTERM) is outer
            entered.set()
            done.wait(30)
            seen["requested"] = guard.requested

    thread = threading.Thread(target=worker)
    thread.start()
    assert entered.wait(30)
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(600):
        if received:
            break
        time.sleep(0.05)
    done.set()
    thread.join(30)
    assert received == [signal.SIGTERM]  # the main thread's handler got it
    assert seen == {"active": False, "handler_is_outer": True, "requested": False}
    assert signal.getsignal(signal.SIGTERM) is outer


def test_request_by_hand_and_the_exception() -> None:
    guard = PreemptionGuard()
    with pytest.raises(RuntimeError, match="no stop was requested"):
        guard.exception()
    with guard:
        guard.request(signal.SIGTERM)  # e.g. another worker was signalled
        guard.request(signal.SIGINT)  # ignored: the first request stands
        error = guard.exception(checkpoint="/ckpt/ckpt-000002", epoch=2, step=5)
    assert isinstance(error, SystemExit) and isinstance(error, Preempted)
    assert error.code == 143 and error.signum == signal.SIGTERM and error.signal_name == "SIGTERM"
    assert (error.checkpoint, error.epoch, error.step) == ("/ckpt/ckpt-000002", 2, 5)
    assert str(error) == "stopped by SIGTERM at epoch 2, step 5; checkpoint saved to /ckpt/ckpt-000002 (exit code 143)"
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.code, copy.signum, copy.checkpoint, copy.step) == (143, signal.SIGTERM, "/ckpt/ckpt-000002", 5)


def test_entering_an_active_guard_again_fails_and_a_new_one_nests() -> None:
    with PreemptionGuard() as outer:
        with pytest.raises(RuntimeError, match="already active"), outer:
            pass
        assert outer.active
        with PreemptionGuard() as inner:
            _deliver(signal.SIGTERM)
        assert inner.requested and not outer.requested
        _deliver(signal.SIGTERM)  # back to the outer guard's handler
        assert outer.requested
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_guard_can_be_used_again_and_starts_clean() -> None:
    guard = PreemptionGuard()
    with guard:
        _deliver(signal.SIGTERM)
    with guard:
        assert not guard.requested


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_exit_code_for(sig: int, code: int) -> None:
    assert exit_code_for(sig) == code == Preempted(sig).code


@pytest.mark.parametrize("bad", [0, -15, signal.NSIG, 1.5, True, "SIGTERM"])
def test_exit_code_for_rejects_non_signals(bad: object) -> None:
    with pytest.raises(ValueError, match="signal number"):
        exit_code_for(bad)  # type: ignore[arg-type]


LOOP = """
import sys, time
from pathlib import Path
from paraml.loop.preemption import PreemptionGuard

out = Path(sys.argv[1])
with PreemptionGuard() as guard:
    (out / "ready").write_text("1")
    for step in range(6000):          # a training loop of 10 ms steps, at most ~60 s
        time.sleep(0.01)
        if guard.requested:           # the step boundary: save, then exit with the documented code
            (out / "saved").write_text(str(step))
            error = guard.exception(checkpoint=str(out / "saved"), step=step)
            print(error, file=sys.stderr)  # SystemExit with an int code prints nothing itself
            raise error
sys.exit(0)
"""


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_process_stops_saves_and_exits_with_the_code(tmp_path: Path, sig: int, code: int) -> None:
    """In a real process: signal -> stop at a step boundary -> save -> exit 128+signum, no traceback."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    # SIGINT may be ignored in a background test run (and children inherit that): start from Python's default.
    launcher = textwrap.dedent(
        f"""
        import runpy, signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = [{str(script)!r}, {str(tmp_path)!r}]
        runpy.run_path({str(script)!r}, run_name="__main__")
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher], env=env, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):
            if (tmp_path / "ready").exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1]
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, stderr
    assert (tmp_path / "saved").exists()
    assert "Traceback" not in stderr
    assert f"stopped by {signal.Signals(sig).name}" in stderr


def test_docstring_examples_run() -> None:
    result = doctest.testmod(paraml.loop.preemption, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 10 and result.failed == 0


def test_module_does_not_import_tensorflow() -> None:
    tree = ast.parse(Path(paraml.loop.preemption.__file__).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert "signal" in imported
    assert imported.isdisjoint({"tensorflow", "keras"})
