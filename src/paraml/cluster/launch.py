"""Multi-worker launcher: ``paraml launch -n 2 train.py --lr 0.1``.

Like ``torchrun`` or ``accelerate launch``: it starts N copies of a training script,
gives each a ``TF_CONFIG`` describing the cluster (a loopback one on one machine),
streams their output with a ``[worker i]`` prefix, and supervises them.

On several machines, ``paraml launch --nnodes N --node-rank R --master HOST:PORT -n K``
runs on each: node 0 listens on the master's port, the others send it their workers'
addresses, and every node gets the whole list before any worker starts
(:mod:`paraml.cluster.rendezvous`). The connections stay open while the workers run, so a
failure on one node stops every node, and a restart restarts every node.

Why a supervisor is needed: when one worker of a TensorFlow multi-worker run dies,
the others only notice if they are inside a collective (TF aborts them after
~15 s). A worker stuck elsewhere (data loading, a sleep, a deadlock in user code)
waits forever. So as soon as one worker fails, the launcher terminates every
other worker's whole process group, escalating to SIGKILL after a grace period.

With ``max_restarts=N`` (``--max-restarts N``) the launcher then starts every
worker again, on fresh ports with a fresh ``TF_CONFIG`` and ``PARAML_RESTART``
set to the restart count, up to N times; a script that trains with
``fit(..., checkpoint_dir=...)`` resumes from its last checkpoint.

POSIX only (process groups, ``killpg``). This module does not import TensorFlow.

Example:
    >>> import sys
    >>> from paraml.cluster.launch import launch
    >>> code = launch("train.py", ["--epochs", "1"], num_workers=2)  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Protocol, TextIO

from paraml.checks import check_int
from paraml.cluster.config import connect_timeout, make_tf_config
from paraml.cluster.elastic import (
    PROGRESS_ENV,
    REACHED_ENV,
    RESIZE_ENV,
    Bounds,
    ElasticHost,
    ElasticMember,
    read_progress,
    resize_text,
)
from paraml.cluster.logs import is_tensorflow_noise, show_all_logs
from paraml.cluster.rendezvous import Rendezvous, split_address

__all__ = [
    "PortUnavailableError",
    "add_arguments",
    "find_free_ports",
    "launch",
    "main",
    "run_from_args",
]

_HOST = "127.0.0.1"  # the address workers advertise; see isolation_prefix for where they listen
_NETNS_ENV = "PARAML_LAUNCH_NETNS"  # set inside the private network namespace
_POLL_INTERVAL = 0.05  # seconds between supervision polls
# Seconds to wait for output to drain after the workers are gone.
_READER_JOIN_TIMEOUT = 5.0
_PREFIX = "[paraml launch]"
_RESTART_ENV = "PARAML_RESTART"  # 0 on the first run, k on the k-th restart
_HOST_ENV = "PARAML_HOST"  # the address this node's workers are reached at (default: the one toward the master)


class PortUnavailableError(OSError):
    """A port requested with ``--port`` cannot be bound on 127.0.0.1.

    Subclasses :class:`OSError` so it can be handled like the bind error behind it.

    Example:
        >>> raise PortUnavailableError("port 2222 on 127.0.0.1 is already in use")  # doctest: +SKIP
    """


class _Terminated(BaseException):
    """Raised in the main thread when the launcher receives SIGTERM.

    A BaseException (like KeyboardInterrupt) so that nothing swallows it by accident.
    """


def find_free_ports(n: int, host: str = _HOST) -> list[int]:
    """Return ``n`` distinct ports that are currently free on ``host``.

    All ``n`` sockets are bound to port 0 at the same time (so the kernel cannot
    hand out the same port twice), their ports are read, then they are closed.
    Another process could still grab a port before a worker binds it; that race
    is inherent and rare in practice.

    Example:
        >>> ports = find_free_ports(2)
        >>> len(set(ports))
        2
    """
    if n < 0:
        raise ValueError(f"find_free_ports: n must be >= 0, got {n}")
    sockets: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _check_ports_free(first: int, n: int) -> list[int]:
    last = first + n - 1
    if not 1 <= first <= 65535 or last > 65535:
        raise ValueError(
            f"--port {first} with {n} worker(s) needs ports {first}..{last}, which must all lie in 1..65535"
        )
    ports = list(range(first, last + 1))
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # The workers' gRPC servers set SO_REUSEADDR, so a port in TIME_WAIT is
            # usable by them; check the same way to avoid false "in use" reports.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((_HOST, port))
            except OSError as exc:
                raise PortUnavailableError(
                    exc.errno,
                    f"port {port} on {_HOST} is not available ({exc.strerror}); "
                    f"workers need ports {first}..{last}. Choose another --port or omit it "
                    "to pick free ports automatically",
                ) from exc
    return ports


def _exit_code(proc: subprocess.Popen[bytes]) -> int | None:
    """Exit code of ``proc`` if it has exited (128+signum if killed), else None.

    Uses ``waitid(WNOWAIT)`` so the child stays a zombie until we reap it at the end:
    while it is unreaped, its PID (which is also its process-group ID) cannot be
    reused, so a later ``killpg`` can never hit an unrelated process group.
    """
    if proc.returncode is not None:
        code = proc.returncode
    elif hasattr(os, "waitid"):
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # already reaped elsewhere
            code = proc.wait()
        else:
            if info is None or info.si_pid == 0:
                return None
            if info.si_code == os.CLD_EXITED:
                return info.si_status
            return 128 + info.si_status
    else:  # pragma: no cover - platforms without waitid
        code = proc.poll()
        if code is None:
            return None
    return 128 - code if code < 0 else code


def _describe_exit(code: int) -> str:
    if code > 128 and code - 128 < signal.NSIG:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = f"signal {code - 128}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"


def _signal_groups(procs: Sequence[subprocess.Popen[bytes]], sig: int) -> None:
    for proc in procs:
        if proc.returncode is not None:
            continue  # reaped: its PGID may belong to someone else now
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            # Group already empty (or only a zombie leader, which macOS reports as EPERM).
            pass


class _Output:
    """Serialises whole lines from many threads onto one text stream."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            try:
                self._out.write(text if text.endswith("\n") else text + "\n")
                self._out.flush()
            except (OSError, ValueError):
                pass  # stream closed (e.g. broken pipe): drop the output


