"""Catch SIGTERM / SIGINT during training so a preempted job can stop at a step boundary and save.

A scheduler that preempts a job (Slurm, Kubernetes, a spot-instance reclaim, ``paraml launch`` stopping its
workers) sends SIGTERM and waits a grace period (often 30 s) before SIGKILL. A terminal sends SIGINT on Ctrl-C.
:class:`PreemptionGuard` turns either into a flag the training loop polls once per step; the loop then saves a
checkpoint at that step, runs ``on_train_end`` and raises :class:`Preempted`, whose exit code
(:func:`exit_code_for`: 128 + the signal number, as shells report it: 143 for SIGTERM, 130 for SIGINT) says
"stopped by a signal, after saving a checkpoint".

Rules:

- Handlers are installed only in the main thread (Python allows nothing else). In any other thread the guard is a
  no-op: it installs nothing and never reports a request (unless :meth:`PreemptionGuard.request` is called).
- A signal whose disposition is ``SIG_IGN`` when the guard starts stays ignored (``nohup``, background jobs of a
  non-interactive shell): the guard does not make a process receive what its parent chose to hide from it.
- A second SIGINT while a stop is pending raises ``KeyboardInterrupt`` at once, so a user can still force-quit a
  process whose save hangs. Further SIGTERMs only repeat the request.
- On exit the previous handlers are restored, whatever happened inside, including handlers installed outside
  Python: TensorFlow's ``MultiWorkerMirroredStrategy`` installs a native SIGTERM handler (its preemption notifier)
  that ``signal.getsignal`` does not show and that keeps a worker alive on SIGTERM. Inside the block the guard
  replaces it; on exit it is put back as it was (``sigaction`` through ctypes, on Linux and macOS).

This module does not import TensorFlow.

Example (runnable; the signal is sent to this very process):

    >>> import os, signal
    >>> from paraml.loop.preemption import PreemptionGuard, Preempted
    >>> with PreemptionGuard() as guard:
    ...     os.kill(os.getpid(), signal.SIGTERM)   # what a scheduler does
    ...     guard.requested, guard.signal_name
    (True, 'SIGTERM')
    >>> err = Preempted(guard.signum)             # the loop raises this after saving
    >>> err.code
    143
"""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
import time
from collections.abc import Iterable
from types import FrameType, TracebackType
from typing import Any

from paraml.checks import check_int

__all__ = [
    "EXIT_SIGINT",
    "EXIT_SIGTERM",
    "Preempted",
    "PreemptionGuard",
    "exit_code_for",
]

EXIT_SIGTERM: int = 128 + signal.SIGTERM
"""143: the process stopped on SIGTERM after saving a checkpoint (128 + 15, as a shell reports it)."""

EXIT_SIGINT: int = 128 + signal.SIGINT
"""130: the process stopped on SIGINT (Ctrl-C) after saving a checkpoint (128 + 2)."""

_DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)


def exit_code_for(signum: int) -> int:
    """The exit code of a process stopped by signal ``signum`` after saving: ``128 + signum``.

    The same number a shell shows for a process killed by that signal (``$?``), and the one ``paraml launch``
    reports for a worker, so the two cases read alike.

    Example:
        >>> import signal
        >>> exit_code_for(signal.SIGTERM), exit_code_for(signal.SIGINT)
        (143, 130)
    """
    return 128 + check_int("the signal number", signum, low=1, high=signal.NSIG - 1)


_SIGACTION_BYTES = 512  # larger than any platform's struct sigaction; it is only copied, never interpreted


def _libc() -> Any:
    if sys.platform not in ("linux", "darwin"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "sigaction") else None
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def _native_action(sig: int) -> ctypes.Array[ctypes.c_char] | None:
    """The process's raw ``struct sigaction`` for ``sig`` (whoever installed it), or None where unavailable."""
    if _LIBC is None:
        return None
    buffer = ctypes.create_string_buffer(_SIGACTION_BYTES)
    return buffer if _LIBC.sigaction(int(sig), None, buffer) == 0 else None


def _set_native_action(sig: int, action: ctypes.Array[ctypes.c_char]) -> None:
    if _LIBC is not None:
        _LIBC.sigaction(int(sig), action, None)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Preempted(SystemExit):
    """Training stopped because of a signal, after saving a checkpoint; the process exits with ``128 + signum``.

    A :class:`SystemExit`, so an uncaught ``Preempted`` ends the process with :attr:`code` and no traceback, and
    ``except Exception`` in user code does not swallow it. Like any ``SystemExit`` with an int code it prints
    nothing: log ``str(err)`` (which says which signal, where, and the checkpoint) before raising it.

    Attributes:
        code: The exit code, :func:`exit_code_for` ``(signum)`` (143 for SIGTERM, 130 for SIGINT).
        signum: The signal that asked for the stop.
        signal_name: Its name, e.g. ``"SIGTERM"``.
        checkpoint: Where the checkpoint was saved, if the loop says so (else None).
        epoch, step: The epoch and the step in it where training stopped, if known.

    Example:
        >>> import signal
        >>> err = Preempted(signal.SIGTERM, checkpoint="/ckpt/ckpt-000004", epoch=1, step=7)
        >>> err.code, str(err)
        (143, 'stopped by SIGTERM at epoch 1, step 7; checkpoint saved to /ckpt/ckpt-000004 (exit code 143)')
    """

    def __init__(
        self, signum: int, *, checkpoint: Any = None, epoch: int | None = None, step: int | None = None
    ) -> None:
        code = exit_code_for(signum)
        super().__init__(code)
        self.code: int = code
        self.signum: int = int(signum)
        self.signal_name: str = _signal_name(self.signum)
        self.checkpoint = checkpoint
        self.epoch = epoch
        self.step = step

    def __str__(self) -> str:
        known = (("epoch", self.epoch), ("step", self.step))
        places = [f"{name} {value}" for name, value in known if value is not None]
        where = " at " + ", ".join(places) if places else ""
        saved = f"; checkpoint saved to {self.checkpoint}" if self.checkpoint is not None else ""
        return f"stopped by {self.signal_name}{where}{saved} (exit code {self.code})"

    def __reduce__(self) -> tuple[Any, ...]:  # picklable with its keyword arguments
        return (_rebuild_preempted, (self.signum, self.checkpoint, self.epoch, self.step))


