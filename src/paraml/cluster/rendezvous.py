"""Exchange the workers' addresses through one master address, before TensorFlow starts.

Some schedulers name only a master: Kubeflow Trainer's ``PET_MASTER_ADDR``/``PET_MASTER_PORT``, ``PARAML_MASTER``
under ``mpirun``, ``paraml launch --master``. Every process knows its rank and how many ranks there are, but not
where the others are, and ``TF_CONFIG`` must list every worker's address. So rank 0 listens on the master's port;
every other rank connects and sends its own addresses; once every rank has joined, rank 0 replies to each with every
rank's addresses, in rank order. Every wait is bounded (``PARAML_CONNECT_TIMEOUT``) and a failure names the master
and the variables it came from.

``paraml launch --nnodes`` keeps the connections open while its workers run (:meth:`Rendezvous.report`,
:attr:`Rendezvous.stop_requested`, :meth:`Rendezvous.outcome`): a failure on any node stops every node, and the
master tells every node whether the job succeeded, restarts or ends.

Messages are lines of JSON. Pure Python: no TensorFlow.

Example:
    >>> split_address("10.0.0.1:29500", "PARAML_MASTER")
    ('10.0.0.1', 29500)
    >>> join_address("fe80::1", 2222)
    '[fe80::1]:2222'
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from paraml.cluster.config import CONNECT_TIMEOUT_ENV, ClusterConfigError

__all__ = ["Rendezvous", "join_address", "split_address"]

_PROTOCOL = "paraml-rendezvous-1"
_MAX_MESSAGE = 1 << 20  # bytes: a hello or a reply is far smaller; anything longer is not ours
_HELLO_SECONDS = 5.0  # how long rank 0 gives a connection to say who it is (a stray one is then dropped)
_RETRY_SECONDS = 0.2  # between attempts to reach the master
_POLL_SECONDS = 0.1  # between checks while waiting for the master's verdict (signals are handled in between)


def split_address(text: str, variables: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` too) as ``(host, port)``; a malformed value is a
    :class:`~paraml.cluster.config.ClusterConfigError` naming ``variables`` (where the value came from).

    Example:
        >>> split_address("[::1]:2222", "--master")
        ('::1', 2222)
    """
    host, sep, port_text = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host:
        raise ClusterConfigError(f'{variables} is "{text}", not "HOST:PORT" (for example 10.0.0.1:29500)')
    try:
        port = int(port_text, 10)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise ClusterConfigError(f'{variables} is "{text}", whose port "{port_text}" is not an integer in 1..65535')
    return host, port


def join_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets (the form ``TF_CONFIG`` takes)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _send(sock: socket.socket, message: dict[str, Any], lock: threading.Lock | None = None) -> None:
    data = json.dumps(message).encode() + b"\n"
    if lock is None:
        sock.sendall(data)
        return
    with lock:
        sock.sendall(data)