#: Lines a worker may still print once another worker failed first; the rest (its secondary errors) are counted.
_SECONDARY_LINES = 5


class _WorkerLines:
    """What the workers of one run print, for people: TensorFlow's own logging left out (unless ``PARAML_LOG=1``),
    each worker's last error line kept, and once a worker failed, the others' secondary errors cut short."""

    def __init__(self, output: _Output) -> None:
        self.output = output
        self.show_all = show_all_logs()
        self.failed: int | None = None  # the worker that failed first
        self.last_error: dict[int, str] = {}
        self.after_failure: dict[int, int] = {}  # lines each other worker printed after the failure
        self._lock = threading.Lock()

    def pump(self, pipe: IO[bytes], index: int, is_stderr: bool) -> None:
        with pipe:
            for raw in iter(pipe.readline, b""):
                text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if not self.show_all and is_tensorflow_noise(text):
                    continue
                with self._lock:
                    if is_stderr and text.strip():
                        self.last_error[index] = text.strip()
                    if self.failed is not None and index != self.failed and not self.show_all:
                        self.after_failure[index] = self.after_failure.get(index, 0) + 1
                        if self.after_failure[index] > _SECONDARY_LINES:
                            continue
                self.output.line(f"[worker {index}] {text}")

    def fail(self, index: int) -> None:
        with self._lock:
            if self.failed is None:
                self.failed = index

    def summary(self, code: int) -> str:
        """One line: which worker failed first, how, its last error line, and what was left out."""
        index = self.failed
        text = f"paraml launch: worker {index} failed first: it {_describe_exit(code)}"
        if index in self.last_error:
            text += f"; its last error line: {self.last_error[index]}"
        left_out = sum(max(0, n - _SECONDARY_LINES) for n in self.after_failure.values())
        if left_out:
            text += f" ({left_out} lines the other workers printed after it were left out; PARAML_LOG=1 shows them)"
        return text