def _rebuild_preempted(signum: int, checkpoint: Any, epoch: int | None, step: int | None) -> Preempted:
    return Preempted(signum, checkpoint=checkpoint, epoch=epoch, step=step)


class PreemptionGuard:
    """A context manager that records SIGTERM/SIGINT instead of dying, so training can stop cleanly.

    Inside the ``with`` block (in the main thread), SIGTERM and SIGINT no longer end the process: they set
    :attr:`requested` and :attr:`signum`. The training loop polls :attr:`requested` at each step boundary (under
    ``multi_worker`` it agrees on it across workers), saves, then raises :meth:`exception`. A second SIGINT while a
    stop is pending raises ``KeyboardInterrupt`` (force-quit). Leaving the block restores the previous handlers.

    Args:
        signals: The signals to catch (default SIGTERM and SIGINT).

    How the loop uses it::

        with PreemptionGuard() as guard:
            for step in steps:
                run(step)
                if guard.requested:          # multi_worker: all-reduce this flag (max) with the step
                    path = save(step)
                    callbacks.on_train_end()
                    raise guard.exception(checkpoint=path, epoch=epoch, step=step)

    Example:
        >>> import os, signal
        >>> before = signal.getsignal(signal.SIGTERM)
        >>> with PreemptionGuard() as guard:
        ...     guard.active, guard.requested
        ...     os.kill(os.getpid(), signal.SIGTERM)   # recorded: the process goes on
        ...     guard.requested, guard.signal_name, guard.exit_code
        (True, False)
        (True, 'SIGTERM', 143)
        >>> guard.active, signal.getsignal(signal.SIGTERM) is before   # handlers restored
        (False, True)
    """

    def __init__(self, signals: Iterable[int] = _DEFAULT_SIGNALS) -> None:
        chosen = tuple(signal.Signals(s) for s in signals)
        if not chosen:
            raise ValueError("PreemptionGuard needs at least one signal to catch")
        self._signals = chosen
        self._previous: dict[signal.Signals, Any] = {}
        self._native: dict[signal.Signals, ctypes.Array[ctypes.c_char] | None] = {}
        self._signum: int | None = None
        self._requested_at: float | None = None
        self._active = False

    # -- state -------------------------------------------------------------------------------------------------------
    @property
    def requested(self) -> bool:
        """Whether a stop was requested (by a signal or :meth:`request`) since the guard was entered."""
        return self._signum is not None

    @property
    def signum(self) -> int | None:
        """The signal number of the first request, or None."""
        return self._signum

    @property
    def signal_name(self) -> str | None:
        """The name of the first request's signal (``"SIGTERM"``), or None."""
        return None if self._signum is None else _signal_name(self._signum)

    @property
    def exit_code(self) -> int | None:
        """``128 + signum`` for the first request (see :func:`exit_code_for`), or None."""
        return None if self._signum is None else exit_code_for(self._signum)

    @property
    def seconds_since_request(self) -> float | None:
        """Seconds since the first request (to log how much of a grace period the stop took), or None."""
        return None if self._requested_at is None else time.monotonic() - self._requested_at

    @property
    def active(self) -> bool:
        """Whether this guard's handlers are installed (False outside the block and in non-main threads)."""
        return self._active

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Record a stop request as if ``signum`` had arrived (e.g. another worker was signalled). Works in any thread.

        Only the first request is kept: later ones do not change :attr:`signum`.
        """
        exit_code_for(signum)  # validates
        if self._signum is None:
            self._signum = int(signum)
            self._requested_at = time.monotonic()

    def exception(self, **details: Any) -> Preempted:
        """The :class:`Preempted` to raise after saving (``checkpoint=``, ``epoch=``, ``step=`` are passed on)."""
        if self._signum is None:
            raise RuntimeError("no stop was requested: there is nothing to raise")
        return Preempted(self._signum, **details)

    # -- handlers ----------------------------------------------------------------------------------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self._signum is not None:
            raise KeyboardInterrupt  # a second Ctrl-C (or Ctrl-C during a pending stop): force-quit
        self.request(signum)

    def __enter__(self) -> PreemptionGuard:
        if self._active:
            raise RuntimeError("this PreemptionGuard is already active; use a new one for a nested block")
        self._signum, self._requested_at = None, None
        if threading.current_thread() is not threading.main_thread():
            return self  # signal.signal only works in the main thread: a no-op guard
        try:
            for sig in self._signals:
                previous = signal.getsignal(sig)
                if previous is signal.SIG_IGN:
                    continue  # ignored by the parent's choice: keep it so
                self._native[sig] = _native_action(sig)  # what is really installed, maybe not by Python
                self._previous[sig] = signal.signal(sig, self._handle)
        except BaseException:
            self._restore()
            raise
        self._active = True
        return self

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            # None: a handler Python did not install (signal.getsignal cannot show it); Python's table says SIG_DFL.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
            native = self._native.get(sig)
            if native is not None and previous in (signal.SIG_DFL, None):
                _set_native_action(sig, native)  # e.g. TensorFlow's own SIGTERM handler, exactly as it was
        self._previous.clear()
        self._native.clear()
        self._active = False

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._restore()