class _Lines:
    """Reads one JSON object per line from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def read(self, deadline: float | None) -> dict[str, Any] | None:
        """The next message; None when the peer closed. TimeoutError after ``deadline``; ValueError if garbled."""
        while b"\n" not in self.buffer:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("no message in time")
                self.sock.settimeout(remaining)
            else:
                self.sock.settimeout(None)
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buffer += chunk
            if len(self.buffer) > _MAX_MESSAGE:
                raise ValueError("message too long")
        line, _, self.buffer = self.buffer.partition(b"\n")
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError("not a JSON object")
        return message


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _raise_longer() -> str:
    return f"or raise {CONNECT_TIMEOUT_ENV} (seconds)"


def _attempt(host: str, port: int, deadline: float | None) -> socket.socket | str:
    """One attempt to reach the master before ``deadline``: the connected socket, or why it failed (after a short
    pause, so that callers can simply try again)."""
    try:
        remaining = 2.0 if deadline is None else max(0.05, min(2.0, deadline - time.monotonic()))
        return socket.create_connection((host, port), timeout=remaining)
    except OSError as exc:
        time.sleep(_RETRY_SECONDS)
        return exc.strerror or str(exc)


class Rendezvous:
    """One exchange of addresses through the master, and (with ``keep_open``) the channel that stays between the
    ranks while their workers run.

    Attributes:
        rank: This process's rank (0 is the master).
        size: How many ranks joined.
        addresses: Every rank's addresses, in rank order (``addresses[r]`` is the list rank ``r`` sent).

    Example:
        >>> Rendezvous.join("127.0.0.1:1", 0, 1, [2222], timeout=1).workers  # alone: no network
        ['127.0.0.1:2222']
    """

    def __init__(self, rank: int, size: int, addresses: list[list[str]]) -> None:
        self.rank = rank
        self.size = size
        self.addresses = addresses
        self._peers: dict[int, tuple[socket.socket, threading.Lock]] = {}  # the master's: rank -> connection
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._done = threading.Event()
        self._results: dict[int, tuple[int, bool]] = {}  # the master's: rank -> (exit code, final)
        self._first_failure: tuple[int, int] | None = None  # (rank, code)
        self._outcome: tuple[int, bool, int | None] = (0, False, None)
        self._threads: list[threading.Thread] = []

    @property
    def workers(self) -> list[str]:
        """Every rank's addresses in one list, in rank order.

        Example:
            >>> Rendezvous(0, 2, [["a:1", "a:2"], ["b:1"]]).workers
            ['a:1', 'a:2', 'b:1']
        """
        return [address for group in self.addresses for address in group]

    # ------------------------------------------------------------------ joining

    @classmethod
    def join(
        cls,
        master: str,
        rank: int,
        size: int,
        addresses: Sequence[str] | Sequence[int],
        *,
        host: str | None = None,
        timeout: float | None,
        round: int = 0,
        keep_open: bool = False,
        variables: str = "the master address",
    ) -> Rendezvous:
        """Join the exchange as ``rank`` of ``size``, sending ``addresses``: ``"host:port"`` strings, or ports, whose
        host is then ``host``, else the master's host for rank 0, else the address this rank reaches the master from.

        Rank 0 listens on the master's port (on every interface) and waits for every other rank; the others retry
        connecting until it answers. Raises :class:`~paraml.cluster.config.ClusterConfigError` after ``timeout`` seconds
        (None: no limit) naming the ranks that never joined or the master that never answered, or when the ranks
        disagree (another ``size`` or ``round``, a rank twice). ``round`` tells a restart's exchange from the last.
        """
        join = _Join(master, rank, size, addresses, host, timeout, round, keep_open, variables)
        if size == 1:
            return cls(rank, size, [_own_addresses(addresses, host or split_address(master, variables)[0])])
        return cls._host(join) if rank == 0 else cls._connect(join)

    @classmethod
    def _host(cls, join: _Join) -> Rendezvous:
        master, size, timeout, variables = join.master, join.size, join.timeout, join.variables
        master_host, port = split_address(master, variables)
        own = _own_addresses(join.addresses, join.host or master_host)
        try:
            server = socket.create_server(("", port))
        except OSError as exc:
            raise ClusterConfigError(
                f"rank 0 cannot listen on port {port} of {variables} ({master}): {exc.strerror or exc}. Rank 0 must "
                "run on the master's machine, and that port must be free"
            ) from None
        joined: dict[int, tuple[socket.socket, list[str]]] = {}
        deadline = _deadline(timeout)
        try:
            server.settimeout(_POLL_SECONDS)
            while len(joined) < size - 1:
                if _expired(deadline):
                    missing = ", ".join(str(r) for r in range(1, size) if r not in joined)
                    raise ClusterConfigError(
                        f"rank 0 waited {timeout:g} s on port {port} ({variables}) and rank(s) {missing} of {size} "
                        f"never joined: start every rank, check that they reach {master}, {_raise_longer()}"
                    )
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                lines = _Lines(conn)
                try:
                    hello = lines.read(time.monotonic() + _HELLO_SECONDS)
                except (OSError, ValueError):
                    hello = None
                if not hello or hello.get("protocol") != _PROTOCOL:
                    conn.close()  # not one of ours (a port scanner, a health check): ignore it
                    continue
                problem = _check_hello(hello, size, join.round, joined)
                if problem:
                    _send_quietly(conn, {"error": problem})
                    conn.close()
                    raise ClusterConfigError(f"{problem} ({variables}: {master})")
                joined[hello["rank"]] = (conn, [str(a) for a in hello["addresses"]])
            everyone = [own] + [joined[r][1] for r in range(1, size)]
            for conn, _ in joined.values():
                _send(conn, {"addresses": everyone})
        except BaseException as exc:
            for conn, _ in joined.values():
                _send_quietly(conn, {"error": f"rank 0 gave up: {exc}"})
                conn.close()
            raise
        finally:
            server.close()
        rendezvous = cls(0, size, everyone)
        if join.keep_open:
            for rank, (conn, _) in joined.items():
                rendezvous._peers[rank] = (conn, threading.Lock())
            for rank, (conn, _) in joined.items():
                rendezvous._listen(rendezvous._from_rank, conn, rank)
        else:
            for conn, _ in joined.values():
                conn.close()
        return rendezvous

    @classmethod
    def _connect(cls, join: _Join) -> Rendezvous:
        master, rank, size, timeout, variables = join.master, join.rank, join.size, join.timeout, join.variables
        master_host, port = split_address(master, variables)
        deadline = _deadline(timeout)
        last_error = "no attempt"
        while True:
            if _expired(deadline):
                raise ClusterConfigError(
                    f"rank {rank} of {size} could not reach the master {master} ({variables}) within {timeout:g} s "
                    f"(last attempt: {last_error}): start rank 0 on the master's machine, check {variables}, "
                    f"{_raise_longer()}"
                )
            sock = _attempt(master_host, port, deadline)
            if isinstance(sock, str):
                last_error = sock
                continue
            lines = _Lines(sock)
            try:
                own = _own_addresses(join.addresses, join.host or sock.getsockname()[0])
                hello = {"protocol": _PROTOCOL, "rank": rank, "size": size, "round": join.round, "addresses": own}
                _send(sock, hello)
                reply = lines.read(deadline)
            except TimeoutError:
                sock.close()
                raise ClusterConfigError(
                    f"rank {rank} of {size} reached the master {master} ({variables}) but it never answered within "
                    f"{timeout:g} s: rank 0 answers once every rank has joined; start every rank, {_raise_longer()}"
                ) from None
            except (OSError, ValueError) as exc:
                sock.close()
                last_error = str(exc) or type(exc).__name__
                time.sleep(_RETRY_SECONDS)
                continue
            if reply is None:  # rank 0 is not listening for this round yet (or a stale socket): try again
                sock.close()
                last_error = "the master closed the connection"
                time.sleep(_RETRY_SECONDS)
                continue
            if "error" in reply:
                sock.close()
                raise ClusterConfigError(f"the master {master} ({variables}) refused rank {rank}: {reply['error']}")
            everyone = reply.get("addresses")
            if not _is_address_lists(everyone, size):
                sock.close()
                raise ClusterConfigError(f"the master {master} ({variables}) sent no address list: {reply!r}")
            rendezvous = cls(rank, size, everyone)
            if join.keep_open:
                rendezvous._peers[0] = (sock, threading.Lock())
                rendezvous._listen(rendezvous._from_master, sock, lines)
            else:
                sock.close()
            return rendezvous

    # ------------------------------------------------------------------ the run that follows (keep_open)

    @property
    def stop_requested(self) -> bool:
        """Whether another rank failed (or the master is gone): this rank should stop its workers."""
        return self._stop.is_set()

    @property
    def stop_reason(self) -> str:
        """Why this rank should stop (empty while the run goes on)."""
        return "another node failed" if self._stop.is_set() else ""

    def report(self, code: int, final: bool = False) -> None:
        """Tell the master how this rank's run ended (0: success); ``final``: never restart (a signal stopped it).
        Reported once: later calls are ignored."""
        if self.rank == 0:
            self._record(0, code, final)
            return
        with self._lock:
            if 0 in self._results:
                return
            self._results[0] = (code, final)
        if 0 in self._peers:
            sock, lock = self._peers[0]
            _send_quietly(sock, {"result": code, "final": final}, lock)

    def outcome(self) -> tuple[int, bool, int | None]:
        """Wait until every rank has reported; return ``(code, final, rank)``: 0 if every rank succeeded, else the
        code of the rank that failed first (``rank``); ``final`` when the run must not restart."""
        while not self._done.wait(_POLL_SECONDS):
            pass
        return self._outcome

    def close(self) -> None:
        """Close every connection (the reading threads end)."""
        for sock, _ in self._peers.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for thread in self._threads:
            thread.join(timeout=2.0)

    def _listen(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name="paraml-rendezvous", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _from_rank(self, conn: socket.socket, rank: int) -> None:
        """The master's reader of one rank: its result, or its end."""
        lines = _Lines(conn)
        while True:
            try:
                message = lines.read(None)
            except (OSError, ValueError):
                message = None
            if message is None:  # its launcher is gone: the run cannot go on, nor restart with it
                self._record(rank, 1, True)
                return
            if "result" in message:
                self._record(rank, int(message["result"]), bool(message.get("final")))

    def _record(self, rank: int, code: int, final: bool) -> None:
        with self._lock:
            if rank in self._results:
                return
            self._results[rank] = (code, final)
            if code != 0 and self._first_failure is None:
                self._first_failure = (rank, code)
                self._stop.set()
                self._broadcast({"stop": True}, but=rank)
            if len(self._results) < self.size:
                return
            failed_rank, failed_code = self._first_failure or (None, 0)
            final_any = any(f for _, f in self._results.values())
            self._outcome = (failed_code, final_any, failed_rank)
            self._broadcast({"outcome": failed_code, "final": final_any, "rank": failed_rank})
            self._done.set()

    def _broadcast(self, message: dict[str, Any], but: int | None = None) -> None:
        for rank, (sock, lock) in self._peers.items():
            if rank != but:
                _send_quietly(sock, message, lock)

    def _from_master(self, sock: socket.socket, lines: _Lines) -> None:
        """A rank's reader of the master: stop, then the outcome; the master gone means both."""
        while True:
            try:
                message = lines.read(None)
            except (OSError, ValueError):
                message = None
            if message is None:
                if not self._done.is_set():
                    self._outcome = (1, True, 0)  # the master's launcher is gone: no one can restart the job
                    self._stop.set()
                    self._done.set()
                return
            if message.get("stop"):
                self._stop.set()
            if "outcome" in message:
                self._outcome = (int(message["outcome"]), bool(message.get("final")), message.get("rank"))
                self._done.set()