def _stop(procs: Sequence[subprocess.Popen[bytes]], sig: int, timeout: float, output: _Output) -> None:
    """Send ``sig`` to every worker group, wait up to ``timeout`` s, then SIGKILL."""
    _signal_groups(procs, sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_exit_code(p) is not None for p in procs):
            return
        time.sleep(_POLL_INTERVAL)
    stuck = [i for i, p in enumerate(procs) if _exit_code(p) is None]
    if stuck:
        names = ", ".join(map(str, stuck))
        output.line(f"{_PREFIX} worker(s) {names} still running after {timeout:g} s; killing them")
    _signal_groups(procs, signal.SIGKILL)


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated()


def _validate(
    script: str,
    args: Sequence[str],
    num_workers: int | str,
    port: int | None,
    stop_timeout: float,
    max_restarts: int = 0,
    nnodes: int | str = 1,
    node_rank: int = 0,
    master: str | None = None,
) -> tuple[Bounds, Bounds, list[int]]:
    """Check the launch's input before anything starts; return the workers' and nodes' bounds and the ports this
    node's workers will use."""
    workers = Bounds.parse(num_workers, "the number of workers (-n)")
    nodes = Bounds.parse(nnodes, "the number of nodes (--nnodes)")
    check_int("the number of restarts (--max-restarts)", max_restarts, low=0)
    check_int(f"the node rank (--node-rank, with --nnodes {nodes})", node_rank, low=0, high=nodes.high - 1)
    if workers.elastic and nodes.high > 1:
        raise ValueError(
            f"-n {workers} with --nnodes {nodes}: across nodes, give the range of nodes (--nnodes MIN:MAX) and a "
            "fixed -n per node"
        )
    if nodes.high > 1:
        if master is None:
            raise ValueError(
                f"--nnodes {nodes} needs --master HOST:PORT: node 0's address and a free port, the same on every "
                "node, through which the nodes exchange their workers' addresses"
            )
        split_address(master, "--master")
    if stop_timeout < 0:
        raise ValueError(f"stop_timeout must be >= 0 seconds, got {stop_timeout!r}")
    if isinstance(args, str):
        raise TypeError(f"args must be a sequence of strings, not the string {args!r}")
    if not os.path.isfile(script):
        raise FileNotFoundError(f"script not found: {script}")
    if not hasattr(os, "killpg"):  # pragma: no cover
        raise OSError("paraml launch needs a POSIX system (process groups)")
    return workers, nodes, _ports(workers.high, port, nodes.high)


def _ports(num_workers: int, port: int | None, nnodes: int) -> list[int]:
    """This node's workers' ports: ``port..port+n-1`` (checked), else free ones (on every interface across nodes)."""
    if port is not None:
        return _check_ports_free(port, num_workers)
    return find_free_ports(num_workers, _HOST if nnodes == 1 else "")


def _start_workers(
    command: Sequence[str],
    base_env: Mapping[str, str],
    addresses: Sequence[str],
    first: int,
    count: int,
    restart: int,
    lines: _WorkerLines,
    procs: list[subprocess.Popen[bytes]],
    readers: list[threading.Thread],
) -> None:
    """Start workers ``first..first+count-1`` of the cluster ``addresses`` (appending to ``procs`` as each starts, so
    a signal mid-way leaves none unseen)."""
    for index in range(first, first + count):
        worker_env = dict(base_env)
        worker_env.update(
            TF_CONFIG=make_tf_config(addresses, index),
            PARAML_WORKER_INDEX=str(index),
            PARAML_NUM_WORKERS=str(len(addresses)),
            PARAML_SCHEDULER="launch",  # this TF_CONFIG, even inside a scheduler's job (whose variables describe us)
            PYTHONUNBUFFERED="1",
        )
        worker_env[_RESTART_ENV] = str(restart)
        proc = subprocess.Popen(
            command,
            env=worker_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # Own session = own process group: killpg reaches the worker's children
            # too, and a terminal's Ctrl-C reaches only the launcher, which forwards it.
            start_new_session=True,
        )
        procs.append(proc)
        for pipe, is_stderr in ((proc.stdout, False), (proc.stderr, True)):
            assert pipe is not None
            reader = threading.Thread(
                target=lines.pump,
                args=(pipe, index, is_stderr),
                name=f"paraml-launch-worker{index}",
                daemon=True,
            )
            reader.start()
            readers.append(reader)


class _Peers(Protocol):
    """The other nodes of a run, as supervision sees them (:class:`Rendezvous`, :class:`ElasticHost`, ...)."""

    @property
    def stop_requested(self) -> bool: ...

    @property
    def stop_reason(self) -> str: ...

    def report(self, code: int, final: bool = False) -> None: ...


def _supervise(
    procs: Sequence[subprocess.Popen[bytes]],
    stop_timeout: float,
    output: _Output,
    lines: _WorkerLines,
    first: int = 0,
    peers: _Peers | None = None,
) -> tuple[int, int]:
    """Wait until every worker succeeded (-> ``(-1, 0)``), one failed (-> ``(index, code)``, the others stopped,
    the other nodes told), or another node failed (-> ``(-1, 143)``, the workers here stopped)."""
    while True:
        codes = [_exit_code(p) for p in procs]
        for position, code in enumerate(codes):
            if code is not None and code != 0:
                index = first + position
                lines.fail(index)
                if peers is not None:
                    peers.report(code)  # first: the other nodes stop while this one does
                others = "; stopping the others" if len(procs) > 1 or peers is not None else ""
                output.line(f"{_PREFIX} worker {index} {_describe_exit(code)}{others}")
                _stop(procs, signal.SIGTERM, stop_timeout, output)
                return index, code
        if all(code == 0 for code in codes):
            return -1, 0
        if peers is not None and peers.stop_requested:
            output.line(f"{_PREFIX} {peers.stop_reason}; stopping the workers on this node")
            _stop(procs, signal.SIGTERM, stop_timeout, output)
            return -1, 128 + signal.SIGTERM
        time.sleep(_POLL_INTERVAL)


def _reap(procs: list[subprocess.Popen[bytes]], readers: list[threading.Thread]) -> None:
    """SIGKILL whatever is left of the workers' groups, reap them, drain their output; empty both lists."""
    _signal_groups(procs, signal.SIGKILL)
    for proc in procs:
        proc.wait()
    for reader in readers:
        reader.join(_READER_JOIN_TIMEOUT)
    procs.clear()
    readers.clear()