@dataclass(frozen=True)
class _Join:
    """What one rank brings to an exchange (the arguments of :meth:`Rendezvous.join`)."""

    master: str
    rank: int
    size: int
    addresses: Sequence[str] | Sequence[int]
    host: str | None
    timeout: float | None
    round: int
    keep_open: bool
    variables: str


def _own_addresses(addresses: Sequence[str] | Sequence[int], host: str) -> list[str]:
    return [a if isinstance(a, str) else join_address(host, a) for a in addresses]


def _send_quietly(sock: socket.socket, message: dict[str, Any], lock: threading.Lock | None = None) -> None:
    try:
        _send(sock, message, lock)
    except OSError:
        pass  # the peer is gone; its reader notices


def _is_address_lists(value: Any, size: int) -> bool:
    return (
        isinstance(value, list)
        and len(value) == size
        and all(isinstance(group, list) and all(isinstance(a, str) for a in group) for group in value)
    )


def _check_hello(hello: dict[str, Any], size: int, round: int, joined: dict[int, Any]) -> str | None:
    rank = hello.get("rank")
    if hello.get("size") != size:
        return f"rank {rank} counts {hello.get('size')} ranks, rank 0 counts {size}: give every rank the same count"
    if hello.get("round") != round:
        return f"rank {rank} joined round {hello.get('round')}, rank 0 is at round {round} (restarts out of step)"
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank < size:
        return f"a process joined as rank {rank!r}, not one of 1..{size - 1}"
    if rank in joined:
        return f"two processes joined as rank {rank}: give each process its own rank"
    if not isinstance(hello.get("addresses"), list):
        return f"rank {rank} sent no addresses"
    return None