def launch(
    script: str,
    args: Sequence[str] = (),
    num_workers: int | str = 2,
    *,
    port: int | None = None,
    stop_timeout: float = 10.0,
    max_restarts: int = 0,
    nnodes: int | str = 1,
    node_rank: int = 0,
    master: str | None = None,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Run ``num_workers`` copies of ``script`` as a local multi-worker cluster.

    Each worker runs ``python -u script *args`` in its own process group, with the
    launcher's environment (or ``env``) plus ``TF_CONFIG`` (a worker-only cluster on
    127.0.0.1), ``PARAML_WORKER_INDEX``, ``PARAML_NUM_WORKERS``, ``PARAML_RESTART``
    (0 on the first run, k on the k-th restart) and ``PYTHONUNBUFFERED=1``. Every
    stdout/stderr line is written to ``out`` as ``[worker i] line``, except TensorFlow's own logging
    (``PARAML_LOG=1`` keeps it) and, once a worker failed, all but the first few lines of each other worker (their
    secondary errors); a closing line on ``err`` names the worker that failed first and its last error line.

    When a worker fails (non-zero exit or killed by a signal), the others are sent
    SIGTERM, given ``stop_timeout`` seconds, then SIGKILLed: they may be stuck
    outside TensorFlow, where nothing else would ever stop them. Then, if fewer
    than ``max_restarts`` restarts were made, every worker is started again on
    fresh ports (the same range if ``port`` is given) and a line
    ``paraml launch: worker 1 was killed by SIGKILL (exit code 137); restart 1 of 2``
    is written to ``err``. A script resumes only if it saves and restores its own
    state (``fit(..., checkpoint_dir=...)``); otherwise a restart starts it over.

    Ctrl-C (SIGINT) and SIGTERM sent to the launcher are forwarded the same way
    and end the launch: they never cause a restart. No worker is left running
    when this function returns or raises.

    With ``nnodes > 1``, run this on each of ``nnodes`` machines with its ``node_rank`` and the same ``master``
    (``"HOST:PORT"`` of node 0, where node 0 listens): before each run the nodes exchange their workers' addresses
    through it (waiting at most ``PARAML_CONNECT_TIMEOUT`` seconds), node ``r``'s workers being numbered after
    those of the nodes before it. A failure on any node stops the workers on every node; then every node restarts
    (give every node the same ``max_restarts``) or ends with the code of the worker that failed first. Each node's
    workers advertise ``PARAML_HOST`` when set, else the address the node reaches the master from.

    Elastic (:mod:`paraml.cluster.elastic`): ``num_workers="MIN:MAX"`` on one machine starts MAX workers and goes on
    without a worker that fails, while MIN remain; ``nnodes="MIN:MAX"`` lets nodes come (they join at once, every worker
    writing its checkpoint first) and go (a stopped or lost node; a failing worker leaves its node), node 0 holding the
    rendezvous for the whole job. A resize that follows a failure takes one of ``max_restarts``; a join does not. The
    workers of a resized run get ``PARAML_RESIZE`` (what changed) and ``PARAML_REACHED``, and the chief prints where it
    resumed and the steps lost.

    Args:
        script: Path of the Python script to run.
        args: Arguments passed to the script.
        num_workers: Number of worker processes (>= 1), on this node, or ``"MIN:MAX"`` (one node, elastic).
        port: First port of a contiguous range ``port..port+num_workers-1`` to use;
            by default free ports are picked automatically (fresh ones for each restart).
        stop_timeout: Grace period in seconds between SIGTERM/SIGINT and SIGKILL.
        max_restarts: How many times to start all workers again after a failure (>= 0; 0: never).
        nnodes: How many machines run a launcher (>= 1), or ``"MIN:MAX"`` (elastic).
        node_rank: This machine's rank, in 0..nnodes-1 (node 0 runs the master).
        master: ``"HOST:PORT"`` of node 0 through which the nodes exchange addresses (needed when ``nnodes > 1``).
        python: Python interpreter to run the script with.
        env: Base environment for the workers (default: ``os.environ``).
        out: Where to write the workers' prefixed output (default: ``sys.stdout``
            at call time, so that redirected/captured stdout is honoured).
        err: Where to write the restart lines (default: ``sys.stderr`` at call time).

    Returns:
        0 if every worker of a run exited with 0; otherwise the exit code of the first
        worker seen to fail in the last run (128+signum if it was killed by a signal);
        130 after Ctrl-C, 143 after SIGTERM.

    Raises:
        ValueError: ``num_workers < 1``, ``max_restarts < 0``, ``stop_timeout < 0``,
            a port range out of 1..65535, a ``node_rank`` out of range, ``nnodes > 1`` without a
            valid ``master``, or (a :class:`~paraml.cluster.config.ClusterConfigError`) an exchange that
            failed or timed out.
        TypeError: ``args`` is a single string instead of a sequence of strings.
        FileNotFoundError: ``script`` does not exist.
        PortUnavailableError: A port of the ``port`` range is already in use (checked
            again before each restart).

    Example:
        >>> launch("train.py", ["--epochs", "1"], num_workers=2)  # doctest: +SKIP
        [worker 0] epoch 1 loss 0.31
        [worker 1] epoch 1 loss 0.31
        0
    """
    workers, nodes, ports = _validate(
        script, args, num_workers, port, stop_timeout, max_restarts, nnodes, node_rank, master
    )
    base_env = dict(os.environ if env is None else env)
    command = [python, "-u", script, *args]
    output = _Output(sys.stdout if out is None else out)
    errors = _Output(sys.stderr if err is None else err)

    procs: list[subprocess.Popen[bytes]] = []  # the current run's workers
    readers: list[threading.Thread] = []
    peers: Rendezvous | None = None  # the other nodes of the current run (a fixed --nnodes)
    elastic: ElasticHost | ElasticMember | None = None  # the other nodes of the whole job (--nnodes MIN:MAX)
    scratch = tempfile.mkdtemp(prefix="paraml-launch-")  # where the chief writes how far it got (the resize line)
    progress = os.path.join(scratch, "progress")
    previous_sigterm = None
    installed_sigterm = False
    try:
        # Signal handlers can only be set from the main thread; elsewhere SIGTERM keeps
        # its current disposition.
        if threading.current_thread() is threading.main_thread():
            previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
            installed_sigterm = True
        if nodes.elastic:
            assert master is not None
            timeout = connect_timeout()
            elastic = (
                ElasticHost(master, workers, nodes, timeout, max_restarts)
                if node_rank == 0
                else ElasticMember(master, workers, nodes, timeout, node_rank)
            )
        restart, run, resize = 0, 0, {}  # failures restarted, runs started, what the last resize changed
        while True:
            lines = _WorkerLines(output)
            addresses, first = [f"{_HOST}:{p}" for p in ports], 0
            if elastic is not None:
                formed = elastic.form(run, ports, base_env.get(_HOST_ENV))
                if formed is None:  # the job ended while this node waited for a place in it
                    assert isinstance(elastic, ElasticMember)
                    return elastic.ended
                addresses, first, run = formed.addresses, formed.first, formed.run
                resize = {RESIZE_ENV: formed.resize, REACHED_ENV: formed.reached} if formed.resize else {}
            elif nodes.high > 1:
                assert master is not None
                peers = Rendezvous.join(
                    master,
                    node_rank,
                    nodes.high,
                    ports,
                    host=base_env.get(_HOST_ENV),
                    timeout=connect_timeout(),
                    round=restart,
                    keep_open=True,
                    variables="--master",
                )
                addresses = peers.workers
                first = sum(len(group) for group in peers.addresses[:node_rank])
            run_env = {**base_env, PROGRESS_ENV: progress, **resize}
            _start_workers(command, run_env, addresses, first, len(ports), run, lines, procs, readers)
            index, code = _supervise(procs, stop_timeout, output, lines, first, elastic or peers)
            _reap(procs, readers)  # every process of this run is gone before the next starts
            run += 1
            failed = f"worker {index} {_describe_exit(code)}"
            reached = read_progress(progress)
            if elastic is not None:
                elastic.report(code)
                code, final, why = elastic.outcome(reached)
                if code == 0:
                    return 0
                errors.line(f"paraml launch: {why}" if why else f"paraml launch: the job ended (exit code {code})")
                if final:
                    if lines.failed is not None:
                        errors.line(lines.summary(code))
                    return code
                ports = _ports(elastic.own_workers, port, nodes.high)
                continue
            final = False
            if peers is not None:
                peers.report(code)
                code, final, failed_node = peers.outcome()
                peers.close()
                peers = None
                if failed_node != node_rank and code:
                    failed = f"node {failed_node} failed first (exit code {code})"
            if code == 0:
                return 0
            # This node's workers in the next run: an elastic one goes on without the one that failed.
            active = len(ports) - (1 if workers.elastic else 0)
            if final or restart >= max_restarts or active < workers.low:
                if max_restarts or workers.elastic:
                    why = f"no restarts left ({restart} used)" if restart >= max_restarts else "not restarted: a node "
                    why += "" if restart >= max_restarts else "was stopped by a signal or lost"
                    if active < workers.low and not final and restart < max_restarts:
                        why = f"{active} worker(s) left, fewer than -n {workers}: the job ends"
                    errors.line(f"paraml launch: {failed}; {why}")
                errors.line(lines.summary(code) if lines.failed is not None else f"paraml launch: {failed}")
                return code
            restart += 1
            if workers.elastic:
                change = resize_text(f"worker {index} left", len(ports), active)
                resize = {RESIZE_ENV: change, REACHED_ENV: reached}
                errors.line(f"paraml launch: {failed}; {change}, restart {restart} of {max_restarts}")
            else:
                errors.line(f"paraml launch: {failed}; restart {restart} of {max_restarts}")
            # Fresh ports: the dead run's may linger or be taken; a given range is checked again.
            ports = _ports(active, port, nodes.high)
    except (KeyboardInterrupt, _Terminated) as exc:
        sig = signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM
        output.line(f"{_PREFIX} received {sig.name}; stopping the workers")
        stopping = peers or (elastic if procs else None)
        if stopping is not None:  # the other nodes stop too; an elastic job goes on without this node (node 0: ends)
            stopping.report(128 + sig, final=True)
        _stop(procs, sig, stop_timeout, output)
        return 128 + sig
    finally:
        # Kill first, then restore the SIGTERM handler, then reap: a signal arriving
        # during the (blocking) reap can then no longer leave a worker running.
        _signal_groups(procs, signal.SIGKILL)
        if installed_sigterm:
            signal.signal(
                signal.SIGTERM,
                signal.SIG_DFL if previous_sigterm is None else previous_sigterm,
            )
        _reap(procs, readers)
        for channel in (peers, elastic):
            if channel is not None:
                channel.close()
        shutil.rmtree(scratch, ignore_errors=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``paraml launch`` options to ``parser`` (a parser or a subparser).

    Use with :func:`run_from_args`:

    Example:
        >>> p = argparse.ArgumentParser(prog="paraml launch")
        >>> add_arguments(p)
        >>> ns = p.parse_args(["-n", "4", "train.py", "--lr", "0.1"])
        >>> ns.num_workers, ns.script, ns.script_args
        (4, 'train.py', ['--lr', '0.1'])
    """
    parser.add_argument(
        "-n",
        "--num-workers",
        type=_count,
        default=2,
        metavar="N|MIN:MAX",
        help="number of worker processes on this node (default: 2); MIN:MAX on one node: start MAX and go on without "
        "a worker that fails while MIN remain",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help="first port of a contiguous range on 127.0.0.1 (default: pick free ports)",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=10.0,
        help="seconds to wait after SIGTERM/SIGINT before killing workers (default: 10)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="when a worker dies, stop the others and start all workers again (fresh ports, PARAML_RESTART=k), up "
        "to N times; training resumes only from fit(checkpoint_dir=...), otherwise it starts over (default: 0)",
    )
    parser.add_argument(
        "--nnodes",
        type=_count,
        default=1,
        metavar="N|MIN:MAX",
        help="machines that each run this launcher with their own --node-rank and the same --master (default: 1); "
        "MIN:MAX: nodes may join (at once, from a checkpoint every worker writes) and leave while the job runs",
    )
    parser.add_argument(
        "--node-rank", type=int, default=0, metavar="R", help="this machine's rank in 0..N-1 (default: 0)"
    )
    parser.add_argument(
        "--master",
        default=None,
        metavar="HOST:PORT",
        help="node 0's address and a free port there, through which the nodes exchange their workers' addresses "
        "(needed with --nnodes > 1)",
    )
    parser.add_argument(
        "--isolate-network",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the workers in a private network namespace with only loopback, so TensorFlow's unauthenticated "
        "ports are reachable from nothing but the workers (default: on where the machine allows it, with one node; "
        "impossible across nodes)",
    )
    parser.add_argument("script", help="Python training script to run on every worker")
    parser.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        help="arguments passed to the script (everything after it)",
    )


def _count(text: str) -> int | str:
    """``-n``/``--nnodes`` as given: an int, or ``"MIN:MAX"`` (checked by :class:`~paraml.cluster.elastic.Bounds`)."""
    return int(text) if text.strip().lstrip("-").isdigit() else text


def isolation_prefix() -> list[str] | None:
    """The command prefix that runs a process in a new network namespace holding only loopback, or None.

    TensorFlow's gRPC server listens on every interface of the machine whatever address ``TF_CONFIG`` gives it, and
    it has no authentication. Inside a private network namespace the only interface is loopback, so the workers of
    a local launch are reachable from nothing but each other. Needs util-linux ``unshare`` and either root or
    unprivileged user namespaces (``--map-root-user``).
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    prefix = [unshare, "--net"] if os.geteuid() == 0 else [unshare, "--map-root-user", "--net"]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return prefix if probe.returncode == 0 else None


def bring_loopback_up() -> None:
    """Set the ``lo`` interface up (a new network namespace starts with it down)."""
    import fcntl
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock.fileno(), siocgifflags, request))[1]
        fcntl.ioctl(sock.fileno(), siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


def _run_isolated(prefix: list[str], ns: argparse.Namespace) -> int:
    """Run this launcher again inside a private network namespace, relay its output and signals, return its code.

    The inner launcher gets its own session, so a terminal's Ctrl-C reaches it once, through this process, and it
    stops its workers with their grace period as it would without isolation.
    """
    argv = ["-n", str(ns.num_workers), "--stop-timeout", str(ns.stop_timeout), "--no-isolate-network"]
    argv += ["--max-restarts", str(getattr(ns, "max_restarts", 0))]
    argv += ["--port", str(ns.port)] if ns.port is not None else []
    command = [*prefix, sys.executable, "-u", "-m", "paraml.cluster.launch", *argv, ns.script, *ns.script_args]
    main_thread = threading.current_thread() is threading.main_thread()
    inner: subprocess.Popen[bytes] | None = None

    def forward(signum: int, frame: object) -> None:
        if inner is not None and inner.poll() is None:
            inner.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    try:
        inner = subprocess.Popen(
            command,
            env={**os.environ, _NETNS_ENV: "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        relays = [
            threading.Thread(target=_relay, args=(inner.stdout, lambda: sys.stdout), daemon=True),
            threading.Thread(target=_relay, args=(inner.stderr, lambda: sys.stderr), daemon=True),
        ]
        for relay in relays:
            relay.start()
        code = inner.wait()
        for relay in relays:
            relay.join(timeout=_READER_JOIN_TIMEOUT)
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it
    finally:
        if inner is not None and inner.poll() is None:  # this process is failing: take the launch down with it
            os.killpg(inner.pid, signal.SIGKILL)
            inner.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _relay(pipe: IO[bytes], stream: Callable[[], TextIO]) -> None:
    """Copy ``pipe`` line by line to ``stream()`` (looked up per line, so captured output is honoured)."""
    for raw in iter(pipe.readline, b""):
        target = stream()
        target.write(raw.decode(errors="replace"))
        target.flush()


def run_from_args(ns: argparse.Namespace) -> int:
    """Run :func:`launch` from arguments parsed with :func:`add_arguments`.

    Invalid input (bad worker count, missing script, port in use, ...) is
    reported as one line ``paraml launch: error: ...`` on stderr, with exit code 2.

    Example:
        >>> p = argparse.ArgumentParser(prog="paraml launch")
        >>> add_arguments(p)
        >>> run_from_args(p.parse_args(["-n", "2", "train.py"]))  # doctest: +SKIP
        0
    """
    nodes = {key: getattr(ns, key, default) for key, default in (("nnodes", 1), ("node_rank", 0), ("master", None))}
    isolate = getattr(ns, "isolate_network", False)
    try:
        if isolate and nodes["nnodes"] != 1:
            raise ValueError(
                "--isolate-network cannot be used with --nnodes > 1: the workers of the other nodes must reach this "
                "node's workers over the network (firewall their ports instead; see docs/cluster.md, Security)"
            )
        if os.environ.get(_NETNS_ENV) == "1":
            bring_loopback_up()
        elif isolate or (isolate is None and nodes["nnodes"] == 1):
            max_restarts = getattr(ns, "max_restarts", 0)
            _validate(ns.script, ns.script_args, ns.num_workers, ns.port, ns.stop_timeout, max_restarts, **nodes)
            prefix = isolation_prefix()
            if prefix is not None:
                return _run_isolated(prefix, ns)
            print(
                f"{_PREFIX} no private network namespace here (needs unshare and user namespaces): the workers' "
                "TensorFlow ports are open on every interface of this machine while they run",
                file=sys.stderr,
            )
        return launch(
            ns.script,
            ns.script_args,
            ns.num_workers,
            port=ns.port,
            stop_timeout=ns.stop_timeout,
            max_restarts=getattr(ns, "max_restarts", 0),
            **nodes,
        )
    except (ValueError, OSError) as exc:  # FileNotFoundError is an OSError
        message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        if isinstance(exc, FileNotFoundError) and exc.filename:
            message = f"{message}: {exc.filename}"
        print(f"paraml launch: error: {message}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``paraml launch`` / ``python -m paraml.cluster.launch``.

    Returns the process exit code instead of exiting, so it can be tested and reused.

    Example:
        >>> main(["-n", "2", "train.py", "--lr", "0.1"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(
        prog="paraml launch",
        description="Run a training script on N local workers with TF_CONFIG set for each.",
    )
    add_arguments(parser)
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:  # argparse usage error or --help
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return run_from_args(ns)


if __name__ == "__main__":
    sys.exit(main())
